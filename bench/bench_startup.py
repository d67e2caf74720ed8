"""Start-up of a small compare: wall time, instruction counts and where the imports go.

    python bench/bench_startup.py                  # wall (best of --repeat), import table
    python bench/bench_startup.py --callgrind      # + instruction counts (valgrind, ~1 min)
    python bench/bench_startup.py --callgrind --before /tmp/head   # + the same for another source tree
                                                   # (e.g. `git archive HEAD consistency | tar -x -C /tmp/head`)

Two 4-tensor npz dumps (a few KB) are compared, so everything measured is start-up:
interpreter, imports, reading the metadata, the report. Wall time on a shared machine
swings with the load; callgrind's instruction count does not, which is why both are given.
The import table is ``python -X importtime``, cumulative microseconds of the top-level
imports each package pulls in (the largest first).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import report  # noqa: E402


def build(out: Path) -> tuple[Path, Path]:
    """A reference with streams 0..3 and a candidate whose slots hold streams 0, 2 and a perturbed 3."""
    from consistency.contract.models import AuxInfo, DumpMetadata, ModelInfo
    from consistency.dump.writer import write_dump

    rng = np.random.default_rng(0)
    streams = [rng.standard_normal((16, 64)).astype(np.float32)]
    for _ in range(3):
        streams.append(streams[-1] + 0.3 * rng.standard_normal((16, 64)).astype(np.float32))
    model = ModelInfo(num_layers=3, hidden_size=64)
    a = write_dump(out / "a.npz", {f"hidden.{s}": x for s, x in enumerate(streams)},
                   DumpMetadata(side="training", model=model, aux=AuxInfo(stream_ids=[0, 1, 2])))
    cand = {"aux.0": streams[0], "aux.1": streams[2], "aux.2": streams[3] * 1.01,
            "input_ids": np.arange(16, dtype=np.int64)}
    b = write_dump(out / "b.npz", cand, DumpMetadata(side="serving", model=model, aux=AuxInfo(stream_ids=[0, 2, 3])))
    return Path(a), Path(b)


def child_env() -> dict[str, str]:
    """Compiled bytecode kept, as an installed package has it (this machine's sessions set
    PYTHONDONTWRITEBYTECODE=1, which recompiles every module of ours on every run)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env.setdefault("PYTHONPYCACHEPREFIX", str(ROOT / "bench" / "out" / "pycache"))
    return env


def wall(cmd: list[str], repeat: int, cwd: Path | None = None) -> float:
    subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False, env=child_env(), cwd=cwd)
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False, env=child_env(),
                       cwd=cwd)
        best = min(best, time.perf_counter() - t)
    return best


def instructions(cmd: list[str], cwd: Path | None = None) -> int | None:
    """Instructions the whole process executes (callgrind; independent of the machine's load)."""
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "cg.out"
        r = subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", *cmd],
                           capture_output=True, text=True, check=False, env=child_env(), cwd=cwd)
        m = re.search(r"Collected : (\d+)", r.stderr)
        return int(m.group(1)) if m else None


def import_table(cmd: list[str], top: int = 25, cwd: Path | None = None) -> list[tuple[str, int]]:
    """``-X importtime``: cumulative us of every module imported at depth 1 (a top-level import)
    and of the consistency modules at any depth, largest first."""
    r = subprocess.run([cmd[0], "-X", "importtime", *cmd[1:]], capture_output=True, text=True, check=False,
                       env=child_env(), cwd=cwd)
    rows = []
    for line in r.stderr.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)", line)
        if not m:
            continue
        depth = len(m.group(3)) // 2
        name = m.group(4)
        if depth <= 1 or name.startswith("consistency"):
            rows.append((("  " * depth) + name, int(m.group(2))))
    total = sum(us for n, us in rows if not n.startswith(" ")) or 1
    rows.sort(key=lambda x: -x[1])
    print(f"imports ({cwd or 'this tree'}): {total / 1e3:.0f} ms cumulative (top-level)")
    for n, us in rows[:top]:
        print(f"  {us / 1e3:8.1f} ms {100 * us / total:5.1f}%  {n}")
    return rows[:top]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--callgrind", action="store_true")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--before", type=Path, help="another source tree (holding consistency/) to measure too")
    args = ap.parse_args()
    py = sys.executable
    with tempfile.TemporaryDirectory() as d:
        a, b = build(Path(d))
        cases: dict[str, tuple[list[str], Path | None]] = {
            "python -c pass": ([py, "-c", "pass"], None),
            "import numpy": ([py, "-c", "import numpy"], None),
            "compare -q": ([py, "-m", "consistency", "compare", str(a), str(b), "-q"], ROOT),
            "compare (text report)": ([py, "-m", "consistency", "compare", str(a), str(b)], ROOT),
        }
        if args.before:
            cases["before: compare -q"] = (cases["compare -q"][0], args.before)
            cases["before: compare (text report)"] = (cases["compare (text report)"][0], args.before)
        os.environ.setdefault("COLUMNS", "120")
        rows = []
        for label, (cmd, cwd) in cases.items():
            row = {"case": label, "wall_best_s": round(wall(cmd, args.repeat, cwd), 3)}
            if args.callgrind:
                n = instructions(cmd, cwd)
                row["instructions_G"] = round(n / 1e9, 3) if n else None
            rows.append(row)
        import_table(cases["compare -q"][0], cwd=ROOT)
        if args.before:
            import_table(cases["compare -q"][0], cwd=args.before)
        report(rows, args.json, load_average=os.getloadavg()[0])


if __name__ == "__main__":
    main()
