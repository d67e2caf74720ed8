"""Write a dump (safetensors or npz, by suffix) atomically, with metadata.

Tensors arrive as numpy arrays, or as ``(storage array, dtype name)`` pairs for dtypes
numpy lacks (bf16 as its uint16 bits). Each tensor's original dtype and shape go into the
metadata so an npz round-trips bf16 and a reader can check header against data.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Union

import numpy as np

from consistency.contract.io import strict_json, writable
from consistency.contract.models import DumpMetadata, TensorMeta
from consistency.dump import dtypes, npz_io, safetensors_io
from consistency.dump.atomic import atomic_write, check_writable
from consistency.dump.reader import META_KEY
from consistency.errors import UsageError

TensorLike = Union[np.ndarray, tuple[np.ndarray, str]]


def normalize(value: TensorLike) -> tuple[np.ndarray, str]:
    """(storage array, canonical dtype) for a numpy array or an explicit pair."""
    if isinstance(value, tuple):
        arr, name = value
        dt = dtypes.lookup(name)
        arr = np.asarray(arr)
        if arr.dtype.itemsize != np.dtype(dt.storage).itemsize:
            raise UsageError(f"storage {arr.dtype} does not fit dtype {dt.name}")
        return arr, dt.name
    arr = np.asarray(value)
    return arr, dtypes.from_numpy(arr.dtype).name


def write_dump(path: str | Path, tensors: Mapping[str, TensorLike], metadata: DumpMetadata | None = None,
               force: bool = False, extra_header: Mapping[str, str] | None = None) -> Path:
    """Write ``tensors`` to ``path``; the suffix picks the format (``.npz`` or safetensors)."""
    p = check_writable(path, force)
    if not tensors:
        raise UsageError(f"{p}: no tensors to write (readers refuse an empty dump)")
    meta = metadata.model_copy(deep=True) if metadata is not None else DumpMetadata()
    arrays: dict[str, tuple[np.ndarray, str]] = {}
    for name, value in tensors.items():
        if not name or name == npz_io.META_MEMBER or name == "__metadata__":
            raise UsageError(f"reserved or empty tensor name {name!r}")
        if len(name) > safetensors_io.MAX_NAME_CHARS or not name.isprintable():
            raise UsageError(f"tensor name {name[:60]!r} is too long or not printable; readers would refuse it")
        arr, dt = normalize(value)
        arrays[name] = (arr, dt)
        tm = meta.tensors.get(name) or TensorMeta()
        tm.dtype = dt
        tm.shape = list(arr.shape)
        meta.tensors[name] = tm
    meta_json = json.dumps(writable(meta.model_dump(mode="json", exclude_none=True)), separators=(",", ":"),
                           ensure_ascii=False)
    extra = {writable(str(k)): writable(str(v)) for k, v in (extra_header or {}).items()}
    try:  # never write a dump our own strict reader would refuse
        strict_json(meta_json)
        strict_json(json.dumps(extra))
    except ValueError as exc:
        raise UsageError(f"metadata for {p} cannot be written: {exc}") from None
    with atomic_write(p, force=force) as fh:
        if p.suffix == ".npz":
            npz_io.write_npz(fh, {n: a for n, (a, _dt) in arrays.items()}, meta_json)
        else:
            header = {META_KEY: meta_json, **extra}
            safetensors_io.write_safetensors(fh, arrays, header)
    return p
