"""Data-parallel attention: put every rank's tokens back in order, and say which are lost.

With SGLang's ``--enable-dp-attention`` (or any token sharding across data-parallel ranks)
each rank holds *other requests'* tokens, and possibly none. A rank records only its own
rows, annotated ``t[dp]``, and declares which tokens they are (``Tokens`` in
:mod:`consistency.dump.layout`: logical row indices, or request id + position). Unsharding
sorts every rank's rows by that key into one tensor. A token no rank holds (a gap in the
rows, a position missing inside a request, or rows short of a declared total) and a token
two ranks both hold are reported: either one would make the merged dump silently differ
from what the single-process model sees.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from consistency.dump import dtypes
from consistency.dump.layout import Tokens
from consistency.dump.reader import TensorView
from consistency.errors import InputError



@dataclass
class Ownership:
    """The merged token order of a DP group and what is wrong with it."""

    keys: list[tuple[Any, ...]]  # logical order
    source: list[tuple[int, int]]  # logical row -> (dp rank, row in that rank's tensors)
    unowned: list[tuple[Any, ...]] = field(default_factory=list)
    duplicated: dict[tuple[Any, ...], list[int]] = field(default_factory=dict)  # key -> dp ranks holding it


def merge_ownership(tokens: Sequence[Tokens]) -> Ownership:
    """Order the tokens of ``tokens`` (one per DP rank, in rank order) and check coverage."""
    holders: dict[tuple[Any, ...], list[tuple[int, int]]] = {}
    for r, t in enumerate(tokens):
        for j, k in enumerate(t.keys()):
            holders.setdefault(k, []).append((r, j))
    keys = sorted(holders)
    dup = {k: [r for r, _ in holders[k]] for k in keys if len(holders[k]) > 1}
    own = Ownership(keys, [holders[k][0] for k in keys], duplicated=dup)
    totals = {t.total for t in tokens if t.total is not None}
    if tokens and tokens[0].rows is not None:
        end = max(max(totals) if totals else 0, (keys[-1][0] + 1) if keys else 0)
        have = {k[0] for k in keys}
        own.unowned = [(i,) for i in range(end) if i not in have]
    else:
        last: dict[Any, int] = {}
        for q, p in keys:
            last[q] = max(last.get(q, -1), p)
        have_k = set(keys)
        own.unowned = [(q, p) for q in sorted(last) for p in range(last[q] + 1) if (q, p) not in have_k]
        if totals and len(keys) + len(own.unowned) < max(totals):
            own.unowned.append(("...", max(totals) - len(keys) - len(own.unowned)))
    return own


class TokenView(TensorView):
    """Rows gathered from several DP ranks' views in token order (memory stays per chunk)."""

    parts: list[TensorView]
    src: np.ndarray  # [rows, 2]: (part, row in part)

    @classmethod
    def of(cls, name: str, parts: list[TensorView], own: Ownership) -> TokenView:
        base = next((p for p in parts if p.rows > 0), parts[0])
        for p in parts:
            if p.shape[1:] != base.shape[1:] and len(base.shape) > 1:
                raise InputError(p.path, f"{name}: token shards differ beyond the token dim "
                                 f"({list(p.shape)} vs {list(base.shape)})")
            if p.dtype != base.dtype:
                raise InputError(p.path, f"{name}: dtype {p.dtype} differs from another rank's {base.dtype}")
        if len(base.shape) > 2:
            raise InputError(base.path, f"{name}: a token-sharded tensor must be [tokens] or [tokens, hidden]")
        out = cls.__new__(cls)
        out.__dict__.update(base.__dict__)
        out.name, out.parts = name, parts
        out.src = np.asarray(own.source, dtype=np.int64).reshape(-1, 2)
        out.shape = (len(own.source), *base.shape[1:])
        out._cols = None
        return out

    def read_rows(self, start: int, stop: int) -> np.ndarray:
        start, stop = max(0, start), min(self.rows, stop)
        out = np.empty((max(stop - start, 0), self.cols), self._storage)
        i = start
        while i < stop:  # runs of consecutive rows from one part are read together
            part, row = (int(x) for x in self.src[i])
            j = i
            while j + 1 < stop and self.src[j + 1, 0] == part and self.src[j + 1, 1] == self.src[j, 1] + 1:
                j += 1
            out[i - start:j + 1 - start] = self.parts[part].read_rows(row, row + j + 1 - i).reshape(j + 1 - i, -1)
            i = j + 1
        return out

    def rows_float(self, start: int, stop: int, out_dtype: type = np.float32) -> np.ndarray:
        return dtypes.to_float(self.read_rows(start, stop), self.dtype, out_dtype)

    def column_view(self, c0: int, c1: int, name: str) -> TensorView:
        from consistency.dump.ranks import _Columns

        return _Columns.of(self, c0, c1, name)


def duplicate_spread(parts: list[TensorView], holders: dict[tuple[Any, ...], list[int]],
                     rows_of: list[dict[tuple[Any, ...], int]]) -> float:
    """Worst token rel_diff between two ranks' copies of a token both hold (0 if they agree)."""
    worst = 0.0
    for k, ranks in list(holders.items())[:256]:
        base = parts[ranks[0]].take_rows([rows_of[ranks[0]][k]], np.float64)
        for r in ranks[1:]:
            x = parts[r].take_rows([rows_of[r][k]], np.float64)
            den = float((x * x).sum() + (base * base).sum())
            if den > 0:
                worst = max(worst, float(((x - base) ** 2).sum()) / den)
    return worst
