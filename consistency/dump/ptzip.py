"""``torch.save`` zip archives (``.pt``/``.pth``) read without torch and without running pickle.

SGLang's tensor dump and dumper and Megatron's activation log write ``torch.save`` archives:
a zip holding ``<root>/data.pkl`` (a pickle of the object tree) and one member
``<root>/data/<key>`` per storage (raw little-endian bytes, stored uncompressed). The pickle
names the globals that rebuild each tensor; loading it with pickle would call whatever it
names. Here a restricted unpickler maps the few globals a tensor archive needs to our own
inert functions (``torch._utils._rebuild_tensor_v2``/``_v3``, ``torch.<T>Storage``,
``torch.storage.UntypedStorage``, a dtype, ``collections.OrderedDict``, and
``_codecs.encode`` for a latin1 bytes value, protocol 2's spelling of ``bytes``) and refuses
every other global with one line naming it, so nothing from the file ever runs. A zip that
names a member twice is refused (torch reads one copy, a last-wins reader the other). Every size,
stride and offset is checked against its storage, and each storage against its member.

A TorchScript archive (``constants.pkl``, ``code/``) is refused outright (``torch.load`` used
to hand it to ``torch.jit.load`` even with ``weights_only=True``: CVE-2025-32434). Storages
must be stored, not deflated (torch never compresses them); ``data.pkl`` may be deflated, up to
:data:`MAX_PICKLE` bytes and :data:`MAX_OPS` opcodes. Everything the reader allocates for a
file (the pickle, its objects, each ``_codecs.encode`` copy, each strided view copied into
memory) is charged to that file's :class:`~consistency.dump.budget.Budget`, and the object
tree is bounded in depth and paths. Works with torch absent."""

from __future__ import annotations

import io
import math
import os
import pickle
import struct
import zipfile
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from consistency.contract.io import env_limit
from consistency.dump import dtypes, zipmembers
from consistency.dump.budget import OBJECT_BYTES, Budget, tree_bounded
from consistency.dump.reader import TensorView
from consistency.dump.zipmembers import MAX_MEMBERS, ZIP_MAGIC
from consistency.errors import InputError

MAX_PICKLE = 256 * 1024 * 1024  # CONSISTENCY_MAX_PICKLE_BYTES: data.pkl of a dump is kilobytes
MAX_OPS = 10_000_000  # CONSISTENCY_MAX_PICKLE_OPS: 100,000 tensors take ~3M; each opcode builds at most one object
MAX_DIMS = 64
MAX_IN_MEMORY = 1 << 30  # CONSISTENCY_MAX_VIEW_BYTES: non-contiguous views are copied into memory

# torch.<Name>Storage (legacy typed storages: numel counts elements)
STORAGE_DTYPES = {
    "DoubleStorage": "float64", "FloatStorage": "float32", "HalfStorage": "float16", "BFloat16Storage": "bfloat16",
    "LongStorage": "int64", "IntStorage": "int32", "ShortStorage": "int16", "CharStorage": "int8",
    "ByteStorage": "uint8", "BoolStorage": "bool",
}
# dtype globals (``torch float8_e4m3fn``) that _rebuild_tensor_v3 passes with an UntypedStorage
DTYPE_GLOBALS = {name for name in dtypes.BY_NAME} | {"float", "double", "half", "long", "int"}
REBUILDS = {"_rebuild_tensor_v2", "_rebuild_tensor_v3"}


class _Inert:
    """Objects the unpickler makes: BUILD (``__setstate__``) on them is refused."""

    def __setstate__(self, state: Any) -> None:
        raise pickle.UnpicklingError(f"BUILD on {type(self).__name__.strip('_')} (object state from the file)")


@dataclass(frozen=True)
class _StorageType(_Inert):
    dtype: str | None  # None: UntypedStorage (numel counts bytes; the tensor names its dtype)


@dataclass(frozen=True)
class _DType(_Inert):
    name: str


@dataclass
class Storage(_Inert):
    """One ``data/<key>`` member: where its bytes are and how many there are."""

    key: str
    dtype: str | None
    nbytes: int
    offset: int  # of the member's data in the archive file


@dataclass
class PtTensor(_Inert):
    """A tensor of the archive, described but not read: dtype, size, stride, offset into its storage."""

    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage: Storage
    offset: int  # in elements
    path: Path = field(repr=False, default=Path("."))
    budget: Budget | None = field(repr=False, default=None, compare=False)

    @property
    def itemsize(self) -> int:
        return np.dtype(dtypes.BY_NAME[self.dtype].storage).itemsize

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def contiguous(self) -> bool:
        expect = 1
        for n, s in zip(reversed(self.shape), reversed(self.stride)):
            if n != 1 and s != expect:
                return False
            expect *= n
        return True

    def view(self, name: str, fd: int) -> TensorView:
        """A lazy view (contiguous tensors: rows read from the file on demand) or, for a
        strided view of a storage, a bounded copy in memory."""
        st = np.dtype(dtypes.BY_NAME[self.dtype].storage)
        if self.contiguous():
            return TensorView(name, self.dtype, self.shape, st, fd, self.storage.offset + self.offset * self.itemsize,
                              self.path)
        nbytes = self.numel * self.itemsize
        limit = env_limit("MAX_VIEW_BYTES", MAX_IN_MEMORY)
        if nbytes > limit:
            raise InputError(self.path, f"{name} is a strided view of {nbytes} bytes, over the {limit}-byte bound for "
                             "copying it in memory (CONSISTENCY_MAX_VIEW_BYTES)")
        self.charge(nbytes, f"{name} (a strided view copied into memory)")
        self.charge(self.storage.nbytes, f"the storage of {name}")  # transient: released below
        raw = _pread_all(fd, self.storage.offset, self.storage.nbytes, self.path, name)
        base = np.frombuffer(raw, dtype=st)
        arr = np.lib.stride_tricks.as_strided(base[self.offset:], shape=self.shape,
                                              strides=tuple(s * st.itemsize for s in self.stride), writeable=False)
        arr = np.ascontiguousarray(arr)
        del raw, base
        if self.budget is not None:
            self.budget.release(self.storage.nbytes)
        return TensorView(name, self.dtype, self.shape, st, None, 0, self.path, array=arr)

    def charge(self, nbytes: int, what: str) -> None:
        """Account memory taken for this tensor against its file's budget (:mod:`consistency.dump.budget`)."""
        if self.budget is not None:
            self.budget.charge(nbytes, what)

    def read(self, fd: int, what: str = "tensor") -> np.ndarray:
        """The whole tensor in memory, charged to the file's budget."""
        v = self.view(what, fd)
        if v._array is None:
            self.charge(self.numel * self.itemsize, f"{what} (read whole)")
        return v.read_all()


def _pread_all(fd: int, offset: int, n: int, path: Path, what: str) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = os.pread(fd, n - len(out), offset + len(out))
        if not chunk:
            raise InputError(path, f"truncated while reading {what}")
        out += chunk
    return bytes(out)


@dataclass
class Archive:
    """An opened archive: its object tree (tensors as :class:`PtTensor`) and the open file."""

    path: Path
    obj: Any
    fd: int
    root: str
    tensors: int

    def close(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass


def is_torch_zip(path: Path, head: bytes) -> bool:
    """A zip whose members sit under one root directory holding ``data.pkl`` (read cheaply)."""
    if not head.startswith(ZIP_MAGIC):
        return False
    from consistency.dump.safetensors_io import open_regular

    try:
        fd = open_regular(path)  # never blocks: a FIFO swapped in after the head was read is refused
    except InputError:
        return False
    try:
        with os.fdopen(fd, "rb") as fh, zipfile.ZipFile(fh) as z:
            return any(n.count("/") == 1 and n.endswith("/data.pkl") for n in z.namelist()[:MAX_MEMBERS])
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, NotImplementedError, RuntimeError, struct.error,
            UnicodeDecodeError):
        return False


def open_archive(path: str | Path) -> Archive:
    """Parse ``path``; every refusal is one :class:`InputError` line naming the file."""
    from consistency.dump.safetensors_io import open_regular

    p = Path(path)
    fd = open_regular(p)
    try:
        size = os.fstat(fd).st_size
        budget = Budget.of(p, size)
        with os.fdopen(os.dup(fd), "rb") as fh:
            head = fh.read(4)
            if not head.startswith(ZIP_MAGIC):
                raise InputError(p, _not_zip(head))
            fh.seek(0)
            with zipmembers.open_zip(p, fh) as z:
                root, members = _members(p, z, budget)
                storages = zipmembers.storages(p, fh, root, members, size)
                data = _pickle_bytes(p, z, members[f"{root}/data.pkl"], budget)
        ops = _scan(p, data, budget)
        un = _Unpickler(p, io.BytesIO(data), storages, budget)
        try:
            obj = un.load()
            tree_bounded(p, obj, ops)
        except InputError:
            raise
        except RecursionError:
            raise InputError(p, "refused: data.pkl nests too deeply") from None
        except (pickle.UnpicklingError, TypeError, AttributeError, ValueError, IndexError, KeyError, EOFError,
                OverflowError, struct.error, MemoryError) as exc:
            raise InputError(p, f"refused: data.pkl is not a plain tensor pickle ({type(exc).__name__}: "
                             f"{str(exc)[:160]})") from None
        return Archive(p, obj, fd, root, un.tensors)
    except BaseException:
        os.close(fd)
        raise


def _not_zip(head: bytes) -> str:
    if head[:1] == b"\x80":
        return ("a raw pickle stream (legacy torch.save, _use_new_zipfile_serialization=False): refused, it cannot be "
                "read without running pickle; re-save it with a torch.save default")
    return "not a torch.save zip archive (its first bytes are not a zip's PK signature)"  # never its bytes


def _members(p: Path, z: zipfile.ZipFile, budget: Budget) -> tuple[str, dict[str, zipfile.ZipInfo]]:
    members = zipmembers.member_names(p, z, budget)
    roots = {n.split("/", 1)[0] for n in members}
    pkls = [n for n in members if n.count("/") == 1 and n.endswith("/data.pkl")]
    script = [n for n in members if n.endswith("constants.pkl") or "/code/" in n]
    if script:
        raise InputError(p, f"a TorchScript archive ({script[0][:120]}): refused, loading it would run its code "
                         "(torch.jit.load; CVE-2025-32434)")
    if len(pkls) != 1 or len(roots) != 1:
        raise InputError(p, "not a torch.save archive: expected one <root>/data.pkl under a single root directory "
                         f"(found {len(pkls)} data.pkl, {len(roots)} roots)")
    root = pkls[0].split("/", 1)[0]
    zipmembers.byteorder_ok(p, z, members, root)
    return root, members


def _pickle_bytes(p: Path, z: zipfile.ZipFile, info: zipfile.ZipInfo, budget: Budget) -> bytes:
    limit = env_limit("MAX_PICKLE_BYTES", MAX_PICKLE)
    if info.file_size > limit:
        raise InputError(p, f"data.pkl is {info.file_size} bytes, over the {limit} bound (CONSISTENCY_MAX_PICKLE_BYTES)")
    budget.charge(info.file_size, "data.pkl (inflated)")
    limit = min(limit, budget.limit - budget.used + info.file_size)  # a lying size inflates no further than the budget
    data = zipmembers.read_member(p, z, info, limit, "data.pkl")
    if len(data) > limit:
        raise InputError(p, f"data.pkl inflates past {limit} bytes: refused (zip bomb; its declared size was "
                         f"{info.file_size})")
    budget.charge(len(data) - info.file_size, "data.pkl (inflated past its declared size)")
    return data


def _scan(p: Path, data: bytes, budget: Budget) -> int:
    """Bound what the unpickler builds before it runs: one opcode, one object (``]``: ~80 bytes,
    so a kilobyte of deflated ``]`` is gigabytes); a memo index is an array size (``LONG_BINPUT
    2**31``: 16 GiB). Opcodes are counted (:data:`MAX_OPS`) and a memo index may not exceed
    the opcodes before it (a pickler numbers from 0). Nothing is built here."""
    import pickletools

    limit = env_limit("MAX_PICKLE_OPS", MAX_OPS)
    n = 0
    try:
        for n, (op, arg, _pos) in enumerate(pickletools.genops(data)):
            if n >= limit:
                raise InputError(p, f"data.pkl holds more than {limit} pickle opcodes: refused (a tensor archive's "
                                 "pickle is small; CONSISTENCY_MAX_PICKLE_OPS)")
            if op.name in ("BINPUT", "LONG_BINPUT", "PUT") and not (isinstance(arg, int) and 0 <= arg <= n):
                raise InputError(p, f"data.pkl puts memo entry {arg!r} after {n} opcodes: refused (a pickler numbers "
                                 "its memo from 0)")
    except (ValueError, TypeError, EOFError, UnicodeDecodeError) as exc:
        raise InputError(p, f"refused: data.pkl is not a well-formed pickle ({str(exc)[:160]})") from None
    budget.charge(n * OBJECT_BYTES, f"the objects of data.pkl's {n} opcodes")
    return n


class _Unpickler(pickle.Unpickler):
    """Only tensor rebuilds, storages, dtypes and plain containers; everything else is refused."""

    def __init__(self, path: Path, fh: io.BytesIO, storages: dict[str, tuple[int, int, int]], budget: Budget) -> None:
        super().__init__(fh)
        self.path = path
        self.budget = budget
        self.members = storages
        self.seen: dict[str, Storage] = {}
        self.tensors = 0

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name in REBUILDS:
            return self._rebuild_v2 if name == "_rebuild_tensor_v2" else self._rebuild_v3
        if module == "torch" and name in STORAGE_DTYPES:
            return _StorageType(STORAGE_DTYPES[name])
        if module == "torch.storage" and name == "UntypedStorage":
            return _StorageType(None)
        if module == "torch" and name in DTYPE_GLOBALS:
            return _DType(dtypes.lookup(name).name)
        if module == "collections" and name == "OrderedDict":
            return OrderedDict
        if module == "_codecs" and name == "encode":
            return self._latin1  # how protocol 2 pickles bytes (torch.save's default protocol)
        if module == "torch" and (name.endswith("Storage") or name.startswith(("complex", "qint", "quint", "float4"))):
            raise InputError(self.path, f"refused: torch.{name} tensors are not read (dtypes read: "
                             f"{', '.join(dtypes.BY_NAME)})")
        raise InputError(self.path, f"refused: the pickle names global {module}.{name}, which a tensor archive never "
                         "needs (only tensors, dtypes and plain containers are read; nothing in the file is run)")

    def persistent_load(self, pid: Any) -> Storage:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _StorageType)
                and isinstance(pid[2], str) and isinstance(pid[4], int) and not isinstance(pid[4], bool)):
            raise InputError(self.path, f"refused: unknown persistent id {str(pid)[:80]!r} in data.pkl")
        _tag, stype, key, _location, numel = pid
        if key in self.seen:
            return self.seen[key]
        if key not in self.members:
            raise InputError(self.path, f"data.pkl names storage {key!r}, which the archive does not hold")
        begin, nbytes, _ = self.members[key]
        item = 1 if stype.dtype is None else np.dtype(dtypes.BY_NAME[stype.dtype].storage).itemsize
        if numel < 0 or numel * item != nbytes:
            raise InputError(self.path, f"storage {key!r} claims {numel} x {item} bytes but its member holds {nbytes}: "
                             "a lying size")
        st = Storage(key, stype.dtype, nbytes, begin)
        self.seen[key] = st
        return st

    def _rebuild_v2(self, storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any = False,
                    hooks: Any = None, metadata: Any = None) -> PtTensor:
        if not isinstance(storage, Storage) or storage.dtype is None:
            raise InputError(self.path, "refused: _rebuild_tensor_v2 without a typed storage")
        return self._tensor(storage, storage.dtype, offset, size, stride, hooks)

    def _rebuild_v3(self, storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any, hooks: Any,
                    dtype: Any = None, metadata: Any = None) -> PtTensor:
        if not isinstance(storage, Storage) or not isinstance(dtype, _DType):
            raise InputError(self.path, "refused: _rebuild_tensor_v3 without a storage and a dtype")
        if storage.dtype is not None and storage.dtype != dtype.name:
            raise InputError(self.path, f"storage {storage.key!r} is {storage.dtype} but a tensor reads it as {dtype.name}")
        return self._tensor(storage, dtype.name, offset, size, stride, hooks)

    def _tensor(self, storage: Storage, dtype: str, offset: Any, size: Any, stride: Any, hooks: Any) -> PtTensor:
        if hooks:
            raise InputError(self.path, "refused: a tensor with backward hooks (they would be callables)")
        shape, strides = _ints(self.path, size, "size"), _ints(self.path, stride, "stride")
        if len(shape) != len(strides) or len(shape) > MAX_DIMS or not isinstance(offset, int) or offset < 0:
            raise InputError(self.path, f"refused: tensor of size {list(shape)} with stride {list(strides)} at offset "
                             f"{offset!r}")
        item = np.dtype(dtypes.BY_NAME[dtype].storage).itemsize
        if storage.nbytes % item:
            raise InputError(self.path, f"storage {storage.key!r} ({storage.nbytes} bytes) is not a whole number of "
                             f"{dtype} elements")
        capacity = storage.nbytes // item
        last = offset + sum((n - 1) * s for n, s in zip(shape, strides)) if all(shape) else offset - 1
        if last >= capacity and math.prod(shape) > 0:
            raise InputError(self.path, f"refused: a {dtype} tensor of size {list(shape)}, stride {list(strides)}, "
                             f"offset {offset} reaches element {last} of a {capacity}-element storage "
                             f"{storage.key!r} (out of bounds)")
        self.tensors += 1
        return PtTensor(dtype, shape, strides, storage, offset, self.path, self.budget)

    def _latin1(self, text: Any, encoding: Any = "latin1") -> bytes:
        """``_codecs.encode(str, 'latin1')``: protocol 2's spelling of a bytes value, and nothing
        else; each call is a new copy, charged (one string, encoded K times, is K copies)."""
        if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
            raise pickle.UnpicklingError("_codecs.encode other than a latin1 bytes value")
        self.budget.charge(len(text) + 33, "a bytes value of data.pkl (_codecs.encode)")
        return text.encode("latin1")


def _ints(path: Path, value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, tuple) or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                                               and x < 1 << 62 for x in value):
        raise InputError(path, f"refused: tensor {what} {str(value)[:80]} is not a tuple of non-negative integers")
    return value
