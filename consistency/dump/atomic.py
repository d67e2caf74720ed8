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
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

from consistency.errors import InputError, OutputExistsError, UsageError

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
    _within_checkout(p)
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


def _identities(p: str | Path) -> set[object]:
    """What makes two paths the same file: the resolved path, and the inode when it exists
    (a hard link or a symlink to the same file)."""
    out: set[object] = set()
    try:
        out.add(os.path.realpath(os.path.abspath(p)))
        st = os.stat(p)
        if stat.S_ISREG(st.st_mode):
            out.add((st.st_dev, st.st_ino))
    except (OSError, ValueError):
        pass
    return out


def check_outputs(outputs: Iterable[str | Path | None], inputs: Iterable[str | Path | None] = (),
                  force: bool = False) -> None:
    """:func:`check_writable` for every output file of a command, and two rules more that
    ``--force`` does not lift: no two outputs are the same file (``--json r.json --html
    r.json`` kept only the HTML), and no output is one of the command's inputs
    (``compare ref.safetensors cand.safetensors --json ref.safetensors --force`` replaced
    the reference dump with its own report)."""
    taken: dict[object, str] = {}
    for i in inputs:
        if i is not None and str(i) not in ("", "-"):
            for ident in _identities(i):
                taken.setdefault(ident, f"input {i}")
    for o in outputs:
        if o is None or str(o) in ("", "-"):
            continue
        check_writable(o, force)
        ids = _identities(o)
        clash = next((taken[x] for x in ids if x in taken), None)
        if clash is not None:
            what = f"is the {clash}" if clash.startswith("input") else "is named twice as an output"
            raise UsageError(f"{o}: {what} of this command; an output never replaces an input or another output, "
                             "even with --force")
        for x in ids:
            taken[x] = f"output {o}"


def refuse_stdout(named: dict[str, str | Path | None]) -> None:
    """``-`` is stdout only for ``--json``; given to another output option (``--html -``,
    ``lint -o -``, ``gate --junit -``) it would name a file called ``-``, written after the
    whole run: refused before any work, in one line."""
    for flag, value in named.items():
        if value is not None and str(value) == "-":
            raise UsageError(f"{flag} -: only --json writes to stdout ('-'); give {flag} a file name")


def workspace() -> Path | None:
    """The checkout a CI job runs in (``$GITHUB_WORKSPACE``), or None outside CI."""
    w = os.environ.get("GITHUB_WORKSPACE")
    if not w:
        return None
    try:
        return Path(os.path.abspath(w))
    except (OSError, ValueError):
        return None


def _within_checkout(p: Path) -> None:
    """An output path inside the CI checkout lands where it reads.

    Every file and symlink of the checkout is the pull request's: a committed symlink
    (``out -> .git``, ``out -> /home/runner``, a dangling ``report.json -> ../.git/x``) must
    not carry an output the workflow named (``--json out/gate.json``) into ``.git/``, a
    dot-directory or out of the checkout. Paths outside the checkout (``$RUNNER_TEMP``) and
    paths without a symlink in them are the caller's choice, as ever.
    """
    ws = workspace()
    if ws is None:
        return
    try:
        lexical, root = Path(os.path.abspath(p)), ws.resolve()
        anchor = next((a for a in (ws, root) if a == lexical or a in lexical.parents), None)
        if anchor is None:
            return
        real = lexical.resolve()
    except (OSError, ValueError, RuntimeError) as exc:  # a symlink loop
        raise InputError(p, f"cannot resolve the output path ({exc}); refused") from None
    said = lexical.relative_to(anchor).parts
    if real == root / Path(*said):
        return
    if real != root and root not in real.parents:
        raise InputError(p, f"resolves through a symlink in the checkout to {real}, outside it ({root}); refused "
                            "as an output (a symlink the repository commits never moves an output)")
    hidden = hidden_by_symlink(lexical, real)
    if hidden:
        raise InputError(p, f"resolves through a symlink in the checkout into {hidden!r} ({real}); refused as an "
                            "output (a symlink the repository commits never moves an output into .git/ or a "
                            "dot-directory)")


def hidden_by_symlink(lexical: Path, real: Path) -> str | None:
    """The dot-directory (or dotfile) that resolving symlinks brought into a path, or None:
    ``sub/hooks/x`` with ``sub -> .git`` gives ``.git``; a dot-part the path spelled is the
    caller's own choice."""
    said = set(lexical.parts)
    return next((part for part in real.parts if part.startswith(".") and part not in said), None)


# (first bytes, a pattern over the first 8 KiB, a pattern over the last 512 bytes or None).
# Text formats carry a trailer line that only our writers put there: a hand-written note
# that happens to start with "consistency compare " is not taken for an old report.
TEXT_TRAILER = "consistency-report: {kind} text"
MD_TRAILER = "<!-- consistency-report: gate summary -->"
_REPORT_HEADS: tuple[tuple[bytes, re.Pattern[bytes], re.Pattern[bytes] | None], ...] = (
    (b"{", re.compile(rb'^\{\s*"tool"\s*:\s*"consistency"'), None),  # compare, lint, replay, gate JSON
    (b"{", re.compile(rb'"\$schema"\s*:\s*"[^"]*sarif[^"]*".*?"driver"\s*:\s*\{\s*"name"\s*:\s*"consistency"', re.S),
     None),
    (b"<?xml", re.compile(rb'<testsuites name="consistency"'), None),  # gate JUnit
    (b"<!DOCTYPE html>", re.compile(rb'<meta name="generator" content="consistency[ "]'), None),  # compare --html
    (b"\x89PNG\r\n\x1a\n", re.compile(rb"tEXtSoftware\x00consistency"), None),  # compare --png
    (b"consistency ", re.compile(rb"^consistency (lint|compare|replay) "),  # lint --output text
     re.compile(rb"\nconsistency-report: (lint|compare|replay) text\n?$")),
    (b"## consistency gate: ", re.compile(rb"^## consistency gate: "),  # gate --summary
     re.compile(re.escape(MD_TRAILER.encode()) + rb"\n?$")),
)


def is_report(path: str | Path) -> bool:
    """True when ``path`` is a regular file holding a report consistency wrote (JSON, SARIF,
    JUnit XML, HTML, PNG, text, Markdown), judged from its first 8 KiB (and, for the text
    formats, the trailer line in its last bytes). A dump never matches: it starts with a
    binary length (safetensors) or ``PK`` (npz)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return False
            head = os.read(fd, 8192)
            tail = os.pread(fd, 512, max(0, st.st_size - 512))
        finally:
            os.close(fd)
    except OSError:
        return False
    return any(head.startswith(magic) and pat.search(head) and (end is None or end.search(tail))
               for magic, pat, end in _REPORT_HEADS)


def _tmp_prefix(p: Path) -> str:
    """``.<name>.tmp-``, the name shortened so that the temporary file's whole name (host,
    pid and random tail added) stays under 255 bytes: a valid output name close to the
    limit must not fail with ENAMETOOLONG on its temporary file."""
    b = os.fsencode(p.name)
    if len(b) > 160:
        b = b[:160]
    return f".{os.fsdecode(b)}.tmp-"


def _tag() -> str:
    host = "".join(c for c in socket.gethostname() if c.isalnum())[:32] or "host"
    return f"{host}-{os.getpid()}-"


@contextlib.contextmanager
def atomic_write(path: str | Path, force: bool = False) -> Iterator[BinaryIO]:
    """Yield a binary file object whose content appears under ``path`` only on success."""
    p = check_writable(path, force)
    _sweep_leftovers(p)
    try:
        fd, tmp = tempfile.mkstemp(prefix=_tmp_prefix(p) + _tag(), dir=p.parent)
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
    prefix = _tmp_prefix(p)
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
