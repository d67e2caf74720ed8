"""Lazy, bounded access to the tensors of a dump file.

A :class:`TensorView` never holds its data: rows are read on demand with ``preadv`` into
a fresh buffer, so memory follows the chunk a caller asks for, not the file. Both formats
(safetensors and npz) and virtual views (a column range of a concatenated ``aux``) share
one interface, which is all that compare and diagnose ever see.
"""

from __future__ import annotations

import math
import os
import zipfile
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any
from pathlib import Path

import numpy as np
from pydantic import ValidationError

from consistency.contract.io import env_limit, strict_json, validation_line
from consistency.contract.models import DumpMetadata
from consistency.dump import dtypes, names, npz_io, safetensors_io, sniff
from consistency.errors import InputError

META_KEY = "consistency"
MAX_IN_MEMORY_FORTRAN = 1024**3  # CONSISTENCY_MAX_FORTRAN_BYTES: Fortran-ordered members are reordered in memory
MAX_META_TEXT = 16 * 1024 * 1024  # CONSISTENCY_MAX_META_BYTES


class TensorView:
    """Rows of one tensor: ``rows = prod(shape[:-1])`` rows of ``cols = shape[-1]`` values."""

    def __init__(self, name: str, dtype: str, shape: tuple[int, ...], storage: np.dtype, fd: int | None,
                 offset: int, path: Path, array: np.ndarray | None = None,
                 cols: tuple[int, int] | None = None, base_cols: int | None = None) -> None:
        self.name = name
        self.dtype = dtype
        self._storage = np.dtype(storage)
        self._fd = fd
        self._offset = offset
        self._array = array  # small or Fortran-ordered members held in memory
        self.path = path
        self._base_cols = base_cols if base_cols is not None else (shape[-1] if len(shape) >= 2 else 1)
        self._cols = cols
        if cols is not None:
            shape = (*shape[:-1], cols[1] - cols[0])
        self.shape = tuple(shape)

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @shape.setter
    def shape(self, value: tuple[int, ...]) -> None:
        # rows/cols/numel are asked for per pair and per chunk: computed once per shape
        shape = tuple(value)
        self._shape = shape
        self._ncols = shape[-1] if len(shape) >= 2 else 1
        self._nrows = 1 if len(shape) == 0 else shape[0] if len(shape) == 1 else math.prod(shape[:-1])
        self._numel = math.prod(shape)

    @property
    def rows(self) -> int:
        return self._nrows

    @property
    def cols(self) -> int:
        return self._ncols

    @property
    def numel(self) -> int:
        return self._numel

    @property
    def is_float(self) -> bool:
        return dtypes.is_float(self.dtype)

    @property
    def nbytes(self) -> int:
        return self.numel * self._storage.itemsize

    def column_view(self, c0: int, c1: int, name: str) -> TensorView:
        """A virtual tensor of columns [c0, c1) (e.g. slot i of a concatenated ``aux``)."""
        if self._cols is not None:
            c0, c1 = self._cols[0] + c0, self._cols[0] + c1
        base_shape = (*self.shape[:-1], self._base_cols)
        return TensorView(name, self.dtype, base_shape, self._storage, self._fd, self._offset, self.path,
                          self._array, (c0, c1), self._base_cols)

    def _read_base_rows(self, start: int, stop: int) -> np.ndarray:
        n = stop - start
        if self._array is not None:
            base_rows = self._array.size // self._base_cols if self._base_cols else self.rows
            return self._array.reshape(base_rows, self._base_cols)[start:stop]
        return self.read_into(start, np.empty((n, self._base_cols), dtype=self._storage))

    def read_into(self, start: int, buf: np.ndarray) -> np.ndarray:
        """Stored rows from ``start`` straight from the file into ``buf`` (a C-contiguous
        ``[n, base cols]`` array of the storage dtype), so a caller that reads block after
        block reuses one buffer instead of allocating one per read."""
        if buf.nbytes == 0:
            return buf
        assert self._fd is not None
        row_bytes = self._base_cols * self._storage.itemsize
        view = memoryview(buf.reshape(-1).view(np.uint8))
        pos, off = 0, self._offset + start * row_bytes
        while pos < buf.nbytes:
            got = os.preadv(self._fd, [view[pos:]], off + pos)
            if got <= 0:
                raise InputError(self.path, f"truncated while reading tensor {self.name!r}")
            pos += got
        return buf

    def read_rows(self, start: int, stop: int) -> np.ndarray:
        """Raw stored values of rows [start, stop) as a [n, cols] array (native byte order)."""
        start, stop = max(0, start), min(self.rows, stop)
        raw = self._read_base_rows(start, max(start, stop))
        if self._cols is not None:
            raw = raw[:, self._cols[0]:self._cols[1]]
        if raw.dtype.byteorder == ">":
            raw = raw.astype(raw.dtype.newbyteorder("<"))
        return raw

    def rows_float(self, start: int, stop: int, out_dtype: type = np.float32) -> np.ndarray:
        return dtypes.to_float(self.read_rows(start, stop), self.dtype, out_dtype)

    def take_rows(self, index: Sequence[int], out_dtype: type = np.float32) -> np.ndarray:
        """Rows at sorted ``index`` (a token sample), reading contiguous runs together."""
        idx = np.asarray(index, dtype=np.int64)
        out = np.empty((len(idx), self.cols), dtype=out_dtype)
        i = 0
        while i < len(idx):
            j = i
            while j + 1 < len(idx) and idx[j + 1] == idx[j] + 1:
                j += 1
            out[i:j + 1] = self.rows_float(int(idx[i]), int(idx[j]) + 1, out_dtype)
            i = j + 1
        return out

    def read_all(self) -> np.ndarray:
        """The whole tensor in its original shape (callers bound the size)."""
        return self.read_rows(0, self.rows).reshape(self.shape)

    def __repr__(self) -> str:
        return f"TensorView({self.name!r}, {self.dtype}, {list(self.shape)})"


class Dump:
    """An opened dump: its tensors (lazy) and its metadata (validated)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._fds: list[int] = []
        self._zip: zipfile.ZipFile | None = None
        self.tensors: dict[str, TensorView] = {}
        self.raw_metadata: dict[str, str] = {}
        self.metadata: DumpMetadata | None = None
        fd = safetensors_io.open_regular(self.path)
        self._fds.append(fd)
        try:
            magic = os.pread(fd, 16, 0)
            if self.path.suffix in (".pt", ".pth", ".bin", ".pkl", ".pickle", ".ckpt", ".gz"):
                raise InputError(self.path, f"is {sniff.looks_like(magic)}, not a dump; consistency reads "
                                 f"{sniff.read_names()}, and a torch.save zip archive of named tensors directly "
                                 "(never unpickled)")
            if self.path.suffix not in (".npz", ".safetensors") and sniff.content_kind(magic) not in ("safetensors",
                                                                                                    "zip"):
                raise InputError(self.path, f"is {sniff.looks_like(magic)}, not a format consistency reads "
                                 f"({sniff.read_names()})")
            if magic[:4] == b"PK\x03\x04" or (magic[:2] == b"PK" and self.path.suffix == ".npz"):
                self.format = "npz"
                self._open_npz(fd)
            elif self.path.suffix == ".npz":
                raise InputError(self.path, f"not a .npz (zip) archive: it is {sniff.looks_like(magic)}, not PK")
            else:
                self.format = "safetensors"
                self._open_safetensors(fd)
            self._apply_metadata_dtypes()
            canonical_names(self)
            if not self.tensors:  # nothing to compare must never read as "nothing differs"
                raise InputError(self.path, f"holds no tensors (an empty {self.format} file)")
        except BaseException:
            self.close()
            raise

    # -- formats ---------------------------------------------------------------------------
    def _open_safetensors(self, fd: int) -> None:
        hdr = safetensors_io.parse_header(self.path, fd)
        self.raw_metadata = hdr.metadata
        for name, e in hdr.entries.items():
            storage = dtypes.BY_NAME[e.dtype].storage
            self.tensors[name] = TensorView(name, e.dtype, e.shape, np.dtype(storage), fd, e.begin, self.path)
        text = hdr.metadata.get(META_KEY)
        if text is not None:
            self.metadata = parse_metadata(self.path, text)

    def _open_npz(self, fd: int) -> None:
        from consistency.dump.budget import Budget

        members, meta_json = npz_io.scan(self.path, fd)
        budget = Budget.of(self.path, os.fstat(fd).st_size)  # what reordering members in memory may take together
        for name, m in members.items():
            dt = dtypes.from_numpy(m.dtype).name
            if m.fortran:
                self.tensors[name] = self._fortran_member(m, dt, budget)
            elif m.data_offset is not None:
                self.tensors[name] = TensorView(name, dt, m.shape, m.dtype, fd, m.data_offset, self.path)
            else:
                sfd = npz_io.spill(self.path, m)
                self._fds.append(sfd)
                self.tensors[name] = TensorView(name, dt, m.shape, m.dtype, sfd, 0, self.path)
        if meta_json is not None:
            self.metadata = parse_metadata(self.path, meta_json)

    def _fortran_member(self, m: npz_io.Member, dt: str, budget: Any) -> TensorView:
        nbytes = math.prod(m.shape) * m.dtype.itemsize
        limit = env_limit("MAX_FORTRAN_BYTES", MAX_IN_MEMORY_FORTRAN)
        if nbytes > limit:
            raise InputError(self.path, f"member {m.name!r} is Fortran-ordered and {nbytes} bytes, over the "
                             f"{limit}-byte bound for reordering in memory (CONSISTENCY_MAX_FORTRAN_BYTES)")
        budget.charge(2 * nbytes, f"member {m.name[:80]!r} (Fortran-ordered, reordered in memory)")  # read + copy
        data = npz_io.read_member(self.path, m)
        if len(data) != nbytes:
            raise InputError(self.path, f"truncated member {m.name!r}")
        arr = np.frombuffer(data, dtype=m.dtype).reshape(m.shape[::-1]).T
        arr = np.ascontiguousarray(arr)
        del data
        budget.release(nbytes)  # the bytes read are dropped; the reordered copy stays
        return TensorView(m.name, dt, m.shape, m.dtype, None, 0, self.path, array=arr)

    def _apply_metadata_dtypes(self) -> None:
        """Metadata names the original dtype (bf16 stored as uint16 in npz); check it agrees."""
        if self.metadata is None:
            return
        for name, tm in self.metadata.tensors.items():
            view = self.tensors.get(name)
            if view is None:
                continue
            if tm.shape is not None and tuple(tm.shape) != view.shape:
                raise InputError(self.path, f"metadata says {name!r} has shape {tm.shape} but the data has {list(view.shape)}")
            if tm.dtype is None or tm.dtype == view.dtype:
                continue
            try:
                want = dtypes.lookup(tm.dtype)
            except KeyError:
                raise InputError(self.path, f"metadata names unknown dtype {tm.dtype!r} for {name!r}") from None
            if np.dtype(want.storage).itemsize != view._storage.itemsize or view.dtype not in ("uint16", "int16", "uint8", "int8"):
                raise InputError(self.path, f"metadata says {name!r} is {want.name} but it is stored as {view.dtype}")
            view.dtype = want.name

    # -- what a set of files adds (tensor-parallel ranks, pipeline stages); one file: nothing --
    replica_checks: Mapping[str, tuple[float, int]] = MappingProxyType({})  # name -> (spread, first rank that differs)
    layout_facts: Sequence[Any] = ()  # facts about the set itself (dump.layout.LayoutFact), worded by diagnose

    def rank_views(self, name: str) -> list[TensorView] | None:
        """Every rank's copy of ``name`` (rank sets only)."""
        return None

    # -- access ----------------------------------------------------------------------------
    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def __getitem__(self, name: str) -> TensorView:
        return self.tensors[name]

    @property
    def names(self) -> list[str]:
        return sorted(self.tensors, key=names.sort_key)

    def close(self) -> None:
        if self._zip is not None:
            self._zip.close()
            self._zip = None
        for fd in self._fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds.clear()

    def __enter__(self) -> Dump:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def canonical_names(d: Dump) -> None:
    """One spelling per meaning: ``hidden.01`` becomes ``hidden.1`` (and its metadata entry
    with it); two spellings of one name in a file are refused, since either could be meant."""
    names.refuse_twins(d.path, d.tensors)  # any name: model.layers.03.x beside model.layers.3.x too
    renames = {n: names.canonical(n) for n in d.tensors if names.canonical(n) != n}
    if not renames:
        return
    targets = list(renames.values())
    for new in targets:
        if new in d.tensors or targets.count(new) > 1:
            twins = sorted({o for o, n in renames.items() if n == new} | ({new} if new in d.tensors else set()))
            raise InputError(d.path, f"holds {' and '.join(repr(t) for t in twins)}: two spellings of {new!r}")
    for old, new in renames.items():
        view = d.tensors.pop(old)
        view.name = new
        d.tensors[new] = view
        if d.metadata is not None and old in d.metadata.tensors:
            d.metadata.tensors[new] = d.metadata.tensors.pop(old)


def parse_metadata(path: Path, text: str) -> DumpMetadata:
    """Validated metadata from untrusted JSON text (strict: no NaN, no duplicates, bounded)."""
    limit = env_limit("MAX_META_BYTES", MAX_META_TEXT)
    if len(text) > limit:
        raise InputError(path, f"metadata is {len(text)} characters, over the {limit} limit (CONSISTENCY_MAX_META_BYTES)")
    try:
        obj = strict_json(text)
    except ValueError as exc:
        msg = str(exc)
        raise InputError(path, f"metadata is {msg}" if msg.startswith("not valid JSON") else f"metadata refused: {msg}") from None
    if not isinstance(obj, dict):
        raise InputError(path, "metadata is not a JSON object")
    try:
        return DumpMetadata.model_validate(obj)
    except ValidationError as exc:
        raise InputError(path, f"invalid metadata at {validation_line(exc)}") from None


def open_dump(path: str | Path) -> Dump:
    return Dump(path)
