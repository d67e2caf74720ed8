"""The sampling stage: one fingerprint set per (rows, cols) shape, each side.

Every float reference tensor that shares a shape with a candidate tensor is sampled on the
same rows as the candidates of that shape (compare.identify). The reference's own slots
are sampled first, before the plan, because what they hold decides what the candidate
should hold (compare.refslots); the sets are reused after row pairing whenever their
membership did not change, so no reference row is read twice.
"""

from __future__ import annotations

from collections import defaultdict

from consistency.compare import identify
from consistency.compare.context import Prints, Shape, key
from consistency.dump.reader import TensorView


def unique(views: list[TensorView]) -> list[TensorView]:
    seen: dict[str, TensorView] = {}
    for v in views:
        seen.setdefault(v.name, v)
    return list(seen.values())


def _float(views: list[TensorView]) -> list[TensorView]:
    return [v for v in views if v.is_float and v.cols > 1]


class Sampler:
    """Builds fingerprint sets and remembers them, so a set with the same members and the
    same sample rows is built once."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget = budget_bytes
        self._made: dict[tuple[Shape, tuple[int, ...], int], identify.Fingerprints] = {}
        self._keep: list[list[TensorView]] = []  # the views a key names stay alive while their key is used

    def _prints(self, shape: Shape, views: list[TensorView], k: int) -> identify.Fingerprints:
        views = unique(views)
        ck = (shape, tuple(id(v) for v in views), k)  # the same view objects: the same file's rows
        if ck not in self._made:
            self._made[ck] = identify.Fingerprints(views, identify.sample_index(shape[0], k))
            self._keep.append(views)
        return self._made[ck]

    def groups(self, ref_views: list[TensorView], cand_views: list[TensorView],
               shapes: set[Shape] | None = None) -> tuple[Prints, Prints]:
        """(reference, candidate) fingerprints for every shape a candidate view has (or the
        given shapes), with the reference views of that shape."""
        by: dict[Shape, tuple[list[TensorView], list[TensorView]]] = defaultdict(lambda: ([], []))
        for v in _float(cand_views):
            by[key(v)][1].append(v)
        for s in shapes or ():
            by.setdefault(s, ([], []))
        for v in _float(ref_views):
            if key(v) in by:
                by[key(v)][0].append(v)
        ref_fp: Prints = {}
        cand_fp: Prints = {}
        for shape, (rviews, cviews) in by.items():
            k = identify.sample_size(shape[0], shape[1], len(unique(rviews)) + len(unique(cviews)), self.budget)
            ref_fp[shape] = self._prints(shape, rviews, k)
            cand_fp[shape] = self._prints(shape, cviews, k)
        return ref_fp, cand_fp
