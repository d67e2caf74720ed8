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
from consistency.dump import dtypes, names, npz_io, safetensors_io
from consistency.dump.atomic import atomic_write, check_writable
from consistency.dump.reader import MAX_META_TEXT, META_KEY
from consistency.errors import InputError, UsageError

TensorLike = Union[np.ndarray, tuple[np.ndarray, str]]


def normalize(value: TensorLike) -> tuple[np.ndarray, str]:
    """(storage array, canonical dtype) for a numpy array or an explicit pair."""
    try:
        if isinstance(value, tuple):
            arr, name = value
            dt = dtypes.lookup(name)
            arr = np.asarray(arr)
            if arr.dtype.itemsize != np.dtype(dt.storage).itemsize:
                raise UsageError(f"storage {arr.dtype} does not fit dtype {dt.name}")
            return arr, dt.name
        arr = np.asarray(value)
        return arr, dtypes.from_numpy(arr.dtype).name
    except KeyError as exc:  # complex, object, str, structured, datetime, float128, float8_e8m0fnu, ...
        raise UsageError(f"dtype {exc.args[0] if exc.args else '?'} cannot be stored in a dump (supported: "
                         f"{', '.join(dtypes.BY_NAME)})") from None


RESERVED_NAMES = frozenset({npz_io.META_MEMBER, "__metadata__"})


def name_problem(name: object) -> str | None:
    """Why a tensor name cannot go into a dump (None when it can): the rules every reader
    applies, checked before writing so that no dump of ours is unreadable by our reader."""
    if not isinstance(name, str):
        return f"is a {type(name).__name__}, not a string"
    if not name or name in RESERVED_NAMES:
        return "is empty or reserved"
    if len(name) > safetensors_io.MAX_NAME_CHARS:
        return f"is {len(name)} characters long, over {safetensors_io.MAX_NAME_CHARS}"
    if not name.isprintable():
        return "holds a non-printable character (a newline, a control)"
    return None


def max_tensors(path: Path) -> int:
    """How many tensors a reader takes from one file of this format (npz: its member bound,
    one member being the metadata)."""
    return npz_io.MAX_MEMBERS - 1 if path.suffix == ".npz" else safetensors_io.MAX_TENSORS


# what a dump is written as; the suffix picks the format, so any other name would hold one
# format's bytes under another's name (``x.pt``: torch.load would read safetensors as a pickle)
WRITE_SUFFIXES = (".safetensors", ".npz")
_PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".pkl", ".pickle")


def dump_name_problem(path: str | Path) -> str | None:
    """Why ``path`` is not a name a dump can be written under, or None."""
    p = Path(path)
    if p.suffix in WRITE_SUFFIXES:
        return None
    said = f"'{p.suffix}'" if p.suffix else "a name without a suffix"
    why = " (torch.load reads it as a pickle)" if p.suffix.lower() in _PICKLE_SUFFIXES else ""
    return (f"a dump is written as .safetensors or .npz (the suffix picks the format), not as {said}{why}; "
            f"write {_suggest(p)} instead")


def _suggest(p: Path) -> str:
    stem = p.with_suffix("")  # x.pt -> x; x.safetensors.tmp -> x.safetensors
    return stem.name if stem.suffix in WRITE_SUFFIXES else stem.name + ".safetensors"


def check_dump_name(path: str | Path) -> Path:
    """Refuse a dump name whose suffix is not a format we write: one line, exit code 2, before any work."""
    problem = dump_name_problem(path)
    if problem:
        raise InputError(path, problem)
    return Path(path)


def write_dump(path: str | Path, tensors: Mapping[str, TensorLike], metadata: DumpMetadata | None = None,
               force: bool = False, extra_header: Mapping[str, str] | None = None) -> Path:
    """Write ``tensors`` to ``path``; the suffix picks the format (``.npz`` or ``.safetensors``)."""
    check_dump_name(path)
    p = check_writable(path, force)
    if not tensors:
        raise UsageError(f"{p}: no tensors to write (readers refuse an empty dump)")
    meta = metadata.model_copy(deep=True) if metadata is not None else DumpMetadata()
    limit = max_tensors(p)
    if len(tensors) > limit:
        raise UsageError(f"{p}: {len(tensors)} tensors; a {p.suffix or 'safetensors'} dump holds at most {limit} "
                         "(readers refuse more)")
    twins = names.twin_spellings(tensors)
    if twins is not None:  # never write a file our own reader refuses
        raise UsageError(f"{p}: tensors {twins[0][:80]!r} and {twins[1][:80]!r} are two spellings of "
                         f"{names.spelling(twins[0])[:80]!r}; readers refuse a file holding both, since either could be "
                         "meant: write one")
    arrays: dict[str, tuple[np.ndarray, str]] = {}
    for name, value in tensors.items():
        problem = name_problem(name)
        if problem:
            raise UsageError(f"tensor name {str(name)[:60]!r} {problem}; readers would refuse it")
        arr, dt = normalize(value)
        if arr.ndim > safetensors_io.MAX_RANK:
            raise UsageError(f"tensor {name[:60]!r} has rank {arr.ndim}; readers refuse more than "
                             f"{safetensors_io.MAX_RANK} dimensions")
        arrays[name] = (arr, dt)
        tm = meta.tensors.get(name) or TensorMeta()
        tm.dtype = dt
        tm.shape = list(arr.shape)
        meta.tensors[name] = tm
    try:
        data = meta.model_dump(mode="json", exclude_none=True)
    except ValueError:  # a lone surrogate no UTF-8 can carry: escaped, like every other unwritable string
        try:
            data = DumpMetadata.model_validate(writable(meta.model_dump(mode="python"))).model_dump(
                mode="json", exclude_none=True)
        except ValueError as exc:
            raise UsageError(f"metadata for {p} cannot be written: {' '.join(str(exc).split())[:300]}") from None
    meta_json = json.dumps(writable(data), separators=(",", ":"), ensure_ascii=False)
    extra = {writable(str(k)): writable(str(v)) for k, v in (extra_header or {}).items()}
    try:  # never write a dump our own strict reader would refuse
        DumpMetadata.model_validate(strict_json(meta_json))
        strict_json(json.dumps(extra))
    except ValueError as exc:  # pydantic's ValidationError is a ValueError
        raise UsageError(f"metadata for {p} cannot be written: {' '.join(str(exc).split())[:300]}") from None
    if len(meta_json) > MAX_META_TEXT:
        raise UsageError(f"metadata for {p} is {len(meta_json)} characters; readers refuse more than {MAX_META_TEXT}")
    with atomic_write(p, force=force) as fh:
        if p.suffix == ".npz":
            npz_io.write_npz(fh, {n: a for n, (a, _dt) in arrays.items()}, meta_json)
        else:
            header = {META_KEY: meta_json, **extra}
            safetensors_io.write_safetensors(fh, arrays, header)
    return p
