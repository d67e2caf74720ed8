"""A pickle-free, bounded ``.npz`` reader and an uncompressed writer.

``np.load(..., allow_pickle=False)`` would refuse object arrays, but it also decompresses
every member fully into memory and trusts the zip's sizes. Here ``zipfile`` only parses the
central directory; everything after that is ours: every member's sizes, local header,
offsets and overlaps are checked before a byte of data is read; each ``.npy`` header is
parsed before its data, and object, structured and oversized members are refused; stored
members are read in place with ``pread``; deflated members are inflated by our own loop,
which stops at the declared size, proves the stream ends there and checks the CRC, into an
unlinked spill file (never memory).
"""

from __future__ import annotations

import io
import math
import os
import shutil
import struct
import tempfile
import zipfile
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from consistency.contract.io import env_limit
from consistency.dump import dtypes
from consistency.dump.safetensors_io import MAX_NAME_CHARS
from consistency.errors import InputError

META_MEMBER = "__consistency__"
MAX_MEMBERS = 100_000
MAX_CENTRAL_DIR = 64 * 1024 * 1024
MAX_META_BYTES = 16 * 1024 * 1024
MAX_NPY_HEADER = 64 * 1024
DEFLATE_MAX_RATIO = 1100  # deflate cannot exceed ~1032:1; a larger claim is a lie
_DEFAULT_MAX_BYTES = 256 * 1024**3
_DEFAULT_MAX_INFLATE = 16 * 1024**3
_DEFAULT_MAX_CRC = 1024**3
_BLOCK = 8 << 20


def max_member_bytes() -> int:
    """Sane bound on one member's claimed uncompressed size (``CONSISTENCY_MAX_MEMBER_BYTES``)."""
    return env_limit("MAX_MEMBER_BYTES", _DEFAULT_MAX_BYTES)


def max_crc_bytes() -> int:
    """Stored members are read in place, so their CRC is proven at open, up to this many
    bytes per file (``CONSISTENCY_MAX_CRC_BYTES``; zlib's crc32 runs at GB/s, so 1 GiB is
    well under a second): a corrupt member is refused, never compared."""
    return env_limit("MAX_CRC_BYTES", _DEFAULT_MAX_CRC)


def max_inflate_bytes() -> int:
    """Bound on all deflated members of one file together (``CONSISTENCY_MAX_INFLATE_BYTES``)."""
    return env_limit("MAX_INFLATE_BYTES", _DEFAULT_MAX_INFLATE)


@dataclass
class Member:
    name: str  # tensor name (member name without ".npy")
    info: zipfile.ZipInfo
    dtype: np.dtype  # numpy storage dtype as declared
    shape: tuple[int, ...]
    fortran: bool
    header_len: int  # bytes of .npy magic + header
    data_offset: int | None  # absolute offset of the array data when stored uncompressed
    fd: int = -1  # the archive
    start: int = 0  # absolute offset of the member's (compressed) bytes in the archive


class _Inflater:
    """Raw-deflate reader over ``pread`` that never produces more than it is asked for."""

    def __init__(self, path: Path, fd: int, name: str, start: int, csize: int) -> None:
        self.path, self.fd, self.name = path, fd, name
        self.pos, self.left = start, csize
        self.d = zlib.decompressobj(-15)

    @property
    def eof(self) -> bool:
        return self.d.eof

    def read(self, n: int) -> bytes:
        """Up to ``n`` bytes; fewer only at the end of the stream."""
        out: list[bytes] = []
        got = 0
        while got < n and not self.d.eof:
            src = self.d.unconsumed_tail
            if not src and self.left > 0:
                src = os.pread(self.fd, min(self.left, 1 << 20), self.pos)
                if not src:
                    raise InputError(self.path, f"truncated: member {self.name!r} ends past the end of the file")
                self.pos += len(src)
                self.left -= len(src)
            try:
                block = self.d.decompress(src, n - got)
            except zlib.error as exc:
                raise InputError(self.path, f"member {self.name!r}: corrupt compressed data ({exc})") from None
            if not block and not src and not self.d.eof:
                raise InputError(self.path, f"truncated: member {self.name!r}: compressed data ends mid-stream")
            out.append(block)
            got += len(block)
        return b"".join(out)


def _npy_header(path: Path, name: str, head: bytes) -> tuple[np.dtype, tuple[int, ...], bool, int]:
    fp = io.BytesIO(head)
    try:
        major, minor = np.lib.format.read_magic(fp)
        if (major, minor) == (1, 0):
            shape, fortran, dt = np.lib.format.read_array_header_1_0(fp, max_header_size=MAX_NPY_HEADER)
        elif (major, minor) in ((2, 0), (3, 0)):
            shape, fortran, dt = np.lib.format.read_array_header_2_0(fp, max_header_size=MAX_NPY_HEADER)
        else:
            raise ValueError(f"unknown .npy version {major}.{minor}")
        dt = np.dtype(dt)
    except Exception as exc:  # noqa: BLE001 - numpy parses hostile header text (ast, tokenize): any failure is "corrupt"
        raise InputError(path, f"member {name!r}: corrupt .npy header ({' '.join(str(exc).split())[:200]})") from None
    shape = tuple(int(d) for d in shape)
    if any(d < 0 for d in shape):
        raise InputError(path, f"member {name!r}: .npy header has negative dimensions {list(shape)}")
    return dt, shape, bool(fortran), fp.tell()


def _valid_name(name: str) -> bool:
    return bool(name) and len(name) <= MAX_NAME_CHARS and name.isprintable()


def _open_zip(path: Path, fd: int) -> zipfile.ZipFile:
    """``zipfile`` parses the central directory, after we bound its size and entry count."""
    fh = os.fdopen(os.dup(fd), "rb")
    try:
        try:
            end = zipfile._EndRecData(fh)  # type: ignore[attr-defined] - stable since Python 2
        except (OSError, ValueError, struct.error, EOFError):
            end = None
        if end is not None:
            count, cd_size = end[zipfile._ECD_ENTRIES_TOTAL], end[zipfile._ECD_SIZE]  # type: ignore[attr-defined]
            if count > MAX_MEMBERS:
                raise InputError(path, f"hostile .npz: claims {count} members (limit {MAX_MEMBERS})")
            if cd_size > MAX_CENTRAL_DIR:
                raise InputError(path, f"hostile .npz: a {cd_size}-byte central directory (limit {MAX_CENTRAL_DIR})")
        return zipfile.ZipFile(fh)
    except zipfile.BadZipFile as exc:
        fh.close()
        raise InputError(path, f"not a valid .npz (zip) archive: truncated or corrupt ({exc})") from None
    except InputError:
        fh.close()
        raise
    except Exception as exc:  # noqa: BLE001 - zipfile parses hostile bytes; any failure means "corrupt"
        fh.close()
        raise InputError(path, f"not a valid .npz (zip) archive ({type(exc).__name__}: {exc})") from None


def scan(path: Path, fd: int) -> tuple[dict[str, Member], str | None]:
    """Validate the archive; return members by tensor name and the raw metadata JSON.

    ``zipfile`` is done once the central directory is read: members are read through ``fd``.
    """
    zf = _open_zip(path, fd)
    try:
        return _scan(path, fd, zf)
    finally:
        fp = zf.fp
        zf.close()
        if fp is not None:
            fp.close()  # ZipFile leaves a file object it was given open


def _scan(path: Path, fd: int, zf: zipfile.ZipFile) -> tuple[dict[str, Member], str | None]:
    infos = [i for i in zf.infolist() if not i.filename.endswith("/")]
    if len(infos) > MAX_MEMBERS:
        raise InputError(path, f"hostile .npz: {len(infos)} members")
    size = os.fstat(fd).st_size
    starts = _structure(path, fd, infos, size)
    members: dict[str, Member] = {}
    meta_json: str | None = None
    seen_meta = False
    for info, start in zip(infos, starts, strict=True):
        fname = info.filename
        name = fname[:-4] if fname.endswith(".npy") else fname
        if not _valid_name(name):
            raise InputError(path, f"member {fname[:60]!r}: bad tensor name")
        if name in members or (name == META_MEMBER and seen_meta):
            raise InputError(path, f"duplicate member {name!r}")
        m = Member(name, info, np.dtype("u1"), (), False, 0, None, fd, start)
        dt, shape, fortran, hlen = _npy_header(path, fname, _head(path, m))
        m.dtype, m.shape, m.fortran, m.header_len = dt, shape, fortran, hlen
        if name == META_MEMBER:
            seen_meta = True
            meta_json = _read_meta(path, m)
            continue
        _check_member_dtype(path, name, dt)
        want = hlen + math.prod(shape) * dt.itemsize
        if want != info.file_size:
            raise InputError(path, f"member {name!r}: .npy header says {dt.str}{list(shape)} ({want} bytes with "
                             f"header) but the member holds {info.file_size}")
        if info.compress_type == zipfile.ZIP_STORED:
            m.data_offset = start + hlen
        members[name] = m
    stored = [m for m in members.values() if m.data_offset is not None]
    if sum(m.info.file_size for m in stored) <= max_crc_bytes():
        for m in stored:  # deflated members are checked as they are inflated (read_verified)
            read_verified(path, m, lambda _b: None)
    return members, meta_json


def _structure(path: Path, fd: int, infos: list[zipfile.ZipInfo], size: int) -> list[int]:
    """Every claim of the central directory, checked before any data is read; data starts returned."""
    bound, inflate_bound = max_member_bytes(), max_inflate_bytes()
    inflate_total = 0
    spans: list[tuple[int, int, str]] = []
    starts: list[int] = []
    for info in infos:
        fname = info.filename
        if info.file_size > bound:
            raise InputError(path, f"member {fname!r} claims {info.file_size} bytes, over the {bound}-byte bound "
                             "(zip bomb?; CONSISTENCY_MAX_MEMBER_BYTES)")
        if info.flag_bits & 0x1:
            raise InputError(path, f"member {fname!r} is encrypted")
        if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
            raise InputError(path, f"member {fname!r}: unsupported compression method {info.compress_type}")
        if info.compress_type == zipfile.ZIP_DEFLATED:
            if info.file_size > DEFLATE_MAX_RATIO * max(info.compress_size, 1) + 4096:
                raise InputError(path, f"member {fname!r} claims a {info.file_size // max(info.compress_size, 1)}:1 "
                                 "compression ratio; deflate cannot exceed ~1032:1 (zip bomb)")
            inflate_total += info.file_size
            if inflate_total > inflate_bound:
                raise InputError(path, f"deflated members inflate to more than {inflate_bound} bytes together "
                                 "(zip bomb?; CONSISTENCY_MAX_INFLATE_BYTES)")
        elif info.file_size != info.compress_size:
            raise InputError(path, f"stored member {fname!r} claims {info.file_size} bytes but occupies "
                             f"{info.compress_size}")
        off = info.header_offset
        if off < 0 or off + 30 > size:
            raise InputError(path, f"truncated: member {fname!r} has its local header past the end of the file")
        hdr = os.pread(fd, 30, off)
        if len(hdr) < 30 or hdr[:4] != b"PK\x03\x04":
            raise InputError(path, f"member {fname!r}: bad local header (the central directory points at no member)")
        n, extra = struct.unpack("<HH", hdr[26:30])
        lname = os.pread(fd, n, off + 30).decode("utf-8" if info.flag_bits & 0x800 else "cp437", "replace")
        if lname != info.orig_filename:
            raise InputError(path, f"member {fname!r}: local header names {lname[:60]!r}; the names differ")
        start = off + 30 + n + extra
        if start + info.compress_size > size:
            raise InputError(path, f"truncated: member {fname!r} extends past the end of the file")
        spans.append((off, start + info.compress_size, fname))
        starts.append(start)
    spans.sort()
    for (_b0, e0, n0), (b1, _e1, n1) in zip(spans, spans[1:], strict=False):
        if b1 < e0:
            raise InputError(path, f"members {n0!r} and {n1!r} overlap (overlapping-member zip bomb?)")
    return starts


def _head(path: Path, m: Member) -> bytes:
    """The first bytes of a member (enough for its .npy header), stored or deflated."""
    n = min(m.info.file_size, MAX_NPY_HEADER + 16)
    if m.info.compress_type == zipfile.ZIP_STORED:
        return os.pread(m.fd, n, m.start)
    return _Inflater(path, m.fd, m.info.filename, m.start, m.info.compress_size).read(n)


def read_verified(path: Path, m: Member, sink: Callable[[bytes], object]) -> None:
    """Feed the member's array bytes (header skipped) to ``sink``; sizes and CRC proven."""
    need, crc, total, skip = m.info.file_size, 0, 0, m.header_len
    if m.info.compress_type == zipfile.ZIP_STORED:
        inf = None
    else:
        inf = _Inflater(path, m.fd, m.info.filename, m.start, m.info.compress_size)
    while True:
        if inf is None:
            block = os.pread(m.fd, min(_BLOCK, need - total), m.start + total) if total < need else b""
        else:
            block = inf.read(min(_BLOCK, need - total + 1))
        if not block:
            break
        total += len(block)
        if total > need:
            raise InputError(path, f"member {m.name!r} inflates to more than its declared {need} bytes (zip bomb?)")
        crc = zlib.crc32(block, crc)
        if skip:
            cut = min(skip, len(block))
            block, skip = block[cut:], skip - cut
        if block:
            sink(block)
    if total < need:
        raise InputError(path, f"truncated: member {m.name!r} holds {total} bytes, fewer than the declared {need}")
    if crc != m.info.CRC:
        raise InputError(path, f"member {m.name!r}: CRC mismatch (corrupt data)")


def read_member(path: Path, m: Member) -> bytes:
    """A (small) member's array bytes, verified; callers bound the size."""
    buf = bytearray()
    read_verified(path, m, buf.extend)
    return bytes(buf)


def _check_member_dtype(path: Path, name: str, dt: np.dtype) -> None:
    if dt.hasobject:
        raise InputError(path, f"member {name!r} is an object array: it needs pickle, which is never used")
    if dt.fields is not None or dt.subdtype is not None:
        raise InputError(path, f"member {name!r} has a structured dtype {dt}, not a tensor")
    try:
        dtypes.from_numpy(dt)
    except KeyError:
        raise InputError(path, f"member {name!r} has unsupported dtype {dt}") from None


def _read_meta(path: Path, m: Member) -> str:
    limit = env_limit("MAX_META_BYTES", MAX_META_BYTES)
    dt = m.dtype
    if dt.kind not in "US" or m.shape != () or m.info.file_size > limit:
        raise InputError(path, f"{META_MEMBER} must be a 0-d string array under {limit} bytes")
    raw = read_member(path, m)
    if len(raw) != dt.itemsize:
        raise InputError(path, f"truncated {META_MEMBER} member")
    try:
        if dt.kind == "U":
            text = raw.decode("utf-32-be" if dt.byteorder == ">" else "utf-32-le")
        else:
            text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        enc = "UTF-32" if dt.kind == "U" else "UTF-8"
        raise InputError(path, f"{META_MEMBER}: not valid {enc} text ({exc.reason} at byte {exc.start})") from None
    return text.rstrip("\0")


def spill(path: Path, m: Member) -> int:
    """Inflate a deflated member's data (exactly its declared size) into an unlinked temp file."""
    need = m.info.file_size - m.header_len
    tmpdir = tempfile.gettempdir()
    free = shutil.disk_usage(tmpdir).free
    if need > free:
        raise InputError(path, f"member {m.name!r} needs {need} bytes inflated but {tmpdir} has {free} free")
    fd, tmp = tempfile.mkstemp(prefix="consistency-npz-", dir=tmpdir)
    os.unlink(tmp)

    def sink(b: bytes) -> None:
        view = memoryview(b)
        while view:
            view = view[os.write(fd, view):]

    try:
        read_verified(path, m, sink)
    except OSError as exc:
        os.close(fd)
        raise InputError(path, f"member {m.name!r}: cannot inflate to {tmpdir} ({exc.strerror or exc})") from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_npz(fh: BinaryIO, arrays: Mapping[str, np.ndarray], meta_json: str | None) -> None:
    """Uncompressed npz (so readers can read members in place), metadata as a 0-d str array."""
    with zipfile.ZipFile(fh, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        items = list(arrays.items())
        if meta_json is not None:
            items.append((META_MEMBER, np.array(meta_json)))
        for name, arr in items:
            with zf.open(f"{name}.npy", "w", force_zip64=True) as member:
                np.lib.format.write_array(member, np.require(arr, requirements="C"), allow_pickle=False)
