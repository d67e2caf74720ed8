"""Where the environment recorder writes when the path it was given cannot be used.

``CONSISTENCY_RECORD=PATH`` records inside a process we do not control (a server that
runs for hours); its recording is never lost to a name clash, a missing or unusable
directory, a full disk or a file-size limit: the path, then a sibling name, then the
temporary directory, each said in one stderr line (docs/security.md).
"""

from __future__ import annotations

import datetime as _dt
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

ENV_PATH = "CONSISTENCY_RECORD"
ENV_FORCE = "CONSISTENCY_FORCE"  # "1": the environment recorder may overwrite an existing file


_told: set[str] = set()


def env_count(name: str) -> int | None:
    """A whole-number knob from the environment (``CONSISTENCY_RECORD_TOKENS=128``), or None.

    The recorder runs inside the host's forward pass: a value that is not a count
    (``abc``, ``3.0``, ``-1``) never raises there; it is ignored, said once on stderr."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    if raw.isascii() and raw.isdigit():
        return int(raw)
    if name not in _told:
        _told.add(name)
        say(f"{name}={raw[:80]!r} is not a whole number; ignored")
    return None


def say(msg: str) -> None:
    """One line on stderr (the server's log): where the recording goes and why."""
    from consistency.escape import term

    emit(f"consistency: {ENV_PATH}: {term(msg)}")


def emit(line: str) -> None:
    """One line to the host's stderr, never an exception into the host: stderr may be closed
    at exit, ``None`` (a daemon started with fd 2 closed, ``pythonw``), a broken pipe, or an
    object of the host's that raises."""
    try:
        err = sys.stderr
        if err is None:
            return
        err.write(line + "\n")
        err.flush()
    except Exception:  # noqa: BLE001 - nothing more we can do, and never into the host
        pass


NAME_MAX = 255  # bytes in one file name on Linux, macOS and Windows filesystems


def _taken(p: Path) -> bool:
    try:
        os.lstat(p)
    except FileNotFoundError:
        return False
    except OSError:  # ENAMETOOLONG, ENOTDIR, EACCES: not a name to write either
        return True
    return True


def _clip(stem: str, room: int) -> str:
    b = os.fsencode(stem)
    return stem if len(b) <= room else (b[:max(room, 1)].decode("utf-8", "ignore") or "recording")


def sibling(path: Path) -> Path:
    """A fresh name next to ``path``: ``out.safetensors`` -> ``out.20261130T081500-4242.safetensors``
    (time and pid, so a re-run and a second process never pick the same name); a stem too
    long for one file name is shortened, so that the name can always be created."""
    suffix = path.suffix if path.suffix and len(path.suffix) <= 16 else ".safetensors"
    stem = path.name[: len(path.name) - len(path.suffix)] if path.suffix else path.name
    stamp = _dt.datetime.now().strftime("%Y%m%dT%H%M%S")
    stem = _clip(stem, NAME_MAX - len(f".{stamp}-{os.getpid()}-{'x' * 8}{suffix}"))
    for k in range(1000):
        cand = path.with_name(f"{stem}.{stamp}-{os.getpid()}{'' if k == 0 else f'-{k}'}{suffix}")
        if not _taken(cand):
            return cand
    return path.with_name(f"{stem}.{stamp}-{os.getpid()}-{os.urandom(4).hex()}{suffix}")


def preflight(rec: Any) -> None:
    """At the first capture, not at exit: say now if the output cannot be written as named.

    A server may run for hours before it exits; learning then that the path existed or its
    directory was missing would lose the whole run. The recording is never dropped for
    these reasons: an existing file keeps its content and the recording gets a sibling
    name; a missing directory is created at exit; an unwritable one falls back to the
    temporary directory. ``CONSISTENCY_FORCE=1`` overwrites an existing file instead.
    """
    if not rec.enabled:
        return
    try:
        _preflight(rec)
    except Exception as exc:  # noqa: BLE001 - never into the host: the write at exit tries every fallback
        say(f"cannot check {rec.path} now ({type(exc).__name__}: {exc}); the recording will be written at exit "
            "where it can be")


def _preflight(rec: Any) -> None:
    p = rec.path
    from consistency.dump.writer import dump_name_problem

    problem = dump_name_problem(p)
    if problem:  # x.pt would be refused at exit: keep the name, add the suffix that says what it holds
        p = rec.redirect = p.with_name(p.name + ".safetensors")
        say(f"{rec.path}: {problem.split(';')[0]}; the recording will be written to {p}")
    if len(os.fsencode(p.name)) > NAME_MAX:  # ENAMETOOLONG at every write: a shorter name beside it
        rec.redirect = sibling(p)
        say(f"{p.name[:60]}...: a file name is at most {NAME_MAX} bytes; the recording will be written to "
            f"{rec.redirect}")
        p = rec.redirect
    if (p.exists() or p.is_symlink()) and not rec.force:
        if p.is_dir() or (p.exists() and not p.is_file()):
            rec.redirect = sibling(p.parent / (p.name + ".safetensors")) if p.is_dir() else sibling(p)
            say(f"{p} is not a regular file; the recording will be written to {rec.redirect}")
        else:
            rec.redirect = sibling(p)
            say(f"{p} exists (kept); the recording will be written to {rec.redirect} "
                 f"(set {ENV_FORCE}=1 to overwrite instead)")
    parent = (rec.redirect or p).parent
    if not parent.exists():
        say(f"directory {parent} does not exist; it will be created when the recording is written")
    elif not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        rec.redirect = sibling(Path(tempfile.gettempdir()) / p.name)
        say(f"{parent} is not a writable directory; the recording will be written to {rec.redirect} instead")


def save_safely(rec: Any) -> Path | None:
    """Write the environment-activated recording, never losing it to a name clash, a missing
    directory or a full disk: try the path, then a sibling name, then the temporary
    directory; say where it went (or why nowhere) in one line, never a traceback."""
    from consistency.errors import ConsistencyError, OutputExistsError

    wanted = rec.redirect or rec.path
    if rec.written is not None and rec.is_ours(rec.written):
        wanted = rec.written  # a flush wrote it: rewritten with everything captured since
    tried: list[str] = []
    candidates = [wanted, sibling(wanted), sibling(Path(tempfile.gettempdir()) / wanted.name)]
    force = rec.force and rec.redirect is None
    for i, cand in enumerate(candidates):
        try:
            if i < 2 and not cand.parent.exists():
                cand.parent.mkdir(parents=True, exist_ok=True)
            out = rec._write(cand, force and i == 0)  # a sibling is never an overwrite
        except OutputExistsError:
            tried.append(f"{cand}: exists")
            continue
        except (ConsistencyError, OSError) as exc:
            tried.append(str(exc) if isinstance(exc, ConsistencyError) else f"{cand}: {exc.strerror or exc}")
            continue
        except Exception as exc:  # noqa: BLE001 - never a traceback at exit
            tried.append(f"{cand}: {type(exc).__name__}: {exc}")
            continue
        if cand != wanted:
            say(f"recording written to {out} (not {wanted}: {'; '.join(tried)})")
        return out
    n = len(rec.tensors)
    mb = sum(getattr(a[0] if isinstance(a, tuple) else a, "nbytes", 0) for a in rec.tensors.values()) / 1e6
    say(f"could not write the recording ({n} tensors, {mb:.1f} MB) anywhere: {'; '.join(tried)}")
    return None
