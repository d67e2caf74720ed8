"""One streaming pass of full metrics over many pairs, chunk by chunk of rows.

Each distinct tensor is read once per chunk however many pairs use it, chunks are sized
so the working set stays near ``CHUNK_BYTES``, and pairs within a chunk are folded on a
thread pool (numpy releases the GIL), which is how both cores get used. Work goes to the
pool in one batch per worker, balanced by bytes: thousands of tiny tensors would otherwise
spend their time in the pool's per-task locks rather than in arithmetic.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from consistency.compare.metrics import PairAccumulator, PairMetrics
from consistency.dump.reader import TensorView

if TYPE_CHECKING:
    from concurrent.futures import ThreadPoolExecutor

CHUNK_BYTES = int(os.environ.get("CONSISTENCY_CHUNK_MB", "64")) * 1024 * 1024
SMALL_BYTES = 4 * 1024 * 1024
Progress = Callable[[int], None]
T = TypeVar("T")


def workers() -> int:
    try:
        return max(1, min(4, len(os.sched_getaffinity(0))))
    except AttributeError:  # pragma: no cover - non-Linux
        return max(1, min(4, os.cpu_count() or 1))


def batches(items: Sequence[T], weight: Callable[[T], int], n: int) -> list[list[T]]:
    """``items`` in at most ``n`` batches of about equal total weight, in order within each
    (largest first across batches, so one big tensor does not sit behind many small ones)."""
    if n <= 1 or len(items) <= 1:
        return [list(items)] if items else []
    if len(items) <= n:
        return [[x] for x in items]
    out: list[list[T]] = [[] for _ in range(n)]
    load = [0] * n
    for x in sorted(items, key=weight, reverse=True):
        i = load.index(min(load))
        out[i].append(x)
        load[i] += max(1, weight(x))
    return [b for b in out if b]


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
    # small work (a few MB per chunk) runs on this thread: starting a pool costs more than it saves
    small = rows * cols * 4 * len(pairs) < SMALL_BYTES
    n_workers = 1 if small else workers()
    # fp32 copies of every distinct view, plus fp32 temporaries (d, |x|) per pair being folded
    per_row = cols * (4 * len(distinct) + 4 * 3 * min(len(pairs), n_workers))
    chunk = max(1, chunk_bytes // max(1, per_row))
    views = list(distinct.items())
    view_batches = batches(views, lambda kv: kv[1].cols * kv[1]._storage.itemsize, n_workers)
    pair_batches = batches(list(range(len(pairs))), lambda i: pairs[i][1].cols, n_workers)
    with _pool(n_workers) as pool:
        for start in range(0, rows, chunk):
            stop = min(rows, start + chunk)

            def read(batch: list[tuple[int, TensorView]], a: int = start, b: int = stop) -> list[tuple[int, np.ndarray]]:
                return [(k, v.rows_float(a, b, np.float64 if v.dtype == "float64" else np.float32)) for k, v in batch]

            data: dict[int, np.ndarray] = {}
            for got in _run(pool, read, view_batches):
                data.update(got)

            def fold(batch: list[int], a: int = start) -> None:
                for i in batch:
                    accs[i].add(a, *_same_dtype(data[id(pairs[i][0])], data[id(pairs[i][1])]))

            _run(pool, fold, pair_batches)
            if progress is not None:
                progress(stop - start)
    return [a.result() for a in accs]


def _pool(n: int) -> contextlib.AbstractContextManager:
    if n <= 1:
        return contextlib.nullcontext()
    from concurrent.futures import ThreadPoolExecutor  # imported here: a small compare never starts a pool

    return ThreadPoolExecutor(max_workers=n)


def _run(pool: ThreadPoolExecutor | None, fn: Callable[[list], T], work: list[list]) -> list[T]:
    """One task per batch; a single batch (or no pool) runs here, with no hand-off."""
    if pool is None:
        return [fn(b) for b in work]
    if len(work) == 1:
        return [fn(work[0])]
    return list(pool.map(fn, work))


def _same_dtype(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A float64 side lifts the other to float64 (its values may exceed the fp32 range)."""
    if a.dtype == b.dtype:
        return a, b
    return a.astype(np.float64), b.astype(np.float64)
