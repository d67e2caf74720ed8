"""Benchmark: ``consistency lint`` on a multi-GB draft reads headers, not weights.

    python bench/bench_lint.py [--repeat 20] [--full-read] [--json PATH]

Builds a *sparse* EAGLE-3 draft the size of a head for a 70B-class target (hidden 8192,
target vocab 128256, draft vocab 32000, bf16: ~4.9 GB on paper, a few hundred KB on disk),
then measures in the same run:

* ``lint``: :func:`consistency.lint.engine.run_lint` with draft, target, runtime and
  training side (all 30 rules), median of ``--repeat`` runs, in-process;
* ``header``: :func:`consistency.dump.safetensors_io.read_header` of the checkpoint alone
  (the least any header-based tool must do) — the baseline for the ratio;
* ``cli``: ``python -m consistency lint ...`` wall time, against ``python -c "import
  consistency"`` (interpreter start-up) in the same run;
* bytes read by the lint (``/proc/self/io`` rchar), against the checkpoint size;
* optionally (``--full-read``) the time to read the whole file once, what loading the
  weights would at least cost (holes read as zeros from the page cache, so this is a lower
  bound on a real checkpoint's cost).

Figures are recorded in docs/lint.md#performance.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from test_lint_support import big_draft  # noqa: E402

build = big_draft  # the same sparse 70B-shaped draft the header-only test uses


def rchar() -> int | None:
    try:
        for line in open("/proc/self/io"):
            if line.startswith("rchar:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def timed(fn, repeat: int) -> float:  # noqa: ANN001
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--full-read", action="store_true")
    ap.add_argument("--json", dest="json_out")
    a = ap.parse_args()
    from consistency.dump.safetensors_io import read_header
    from consistency.lint.engine import LintRequest, run_lint

    with tempfile.TemporaryDirectory(prefix="bench-lint-") as t:
        d, tgt = build(Path(t))
        ck = d / "model.safetensors"
        size = ck.stat().st_size
        on_disk = ck.stat().st_blocks * 512
        req = LintRequest(draft=str(d), target=str(tgt), runtime="vllm@0.33.0", trained_with="speculators:2,40,77")
        rep = run_lint(req)  # warm-up (lazy imports)
        assert rep.verdict == "pass", rep.summary
        r0 = rchar()
        run_lint(req)
        r1 = rchar()
        lint_s = timed(lambda: run_lint(req), a.repeat)
        header_s = timed(lambda: read_header(ck), a.repeat)
        args = ["lint", "--draft", str(d), "--target", str(tgt), "--runtime", "vllm@0.33.0", "-q"]
        cli_s = timed(lambda: subprocess.run([sys.executable, "-m", "consistency", *args], cwd=ROOT,
                                             capture_output=True, check=False), max(3, a.repeat // 4))
        start_s = timed(lambda: subprocess.run([sys.executable, "-c", "import consistency"], cwd=ROOT,
                                               capture_output=True, check=True), max(3, a.repeat // 4))
        full_s = None
        if a.full_read:
            def full() -> None:
                with open(ck, "rb") as fh:
                    while fh.read(64 * 2**20):
                        pass
            full_s = timed(full, 1)
    res = {
        "checkpoint_bytes": size, "checkpoint_on_disk_bytes": on_disk,
        "lint_ms": lint_s * 1e3, "header_only_ms": header_s * 1e3, "lint_over_header": lint_s / header_s,
        "lint_bytes_read": (r1 - r0) if r0 is not None and r1 is not None else None,
        "cli_ms": cli_s * 1e3, "python_import_ms": start_s * 1e3, "cli_over_import": cli_s / start_s,
        "full_read_ms": full_s * 1e3 if full_s else None,
        "full_read_over_lint": (full_s / lint_s) if full_s else None,
    }
    for k, v in res.items():
        print(f"{k:26s} {v:.4g}" if isinstance(v, float) else f"{k:26s} {v}")
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
