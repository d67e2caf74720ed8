"""A dump held in memory: a mapping of names to numpy arrays or torch tensors.

Notebooks and test suites already hold the tensors they want to compare; writing them to
a file first only to read them back would cost time and a temporary path. A
:class:`MemoryDump` offers what :class:`~consistency.dump.reader.Dump` offers to compare
and diagnose (``path``, ``format``, ``tensors``, ``metadata``, ``raw_metadata``,
``names``, ``in``/``[]``, ``close``), with every view over a host copy of the data.

dtypes keep their meaning: a torch ``bfloat16`` tensor is stored as its uint16 bits and
viewed as ``bfloat16`` (numpy cannot hold it), so the tolerance model uses bf16's noise
floor and values widen exactly; float8 likewise. torch is imported only when a value is
a torch tensor, so numpy-only callers never load it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from consistency.contract.models import DumpMetadata, TensorMeta
from consistency.dump import dtypes
from consistency.dump.reader import Dump, TensorView, canonical_names
from consistency.errors import InputError, UsageError



def _is_torch(value: Any) -> bool:
    return type(value).__module__.startswith("torch") and hasattr(value, "detach")


def storage_of(value: Any, where: str = "") -> tuple[np.ndarray, str]:
    """(host storage array, canonical dtype name) of a numpy array or torch tensor."""
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], str):  # (storage, dtype), as the writer
        arr, name = np.asarray(value[0]), value[1]
        try:
            dt = dtypes.lookup(name)
        except KeyError:
            raise UsageError(f"{where}: unknown dtype {name!r}") from None
        if arr.dtype.itemsize != np.dtype(dt.storage).itemsize:
            raise UsageError(f"{where}: storage {arr.dtype} does not hold {dt.name}")
        return np.ascontiguousarray(arr).view(np.dtype(dt.storage)), dt.name
    if _is_torch(value):
        try:
            raw, name = dtypes.torch_storage(value)
            return raw, dtypes.lookup(name).name
        except (KeyError, TypeError):
            raise UsageError(f"{where}: torch dtype {value.dtype} is not supported") from None
    arr = np.asarray(value)
    if arr.dtype == object:
        raise UsageError(f"{where}: expected a numpy array or torch tensor, got {type(value).__name__}")
    try:
        return np.ascontiguousarray(arr), dtypes.from_numpy(arr.dtype).name
    except KeyError:
        raise UsageError(f"{where}: numpy dtype {arr.dtype} is not supported") from None


class MemoryDump(Dump):
    """A :class:`Dump` over in-memory tensors; nothing to close, nothing on disk.

    ``name`` stands where a file path would (reports, error messages). ``metadata`` may
    claim what a recorder would (aux stream ids, runtime, per-tensor norm state) as a
    :class:`~consistency.contract.models.DumpMetadata` or its dict form.
    """

    def __init__(self, tensors: Mapping[str, Any], metadata: DumpMetadata | Mapping[str, Any] | None = None,
                 name: str = "<memory>") -> None:  # noqa: D107 - see class
        self.path = Path(name)
        self.format = "memory"
        self._fds: list[int] = []
        self._zip = None
        self.raw_metadata: dict[str, str] = {}
        if not isinstance(tensors, Mapping):
            raise UsageError(f"{name}: expected a mapping of tensor names to arrays, got {type(tensors).__name__}")
        if not tensors:
            raise InputError(self.path, "holds no tensors (an empty mapping)")
        self.metadata = _metadata(metadata, self.path)
        self.tensors: dict[str, TensorView] = {}
        for key, value in tensors.items():
            if not isinstance(key, str) or not key or not key.isprintable():
                raise UsageError(f"{name}: tensor names must be non-empty printable strings, got {key!r:.60}")
            arr, dt = storage_of(value, f"{name}[{key!r}]")
            shape = tuple(int(s) for s in arr.shape)
            self.tensors[key] = TensorView(key, dt, shape, arr.dtype, None, 0, self.path, array=arr.reshape(-1))
            tm = self.metadata.tensors.get(key)
            if tm is None:
                self.metadata.tensors[key] = TensorMeta(dtype=dt, shape=list(shape))
            elif tm.shape is not None and tuple(tm.shape) != shape:
                raise InputError(self.path, f"metadata says {key!r} has shape {tm.shape} "
                                            f"but the data has {list(shape)}")
        canonical_names(self)

    def close(self) -> None:
        """Nothing to release: the views hold host copies, not file descriptors."""

    def same_data(self, other: Any) -> bool:
        """Both sides are the very same tensors (one mapping passed twice, or a copy of the
        mapping): every tensor of ``other`` is this dump's tensor of its name, the same
        memory, not equal values computed twice. Such a comparison verifies nothing."""
        if other is self:
            return True
        if not isinstance(other, MemoryDump) or not other.tensors:
            return False
        for key, v in other.tensors.items():
            mine = self.tensors.get(key)
            a, b = getattr(mine, "_array", None), getattr(v, "_array", None)
            if a is None or b is None or a.nbytes != b.nbytes or a.dtype != b.dtype or \
                    a.__array_interface__["data"][0] != b.__array_interface__["data"][0]:
                return False
        return True


def _metadata(meta: DumpMetadata | Mapping[str, Any] | None, path: Path) -> DumpMetadata:
    if meta is None:
        return DumpMetadata()
    if isinstance(meta, DumpMetadata):
        return meta.model_copy(deep=True)
    from pydantic import ValidationError

    from consistency.contract.io import validation_line

    try:
        return DumpMetadata.model_validate(dict(meta))
    except ValidationError as exc:
        raise InputError(path, f"invalid metadata at {validation_line(exc)}") from None


def as_side(value: Any, role: str) -> Any:
    """What the compare pipeline opens: a path string for a path, a :class:`Dump` as is,
    a :class:`MemoryDump` for a mapping of tensors. ``role`` names it in errors."""
    if isinstance(value, Dump):
        return value
    if isinstance(value, (str, os.PathLike)):
        return os.fspath(value)
    if isinstance(value, Mapping):
        return MemoryDump(value, name=f"<{role}>")
    raise UsageError(f"{role}: expected a path, a Dump or a dict of arrays/tensors, got {type(value).__name__}")
