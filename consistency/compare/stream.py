"""One streaming pass of full metrics over many pairs, chunk by chunk of rows.

Each distinct tensor is read once per chunk however many pairs use it, chunks are sized
so the working set stays near ``CHUNK_BYTES``, and pairs within a chunk are folded on a
thread pool (numpy releases the GIL), which is how both cores get used.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from consistency.compare.metrics import PairAccumulator, PairMetrics
from consistency.dump.reader import TensorView

CHUNK_BYTES = int(os.environ.get("CONSISTENCY_CHUNK_MB", "64")) * 1024 * 1024
Progress = Callable[[int], None]


def workers() -> int:
    try:
        return max(1, min(4, len(os.sched_getaffinity(0))))
    except AttributeError:  # pragma: no cover - non-Linux
        return max(1, min(4, os.cpu_count() or 1))


def measure(pairs: Sequence[tuple[TensorView, TensorView, float, float]], progress: Progress | None = None,
            chunk_bytes: int = CHUNK_BYTES, row_index: Sequence[np.ndarray | None] | None = None) -> list[PairMetrics]:
    """Full metrics of (ref, cand, rtol, atol) pairs; all pairs in one call share a row count."""
    if not pairs:
        return []
    rows, cols = pairs[0][1].rows, pairs[0][1].cols
    accs = [PairAccumulator(c.rows, c.cols, rtol, atol) for _r, c, rtol, atol in pairs]
    distinct: dict[int, TensorView] = {}
    for r, c, _rt, _at in pairs:
        distinct.setdefault(id(r), r)
        distinct.setdefault(id(c), c)
    # fp32 copies of every distinct view, plus fp32 temporaries (d, |x|) per pair being folded
    per_row = cols * (4 * len(distinct) + 4 * 3 * min(len(pairs), workers()))
    chunk = max(1, chunk_bytes // max(1, per_row))
    with ThreadPoolExecutor(max_workers=workers()) as pool:
        for start in range(0, rows, chunk):
            stop = min(rows, start + chunk)
            data = dict(zip(distinct, pool.map(
                lambda v: v.rows_float(start, stop, np.float64 if v.dtype == "float64" else np.float32),
                distinct.values()), strict=True))
            list(pool.map(lambda i: accs[i].add(start, *_same_dtype(data[id(pairs[i][0])], data[id(pairs[i][1])])),
                          range(len(pairs))))
            if progress is not None:
                progress(stop - start)
    return [a.result() for a in accs]


def _same_dtype(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A float64 side lifts the other to float64 (its values may exceed the fp32 range)."""
    if a.dtype == b.dtype:
        return a, b
    return a.astype(np.float64), b.astype(np.float64)
