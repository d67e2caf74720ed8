"""The members of a ``torch.save`` zip, checked before anything is read from them.

torch.save writes one root directory of plain members: ``data.pkl``, ``byteorder``,
``data/<key>`` storages, every one stored, unencrypted, named once. Whatever else a zip can
carry (encryption, compression methods torch never writes, a bad CRC, a name given twice) is
refused here in one line naming the member, never left to ``zipfile`` to raise
``RuntimeError``/``NotImplementedError`` in the middle of a read. Every loop here is linear
in the number of members (a duplicate is found with a set, not by counting each name).
"""

from __future__ import annotations

import io
import struct
import zipfile
import zlib
from pathlib import Path
from typing import Any

from consistency.dump.budget import Budget
from consistency.errors import InputError

MAX_MEMBERS = 1_000_000
ZIP_MAGIC = b"PK\x03\x04"
INFO_BYTES = 600  # what zipfile keeps per member (a ZipInfo and its name): charged to the file's budget
READ_METHODS = {zipfile.ZIP_STORED: "stored", zipfile.ZIP_DEFLATED: "deflated"}  # all torch.save writes


def member_names(p: Path, z: zipfile.ZipFile, budget: Budget) -> dict[str, zipfile.ZipInfo]:
    """name -> info; a name given twice (torch reads one copy, a last-wins reader the other),
    more than :data:`MAX_MEMBERS` members or an encrypted member is refused."""
    infos = z.infolist()
    if len(infos) > MAX_MEMBERS:
        raise InputError(p, f"holds {len(infos)} zip members, over the {MAX_MEMBERS} bound")
    budget.charge(len(infos) * INFO_BYTES, f"the zip directory of {len(infos)} members")
    members: dict[str, zipfile.ZipInfo] = {}
    for info in infos:
        if info.filename in members:
            raise InputError(p, f"zip member {info.filename[:120]!r} appears twice: refused (readers disagree on which "
                             "copy is the archive's; torch.save never writes a name twice)")
        if info.flag_bits & 0x1:
            raise InputError(p, f"zip member {info.filename[:120]!r} is encrypted: refused (torch.save never "
                             "encrypts; nothing encrypted is read)")
        members[info.filename] = info
    return members


def read_member(p: Path, z: zipfile.ZipFile, info: zipfile.ZipInfo, limit: int, what: str) -> bytes:
    """A small member's bytes (``data.pkl``, ``byteorder``), at most ``limit`` of them; an
    unknown method, a bad CRC or a broken deflate stream is one line naming the member."""
    if info.compress_type not in READ_METHODS:
        raise InputError(p, f"{what} uses zip compression method {info.compress_type}, which torch.save never "
                         "writes: refused (read: stored, deflated)")
    try:
        with z.open(info) as f:
            return f.read(limit + 1)
    except zipfile.BadZipFile as exc:
        bad = "fails its CRC check" if "CRC" in str(exc) else "is corrupt"
        raise InputError(p, f"{what} {bad}: refused (a damaged or edited archive)") from None
    except (zlib.error, EOFError, OSError, ValueError, NotImplementedError, RuntimeError, struct.error):
        raise InputError(p, f"{what} cannot be inflated (a broken or truncated deflate stream): refused") from None


def byteorder_ok(p: Path, z: zipfile.ZipFile, members: dict[str, zipfile.ZipInfo], root: str) -> None:
    order = members.get(f"{root}/byteorder")
    got = b"little" if order is None else read_member(p, z, order, 16, f"member {root}/byteorder")
    if got != b"little":  # torch.load itself refuses anything but "little" / "big"
        raise InputError(p, f"byteorder {got[:16]!r}: refused (little-endian storages only; a big-endian archive)")


def storages(p: Path, fh: Any, root: str, members: dict[str, zipfile.ZipInfo],
             size: int) -> dict[str, tuple[int, int, int]]:
    """key -> (data offset in the file, stored bytes, compression); offsets read from local headers."""
    out: dict[str, tuple[int, int, int]] = {}
    prefix = f"{root}/data/"
    for name, info in members.items():
        if not name.startswith(prefix) or name.endswith("/"):
            continue
        key = name[len(prefix):]
        if info.compress_type != zipfile.ZIP_STORED:
            raise InputError(p, f"storage member {name[:120]!r} is compressed: refused (torch.save never compresses "
                             "storages; a deflated one can inflate without bound)")
        fh.seek(info.header_offset)
        local = fh.read(30)
        if len(local) != 30 or local[:4] != ZIP_MAGIC:
            raise InputError(p, f"corrupt zip: bad local header for {name[:120]!r}")
        flags, = struct.unpack("<H", local[6:8])
        if flags & 0x1:
            raise InputError(p, f"storage member {name[:120]!r} is encrypted: refused")
        n_name, n_extra = struct.unpack("<HH", local[26:30])
        begin = info.header_offset + 30 + n_name + n_extra
        if info.file_size != info.compress_size or begin + info.file_size > size:
            raise InputError(p, f"storage member {name[:120]!r} claims {info.file_size} bytes past the end of the file "
                             f"({size} bytes): truncated or lying sizes")
        out[key] = (begin, info.file_size, info.compress_type)
    return out


def open_zip(p: Path, fh: io.BufferedReader) -> zipfile.ZipFile:
    try:
        return zipfile.ZipFile(fh)
    except (zipfile.BadZipFile, ValueError, EOFError, OSError, NotImplementedError, RuntimeError, struct.error,
            UnicodeDecodeError):
        raise InputError(p, "corrupt zip archive (no readable central directory)") from None
