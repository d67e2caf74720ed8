"""A strict, torch-free safetensors reader and writer.

The format is 8 bytes of little-endian header length, a JSON header mapping names to
``{dtype, shape, data_offsets}``, then raw bytes. We parse it ourselves because (a) the
``safetensors`` numpy API cannot express bfloat16, (b) we must validate every field of a
file that may come from anywhere before touching its data, and (c) we read rows with
``pread`` into bounded buffers so a multi-GB dump never becomes resident.
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from consistency.contract.io import env_limit, strict_json
from consistency.dump import dtypes
from consistency.errors import InputError

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the reference implementation's own bound
MAX_TENSORS = 1_000_000
MAX_RANK = 16
MAX_NAME_CHARS = 1024


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: str  # canonical name
    shape: tuple[int, ...]
    begin: int  # absolute file offset of the first byte
    nbytes: int


@dataclass(frozen=True)
class Header:
    entries: dict[str, Entry]
    metadata: dict[str, str]
    data_start: int
    file_size: int


def open_regular(path: Path) -> int:
    """Open a path for reading, refusing directories, devices, FIFOs and sockets.

    ``stat`` first, so a device is never even opened; then open non-blocking and check the
    open descriptor again, so a path swapped for a FIFO in between cannot hang the read.
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise InputError(path, "no such file") from None
    except PermissionError:
        raise InputError(path, "permission denied") from None
    except OSError as exc:
        raise InputError(path, f"cannot stat: {exc.strerror or exc}") from None
    _regular(path, st.st_mode)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0))
    except PermissionError:
        raise InputError(path, "permission denied") from None
    except OSError as exc:
        raise InputError(path, f"cannot open: {exc.strerror or exc}") from None
    try:
        _regular(path, os.fstat(fd).st_mode)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_head(path: Path, n: int = 16) -> bytes:
    """The first ``n`` bytes of a regular file, opened as :func:`open_regular` opens (never
    blocks on a FIFO swapped in after a check); InputError for anything else."""
    fd = open_regular(path)
    try:
        return os.pread(fd, n, 0)
    finally:
        os.close(fd)


def _regular(path: Path, mode: int) -> None:
    if stat.S_ISDIR(mode):
        raise InputError(path, "is a directory, expected a dump file")
    if not stat.S_ISREG(mode):
        raise InputError(path, "is not a regular file (device, FIFO or socket)")


def _int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _describe(head: bytes) -> str:
    """What the first bytes of a file that is not a dump look like, shown, never as a number."""
    for magic, kind in ((b"\x1f\x8b", "gzip"), (b"PK\x03\x04", "zip"), (b"\x80", "pickle"), (b"%PDF", "PDF"),
                        (b"\x89PNG", "PNG"), (b"\x7fELF", "ELF")):
        if head.startswith(magic):
            return f"{kind} data"
    try:  # strict: a replacement character is printable, so "replace" called random bytes text
        text = head.decode("utf-8")
    except UnicodeDecodeError as exc:  # a character cut by the 16-byte window is still text
        text = head[:exc.start].decode("utf-8") if exc.reason == "unexpected end of data" else "\x00"
    if text and all(c.isprintable() or c in "\t\r\n" for c in text):
        return "text" + (" (JSON)" if text.lstrip().startswith(("{", "[")) else "")  # never echoed: it may be a secret
    return "binary data"  # never its bytes: a committed symlink may point at a secret


def parse_header(path: Path, fd: int) -> Header:
    size = os.fstat(fd).st_size
    if size < 8:
        raise InputError(path, f"truncated: {size} bytes, shorter than the 8-byte header length")
    head = os.pread(fd, 16, 0)
    (n,) = struct.unpack("<Q", head[:8])
    if n == 0:
        raise InputError(path, "corrupt safetensors header: length 0")
    limit = env_limit("MAX_HEADER_BYTES", MAX_HEADER_BYTES)
    if (n > limit or 8 + n > size) and head[8:9] != b"{":  # a length no header has, and no JSON after it
        raise InputError(path, f"not a safetensors file: it starts with {_describe(head)}, not an 8-byte header "
                               "length and '{'")
    if n > limit:
        raise InputError(path, f"corrupt or hostile safetensors header: claims {n} bytes (limit {limit}, "
                         "CONSISTENCY_MAX_HEADER_BYTES)")
    if 8 + n > size:
        raise InputError(path, f"truncated: header claims {n} bytes but the file has {size - 8} after the length")
    raw = os.pread(fd, n, 8)
    if len(raw) != n:
        raise InputError(path, f"truncated: the header is {n} bytes but only {len(raw)} could be read")
    try:
        obj = strict_json(raw)
    except ValueError as exc:
        raise InputError(path, f"corrupt safetensors header: {exc}") from None
    if not isinstance(obj, dict):
        raise InputError(path, "corrupt safetensors header: not a JSON object")
    meta = obj.pop("__metadata__", None)
    meta = {} if meta is None else meta
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise InputError(path, "corrupt safetensors header: __metadata__ must map strings to strings")
    if len(obj) > MAX_TENSORS:
        raise InputError(path, f"hostile safetensors header: {len(obj)} tensors")
    data_start = 8 + n
    data_len = size - data_start
    entries: dict[str, Entry] = {}
    spans: list[tuple[int, int, str]] = []
    for name, spec in obj.items():
        entries[name] = _entry(path, name, spec, data_start, data_len)
        e = entries[name]
        spans.append((e.begin - data_start, e.begin - data_start + e.nbytes, name))
    spans.sort()
    pos = 0
    for b, e, name in spans:
        if b < pos:
            raise InputError(path, f"corrupt safetensors header: tensor {name!r} overlaps another")
        if b > pos:
            raise InputError(path, f"corrupt safetensors header: {b - pos} unaccounted bytes before tensor {name!r}")
        pos = e
    if pos != data_len:
        raise InputError(path, f"corrupt safetensors file: {data_len - pos} trailing bytes not described by the header")
    return Header(entries, dict(meta), data_start, size)


def _entry(path: Path, name: str, spec: object, data_start: int, data_len: int) -> Entry:
    if not name or len(name) > MAX_NAME_CHARS or not name.isprintable():
        raise InputError(path, f"corrupt safetensors header: bad tensor name {name[:40]!r}")
    if not isinstance(spec, dict) or set(spec) != {"dtype", "shape", "data_offsets"}:
        raise InputError(path, f"corrupt safetensors header: entry {name!r} needs exactly dtype, shape, data_offsets")
    code, shape, offs = spec["dtype"], spec["shape"], spec["data_offsets"]
    if not isinstance(code, str) or code not in dtypes.BY_ST_CODE:
        raise InputError(path, f"unsupported dtype {code!r} for tensor {name!r}")
    if not isinstance(shape, list) or len(shape) > MAX_RANK or not all(_int(d) and d >= 0 for d in shape):
        raise InputError(path, f"corrupt safetensors header: bad shape {shape!r} for tensor {name!r}")
    if not (isinstance(offs, list) and len(offs) == 2 and all(_int(o) for o in offs)):
        raise InputError(path, f"corrupt safetensors header: bad data_offsets for tensor {name!r}")
    b, e = offs
    if not 0 <= b <= e:
        raise InputError(path, f"corrupt safetensors header: data_offsets {offs} of {name!r} are reversed or negative")
    if e > data_len:
        raise InputError(path, f"truncated: tensor {name!r} ends at byte {e} but the data area has {data_len}")
    dt = dtypes.BY_ST_CODE[code]
    want = math.prod(shape) * (dt.bits // 8)
    if e - b != want:
        raise InputError(
            path, f"header of {name!r} says {code}{shape} = {want} bytes but its offsets span {e - b} bytes"
        )
    return Entry(name, dt.name, tuple(shape), data_start + b, e - b)


def read_header(path: str | Path) -> Header:
    p = Path(path)
    fd = open_regular(p)
    try:
        return parse_header(p, fd)
    finally:
        os.close(fd)


def serialize_header(tensors: Mapping[str, tuple[str, tuple[int, ...], int]], metadata: Mapping[str, str]) -> bytes:
    """Header bytes (length prefix included) for (dtype, shape, nbytes) in order."""
    hdr: dict[str, object] = {}
    if metadata:
        hdr["__metadata__"] = dict(metadata)
    pos = 0
    for name, (dtype_name, shape, nbytes) in tensors.items():
        hdr[name] = {"dtype": dtypes.BY_NAME[dtype_name].st_code, "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        pos += nbytes
    body = json.dumps(hdr, separators=(",", ":")).encode("utf-8")
    body += b" " * ((8 - len(body) % 8) % 8)  # align the data area to 8 bytes, as upstream does
    return struct.pack("<Q", len(body)) + body


def write_safetensors(fh: BinaryIO, arrays: Mapping[str, tuple[np.ndarray, str]], metadata: Mapping[str, str]) -> None:
    """Write ``name -> (storage array, canonical dtype)`` to an open binary file."""
    specs = {n: (dt, tuple(a.shape), a.nbytes) for n, (a, dt) in arrays.items()}
    fh.write(serialize_header(specs, metadata))
    for a, _dt in arrays.values():
        write_raw(fh, a)


def write_raw(fh: BinaryIO, a: np.ndarray) -> None:
    """Write an array's bytes little-endian in C order without a second full copy."""
    if a.nbytes == 0:
        return
    a = np.ascontiguousarray(a)
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    fh.write(a.reshape(-1).view(np.uint8).data)
