"""Where a whole ``consistency compare`` process spends its time, on the Kimi-shaped dumps.

    python bench/bench_e2e.py            # after bench/bench_compare.py has written the dumps
    python bench/bench_e2e.py --out DIR  # where bench_compare.py wrote them (--out there)

Five child processes, each best of --repeat: the interpreter alone, numpy alone, every
import of the compare path, those imports plus the whole pipeline in-process (open,
compare, diagnose, report; its own time printed by the child), and the CLI itself. The
differences say how much of the end-to-end time is start-up, which no change to the
compare can remove (docs/performance.md, "Issue 17, second session").
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_compare import child_env  # noqa: E402
from bench.common import report  # noqa: E402

MODS = ("import consistency.cli, consistency.cli.compare_cmd, consistency.pipeline.compare, consistency.compare.engine, "
        "consistency.diagnose.engine, consistency.diagnose.report, consistency.compare.prepare, consistency.dump.sets, "
        "consistency.diagnose.metadiff")
PIPELINE = (MODS + "\nimport sys, time\nt = time.perf_counter()\ntry:\n"
            "    consistency.cli.run(['compare', sys.argv[1], sys.argv[2], '-q'])\nexcept SystemExit:\n    pass\n"
            "print('pipeline', time.perf_counter() - t, file=sys.stderr)")


def best(cmd: list[str], repeat: int) -> tuple[float, str]:
    subprocess.run(cmd, env=child_env(), capture_output=True, cwd=ROOT)  # bytecode compiled once
    wall, err = float("inf"), ""
    for _ in range(repeat):
        t = time.perf_counter()
        p = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, cwd=ROOT)
        if time.perf_counter() - t < wall:
            wall, err = time.perf_counter() - t, p.stderr
    return wall, err


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out")
    ap.add_argument("--name", default="61x7168x2048")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    ref, cand = args.out / f"ref-{args.name}.safetensors", args.out / f"cand-{args.name}.safetensors"
    if not (ref.exists() and cand.exists()):
        raise SystemExit(f"{ref} / {cand} missing: run bench/bench_compare.py --out {args.out} first")
    py = sys.executable
    row: dict[str, float] = {}
    row["python_pass_s"] = best([py, "-c", "pass"], args.repeat)[0]
    row["import_numpy_s"] = best([py, "-c", "import numpy"], args.repeat)[0]
    row["imports_s"] = best([py, "-c", MODS], args.repeat)[0]
    wall, err = best([py, "-c", PIPELINE, str(ref), str(cand)], args.repeat)
    row["imports_and_pipeline_s"] = wall
    row["pipeline_in_child_s"] = float(next(x.split()[1] for x in err.splitlines() if x.startswith("pipeline ")))
    row["cli_q_s"] = best([py, "-m", "consistency", "compare", str(ref), str(cand), "-q"], args.repeat)[0]
    report([{k: round(v, 3) for k, v in row.items()}], args.json)


if __name__ == "__main__":
    main()
