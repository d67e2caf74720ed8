"""Eager decode timed in short interleaved blocks, with ratios paired inside each block.

An eager decode step of an 8B model at batch 1 is host-bound (about 1,200 kernel launches
from Python), and its time drifts by 10-20% over a minute on the H200 machine (clocks, the
host's other work): whole-run medians of separate runs read that drift as recorder cost
(the probe of this issue measured a copy-free hook at 0.88x "cost"). Here every block runs
each mode for a few steps from the same prefilled cache, in an order rotated block by
block, and a mode's cost is the median over blocks of its time over the ``off`` time of
the same block: drift slower than a block cancels.
"""

from __future__ import annotations

import copy
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def decode_blocks(model: Any, ids: torch.Tensor, modes: list[str], hooks_for: Callable[[str], Any],
                  recorder_for: Callable[[str], Any], steps: int, blocks: int,
                  timed: Callable[[Callable[[], None]], float]) -> tuple[dict, dict[str, int]]:
    """Per mode: median ms per decode step, and the median and quartiles of the paired ratio."""
    assert modes[0] == "off"
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        base, first = out.past_key_values, out.logits[:, -1:].argmax(-1)
    recs = {m: r for m in modes if (r := recorder_for(m)) is not None}
    ms: dict[str, list[float]] = {m: [] for m in modes}
    ratio: dict[str, list[float]] = {m: [] for m in modes}
    try:
        for b in range(blocks + 1):  # block 0 warms up (kernels, the staging views, the ring)
            k = b % len(modes)
            row: dict[str, float] = {}
            for m in modes[k:] + modes[:k]:
                pkv = copy.deepcopy(base)
                hooks, rec = hooks_for(m), recs.get(m)
                if rec is not None:
                    enter(rec)
                try:
                    def run(pkv: Any = pkv) -> None:
                        nxt = first
                        with torch.no_grad():
                            for _ in range(steps):
                                o = model(input_ids=nxt, past_key_values=pkv, use_cache=True)
                                pkv, nxt = o.past_key_values, o.logits[:, -1:].argmax(-1)

                    row[m] = timed(run) / steps
                finally:
                    if rec is not None:
                        leave(rec)
                    if hooks is not None:
                        hooks.remove()
                        hooks.sink.clear()
            if b:
                for m in modes:
                    ms[m].append(row[m])
                    ratio[m].append(row[m] / row["off"])
    finally:
        dropped = {}
        for m, rec in recs.items():
            rec.wait()
            dropped[m] = sum(rec.dropped.values())
            rec.discard()
    res = {}
    for m in modes:
        q = statistics.quantiles(ratio[m], n=4) if len(ratio[m]) > 1 else [ratio[m][0]] * 3
        res[m] = {"decode_ms": round(statistics.median(ms[m]), 3), "decode_ratio": round(statistics.median(ratio[m]), 4),
                  "decode_ratio_q1": round(q[0], 4), "decode_ratio_q3": round(q[2], 4)}
    return res, dropped


def recorder(tmp: Path, mode: str, baseline: Path | None = None, ring_bytes: int = 512 << 20) -> Any:
    """The mode's AsyncRecorder: ``*_base`` from the checkout ``baseline`` (loaded under another
    module name, sharing this checkout's capture()), ``*_step`` sending every step alone."""
    cls = _baseline(baseline) if mode.endswith("_base") else None
    if cls is None:
        from consistency.record.async_capture import AsyncRecorder as cls
    kw = {"flush_bytes": 0} if mode.endswith("_step") else {}
    return cls(tmp / f"{mode}.safetensors", force=True, max_host_bytes=64 << 30, ring_bytes=ring_bytes, **kw).prepare()


def _baseline(tree: Path | None) -> Any:
    if tree is None:
        raise SystemExit("the *_base modes need --baseline-tree")
    return load_baseline(tree)[0]


def load_baseline(tree: Path) -> tuple[Any, Any]:
    """``tree``'s AsyncRecorder and capture(), with its whole ``consistency`` package (staging,
    recorder, pinned ring: a change to any of them is part of the before/after), imported
    under the same names and then put aside so this checkout's modules stay in place."""
    import importlib
    import sys

    def ours() -> dict[str, Any]:
        return {k: v for k, v in sys.modules.items() if k == "consistency" or k.startswith("consistency.")}

    mine = ours()
    for k in mine:
        del sys.modules[k]
    sys.path.insert(0, str(tree))
    try:
        mod = importlib.import_module("consistency.record.async_capture")
        api = importlib.import_module("consistency.record")
    finally:
        sys.path.remove(str(tree))
        for k in ours():
            del sys.modules[k]
        sys.modules.update(mine)
    return mod.AsyncRecorder, api.capture


def enter(rec: Any) -> None:
    """Activate ``rec`` for this checkout's capture() too (a baseline's recorder activates its own)."""
    from consistency.record import recorder as mine

    rec.__enter__()
    if not isinstance(rec, mine.Recorder):
        rec._ours_previous = mine._active
        mine._active = rec


def leave(rec: Any) -> None:
    from consistency.record import recorder as mine

    rec._deactivate()
    if mine._active is rec:
        mine._active = getattr(rec, "_ours_previous", None)
