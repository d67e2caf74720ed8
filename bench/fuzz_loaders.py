"""Fuzz the dump loaders and the metadata/contract parsers, long; report inputs tried and throughput.

    python bench/fuzz_loaders.py                          # hypothesis 2000 examples/target + atheris 120 s
    python bench/fuzz_loaders.py --engine atheris --seconds 600
    python bench/fuzz_loaders.py --engine hypothesis --examples 20000 --json bench/out/fuzz.json

The property (fixtures/hostile/fuzz.py): every input ends in a result or a clean
ConsistencyError; any other exception, a hang (per-input alarm) or a leaked file
descriptor is a failure, printed with the input that caused it. tests/dump/test_fuzz.py runs
the same targets with a budget of seconds in CI; docs/security.md records a long run.

atheris (libFuzzer, coverage-guided) runs in a child process, because ``atheris.Fuzz()``
never returns: it is seeded with valid dumps and the hostile corpus, instruments the
``consistency`` package and ``zipfile``, and is bounded by ``-rss_limit_mb`` and ``-timeout``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RSS_LIMIT_MB = 2048
PER_INPUT_TIMEOUT_S = 10


# -- hypothesis ---------------------------------------------------------------------------------
def run_hypothesis(examples: int) -> list[dict]:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from fixtures.hostile import fuzz as fz

    seeds = fz.seeds()
    targets = {
        "safetensors/structured": (fz.safetensors_files(), lambda b: fz.load_dump_bytes(b, ".safetensors")),
        "safetensors/mutated": (fz.mutated(seeds["safetensors"]), lambda b: fz.load_dump_bytes(b, ".safetensors")),
        "safetensors/bytes": (st.binary(max_size=512), lambda b: fz.load_dump_bytes(b, ".safetensors")),
        "npz/structured": (fz.npz_files(), lambda b: fz.load_dump_bytes(b, ".npz")),
        "npz/mutated": (fz.mutated(seeds["npz"]), lambda b: fz.load_dump_bytes(b, ".npz")),
        "metadata/structured": (fz.metadata_texts(), fz.parse_metadata_text),
        "metadata/mutated": (fz.mutated(seeds["metadata"]), lambda b: fz.run_kind("metadata", b)),
        "contract/json": (fz.mutated(seeds["contract_json"]), lambda b: fz.run_kind("contract_json", b)),
        "contract/yaml": (fz.mutated(seeds["contract_yaml"]), lambda b: fz.run_kind("contract_yaml", b)),
    }
    rows = []
    for name, (strategy, target) in targets.items():
        counts = {"ok": 0, "refused": 0}
        prop = _property(strategy, target, counts, settings(max_examples=examples, deadline=None, database=None,
                                                            suppress_health_check=list(HealthCheck)), given)
        t0 = time.perf_counter()
        prop()
        dt = time.perf_counter() - t0
        n = counts["ok"] + counts["refused"]
        rows.append({"engine": "hypothesis", "target": name, "inputs": n, "accepted": counts["ok"],
                     "refused": counts["refused"], "seconds": round(dt, 2), "per_second": round(n / dt, 1)})
        print(f"hypothesis {name:24s} {n:7d} inputs  {counts['ok']:6d} ok  {counts['refused']:7d} refused  "
              f"{n / dt:8.1f}/s", flush=True)
    return rows


def _property(strategy, target, counts, config, given):  # noqa: ANN001, ANN202
    from fixtures.hostile import fuzz as fz

    @config
    @given(strategy)
    def prop(x: object) -> None:
        counts[fz.checked(lambda: _alarmed(target, x))] += 1

    return prop


class Hang(Exception):
    """Not a ConsistencyError: a hang fails the property like any other escape."""


def _alarmed(target, x):  # noqa: ANN001, ANN202
    def fire(*_a: object) -> None:
        raise Hang(f"input took more than {PER_INPUT_TIMEOUT_S}s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(PER_INPUT_TIMEOUT_S)
    try:
        return target(x)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


# -- atheris ------------------------------------------------------------------------------------
def atheris_worker(argv: list[str]) -> None:
    """The child: libFuzzer drives one entry point; the first byte picks the target."""
    import atheris

    with atheris.instrument_imports(include=["consistency", "zipfile"]):
        import zipfile  # noqa: F401

        from consistency.contract import io as _cio  # noqa: F401
        from consistency.dump import npz_io, reader, safetensors_io, sets  # noqa: F401
        from consistency.dump.formats import speculators  # noqa: F401 - open_side's sniffers
    from fixtures.hostile import fuzz as fz

    def one(data: bytes) -> None:
        if not data:
            return
        kind = fz.KINDS[data[0] % len(fz.KINDS)]
        fz.checked(lambda: fz.run_kind(kind, data[1:]))

    atheris.Setup(argv, one)
    atheris.Fuzz()


def write_atheris_seeds(d: Path) -> None:
    from fixtures.hostile import fuzz as fz

    for kind, blobs in fz.seeds().items():
        for i, b in enumerate(blobs):
            (d / f"{kind}-{i}").write_bytes(bytes([fz.KINDS.index(kind)]) + b)


def run_atheris(seconds: int, out_dir: Path) -> dict:
    try:
        import atheris  # noqa: F401
    except ImportError as exc:
        print(f"atheris not available ({exc}); hypothesis only", flush=True)
        return {"engine": "atheris", "skipped": str(exc)}
    corpus = Path(tempfile.mkdtemp(prefix="consistency-atheris-"))
    write_atheris_seeds(corpus)
    n_seeds = len(list(corpus.iterdir()))
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, __file__, "--atheris-worker", f"-max_total_time={seconds}", f"-rss_limit_mb={RSS_LIMIT_MB}",
           f"-timeout={PER_INPUT_TIMEOUT_S}", f"-artifact_prefix={out_dir}/crash-", "-print_final_stats=1",
           str(corpus)]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=seconds + 300)
    dt = time.perf_counter() - t0
    log = r.stdout + r.stderr
    runs = _stat(log, "stat::number_of_executed_units") or _last_int(log, r"#(\d+)\s")
    row = {"engine": "atheris", "target": "all (first byte picks)", "inputs": runs, "seconds": round(dt, 2),
           "per_second": round(runs / dt, 1) if runs else 0, "seeds": n_seeds, "exit_code": r.returncode,
           "coverage": _last_int(log, r"cov: (\d+)"), "features": _last_int(log, r"ft: (\d+)"),
           "corpus_after": len(list(corpus.iterdir())), "peak_rss_mb": _stat(log, "stat::peak_rss_mb"),
           "new_units": _stat(log, "stat::new_units_added")}
    print(f"atheris    {row['target']:24s} {runs:7d} inputs  cov {row['coverage']}  ft {row['features']}  "
          f"{row['per_second']:8.1f}/s  exit {r.returncode}", flush=True)
    if r.returncode != 0:
        print(log[-6000:], file=sys.stderr)
        row["failure"] = log[-3000:]
    return row


def _stat(log: str, key: str) -> int | None:
    m = re.search(re.escape(key) + r":\s*(\d+)", log)
    return int(m.group(1)) if m else None


def _last_int(log: str, pattern: str) -> int:
    found = re.findall(pattern, log)
    return int(found[-1]) if found else 0


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--atheris-worker":
        atheris_worker([sys.argv[0], *sys.argv[2:]])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", choices=["hypothesis", "atheris", "both"], default="both")
    ap.add_argument("--examples", type=int, default=2000, help="hypothesis examples per target")
    ap.add_argument("--seconds", type=int, default=120, help="atheris wall-clock budget")
    ap.add_argument("--json", type=Path, help="write the figures here")
    ap.add_argument("--artifacts", type=Path, default=ROOT / "bench" / "out" / "fuzz", help="atheris crash inputs")
    a = ap.parse_args()
    os.environ.setdefault("PYTHONHASHSEED", "0")
    rows: list[dict] = []
    ok = True
    if a.engine in ("hypothesis", "both"):
        try:
            rows += run_hypothesis(a.examples)
        except Exception:  # noqa: BLE001 - report the falsifying input, then fail
            import traceback

            ok = False
            print("hypothesis found a failure:", file=sys.stderr)
            traceback.print_exc()
    if a.engine in ("atheris", "both"):
        row = run_atheris(a.seconds, a.artifacts)
        rows.append(row)
        ok = ok and row.get("exit_code", 0) == 0
    total = sum(r.get("inputs") or 0 for r in rows)
    print(f"total: {total} inputs, {'no failures' if ok else 'FAILURES (see above)'}; "
          f"{platform.python_version()} on {platform.machine()}, {os.cpu_count()} CPUs", flush=True)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"rows": rows, "total_inputs": total, "ok": ok,
                                      "python": platform.python_version()}, indent=2) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
