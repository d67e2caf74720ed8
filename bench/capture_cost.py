"""The host cost of one capture, without a model: where an eager decode step's recorder
time goes (issue 36: every stream at batch 1 costs 33 captures a step, 60-110 us each on
the H200 host, against 21 us for a bare device copy).

    python bench/capture_cost.py --out cost.json [--baseline-tree DIR]     # on a CUDA machine

A step is 33 points, each after ``--launches`` small kernel launches (an eager decoder
layer launches about 36), so the recorder's copies interleave with other launches as in
a decode. Modes, timed in interleaved blocks (the order rotated block by block):
  off      the launches alone
  copy     plus one bare ``copy_`` per point into a buffer of its own (the floor of any snapshot)
  rec      plus ``consistency.record.capture`` into this checkout's AsyncRecorder, every point
  base     the same with the AsyncRecorder of ``--baseline-tree`` (its whole record package)
Reported: median microseconds per step, per point over ``off``, and the median paired ratio;
and a cProfile of ``rec``'s captures (the top functions by own time).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import emit  # noqa: E402

from bench.decode_blocks import load_baseline  # noqa: E402
from consistency.record import capture  # noqa: E402
from consistency.record.async_capture import AsyncRecorder  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--points", type=int, default=33)
    ap.add_argument("--launches", type=int, default=36)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--blocks", type=int, default=40)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--baseline-tree", type=Path)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    x = torch.randn(1, 1, args.hidden, device="cuda", dtype=torch.bfloat16)
    scratch = torch.zeros(64, device="cuda")
    names = [f"hidden.{i}" for i in range(args.points)]
    bufs = {n: torch.empty_like(x) for n in names}
    recs = {"rec": (AsyncRecorder(tmp / "rec.safetensors", force=True, max_host_bytes=64 << 30).prepare(), capture)}
    if args.baseline_tree:
        cls, cap = load_baseline(args.baseline_tree)
        recs["base"] = (cls(tmp / "base.safetensors", force=True, max_host_bytes=64 << 30).prepare(), cap)
    modes = ["off", "copy", *recs]

    def step(mode: str) -> None:
        for n in names:
            for _ in range(args.launches):
                scratch.add_(1.0)
            if mode == "copy":
                bufs[n].copy_(x)
            elif mode != "off":
                recs[mode][1](n, x)

    def block(mode: str) -> float:
        rec = recs.get(mode, (None,))[0]
        if rec is not None:
            rec.__enter__()
        try:
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(args.steps):
                step(mode)
            torch.cuda.synchronize()
            return (time.perf_counter() - t) / args.steps * 1e6
        finally:
            if rec is not None:
                rec._deactivate()

    us: dict[str, list[float]] = {m: [] for m in modes}
    ratio: dict[str, list[float]] = {m: [] for m in modes}
    for b in range(args.blocks + 1):
        k = b % len(modes)
        row = {m: block(m) for m in modes[k:] + modes[:k]}
        if b:
            for m in modes:
                us[m].append(row[m])
                ratio[m].append(row[m] / row["off"])
    off = statistics.median(us["off"])
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "points": args.points,
                 "launches": args.launches, "steps": args.steps, "blocks": args.blocks, "modes": {}}
    for m in modes:
        med = statistics.median(us[m])
        res["modes"][m] = {"step_us": round(med, 1), "per_point_us": round((med - off) / args.points, 2),
                           "ratio": round(statistics.median(ratio[m]), 4)}
    rec = recs["rec"][0]
    rec.__enter__()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.steps * 4):
        step("rec")
    prof.disable()
    rec._deactivate()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(16)
    res["profile_rec"] = s.getvalue().splitlines()[-24:]
    for name, (r, _) in recs.items():
        r.wait()
        res["modes"][name]["captures"] = sum(r.counts.values())
        res["modes"][name]["dropped"] = sum(r.dropped.values())
        r.discard()
    emit(res, args.out)


if __name__ == "__main__":
    main()
