"""Which reference tensor does each candidate tensor actually hold?

Comparing every slot with every layer in full would read the whole reference once per
slot. Instead one pass reads a fixed sample of token rows of every reference tensor (the
fingerprint: attention-sink rows first, then evenly spaced rows), and ranks references by
token rel_diff on that sample. Full metrics are computed afterwards only for the few
pairs that matter (expected and identified). Memory is bounded by ``budget_bytes``.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from consistency.dump import names
from consistency.dump.reader import TensorView

DEFAULT_BUDGET = int(os.environ.get("CONSISTENCY_SAMPLE_MB", "192")) * 1024 * 1024
MAX_SAMPLE = 256
MIN_SAMPLE = 16
HEAD_ROWS = 4  # massive-activation / sink tokens live at the start


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
        self.stack = np.zeros((len(index), len(views), cols))
        for j, v in enumerate(views):
            at = 0
            for a, b in runs:
                rows = v.rows_float(a, b, np.float64 if v.dtype == "float64" else np.float32)
                self.stack[at:at + b - a, j] = np.clip(rows, -1e150, 1e150) if rows.dtype == np.float64 else rows
                at += b - a
        self.stack[~np.isfinite(self.stack)] = 0.0
        self.sqn = np.einsum("knh,knh->kn", self.stack, self.stack)  # [k, n]
        self._memo: dict[tuple[str, int], np.ndarray] = {}

    @property
    def data(self) -> dict[str, np.ndarray]:
        """name -> sampled rows [k, cols] (views into the stack)."""
        return {n: self.stack[:, i] for n, i in self.pos.items()}

    def rows(self, name: str) -> np.ndarray:
        return self.stack[:, self.pos[name]]

    def __contains__(self, name: str) -> bool:
        return name in self.pos

    def distances(self, a: str, other: Fingerprints | None = None) -> np.ndarray:
        """Token rel_diff from tensor ``a`` (of self) to every tensor of ``other``, via
        Σa²+Σb²-2Σab in fp64 (the cancellation is far below any floor)."""
        src = other if other is not None else self
        key = (a, id(src))
        if key not in self._memo:
            x = self.stack[:, self.pos[a]]  # [k, h]
            if src.stack.shape[0] != x.shape[0] or src.stack.shape[2] != x.shape[1]:
                self._memo[key] = np.full(len(src.names), math.inf)
            elif x.shape[0] == 0:  # no rows: nothing differs
                self._memo[key] = np.zeros(len(src.names))
            else:
                dots = np.matmul(src.stack, x[:, :, None])[..., 0]  # [k, n]
                den = self.sqn[:, self.pos[a]][:, None] + src.sqn
                num = np.maximum(den - 2.0 * dots, 0.0)
                out = np.zeros_like(num)
                np.divide(num, den, out=out, where=den > 0)
                self._memo[key] = out.mean(axis=0)
        return self._memo[key]

    def distance(self, a: str, b: str, other: Fingerprints | None = None) -> float:
        src = other if other is not None else self
        return float(self.distances(a, src)[src.pos[b]])


@dataclass
class Ranked:
    name: str
    distance: float


@dataclass
class Identification:
    tensor: str
    ranking: list[Ranked]  # best first, one entry per group of equal references
    groups: list[list[str]] = field(default_factory=list)  # members of each ranked group
    expected: str | None = None
    expected_distance: float | None = None
    gap: float | None = None  # expected's distance to its nearest other reference stream

    @property
    def group(self) -> list[str]:
        """References equal to the best match (e.g. ``hidden.3`` and the reference's ``aux.1``)."""
        return self.groups[0] if self.groups else []

    def promote(self, name: str, distance: float | None) -> None:
        """Put the group holding ``name`` first (the joint assignment chose it)."""
        for i, grp in enumerate(self.groups):
            if name in grp:
                self.ranking.insert(0, self.ranking.pop(i))
                self.groups.insert(0, self.groups.pop(i))
                return
        self.ranking.insert(0, Ranked(name, distance if distance is not None else math.inf))
        self.groups.insert(0, [name])

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


def rank(cand: str, cfp: Fingerprints, rfp: Fingerprints, candidates: Sequence[str], same_floor: float) -> Identification:
    """Rank reference ``candidates`` for one candidate tensor; merge references equal to each other."""
    all_d = cfp.distances(cand, rfp)
    dist = sorted(((float(all_d[rfp.pos[r]]), names.preference(r), r) for r in candidates))
    ranked: list[Ranked] = []
    groups: list[list[str]] = []
    for d, _pref, r in dist:
        # a reference within same_floor of an already-ranked one is the same tensor: merge.
        # sqrt(token rel_diff) behaves like a distance, so only near-equal ones are checked.
        merged = False
        for g_i, grp in enumerate(groups):
            if abs(math.sqrt(d) - math.sqrt(ranked[g_i].distance)) > 2 * math.sqrt(same_floor):
                continue
            if rfp.distance(grp[0], r) <= same_floor:
                grp.append(r)
                merged = True
                if names.preference(r) < names.preference(ranked[g_i].name):
                    ranked[g_i] = Ranked(r, d)
                break
        if not merged:
            if len(groups) >= 6:
                break
            groups.append([r])
            ranked.append(Ranked(r, d))
    return Identification(cand, ranked, [sorted(g, key=names.sort_key) for g in groups])


def neighbour_gap(expected: str, rfp: Fingerprints, pool: Sequence[str], same_floor: float) -> float | None:
    """Distance from ``expected`` to the nearest other reference stream (its own copies excluded)."""
    best = math.inf
    all_d = rfp.distances(expected)
    for r in pool:
        d = float(all_d[rfp.pos[r]])
        if r != expected and d > same_floor:
            best = min(best, d)
    return None if math.isinf(best) else best


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
