"""Which reference tensor does each candidate tensor actually hold?

Comparing every slot with every layer in full would read the whole reference once per
slot. Instead one pass reads a fixed sample of token rows of every reference tensor (the
fingerprint: attention-sink rows first, then evenly spaced rows), and ranks references by
token rel_diff on that sample. Full metrics are computed afterwards only for the few
pairs that matter (expected and identified). Memory is bounded by ``budget_bytes``.

Cost in the number of tensors n (docs/performance.md, "Many tensors"): building the
fingerprints, checking a same-name pair and every name look-up are O(1) per tensor (one
pair distance is O(rows x cols) on the sample, never a row of n distances); ranking one
candidate is one batched product over the pool, O(n) in C plus O(selected) in Python, so
identifying m candidates costs O(m * n * sample) arithmetic and O(n) memory at any time
(the memo of distance rows is bounded by ``MEMO_BYTES``).
"""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Union

import numpy as np

from consistency.compare import stream
from consistency.contract.bounds import knob
from consistency.dump import names
from consistency.dump.reader import TensorView

DEFAULT_BUDGET = knob("SAMPLE_MB") * 1024 * 1024
MEMO_BYTES = 64 * 1024 * 1024  # distance rows kept per Fingerprints (each row is 8 bytes x tensors)
MAX_SAMPLE = 256
MIN_SAMPLE = 16
HEAD_ROWS = 4  # massive-activation / sink tokens live at the start
MAX_GROUPS = 6  # rank() keeps this many groups of equal references
_FIRST_PICK = 64  # rank() sorts this many nearest references first, more only if merging needs them


def sample_index(rows: int, k: int, block: int = 8) -> np.ndarray:
    """Deterministic row sample: the first HEAD_ROWS rows (sinks and massive activations
    live there), then blocks of ``block`` consecutive rows at evenly spaced offsets, so a
    sample costs a few dozen reads instead of one read per row."""
    if rows <= k:
        return np.arange(rows, dtype=np.int64)
    head = np.arange(min(HEAD_ROWS, k), dtype=np.int64)
    n_blocks = max(1, (k - len(head)) // block)
    starts = np.linspace(len(head), rows - block, n_blocks).round().astype(np.int64)
    rest = (starts[:, None] + np.arange(block)[None, :]).reshape(-1)
    return np.unique(np.concatenate([head, rest[(rest >= 0) & (rest < rows)]]))


def sample_size(rows: int, cols: int, n_tensors: int, budget_bytes: int = DEFAULT_BUDGET) -> int:
    per_row = max(1, cols * 8 * max(1, n_tensors))
    k = int(budget_bytes // per_row)
    return max(1, min(rows, MAX_SAMPLE, max(MIN_SAMPLE, k)))


def token_distance(a: np.ndarray, b: np.ndarray) -> float:
    """Mean over rows of Σ(a-b)²/(Σa²+Σb²): the token rel_diff of two sampled tensors."""
    if a.shape != b.shape or a.size == 0:
        return math.inf if a.shape != b.shape else 0.0
    d = a - b
    num = np.einsum("ij,ij->i", d, d)
    den = np.einsum("ij,ij->i", a, a) + np.einsum("ij,ij->i", b, b)
    out = np.zeros_like(num)
    np.divide(num, den, out=out, where=den > 0)
    return float(out.mean())


class Fingerprints:
    """Sampled rows (fp64) of a set of tensors that share rows and cols, stacked as one
    [k, n, cols] array with each row's squared norm cached: the distances from one tensor
    to all n others are then a single batched matrix-vector product."""

    def __init__(self, views: Iterable[TensorView], index: np.ndarray) -> None:
        self.index = index
        views = list(views)
        self.names = [v.name for v in views]
        self.pos = {n: i for i, n in enumerate(self.names)}
        cuts = np.flatnonzero(np.diff(index) != 1) + 1  # contiguous runs of the sample
        runs = [(int(r[0]), int(r[-1]) + 1) for r in np.split(index, cuts) if len(r)]
        cols = views[0].cols if views else 0
        self.stack = np.empty((len(index), len(views), cols))  # every entry is written below
        self.sqn = np.empty((len(index), len(views)))  # [k, n]: each sampled row's squared norm

        def fill(batch: list[int]) -> None:
            buf = stream.scratch()
            for j in batch:
                rows = stream.read_runs(views[j], runs, buf)  # one read per run, one widening
                if rows.dtype == np.float64:
                    rows = np.clip(rows, -1e150, 1e150)  # squares stay finite
                if not np.isfinite(rows).all():  # NaN/inf rows are zero in the fingerprint
                    rows = np.where(np.isfinite(rows), rows, 0.0)
                col = self.stack[:, j]
                col[...] = rows
                self.sqn[:, j] = np.einsum("kh,kh->k", col, col)  # while the rows are in cache

        # the views are filled on both cores (reads and numpy release the GIL) once it pays
        n_workers = stream.workers() if self.stack.nbytes >= 4 * stream.SMALL_BYTES else 1
        work = stream.batches(list(range(len(views))), lambda _j: 1, n_workers)
        with stream.pool(len(work)) as ex:
            stream.run(ex, fill, work)
        self._memo: OrderedDict[tuple[str, int], np.ndarray] = OrderedDict()
        self._memo_rows = max(1, MEMO_BYTES // max(1, 8 * len(self.names)))
        self._kinds: dict[str, np.ndarray] = {}
        self._order: tuple[np.ndarray, np.ndarray] | None = None

    @property
    def data(self) -> dict[str, np.ndarray]:
        """name -> sampled rows [k, cols] (views into the stack)."""
        return {n: self.stack[:, i] for n, i in self.pos.items()}

    def rows(self, name: str) -> np.ndarray:
        return self.stack[:, self.pos[name]]

    def __contains__(self, name: str) -> bool:
        return name in self.pos

    # -- per-name facts, computed once per set (never once per candidate) ------------------
    def of_kind(self, *kinds: str) -> np.ndarray:
        """Positions of the tensors whose name is of one of ``kinds`` (e.g. ``hidden``), in order."""
        key = ",".join(kinds)
        if key not in self._kinds:
            self._kinds[key] = np.fromiter((i for i, n in enumerate(self.names) if names.parse(n).kind in kinds),
                                           dtype=np.int64)
        return self._kinds[key]

    def positions(self, pool: Sequence[str] | None) -> np.ndarray | None:
        """Positions of ``pool`` (None: every tensor); names not held here are skipped."""
        if pool is None or pool is self.names or (len(pool) == len(self.names) and list(pool) == self.names):
            return None
        return np.fromiter((self.pos[n] for n in pool if n in self.pos), dtype=np.int64)

    def _tiebreak(self) -> tuple[np.ndarray, np.ndarray]:
        """(name preference, rank of the name as a string) per tensor: rank()'s tie order."""
        if self._order is None:
            pref = np.fromiter((names.preference(n) for n in self.names), dtype=np.int64, count=len(self.names))
            alpha = np.empty(len(self.names), dtype=np.int64)
            alpha[np.array(sorted(range(len(self.names)), key=self.names.__getitem__), dtype=np.int64)] = \
                np.arange(len(self.names))
            self._order = (pref, alpha)
        return self._order

    # -- distances ---------------------------------------------------------------------------
    def distances(self, a: str, other: Fingerprints | None = None) -> np.ndarray:
        """Token rel_diff from tensor ``a`` (of self) to every tensor of ``other``, via
        Σa²+Σb²-2Σab in fp64 (the cancellation is far below any floor)."""
        src = other if other is not None else self
        key = (a, id(src))
        hit = self._memo.get(key)
        if hit is not None:
            self._memo.move_to_end(key)
            return hit
        x = self.stack[:, self.pos[a]]  # [k, h]
        if src.stack.shape[0] != x.shape[0] or src.stack.shape[2] != x.shape[1]:
            out = np.full(len(src.names), math.inf)
        elif x.shape[0] == 0:  # no rows: nothing differs
            out = np.zeros(len(src.names))
        else:
            dots = np.matmul(src.stack, x[:, :, None])[..., 0]  # [k, n]
            out = _rel(self.sqn[:, self.pos[a]][:, None] + src.sqn, dots)
        self._remember(key, out)
        return out

    def _remember(self, key: tuple[str, int], row: np.ndarray) -> None:
        self._memo[key] = row
        if len(self._memo) > self._memo_rows:  # bounded: a row per candidate would be O(n²) memory
            self._memo.popitem(last=False)

    def distance(self, a: str, b: str, other: Fingerprints | None = None) -> float:
        """One pair, O(sample) work: a memoized row when there is one, else just this pair."""
        src = other if other is not None else self
        row = self._memo.get((a, id(src)))
        if row is not None:
            return float(row[src.pos[b]])
        x, y = self.stack[:, self.pos[a]], src.stack[:, src.pos[b]]
        if x.shape != y.shape:
            return math.inf
        if x.shape[0] == 0:
            return 0.0
        dots = np.matmul(y[:, None, :], x[:, :, None])[..., 0]  # [k, 1], as one column of distances()
        return float(_rel(self.sqn[:, self.pos[a]][:, None] + src.sqn[:, src.pos[b]][:, None], dots)[0])


def prefetch(cand_fp: dict[tuple[int, int], Fingerprints], ref_fp: dict[tuple[int, int], Fingerprints],
             pairs: Sequence[tuple[TensorView, TensorView | None]]) -> None:
    """The distances compare will ask for on each (slot, expected reference) pair -- the
    slot ranked against every reference, the expected reference's neighbour gap -- in one
    pass over each reference sample for all of them."""
    wanted: dict[tuple[int, int], list[tuple[Fingerprints, str]]] = {}
    for cand, ref in pairs:
        key = (cand.rows, cand.cols)
        if not (cand.is_float and cand.cols > 1) or key not in ref_fp or key not in cand_fp:
            continue
        todo = wanted.setdefault(key, [])
        todo.append((cand_fp[key], cand.name))
        if ref is not None and ref.name in ref_fp[key]:
            todo.append((ref_fp[key], ref.name))
    for key, todo in wanted.items():
        scan(ref_fp[key], todo)


def scan(src: Fingerprints, wanted: Sequence[tuple[Fingerprints, str]]) -> None:
    """Memoize the distance row of every (fingerprints, name) in ``wanted`` against all of
    ``src`` in one pass over ``src``'s stack (the sample of every reference, ~200 MB for a
    Kimi-sized dump): per sampled row, one [n, h] x [h, m] product (BLAS, threaded by the
    library) while that row of every reference is in cache. On the 16-core machine this
    is 15 ms for the six rows a 3-slot compare needs, against 80 ms as six passes of
    products from our own threads (bench/results, issue 17)."""
    todo = [(fp, a) for fp, a in dict.fromkeys(wanted) if a in fp.pos and (a, id(src)) not in fp._memo
            and fp.stack.shape[0] == src.stack.shape[0] and fp.stack.shape[2] == src.stack.shape[2]]
    if len(todo) < 2 or src.stack.shape[0] == 0:
        return  # one row: distances() computes it directly
    k, n, h = src.stack.shape
    # per batch: the memo rows it fills, its products [k, n, m] and its copied rows [k, m, h], each bounded
    step = max(1, min(min(fp._memo_rows for fp, _a in todo), MEMO_BYTES // max(1, 8 * k * n),
                      MEMO_BYTES // max(1, 8 * k * h)))
    for i in range(0, len(todo), step):
        part = todo[i:i + step]
        vecs = np.stack([fp.stack[:, fp.pos[a]] for fp, a in part], axis=1)  # [k, m, h]
        dots = np.empty((k, n, len(part)))
        for r in range(k):
            np.matmul(src.stack[r], vecs[r].T, out=dots[r])
        for j, (fp, a) in enumerate(part):
            fp._remember((a, id(src)), _rel(fp.sqn[:, fp.pos[a]][:, None] + src.sqn, dots[:, :, j]))


def _rel(den: np.ndarray, dots: np.ndarray) -> np.ndarray:
    """Mean over sampled rows of (Σa²+Σb²-2Σab)/(Σa²+Σb²), per column of ``den``/``dots`` [k, n]."""
    num = np.maximum(den - 2.0 * dots, 0.0)
    out = np.zeros_like(num)
    np.divide(num, den, out=out, where=den > 0)
    return out.mean(axis=0)


@dataclass(frozen=True)
class Ranked:
    name: str
    distance: float


@dataclass(frozen=True)
class Identification:
    """A candidate's ranking against the reference: a value (the joint slot assignment
    returns a promoted copy, it never reorders this one)."""

    tensor: str
    ranking: tuple[Ranked, ...]  # best first, one entry per group of equal references
    groups: tuple[tuple[str, ...], ...] = ()  # members of each ranked group
    expected: str | None = None
    expected_distance: float | None = None
    gap: float | None = None  # expected's distance to its nearest other reference stream

    @property
    def group(self) -> tuple[str, ...]:
        """References equal to the best match (e.g. ``hidden.3`` and the reference's ``aux.1``)."""
        return self.groups[0] if self.groups else ()

    def promoted(self, name: str, distance: float | None) -> Identification:
        """The same ranking with the group holding ``name`` first (the joint assignment chose it)."""
        ranking, groups = list(self.ranking), list(self.groups)
        for i, grp in enumerate(groups):
            if name in grp:
                ranking.insert(0, ranking.pop(i))
                groups.insert(0, groups.pop(i))
                break
        else:
            ranking.insert(0, Ranked(name, distance if distance is not None else math.inf))
            groups.insert(0, (name,))
        return replace(self, ranking=tuple(ranking), groups=tuple(groups))

    @property
    def best(self) -> Ranked | None:
        return self.ranking[0] if self.ranking else None

    @property
    def runner_up(self) -> Ranked | None:
        return self.ranking[1] if len(self.ranking) > 1 else None

    @property
    def confidence(self) -> float | None:
        """Runner-up distance over match distance (large is sure; near 1 is a coin toss)."""
        b, r = self.best, self.runner_up
        if b is None or r is None:
            return None
        if b.distance <= 0:
            return 1e12 if r.distance > 0 else 1.0
        return r.distance / b.distance


Pool = Union[Sequence[str], np.ndarray, None]  # names, positions in the reference Fingerprints, or None for all


def _pool_positions(fp: Fingerprints, pool: Pool) -> np.ndarray | None:
    if isinstance(pool, np.ndarray):
        return pool.astype(np.int64, copy=False)
    return fp.positions(pool)


def _nearest_first(all_d: np.ndarray, rfp: Fingerprints, at: np.ndarray | None) -> Iterable[tuple[float, str]]:
    """(distance, name) in the order of sorted((d, preference, name)), the nearest
    ``_FIRST_PICK`` (and every tie with the last of them) sorted first, the rest only if asked."""
    pos = np.arange(len(all_d), dtype=np.int64) if at is None else at
    d = all_d[pos]
    pref, alpha = rfp._tiebreak()
    if len(pos) > _FIRST_PICK:
        cut = np.partition(d, _FIRST_PICK - 1)[_FIRST_PICK - 1]
        near = d <= cut
        parts = [(pos[near], d[near]), (pos[~near], d[~near])]
    else:
        parts = [(pos, d)]
    for p, dd in parts:
        order = np.lexsort((alpha[p], pref[p], dd))
        for i in order:
            yield float(dd[i]), rfp.names[p[i]]


def rank(cand: str, cfp: Fingerprints, rfp: Fingerprints, candidates: Pool, same_floor: float) -> Identification:
    """Rank reference ``candidates`` (None: all of ``rfp``) for one candidate tensor; merge
    references equal to each other. Sorting touches only the nearest few in Python."""
    at = _pool_positions(rfp, candidates)
    if at is not None and _small(at, rfp):  # a bounded pool: only its distances, never a row over all n
        all_d = np.full(len(rfp.names), math.inf)
        all_d[at] = [cfp.distance(cand, rfp.names[int(i)], rfp) for i in at]
    else:
        all_d = cfp.distances(cand, rfp)
    ranked: list[Ranked] = []
    groups: list[list[str]] = []
    window = 2 * math.sqrt(same_floor)
    for d, r in _nearest_first(all_d, rfp, at):
        # a reference within same_floor of an already-ranked one is the same tensor: merge.
        # sqrt(token rel_diff) behaves like a distance, so only near-equal ones are checked.
        merged = False
        for g_i, grp in enumerate(groups):
            if abs(math.sqrt(d) - math.sqrt(ranked[g_i].distance)) > window:
                continue
            if rfp.distance(grp[0], r) <= same_floor:
                grp.append(r)
                merged = True
                if names.preference(r) < names.preference(ranked[g_i].name):
                    ranked[g_i] = Ranked(r, d)
                break
        if not merged:
            if len(groups) >= MAX_GROUPS:
                break
            groups.append([r])
            ranked.append(Ranked(r, d))
    return Identification(cand, tuple(ranked), tuple(tuple(sorted(g, key=names.sort_key)) for g in groups))


def neighbour_gap(expected: str, rfp: Fingerprints, pool: Pool, same_floor: float) -> float | None:
    """Distance from ``expected`` to the nearest other reference stream (its own copies
    excluded). ``pool``: names, positions (e.g. ``rfp.of_kind(names.HIDDEN)``) or None (all)."""
    at = _pool_positions(rfp, pool)
    if at is not None and _small(at, rfp):
        d = np.array([rfp.distance(expected, rfp.names[int(i)]) for i in at])
    else:
        all_d = rfp.distances(expected)
        d = all_d if at is None else all_d[at]
    keep = d > same_floor
    me = rfp.pos[expected]
    if at is None:
        keep[me] = False
    else:
        keep &= at != me
    best = float(d[keep].min()) if keep.any() else math.inf
    return None if math.isinf(best) else best


def _small(at: np.ndarray, fp: Fingerprints) -> bool:
    """A pool small enough that pair by pair beats one batched row over every tensor."""
    return len(at) * 8 < len(fp.names)


def assign(options: list[list[tuple[str, float]]]) -> list[str | None]:
    """Joint assignment: each slot's acceptable references (within noise of its best),
    chosen so that slots get distinct references when that is possible at minimal total
    distance; otherwise each slot keeps its own best (real duplicates stay duplicates)."""
    best = [o[0][0] if o else None for o in options]
    if len(options) > 8 or any(not o for o in options):
        return best
    choice: tuple[tuple[str, float], ...] | None = None
    total = math.inf
    for combo in itertools.product(*options):
        refs = [c[0] for c in combo]
        if len(set(refs)) != len(refs):
            continue
        t = sum(c[1] for c in combo)
        if t < total:
            choice, total = combo, t
    return [c[0] for c in choice] if choice is not None else best
