"""The test suite's time, as CI runs it: wall, CPU and the slowest tests, with the load around it.

    python bench/bench_suite.py                       # the whole suite, -n auto --dist worksteal
    python bench/bench_suite.py tests/gate/test_gate.py    # a subset (any pytest arguments)
    python bench/bench_suite.py --json bench/results/cpu-suite.json

Issue 39's bar: the whole suite in <= 6 minutes on the 2-core machine. A wall time on a
shared machine says as much about the neighbours as about the suite, so the load average is
sampled every 5 s during the run and reported beside it, with the CPU seconds (user + sys,
children included: the CLI subprocesses and gloo workers count) and pytest's own
``--durations`` table (the 30 slowest setups, calls and teardowns). Compare runs only at
the same load; CPU seconds are the steadier figure. Run it on a quiet machine for the
number that goes into docs/performance.md.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import report  # noqa: E402

BAR_S = 6 * 60
_DURATION = re.compile(r"^\s*(\d+\.\d+)s (setup|call|teardown)\s+(\S+)", re.M)
_SUMMARY = re.compile(r"(\d+) passed(?:, (\d+) skipped)?(?:, (\d+) failed)?")


def _sample_load(stop: threading.Event, out: list[float]) -> None:
    while not stop.wait(5.0):
        out.append(os.getloadavg()[0])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, help="also write the figures here")
    ap.add_argument("--workers", default=os.environ.get("PYTEST_WORKERS", "auto"))
    ap.add_argument("pytest_args", nargs="*", default=["tests"])
    args = ap.parse_args(argv)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", args.workers, "--dist", "worksteal",
           "--durations=30", *args.pytest_args]
    loads: list[float] = []
    stop = threading.Event()
    sampler = threading.Thread(target=_sample_load, args=(stop, loads), daemon=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    load0 = os.getloadavg()[0]
    sampler.start()
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    stop.set()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    out = r.stdout + r.stderr
    summary = _SUMMARY.search(out)
    slow = [{"seconds": float(s), "phase": phase, "test": name} for s, phase, name in _DURATION.findall(out)]
    loads = [load0, *loads]
    rows = [{"what": " ".join(args.pytest_args), "exit": r.returncode,
             "passed": int(summary.group(1)) if summary else None,
             "wall s": round(wall, 1), "CPU s": round(cpu, 1),
             "load avg (min/mean/max)": f"{min(loads):.1f}/{sum(loads) / len(loads):.1f}/{max(loads):.1f}",
             "within the 6-min bar": wall <= BAR_S}]
    report(rows, args.json, slowest=slow, command=" ".join(cmd[1:]))
    print("\nslowest:")
    for s in slow[:30]:
        print(f"  {s['seconds']:7.2f} s  {s['phase']:<8} {s['test']}")
    return 0 if r.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
