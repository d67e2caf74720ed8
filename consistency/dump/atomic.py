"""Atomic file writes: a crash, a kill -9 or a full disk leaves the old file or none.

Data goes to a hidden temporary file in the destination directory (same filesystem, so
``os.replace`` is atomic), is fsync'd, and only then renamed over the final name. The
temporary file is removed on any Python-level failure; after a kill -9 it may remain, but
under a name no reader ever opens (``.<name>.tmp-<random>``).
"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from consistency.errors import InputError, OutputExistsError


def check_writable(path: str | Path, force: bool) -> Path:
    """Fail early (before any work) if the output would clobber a file or cannot exist."""
    p = Path(path)
    if p.exists() or p.is_symlink():
        if p.is_dir():
            raise InputError(p, "is a directory, expected a file path to write")
        if not force:
            raise OutputExistsError(p)
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise InputError(p, f"directory {parent} does not exist")
    return p


@contextlib.contextmanager
def atomic_write(path: str | Path, force: bool = False) -> Iterator[BinaryIO]:
    """Yield a binary file object whose content appears under ``path`` only on success."""
    p = check_writable(path, force)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.tmp-", dir=p.parent)
    os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; outputs get the usual permissions
    ok = False
    try:
        with os.fdopen(fd, "wb") as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        if p.exists() and not force:  # someone else wrote it meanwhile: never clobber
            raise OutputExistsError(p)
        os.replace(tmp, p)
        ok = True
        _fsync_dir(p.parent)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise InputError(p, f"no space left to write ({os.strerror(exc.errno)}); nothing was written") from exc
        raise InputError(p, f"cannot write: {exc.strerror or exc}") from exc
    finally:
        if not ok:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def write_bytes_atomic(path: str | Path, data: bytes, force: bool = False) -> None:
    with atomic_write(path, force=force) as fh:
        fh.write(data)


def write_text_atomic(path: str | Path, text: str, force: bool = False) -> None:
    write_bytes_atomic(path, text.encode("utf-8"), force=force)


def _fsync_dir(d: Path) -> None:
    with contextlib.suppress(OSError):
        dfd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
