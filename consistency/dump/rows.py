"""Row-selecting and row-joining views: a dump restricted to chosen tokens, lazily.

Stitching (captures of one name joined into one token axis) and token alignment (only
the tokens both sides hold) both end in the same question -- "rows i0, i1, ... of this
tensor, in this order" -- so both are answered here by views that read only the rows
asked for, run by run, from the views underneath. Compare and diagnose keep seeing a
plain :class:`~consistency.dump.reader.Dump` of :class:`TensorView` s; nothing is
materialised beyond the chunk a caller reads.

``rows_float`` is delegated to the source view (not rebuilt from ``read_rows``), so a
scaled FP8 view or a summed tensor-parallel view keep their own float semantics.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from consistency.contract.models import DumpMetadata
from consistency.dump.formats.base import ForeignDump
from consistency.dump.reader import Dump, TensorView


def _runs(idx: np.ndarray) -> list[tuple[int, int, int]]:
    """(out_start, src_start, length) for each run of consecutive source rows in ``idx``."""
    if len(idx) == 0:
        return []
    breaks = np.flatnonzero(np.diff(idx) != 1) + 1
    starts = np.concatenate(([0], breaks))
    stops = np.concatenate((breaks, [len(idx)]))
    return [(int(a), int(idx[a]), int(b - a)) for a, b in zip(starts, stops, strict=True)]


def _token_shape(src: TensorView, n: int) -> tuple[int, ...]:
    return (n,) if len(src.shape) <= 1 else (n, src.cols)


class RowView(TensorView):
    """Rows ``index`` of ``src`` (any order, repeats allowed), read lazily run by run.

    The result is ``[len(index), cols]`` (or ``[len(index)]`` for a 1-D source): the token
    axis is flattened, which is what every consumer of a view already assumes.
    """

    src: TensorView
    index: np.ndarray

    @classmethod
    def of(cls, src: TensorView, index: Sequence[int] | np.ndarray, name: str | None = None) -> RowView:
        idx = np.asarray(index, dtype=np.int64).reshape(-1)
        if len(idx) and (idx.min() < 0 or idx.max() >= src.rows):
            raise IndexError(f"{src.name}: row index out of range 0..{src.rows - 1}")
        out = cls.__new__(cls)
        out.__dict__.update(src.__dict__)
        out.src, out.index = src, idx
        out.name = name or src.name
        out.shape = _token_shape(src, len(idx))
        out._cols = None
        return out

    def _gather(self, start: int, stop: int, read: Callable[[int, int], np.ndarray], dtype: np.dtype) -> np.ndarray:
        start, stop = max(0, start), min(self.rows, stop)
        idx = self.index[start:max(start, stop)]
        out = np.empty((len(idx), self.cols), dtype=dtype)
        for o, s, n in _runs(idx):
            out[o:o + n] = read(s, s + n).reshape(n, self.cols)
        return out

    def read_rows(self, start: int, stop: int) -> np.ndarray:
        probe = self.src.read_rows(0, 0)
        return self._gather(start, stop, self.src.read_rows, probe.dtype)

    def rows_float(self, start: int, stop: int, out_dtype: type = np.float32) -> np.ndarray:
        return self._gather(start, stop, lambda a, b: self.src.rows_float(a, b, out_dtype), np.dtype(out_dtype))

    def column_view(self, c0: int, c1: int, name: str) -> TensorView:
        return RowView.of(self.src.column_view(c0, c1, name), self.index, name)


class ConcatView(TensorView):
    """Several views of equal width joined along the token axis (the captures of one name)."""

    parts: list[TensorView]
    bounds: np.ndarray  # cumulative row offsets, len(parts) + 1

    @classmethod
    def of(cls, parts: Sequence[TensorView], name: str) -> ConcatView:
        base = parts[0]
        out = cls.__new__(cls)
        out.__dict__.update(base.__dict__)
        out.parts = list(parts)
        out.bounds = np.concatenate(([0], np.cumsum([p.rows for p in parts]))).astype(np.int64)
        out.name = name
        out.shape = _token_shape(base, int(out.bounds[-1]))
        out._cols = None
        return out

    def _gather(self, start: int, stop: int, read: Callable[[TensorView, int, int], np.ndarray],
                dtype: np.dtype) -> np.ndarray:
        start, stop = max(0, start), min(self.rows, stop)
        out = np.empty((max(0, stop - start), self.cols), dtype=dtype)
        for p, part in enumerate(self.parts):
            lo, hi = int(self.bounds[p]), int(self.bounds[p + 1])
            a, b = max(start, lo), min(stop, hi)
            if a < b:
                out[a - start:b - start] = read(part, a - lo, b - lo).reshape(b - a, self.cols)
        return out

    def read_rows(self, start: int, stop: int) -> np.ndarray:
        probe = self.parts[0].read_rows(0, 0)
        return self._gather(start, stop, lambda v, a, b: v.read_rows(a, b), probe.dtype)

    def rows_float(self, start: int, stop: int, out_dtype: type = np.float32) -> np.ndarray:
        return self._gather(start, stop, lambda v, a, b: v.rows_float(a, b, out_dtype), np.dtype(out_dtype))

    def column_view(self, c0: int, c1: int, name: str) -> TensorView:
        return ConcatView.of([p.column_view(c0, c1, name) for p in self.parts], name)


def array_view(name: str, values: np.ndarray, path: Path, dtype: str = "int64") -> TensorView:
    """A small in-memory 1-D view (stitched ids, positions)."""
    arr = np.ascontiguousarray(values, dtype=np.dtype(dtype)).reshape(-1)
    return TensorView(name, dtype, (len(arr),), arr.dtype, None, 0, path, array=arr)


class ViewDump(ForeignDump):
    """A dump whose tensors are views over another dump (stitched, or restricted to rows).

    It keeps the base dump open (and closes it with itself), carries its metadata, and
    forwards ``rank_views``/``replica_checks`` of a tensor-parallel base through the same
    row selection, so diagnosis that looks at ranks keeps working.
    """

    def __init__(self, base: Dump, tensors: dict[str, TensorView], metadata: DumpMetadata | None = None,
                 select: Callable[[TensorView], TensorView] | None = None, fmt: str | None = None) -> None:
        meta = (metadata or base.metadata or DumpMetadata()).model_copy(deep=True)
        super().__init__(base.path, fmt or base.format, tensors, meta)
        self.raw_metadata = dict(getattr(base, "raw_metadata", {}))
        self.base = base
        self._select = select
        self.joins: dict[str, tuple[list[str], np.ndarray]] = {}  # set by stitching: name -> (capture keys, rows)
        self.pass_positions: list[np.ndarray] | None = None  # set by stitching: each pass's recorded positions
        if hasattr(base, "replica_checks"):
            self.replica_checks = base.replica_checks
        for name, v in tensors.items():  # shapes in metadata follow the views
            tm = self.metadata.tensors.get(name) if self.metadata else None
            if tm is not None and tm.shape is not None:
                tm.shape = list(v.shape)

    def rank_views(self, name: str) -> list[TensorView] | None:
        views_of = getattr(self.base, "rank_views", None)
        if views_of is None:
            return None
        joined = self.joins.get(name)
        if joined is not None:  # a stitched name: stitch every rank's own captures the same way
            keys, order = joined
            per_key = [views_of(k) for k in keys]
            if any(v is None for v in per_key):
                return None
            ranks = [[v[r] for v in per_key] for r in range(len(per_key[0]))]  # type: ignore[index]
            return [RowView.of(p[0] if len(p) == 1 else ConcatView.of(p, name), order, name) for p in ranks]
        views = views_of(name)
        if views is None or self._select is None:
            return views
        return [self._select(v) for v in views]

    def close(self) -> None:
        self.base.close()
        super().close()


def restrict(d: Dump, index: Sequence[int] | np.ndarray, token_rows: int, fmt_note: str = "rows") -> ViewDump:
    """``d`` with every tensor of ``token_rows`` rows cut to rows ``index`` (others kept).

    Tensors with another row count (a per-model constant, a one-row summary) are not on
    the token axis and are left as they are.
    """
    idx = np.asarray(index, dtype=np.int64)

    def select(v: TensorView) -> TensorView:
        return RowView.of(v, idx) if v.rows == token_rows else v

    tensors = {n: select(v) for n, v in d.tensors.items()}
    return ViewDump(d, tensors, select=select, fmt=f"{d.format} ({fmt_note})")


@dataclass(frozen=True)
class Origin:
    """Where one compared row sits in the file it came from: the file's tensor (a capture
    key such as ``aux.0#3``), the row in it, its position when the file says (positions
    recorded, or one sequence), and the file when a rank set merged several."""

    tensor: str
    row: int
    position: int | None = None
    file: str | None = None

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"tensor": self.tensor, "row": self.row, "position": self.position}
        if self.file:
            out["file"] = self.file
        return out


_CAPTURE = re.compile(r"^.+#([0-9]{1,9})$")  # the k of a capture key ``name#k`` (dump.stitch)


def _root(v: TensorView, row: int) -> tuple[TensorView, int]:
    """Follow row and join views down to the view that reads the file."""
    # a view of a rank set or a DP merge exists only once its module was imported: never import
    # one (15 ms of a plain compare's start-up) just to learn that a view is not of it
    ranks, toks = sys.modules.get("consistency.dump.ranks"), sys.modules.get("consistency.dump.tokens")
    _Columns = getattr(ranks, "_Columns", ())  # noqa: N806 - a class, or no class at all
    TokenView = getattr(toks, "TokenView", ())  # noqa: N806
    for _ in range(64):
        if isinstance(v, RowView):
            row, v = int(v.index[row]), v.src
        elif isinstance(v, ConcatView):
            p = int(np.searchsorted(v.bounds, row, side="right")) - 1
            row, v = row - int(v.bounds[p]), v.parts[p]
        elif isinstance(v, TokenView):
            part, r = (int(x) for x in v.src[row])
            row, v = r, v.parts[part]
        elif isinstance(v, _Columns):
            v = v.src
        else:
            break
    return v, row


def origins(d: Dump, v: TensorView, rows: Sequence[int]) -> list[Origin]:
    """The file row of each of ``rows`` of ``v`` (a view of ``d``, however stitched, aligned
    or restricted). Positions come from the pass's recorded positions, else from the row
    when the file holds one sequence (a 1-D ``input_ids``, or none)."""
    from consistency.dump import names

    base: Any = d
    passes, single = None, True
    for _ in range(16):
        passes = passes if passes is not None else getattr(base, "pass_positions", None)
        nxt = getattr(base, "base", None)
        if nxt is None:
            break
        base = nxt
    ids = base.tensors.get(names.INPUT_IDS) if hasattr(base, "tensors") else None
    if ids is not None and len(ids.shape) == 2 and ids.shape[0] > 1:
        single = False
    out = []
    for i in rows:
        root, r = _root(v, int(i))
        m = _CAPTURE.match(root.name)
        k = int(m.group(1)) if m else 1
        pos: int | None = None
        if passes is not None and 0 < k <= len(passes) and r < len(passes[k - 1]):
            pos = int(passes[k - 1][r])
        elif passes is None and len(root.shape) == 3:
            pos = r % root.shape[-2]  # [batch, tokens, hidden]: the row's place in its sequence
        elif passes is None and single and k == 1:
            pos = r
        file = root.path.name if root.path is not None and Path(root.path) != Path(d.path) else None
        out.append(Origin(root.name, r, pos, file))
    return out
