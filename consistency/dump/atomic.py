"""Atomic file writes: a crash, a kill -9 or a full disk leaves the old file or none.

Data goes to a hidden temporary file in the destination directory (same filesystem, so
the final rename is atomic), is fsync'd, and only then published under the final name:
with ``os.replace`` when overwriting is allowed (``--force``), else with ``os.link``, which
fails if the name appeared meanwhile, so a concurrent writer is never clobbered either.
The temporary file is removed on any Python-level failure. After a kill -9 it remains, but
under a name no reader opens (``.<name>.tmp-<host>-<pid>-<random>``); the next write to
the same name removes such leftovers once their writer's process is gone.

Overwrite rule (all commands): a report of ours may be replaced without ``--force``; a
dump or any other existing file needs ``--force``; a FIFO/device/socket is never an output.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import socket
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from consistency.errors import InputError, OutputExistsError

_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def check_writable(path: str | Path, force: bool) -> Path:
    """Fail early (before any work) if the output would clobber a file or cannot exist.

    The one overwrite rule of every command (docs/commands.md#outputs): an existing file is
    replaced without ``--force`` only when it is a report consistency wrote (recognised by
    its content, :func:`is_report`), so ``compare --json r.json`` re-runs in a loop while a
    dump or any other file is never lost to a mistyped option. A FIFO, device or socket is
    refused even with ``--force``: writing to one would block or reach hardware.
    """
    p = Path(path)
    if p.exists() or p.is_symlink():
        if p.is_dir():
            raise InputError(p, "is a directory, expected a file path to write")
        if p.exists() and not p.is_file():
            raise InputError(p, "is not a regular file (a FIFO, device or socket); refused as an output")
        if not force and not is_report(p):
            raise OutputExistsError(p)
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise InputError(p, f"directory {parent} does not exist")
    return p


_REPORT_HEADS: tuple[tuple[bytes, re.Pattern[bytes]], ...] = (
    (b"{", re.compile(rb'^\{\s*"tool"\s*:\s*"consistency"')),  # compare, lint, replay, gate JSON
    (b"{", re.compile(rb'"\$schema"\s*:\s*"[^"]*sarif[^"]*".*?"driver"\s*:\s*\{\s*"name"\s*:\s*"consistency"', re.S)),
    (b"<?xml", re.compile(rb'<testsuites name="consistency"')),  # gate JUnit
    (b"<!DOCTYPE html>", re.compile(rb'<meta name="generator" content="consistency[ "]')),  # compare --html
    (b"\x89PNG\r\n\x1a\n", re.compile(rb"tEXtSoftware\x00consistency")),  # compare --png
    (b"consistency ", re.compile(rb"^consistency (lint|compare|replay) ")),  # lint --output text
)


def is_report(path: str | Path) -> bool:
    """True when ``path`` is a regular file holding a report consistency wrote (JSON, SARIF,
    JUnit XML, HTML, PNG, text), judged from its first 8 KiB. A dump never matches: it
    starts with a binary length (safetensors) or ``PK`` (npz)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return False
            head = os.read(fd, 8192)
        finally:
            os.close(fd)
    except OSError:
        return False
    return any(head.startswith(magic) and pat.search(head) for magic, pat in _REPORT_HEADS)


def _tag() -> str:
    host = "".join(c for c in socket.gethostname() if c.isalnum())[:32] or "host"
    return f"{host}-{os.getpid()}-"


@contextlib.contextmanager
def atomic_write(path: str | Path, force: bool = False) -> Iterator[BinaryIO]:
    """Yield a binary file object whose content appears under ``path`` only on success."""
    p = check_writable(path, force)
    _sweep_leftovers(p)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.tmp-{_tag()}", dir=p.parent)
    except OSError as exc:
        raise _write_error(p, exc) from exc
    ok = False
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; outputs get the usual permissions
        with os.fdopen(fd, "wb") as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        _publish(tmp, p, force)
        ok = True
        _fsync_dir(p.parent)
    except OSError as exc:
        raise _write_error(p, exc) from exc
    finally:
        if not ok:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def _publish(tmp: str, p: Path, force: bool) -> None:
    """Rename into place; without ``force`` never replace a file that appeared meanwhile."""
    if force:
        os.replace(tmp, p)
        return
    try:
        os.link(tmp, p)  # atomic "create if absent"
    except FileExistsError:
        if not is_report(p):
            raise OutputExistsError(p) from None
        os.replace(tmp, p)  # a previous report of ours: reports are outputs, not data
        return
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
            raise
        if p.exists():  # a filesystem without hard links: best effort
            raise OutputExistsError(p) from None
        os.replace(tmp, p)
        return
    with contextlib.suppress(OSError):  # published; a leftover link name is harmless
        os.unlink(tmp)


def _write_error(p: Path, exc: OSError) -> InputError:
    if exc.errno in _NO_SPACE:
        return InputError(p, f"no space left to write ({os.strerror(exc.errno)}); nothing was written")
    return InputError(p, f"cannot write: {exc.strerror or exc}")


def _sweep_leftovers(p: Path) -> None:
    """Remove temp files of ``p`` left by a killed writer on this host (its pid is gone)."""
    prefix = f".{p.name}.tmp-"
    host = _tag().split("-")[0]
    try:
        names = [n for n in os.listdir(p.parent) if n.startswith(prefix)]
    except OSError:
        return
    for n in names:
        parts = n[len(prefix):].split("-")
        if len(parts) < 3 or parts[0] != host or not parts[1].isdigit():
            continue
        pid = int(parts[1])
        if pid == os.getpid() or _alive(pid):
            continue
        with contextlib.suppress(OSError):
            os.unlink(p.parent / n)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists, owned by someone else
        return True
    return True


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
