"""A pickle-free, bounded ``.npz`` reader and an uncompressed writer.

``np.load(..., allow_pickle=False)`` would refuse object arrays, but it also decompresses
every member fully into memory and trusts the zip's sizes. Here each member's ``.npy``
header is parsed first; object, structured and oversized members are refused before any
data is read; stored (uncompressed) members are read in place with ``pread``; deflated
members are inflated, at most to their declared size, into an unlinked spill file.
"""

from __future__ import annotations

import math
import os
import shutil
import struct
import tempfile
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from consistency.dump import dtypes
from consistency.errors import InputError

META_MEMBER = "__consistency__"
MAX_MEMBERS = 100_000
MAX_META_BYTES = 16 * 1024 * 1024
MAX_NPY_HEADER = 64 * 1024
DEFLATE_MAX_RATIO = 1100  # deflate cannot exceed ~1032:1; a larger claim is a lie
_DEFAULT_MAX_BYTES = 256 * 1024**3


def max_member_bytes() -> int:
    """Sane bound on one member's uncompressed size (env-tunable for giant dumps)."""
    try:
        return int(os.environ.get("CONSISTENCY_MAX_MEMBER_BYTES", _DEFAULT_MAX_BYTES))
    except ValueError:
        return _DEFAULT_MAX_BYTES


@dataclass
class Member:
    name: str  # tensor name (member name without ".npy")
    info: zipfile.ZipInfo
    dtype: np.dtype  # numpy storage dtype as declared
    shape: tuple[int, ...]
    fortran: bool
    header_len: int  # bytes of .npy magic + header
    data_offset: int | None  # absolute offset in the archive when stored uncompressed


def _npy_header(path: Path, name: str, fp: BinaryIO) -> tuple[np.dtype, tuple[int, ...], bool, int]:
    try:
        major, minor = np.lib.format.read_magic(fp)
        if (major, minor) == (1, 0):
            shape, fortran, dt = np.lib.format.read_array_header_1_0(fp, max_header_size=MAX_NPY_HEADER)
        elif (major, minor) in ((2, 0), (3, 0)):
            shape, fortran, dt = np.lib.format.read_array_header_2_0(fp, max_header_size=MAX_NPY_HEADER)
        else:
            raise ValueError(f"unknown .npy version {major}.{minor}")
    except (ValueError, OSError, EOFError, SyntaxError, zipfile.BadZipFile) as exc:
        raise InputError(path, f"member {name!r}: corrupt .npy header ({exc})") from None
    hlen = fp.tell()
    return np.dtype(dt), tuple(int(d) for d in shape), bool(fortran), hlen


def _local_data_offset(path: Path, fd: int, info: zipfile.ZipInfo) -> int:
    hdr = os.pread(fd, 30, info.header_offset)
    if len(hdr) < 30 or hdr[:4] != b"PK\x03\x04":
        raise InputError(path, f"member {info.filename!r}: corrupt zip local header")
    n, m = struct.unpack("<HH", hdr[26:30])
    return info.header_offset + 30 + n + m


def scan(path: Path, fd: int) -> tuple[zipfile.ZipFile, dict[str, Member], str | None]:
    """Validate the archive; return open zip, members by tensor name, and raw metadata JSON."""
    try:
        zf = zipfile.ZipFile(os.fdopen(os.dup(fd), "rb"))
    except zipfile.BadZipFile:
        raise InputError(path, "not a valid .npz (zip) archive: truncated or corrupt") from None
    except (OSError, ValueError, EOFError, struct.error) as exc:
        raise InputError(path, f"not a valid .npz archive: {exc}") from None
    infos = zf.infolist()
    if len(infos) > MAX_MEMBERS:
        raise InputError(path, f"hostile .npz: {len(infos)} members")
    size = os.fstat(fd).st_size
    members: dict[str, Member] = {}
    meta_json: str | None = None
    spans: list[tuple[int, int, str]] = []
    for info in infos:
        fname = info.filename
        if fname.endswith("/"):
            continue
        if info.flag_bits & 0x1:
            raise InputError(path, f"member {fname!r} is encrypted")
        if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
            raise InputError(path, f"member {fname!r}: unsupported compression method {info.compress_type}")
        if info.header_offset + info.compress_size > size:
            raise InputError(path, f"truncated: member {fname!r} extends past the end of the file")
        bound = max_member_bytes()
        if info.file_size > bound:
            raise InputError(path, f"member {fname!r} claims {info.file_size} bytes, over the {bound}-byte bound (zip bomb?)")
        if info.compress_type == zipfile.ZIP_DEFLATED and info.file_size > DEFLATE_MAX_RATIO * max(info.compress_size, 1) + 4096:
            raise InputError(path, f"member {fname!r} claims a {info.file_size // max(info.compress_size, 1)}:1 compression ratio (zip bomb)")
        spans.append((info.header_offset, info.header_offset + 30 + info.compress_size, fname))
        name = fname[:-4] if fname.endswith(".npy") else fname
        if name in members or (name == META_MEMBER and meta_json is not None):
            raise InputError(path, f"duplicate member {name!r}")
        try:
            with zf.open(info) as fp:
                dt, shape, fortran, hlen = _npy_header(path, fname, fp)
                if name == META_MEMBER:
                    meta_json = _read_meta(path, fp, dt, shape, info)
                    continue
        except (zipfile.BadZipFile, OSError, EOFError, RuntimeError) as exc:
            raise InputError(path, f"member {fname!r}: {exc}") from None
        _check_member_dtype(path, name, dt)
        want = hlen + math.prod(shape) * dt.itemsize
        if want != info.file_size:
            raise InputError(path, f"member {name!r}: .npy header says {dt.str}{list(shape)} ({want} bytes with header) but the member holds {info.file_size}")
        off = None
        if info.compress_type == zipfile.ZIP_STORED:
            off = _local_data_offset(path, fd, info) + hlen
            if off - hlen + info.compress_size > size:
                raise InputError(path, f"truncated: member {name!r} data ends past the end of the file")
        members[name] = Member(name, info, dt, shape, fortran, hlen, off)
    spans.sort()
    for (b0, e0, n0), (b1, _e1, n1) in zip(spans, spans[1:], strict=False):
        if b1 < e0:
            raise InputError(path, f"members {n0!r} and {n1!r} overlap (overlapping-member zip bomb?)")
    return zf, members, meta_json


def _check_member_dtype(path: Path, name: str, dt: np.dtype) -> None:
    if dt.hasobject:
        raise InputError(path, f"member {name!r} is an object array: it needs pickle, which is never used")
    if dt.fields is not None or dt.subdtype is not None:
        raise InputError(path, f"member {name!r} has a structured dtype {dt}, not a tensor")
    try:
        dtypes.from_numpy(dt)
    except KeyError:
        raise InputError(path, f"member {name!r} has unsupported dtype {dt}") from None


def _read_meta(path: Path, fp: BinaryIO, dt: np.dtype, shape: tuple[int, ...], info: zipfile.ZipInfo) -> str:
    if dt.kind not in "US" or shape != () or info.file_size > MAX_META_BYTES:
        raise InputError(path, f"{META_MEMBER} must be a 0-d string array under {MAX_META_BYTES} bytes")
    data = fp.read(dt.itemsize + 1)
    if len(data) != dt.itemsize:
        raise InputError(path, f"truncated {META_MEMBER} member")
    arr = np.frombuffer(data, dtype=dt)
    return str(arr[0])


def spill(path: Path, zf: zipfile.ZipFile, m: Member) -> int:
    """Inflate a deflated member's data (at most its declared size) into an unlinked temp file."""
    need = m.info.file_size
    tmpdir = tempfile.gettempdir()
    free = shutil.disk_usage(tmpdir).free
    if need > free:
        raise InputError(path, f"member {m.name!r} needs {need} bytes inflated but {tmpdir} has {free} free")
    fd, tmp = tempfile.mkstemp(prefix="consistency-npz-")
    os.unlink(tmp)
    try:
        with zf.open(m.info) as src:
            src.read(m.header_len)
            left = need - m.header_len
            while left > 0:
                block = src.read(min(left, 8 << 20))
                if not block:
                    raise InputError(path, f"truncated: member {m.name!r} inflates to fewer bytes than declared")
                os.write(fd, block)
                left -= len(block)
    except (zipfile.BadZipFile, OSError, EOFError, RuntimeError, ValueError) as exc:
        os.close(fd)
        if isinstance(exc, OSError) and not isinstance(exc, zipfile.BadZipFile) and exc.errno:
            raise InputError(path, f"member {m.name!r}: cannot inflate ({exc.strerror})") from None
        raise InputError(path, f"member {m.name!r}: corrupt compressed data ({exc})") from None
    except InputError:
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
