"""Compare cost against the number of tensors: many tiny ``hidden.{i}`` tensors, in one run.

    python bench/bench_tensors.py                       # 1k, 3k, 10k, 30k identical; 1k, 3k, 10k perturbed
    python bench/bench_tensors.py --counts 1000 3000 --perturbed 1000

Each row runs ``consistency compare -q`` as a subprocess on two dumps of N tensors of shape
[4, 5] float32 (safetensors) and reports its wall time, its CPU time (user + sys, from
wait4: steadier than wall on a shared machine), its own peak RSS (VmHWM) and the ratio of
each to the smallest N, so growth reads directly (linear: the time ratio follows the N
ratio). ``identical`` pairs need no identification (every pair agrees on its fingerprint);
``perturbed`` pairs differ by 10% noise, so every tensor is identified against all N
references: the quadratic term, O(N^2 x sample) arithmetic in one BLAS call per tensor.
docs/performance.md ("Many tensors") holds the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import report  # noqa: E402

from consistency.dump.writer import write_dump  # noqa: E402

HWM_WRAPPER = ("import sys\nfrom consistency.cli import run\ntry:\n    run(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
               "print('VmHWM', next(int(x.split()[1]) for x in open('/proc/self/status') if x.startswith('VmHWM:')),"
               " file=sys.stderr)")


def build(out: Path, n: int, perturb: float) -> tuple[Path, Path]:
    ref, cand = out / f"tensors-ref-{n}.safetensors", out / f"tensors-cand-{n}-{perturb:g}.safetensors"
    if ref.exists() and cand.exists():
        return ref, cand
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, 4, 5)).astype(np.float32)
    write_dump(ref, {f"hidden.{i}": x[i] for i in range(n)}, force=True)
    y = x + rng.standard_normal(x.shape).astype(np.float32) * np.float32(perturb) if perturb else x
    write_dump(cand, {f"hidden.{i}": y[i] for i in range(n)}, force=True)
    return ref, cand


def run_child(args: list[str], timeout: float) -> tuple[float, float, int]:
    """Wall seconds, peak RSS (MB, the child's own VmHWM) and exit code of one command."""
    t = time.perf_counter()
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return float("inf"), float("nan"), -9
    wall = time.perf_counter() - t
    hwm = [int(x.split()[1]) for x in err.splitlines() if x.startswith("VmHWM ")]
    if proc.returncode not in (0, 1):
        raise SystemExit(f"{args[2:5]} failed ({proc.returncode}): {err[-2000:]}")
    return wall, (hwm[-1] / 1024 if hwm else float("nan")), proc.returncode


def run_timed(args: list[str], timeout: float) -> tuple[float, float, float, int]:
    """Wall seconds, CPU seconds (user + sys of that child, reaped), peak RSS (MB), exit code."""
    import resource

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    wall, rss, code = run_child(args, timeout)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, rss, code


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--counts", type=int, nargs="*", default=[1000, 3000, 10000, 30000])
    ap.add_argument("--perturbed", type=int, nargs="*", default=[1000, 3000, 10000])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for kind, counts, perturb in (("identical", args.counts, 0.0), ("perturbed", args.perturbed, 0.1)):
        base = None
        for n in counts:
            ref, cand = build(args.out, n, perturb)
            cmd = [sys.executable, "-c", HWM_WRAPPER, "compare", str(ref), str(cand), "-q"]
            wall, cpu, rss, code = run_timed(cmd, args.timeout)
            row = {"pair": kind, "tensors": n, "bytes": ref.stat().st_size + cand.stat().st_size,
                   "wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "peak_rss_mb": round(rss, 1),
                   "exit": code}
            base = base or row
            row.update(n_ratio=round(n / base["tensors"], 1), cpu_ratio=round(cpu / base["cpu_s"], 1),
                       rss_ratio=round(rss / base["peak_rss_mb"], 2))
            rows.append(row)
            print(json.dumps(row), flush=True)
    report(rows, args.json, load_avg=os.getloadavg())


if __name__ == "__main__":
    main()
