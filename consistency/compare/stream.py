"""One streaming pass of full metrics over many pairs, block by block of rows.

Each block of a pair is read into a reused buffer, widened to fp32 and folded in one
sweep while it is in cache (``compare/metrics.py``); nothing the size of a tensor or of a
chunk is ever allocated. Pairs are folded on a thread pool (numpy releases the GIL),
which is how both cores get used: a few big pairs are split by rows between the workers,
many small ones by pair, in one batch per worker (thousands of tiny tensors would
otherwise spend their time in the pool's per-task locks rather than in arithmetic).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from consistency.compare.metrics import PairAccumulator, PairMetrics, Scratch, block_rows
from consistency.contract.bounds import knob
from consistency.dump.reader import TensorView

if TYPE_CHECKING:
    from concurrent.futures import ThreadPoolExecutor

CHUNK_BYTES = knob("CHUNK_MB") * 1024 * 1024
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
    """Full metrics of (ref, cand, rtol, atol) pairs; all pairs in one call share a row count.

    Work is done block by block of rows (:data:`~consistency.compare.metrics.BLOCK_ELEMS`):
    each block is read (a plain bf16/fp32/fp16 file view straight into a reused buffer),
    widened and folded while it sits in the core's cache. A few big pairs are split by rows
    between the workers (each folds into its own shard of the pair's accumulator); many
    pairs are split by pair. ``chunk_bytes`` only sets how often ``progress`` ticks."""
    if not pairs:
        return []
    rows = pairs[0][1].rows
    accs = [PairAccumulator(c.rows, c.cols, rtol, atol) for _r, c, rtol, atol in pairs]
    width = sum(c.cols for _r, c, _rt, _at in pairs)
    # small work (a few MB) runs on this thread: starting a pool costs more than it saves
    n_workers = 1 if rows * width * 4 < SMALL_BYTES else workers()
    readers: dict[int, Callable[[int, int, Scratch, str], np.ndarray]] = {}
    for r, c, _rt, _at in pairs:
        readers.setdefault(id(r), block_reader(r))
        readers.setdefault(id(c), block_reader(c))
    by_rows = n_workers > 1 and len(pairs) < 2 * n_workers
    shards = [[a] + [a.shard() for _ in range(n_workers - 1)] if by_rows else [a] for a in accs]
    pair_sets = [list(range(len(pairs)))] * n_workers if by_rows else \
        batches(list(range(len(pairs))), lambda i: pairs[i][1].cols, n_workers)
    chunk = max(1, chunk_bytes // max(1, 8 * width))
    with pool(len(pair_sets)) as ex:
        for start in range(0, rows, chunk):
            stop = min(rows, start + chunk)
            if by_rows:
                cut = [start + (stop - start) * w // n_workers for w in range(n_workers + 1)]
                spans = [(cut[w], cut[w + 1]) for w in range(n_workers)]
            else:
                spans = [(start, stop)] * len(pair_sets)

            def fold(w: int) -> None:
                buf = scratch()
                a, b = spans[w]
                for i in pair_sets[w]:
                    r, c = pairs[i][0], pairs[i][1]
                    acc = shards[i][w] if by_rows else accs[i]
                    step = block_rows(c.cols)
                    for s in range(a, b, step):
                        e = min(b, s + step)
                        acc.add_block(s, readers[id(r)](s, e, buf, "x"), readers[id(c)](s, e, buf, "y"), buf)

            run(ex, fold, list(range(len(pair_sets))))
            if progress is not None:
                progress(stop - start)
    for acc, parts in zip(accs, shards, strict=True):
        for part in parts[1:]:
            acc.merge(part)
    return [a.result() for a in accs]


_LOCAL = threading.local()


def scratch() -> Scratch:
    """This thread's block buffers (kept between calls: a compare folds many chunks)."""
    got = getattr(_LOCAL, "scratch", None)
    if got is None:
        got = _LOCAL.scratch = Scratch()
    return got


_DIRECT = {"bfloat16": np.dtype("<u2"), "float32": np.dtype("<f4"), "float16": np.dtype("<f2")}


def _direct(v: TensorView) -> np.dtype | None:
    """The storage dtype when ``v`` can be read straight into a buffer and widened here: a
    plain file-backed view (not a column slice, a row selection, a scaled or rank view --
    those keep their own ``rows_float``) of bf16, fp32 or fp16 in little-endian storage."""
    storage = _DIRECT.get(v.dtype)
    if type(v) is not TensorView or v._array is not None or v._cols is not None or storage is None \
            or v._storage != storage or v._fd is None:
        return None
    return storage


def _widen(v: TensorView, raw: np.ndarray, buf: Scratch, tag: str) -> np.ndarray:
    """fp32 values of stored rows ``raw``: bf16 by one shift (its bits are the high half of
    the fp32 bits) into a reused buffer, fp16 by one cast, fp32 as it is."""
    if v.dtype == "float32":
        return raw
    out = buf.get(tag, raw.shape[0], raw.shape[1], np.float32)
    if v.dtype == "float16":
        np.copyto(out, raw)
    else:
        np.left_shift(raw, np.uint32(16), out=out.view(np.uint32), dtype=np.uint32)
    return out


def block_reader(v: TensorView) -> Callable[[int, int, Scratch, str], np.ndarray]:
    """``read(a, b, scratch, tag)`` -> float rows [a, b) of ``v`` (fp32; fp64 for fp64),
    valid until the next read with the same ``tag``."""
    want = np.float64 if v.dtype == "float64" else np.float32
    storage = _direct(v)
    if storage is None:
        return lambda a, b, _buf, _tag: v.rows_float(a, b, want)
    cols = v.cols

    def read(a: int, b: int, buf: Scratch, tag: str) -> np.ndarray:
        return _widen(v, v.read_into(a, buf.get(tag + "raw", b - a, cols, storage)), buf, tag)

    return read


def read_runs(v: TensorView, runs: Sequence[tuple[int, int]], buf: Scratch, tag: str = "runs") -> np.ndarray:
    """Float rows of ``v`` for the row ranges ``runs``, one after the other (a token sample):
    one read per run into one buffer, then one widening for all of them."""
    k = sum(b - a for a, b in runs)
    storage = _direct(v)
    if storage is None:
        want = np.float64 if v.dtype == "float64" else np.float32
        out = buf.get(tag, k, v.cols, want)
        at = 0
        for a, b in runs:
            out[at:at + b - a] = v.rows_float(a, b, want)
            at += b - a
        return out
    raw = buf.get(tag + "raw", k, v.cols, storage)
    at = 0
    for a, b in runs:
        v.read_into(a, raw[at:at + b - a])
        at += b - a
    return _widen(v, raw, buf, tag)


def pool(n: int) -> contextlib.AbstractContextManager:
    if n <= 1:
        return contextlib.nullcontext()
    from concurrent.futures import ThreadPoolExecutor  # imported here: a small compare never starts a pool

    return ThreadPoolExecutor(max_workers=n)


def run(ex: ThreadPoolExecutor | None, fn: Callable[[Any], T], work: list[Any]) -> list[T]:
    """One task per batch; a single batch (or no pool) runs here, with no hand-off."""
    if ex is None:
        return [fn(b) for b in work]
    if len(work) == 1:
        return [fn(work[0])]
    return list(ex.map(fn, work))
