"""What every foreign-format reader shares: a Dump built from views, and layer-id claims.

Training data written by other tools (speculators ``hs_*.safetensors``, SpecForge
``.ckpt``) holds the same tensors a dump holds under other names, and never records which
streams its aux slots are. A reader maps the names onto the dump format and turns the
user's ``--layer-ids``/``--convention`` into the stream claims a dump would carry, so
compare, diagnose and lint never learn that the file was not a dump.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from consistency.contract.models import AuxInfo, DumpMetadata, TensorMeta
from consistency.dump import dtypes
from consistency.dump.reader import Dump, TensorView
from consistency.errors import InputError, UsageError


class ForeignDump(Dump):
    """A :class:`Dump` whose views point into a file another tool wrote.

    It does not run ``Dump.__init__`` (that parses our own format); it sets the same
    attributes, so every consumer of a Dump (compare, diagnose, convert) works unchanged.
    ``keep`` holds objects the views borrow memory from (e.g. tensors loaded by torch).
    """

    def __init__(self, path: str | Path, fmt: str, tensors: dict[str, TensorView], metadata: DumpMetadata,
                 fds: Iterable[int] = (), keep: Iterable[Any] = ()) -> None:  # noqa: D107 - see class
        self.path = Path(path)
        self.format = fmt
        self._fds = list(fds)
        self._zip = None
        self.tensors = tensors
        self.raw_metadata: dict[str, str] = {}
        self.metadata = metadata
        self._keep = list(keep)

    @property
    def notes(self) -> list[str]:
        """Assumptions the reader made (also in ``metadata.extra['notes']``)."""
        return list(self.metadata.extra.get("notes", [])) if self.metadata else []

    def close(self) -> None:
        super().close()
        self._keep.clear()


class ScaledView(TensorView):
    """Rows stored in a narrow dtype with one scale per row (speculators' FP8 hidden states).

    ``dtype`` stays the stored one (e.g. ``float8_e4m3fn``) so the tolerance model uses
    that format's noise floor; :meth:`rows_float` applies the per-row scale, which is what
    every float comparison reads. ``read_rows`` still returns the raw stored codes.
    """

    scale: np.ndarray

    @classmethod
    def wrap(cls, view: TensorView, scale: np.ndarray) -> ScaledView:
        out = cls.__new__(cls)
        out.__dict__.update(view.__dict__)
        out.scale = np.asarray(scale, dtype=np.float64).reshape(-1)
        if out.scale.shape[0] != view.rows:
            raise InputError(view.path, f"{view.name}: {out.scale.shape[0]} scales for {view.rows} rows")
        return out

    def rows_float(self, start: int, stop: int, out_dtype: type = np.float32) -> np.ndarray:
        start, stop = max(0, start), min(self.rows, stop)
        vals = dtypes.to_float(self.read_rows(start, stop), self.dtype, np.float64)
        return (vals * self.scale[start:max(start, stop), None]).astype(out_dtype, copy=False)

    def column_view(self, c0: int, c1: int, name: str) -> TensorView:
        return ScaledView.wrap(super().column_view(c0, c1, name), self.scale)


def memory_view(name: str, array: np.ndarray, dtype: str, path: Path) -> TensorView:
    """A view over an in-memory storage array (e.g. a tensor unpickled by torch)."""
    return TensorView(name, dtype, tuple(array.shape), array.dtype, None, 0, path, array=array)


def rename(view: TensorView, name: str) -> TensorView:
    out = copy.copy(view)
    out.name = name
    return out


def split_slots(view: TensorView, n: int, prefix: str = "aux") -> list[TensorView]:
    """Column views ``aux.0 .. aux.{n-1}`` of a [rows, n*H] tensor (slots in capture order)."""
    if n <= 0 or view.cols % n:
        raise InputError(view.path, f"{view.name} is {view.cols} wide: cannot split it into {n} equal slots")
    w = view.cols // n
    return [view.column_view(i * w, (i + 1) * w, f"{prefix}.{i}") for i in range(n)]


@dataclass
class Claims:
    """Stream ids of the file's slots, from the user's ids under a convention."""

    streams: list[int] | None = None  # one per slot, in the file's slot order
    native: list[int] | None = None
    convention: str | None = None
    notes: list[str] = field(default_factory=list)


def resolve_claims(path: Path, ids: Sequence[int] | None, convention: str | None, default: str,
                   sorted_slots: bool, num_layers: int | None = None, slots: int | None = None,
                   what: str = "--layer-ids") -> Claims:
    """Map ``ids`` (as the producing tool spells them) to stream indices, through the one
    shared resolver (contract/resolve.py): an unknown convention, an id outside 0..N or a
    count that differs from the file's ``slots`` is a usage error naming what is valid.

    ``sorted_slots``: the producer fills slots in layer-loop order (vLLM sorts its ids,
    SGLang walks its layers), so the file's slot order is ascending whatever order the
    ids were written in.
    """
    from consistency.contract.resolve import check_spec, check_streams, depends_on_n, streams_of

    spec = convention or default
    if ids is None:
        if convention:
            check_spec(convention)
            return Claims(notes=[f"--convention {convention} ignored: no --layer-ids given"])
        return Claims()
    res = check_spec(spec)
    native = list(ids)
    if num_layers is None and depends_on_n(spec, native):
        raise UsageError(f"--convention {spec}: its ids depend on the number of layers, which {path.name} does "
                         f"not record; use a convention that does not (e.g. stream)")
    streams = streams_of(native, spec, num_layers or 0).streams or []
    notes = [res.assumed] if res.assumed else []
    check_streams(native, streams, num_layers, slots, what=what, spec=spec)
    if sorted_slots and streams != sorted(streams):
        notes.append(f"ids {native} reordered: the producer fills slots in layer order, so the slots hold "
                     f"streams {sorted(streams)}")
        order = sorted(range(len(streams)), key=lambda i: streams[i])
        streams, native = [streams[i] for i in order], [native[i] for i in order]
    if not sorted_slots and streams != sorted(streams):
        notes.append(f"slots taken in the order the ids are written ({native}); a producer that walks the "
                     f"layer loop would fill them in ascending order")
    return Claims(streams, native, spec, notes)


def tensor_meta(view: TensorView, producer: str, **extra: Any) -> TensorMeta:
    return TensorMeta(dtype=view.dtype, shape=list(view.shape), producer=producer, **extra)


def aux_info(claims: Claims, n_slots: int) -> AuxInfo | None:
    if claims.streams is None:
        return None
    return AuxInfo(stream_ids=claims.streams[:n_slots],
                   native_ids=claims.native[:n_slots] if claims.native is not None else None,
                   convention=claims.convention)
