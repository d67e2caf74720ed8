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
:data:`MAX_PICKLE` bytes and :data:`MAX_OPS` opcodes. Works with torch absent."""

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
from consistency.dump import dtypes
from consistency.dump.reader import TensorView
from consistency.errors import InputError

MAX_PICKLE = 256 * 1024 * 1024  # CONSISTENCY_MAX_PICKLE_BYTES: data.pkl of a dump is kilobytes
MAX_MEMBERS = 1_000_000
MAX_OPS = 10_000_000  # CONSISTENCY_MAX_PICKLE_OPS: 100,000 tensors take ~3M; each opcode builds at most one object
MAX_DIMS = 64
MAX_IN_MEMORY = 1 << 30  # CONSISTENCY_MAX_VIEW_BYTES: non-contiguous views are copied into memory
ZIP_MAGIC = b"PK\x03\x04"

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
        raw = _pread_all(fd, self.storage.offset, self.storage.nbytes, self.path, name)
        base = np.frombuffer(raw, dtype=st)
        arr = np.lib.stride_tricks.as_strided(base[self.offset:], shape=self.shape,
                                              strides=tuple(s * st.itemsize for s in self.stride), writeable=False)
        arr = np.ascontiguousarray(arr)
        return TensorView(name, self.dtype, self.shape, st, None, 0, self.path, array=arr)

    def read(self, fd: int) -> np.ndarray:
        """The whole tensor (callers bound the size: ids, positions, small metadata tensors)."""
        return self.view("tensor", fd).read_all()


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
    try:
        with zipfile.ZipFile(path) as z:
            return any(n.count("/") == 1 and n.endswith("/data.pkl") for n in z.namelist()[:MAX_MEMBERS])
    except (zipfile.BadZipFile, OSError, ValueError, EOFError):
        return False


def open_archive(path: str | Path) -> Archive:
    """Parse ``path``; every refusal is one :class:`InputError` line naming the file."""
    from consistency.dump.safetensors_io import open_regular

    p = Path(path)
    fd = open_regular(p)
    try:
        size = os.fstat(fd).st_size
        with os.fdopen(os.dup(fd), "rb") as fh:
            head = fh.read(4)
            if not head.startswith(ZIP_MAGIC):
                raise InputError(p, _not_zip(head))
            fh.seek(0)
            try:
                z = zipfile.ZipFile(fh)
            except (zipfile.BadZipFile, ValueError, EOFError, OSError) as exc:
                raise InputError(p, f"corrupt zip archive ({exc})") from None
            with z:
                root, members = _members(p, z)
                storages = _storages(p, z, fh, root, members, size)
                data = _pickle_bytes(p, z, members[f"{root}/data.pkl"])
        _scan(p, data)
        un = _Unpickler(p, io.BytesIO(data), storages)
        try:
            obj = un.load()
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
    return f"not a torch.save zip archive (starts with {head!r}, not PK)"


def _members(p: Path, z: zipfile.ZipFile) -> tuple[str, dict[str, zipfile.ZipInfo]]:
    infos = z.infolist()
    if len(infos) > MAX_MEMBERS:
        raise InputError(p, f"holds {len(infos)} zip members, over the {MAX_MEMBERS} bound")
    members = {i.filename: i for i in infos}
    if len(members) != len(infos):
        names = [i.filename for i in infos]
        dup = next(n for n in names if names.count(n) > 1)
        raise InputError(p, f"zip member {dup!r} appears twice: refused (readers disagree on which copy is the "
                         "archive's; torch.save never writes a name twice)")
    roots = {n.split("/", 1)[0] for n in members}
    pkls = [n for n in members if n.count("/") == 1 and n.endswith("/data.pkl")]
    script = [n for n in members if n.endswith("constants.pkl") or "/code/" in n]
    if script:
        raise InputError(p, f"a TorchScript archive ({script[0]}): refused, loading it would run its code "
                         "(torch.jit.load; CVE-2025-32434)")
    if len(pkls) != 1 or len(roots) != 1:
        raise InputError(p, "not a torch.save archive: expected one <root>/data.pkl under a single root directory "
                         f"(found {len(pkls)} data.pkl, {len(roots)} roots)")
    root = pkls[0].split("/", 1)[0]
    order = members.get(f"{root}/byteorder")
    with (z.open(order) if order is not None else io.BytesIO(b"little")) as f:
        got = f.read(17)
    if got != b"little":  # torch.load itself refuses anything but "little" / "big"
        raise InputError(p, f"byteorder {got[:16]!r}: refused (little-endian storages only; a big-endian archive)")
    return root, members


def _storages(p: Path, z: zipfile.ZipFile, fh: Any, root: str, members: dict[str, zipfile.ZipInfo],
              size: int) -> dict[str, tuple[int, int, int]]:
    """key -> (data offset in the file, stored bytes, compression); offsets read from local headers."""
    out: dict[str, tuple[int, int, int]] = {}
    prefix = f"{root}/data/"
    for name, info in members.items():
        if not name.startswith(prefix) or name.endswith("/"):
            continue
        key = name[len(prefix):]
        if info.compress_type != zipfile.ZIP_STORED:
            raise InputError(p, f"storage member {name} is compressed: refused (torch.save never compresses "
                             "storages; a deflated one can inflate without bound)")
        fh.seek(info.header_offset)
        local = fh.read(30)
        if len(local) != 30 or local[:4] != ZIP_MAGIC:
            raise InputError(p, f"corrupt zip: bad local header for {name}")
        n_name, n_extra = struct.unpack("<HH", local[26:30])
        begin = info.header_offset + 30 + n_name + n_extra
        if info.file_size != info.compress_size or begin + info.file_size > size:
            raise InputError(p, f"storage member {name} claims {info.file_size} bytes past the end of the file "
                             f"({size} bytes): truncated or lying sizes")
        out[key] = (begin, info.file_size, info.compress_type)
    return out


def _pickle_bytes(p: Path, z: zipfile.ZipFile, info: zipfile.ZipInfo) -> bytes:
    limit = env_limit("MAX_PICKLE_BYTES", MAX_PICKLE)
    if info.file_size > limit:
        raise InputError(p, f"data.pkl is {info.file_size} bytes, over the {limit} bound (CONSISTENCY_MAX_PICKLE_BYTES)")
    try:
        with z.open(info) as f:
            data = f.read(limit + 1)
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, NotImplementedError) as exc:
        raise InputError(p, f"corrupt data.pkl ({exc})") from None
    if len(data) > limit:
        raise InputError(p, f"data.pkl inflates past {limit} bytes: refused (zip bomb)")
    return data


def _scan(p: Path, data: bytes) -> None:
    """Bound what the unpickler builds before it runs: one opcode, one object (``]``: ~80 bytes,
    so a kilobyte of deflated ``]`` is gigabytes); a memo index is an array size (``LONG_BINPUT
    2**31``: 16 GiB). Opcodes are counted (:data:`MAX_OPS`) and a memo index may not exceed
    the opcodes before it (a pickler numbers from 0). Nothing is built here."""
    import pickletools

    limit = env_limit("MAX_PICKLE_OPS", MAX_OPS)
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


class _Unpickler(pickle.Unpickler):
    """Only tensor rebuilds, storages, dtypes and plain containers; everything else is refused."""

    def __init__(self, path: Path, fh: io.BytesIO, storages: dict[str, tuple[int, int, int]]) -> None:
        super().__init__(fh)
        self.path = path
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
            return _latin1  # how protocol 2 pickles bytes (torch.save's default protocol)
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
        return PtTensor(dtype, shape, strides, storage, offset, self.path)


def _latin1(text: Any, encoding: Any = "latin1") -> bytes:
    """``_codecs.encode(str, 'latin1')``: protocol 2's spelling of a bytes value, and nothing else."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError("_codecs.encode other than a latin1 bytes value")
    return text.encode("latin1")


def _ints(path: Path, value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, tuple) or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                                               and x < 1 << 62 for x in value):
        raise InputError(path, f"refused: tensor {what} {str(value)[:80]} is not a tuple of non-negative integers")
    return value
