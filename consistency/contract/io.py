"""Read and write contracts (JSON or YAML, validated), and parse any untrusted JSON/YAML text.

Contracts, dump metadata and safetensors headers arrive from other machines, so every text
parser here is strict and bounded: :func:`strict_json` refuses duplicate keys, ``NaN``/
``Infinity``, numbers beyond int64 or float range, nesting deeper than a bound and strings
no UTF-8 can carry (lone surrogates) and control characters (terminal escapes); :func:`safe_yaml` additionally refuses aliases (the
"billion laughs" expansion) and every tag beyond plain data. A violation is a
``ValueError`` whose text names the problem; callers wrap it in one ``InputError`` line.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from consistency.contract.models import AuxContract
from consistency.contract.bounds import env_limit
from consistency.errors import InputError

MAX_CONTRACT_BYTES = 4 * 1024 * 1024
# C0/C1 controls but tab, newline, carriage return: ESC/CSI in a string printed by a report
# would drive the reader's terminal (or a CI log viewer); no field of ours needs them.
_CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")
INT_LIMIT = 2**63  # no count, id, size or offset in any of our formats needs more


def max_json_depth() -> int:
    return env_limit("MAX_JSON_DEPTH", 64)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number (JSON has no NaN/Infinity)")


def _int(s: str) -> int:
    digits = s.lstrip("-")
    if len(digits) > 19 or abs(v := int(s)) >= INT_LIMIT:
        raise ValueError(f"integer {s[:24]}{'...' if len(s) > 24 else ''} is too large (beyond int64)")
    return v


def _float(s: str) -> float:
    v = float(s)
    if not math.isfinite(v):
        raise ValueError(f"number {s[:24]} is non-finite (overflows float64)")
    return v


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k[:60]!r}")
        out[k] = v
    return out


def strict_json(text: str | bytes) -> Any:
    """``json.loads`` for hostile text; every refusal is a ``ValueError`` naming the problem."""
    if isinstance(text, (bytes, bytearray)):
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"not UTF-8 (byte {exc.start})") from None
    try:
        obj = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_refuse_constant,
                         parse_int=_int, parse_float=_float)
    except RecursionError:
        raise ValueError(f"nested too deeply (limit {max_json_depth()})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc.msg} at char {exc.pos})") from None
    check_tree(obj)
    return obj


def check_tree(obj: Any, max_depth: int | None = None) -> None:
    """Walk parsed data without recursion: depth, finite numbers, int64 ints, encodable strings."""
    limit = max_json_depth() if max_depth is None else max_depth
    stack: list[tuple[Any, int]] = [(obj, 1)]
    while stack:
        x, d = stack.pop()
        if isinstance(x, (dict, list, tuple)):
            if d > limit:
                raise ValueError(f"nested too deeply (more than {limit} levels)")
            if isinstance(x, dict):
                for k, v in x.items():
                    _leaf(k)
                    stack.append((v, d + 1))
            else:
                stack.extend((v, d + 1) for v in x)
        else:
            _leaf(x)


def _leaf(x: Any) -> None:
    if isinstance(x, str):
        if not x.isascii():
            try:
                x.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError("a string holds a lone surrogate: not encodable as UTF-8") from None
        if (m := _CONTROL.search(x)) is not None:
            raise ValueError(f"a string holds control character {m.group()!r} (terminal escapes are refused)")
    elif isinstance(x, bool) or x is None:
        return
    elif isinstance(x, int):
        if abs(x) >= INT_LIMIT:
            raise ValueError(f"integer {str(x)[:24]} is too large (beyond int64)")
    elif isinstance(x, float):
        if not math.isfinite(x):
            raise ValueError(f"{x} is not a finite number (NaN/Infinity refused)")
    else:  # YAML dates, bytes, sets...: not data our models take
        raise ValueError(f"a value of type {type(x).__name__} is not plain JSON data")


def writable(obj: Any) -> Any:
    """A copy of plain data that :func:`strict_json` accepts: what a writer records must read back.

    Control characters and lone surrogates in strings become visible escapes (``\\x1b``),
    integers beyond int64 become strings and non-finite floats ``None``: a recording is
    never lost for a stray character in a prompt, and never written unreadable.
    """
    if isinstance(obj, dict):
        return {writable(k): writable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [writable(v) for v in obj]
    if isinstance(obj, str):
        s = _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", obj)
        return s if s.isascii() else s.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(obj, bool) or obj is None:
        return obj
    if isinstance(obj, int):
        return obj if abs(obj) < INT_LIMIT else str(obj)
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    return obj


def safe_yaml(text: str) -> Any:
    """``yaml.safe_load`` without aliases (expansion bombs), deep nesting or non-JSON types."""
    import yaml

    class _Loader(yaml.SafeLoader):
        depth = 0

        def compose_node(self, parent: Any, index: Any) -> Any:
            if self.check_event(yaml.AliasEvent):
                ev = self.peek_event()
                raise yaml.composer.ComposerError(None, None, "aliases (*ref) are not allowed", ev.start_mark)
            self.depth += 1
            if self.depth > max_json_depth():
                raise yaml.composer.ComposerError(None, None, f"nested too deeply (limit {max_json_depth()})",
                                                  self.peek_event().start_mark)
            try:
                return super().compose_node(parent, index)
            finally:
                self.depth -= 1

    try:
        obj = yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise ValueError(" ".join(str(exc).split())[:300]) from None
    except RecursionError:
        raise ValueError("nested too deeply") from None
    check_tree(obj)
    return obj


def read_small_file(path: str | Path, limit: int, what: str = "file") -> bytes:
    """All bytes of a regular file of at most ``limit`` bytes; devices, FIFOs, directories refused.

    Opened non-blocking and checked with ``fstat`` on the open descriptor, so a path swapped
    for a FIFO after a ``stat`` can neither hang the read nor bypass the check.
    """
    p = Path(path)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise InputError(p, f"no such {what}") from None
    except IsADirectoryError:
        raise InputError(p, f"is a directory, expected a {what}") from None
    except PermissionError:
        raise InputError(p, "permission denied") from None
    except OSError as exc:
        raise InputError(p, f"cannot open: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise InputError(p, f"is a directory, expected a {what}")
        if not stat.S_ISREG(st.st_mode):
            raise InputError(p, f"is not a regular file (device, FIFO or socket), expected a {what}")
        if st.st_size > limit:
            raise InputError(p, f"{what} is {st.st_size} bytes, over the {limit}-byte limit")
        chunks, total = [], 0
        while True:
            b = os.read(fd, min(1 << 20, limit + 1 - total))
            if not b:
                break
            chunks.append(b)
            total += len(b)
            if total > limit:
                raise InputError(p, f"{what} grew past the {limit}-byte limit while being read")
        return b"".join(chunks)
    except OSError as exc:
        raise InputError(p, f"cannot read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)


def read_config_json(path: str | Path, limit: int, what: str = "config") -> dict[str, Any]:
    """A model or draft ``config.json``: bounded in size and in nesting, one line on failure.

    Lenient where real configs are (NaN, duplicate keys: Python's own ``json``), strict
    where a hostile file attacks: a FIFO or device, more than ``limit`` bytes, nesting past
    :func:`max_json_depth` (a 5,000-deep file made ``json`` raise RecursionError).
    """
    p = Path(path)
    raw = read_small_file(p, limit, f"{what} file")
    try:
        obj = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise InputError(p, f"not UTF-8 text (byte {exc.start})") from None
    except RecursionError:
        raise InputError(p, f"not a usable {what}: nested too deeply (limit {max_json_depth()} levels)") from None
    except ValueError as exc:
        raise InputError(p, f"not valid JSON: {' '.join(str(exc).split())[:200]}") from None
    limit_depth = max_json_depth()
    stack: list[tuple[Any, int]] = [(obj, 1)]
    while stack:
        x, d = stack.pop()
        if isinstance(x, (dict, list)):
            if d > limit_depth:
                raise InputError(p, f"not a usable {what}: nested more than {limit_depth} levels deep")
            stack.extend((v, d + 1) for v in (x.values() if isinstance(x, dict) else x))
    if not isinstance(obj, dict):
        raise InputError(p, f"a {what} must be a JSON object")
    return obj


def read_contract(path: str | Path) -> AuxContract:
    p = Path(path)
    raw = read_small_file(p, env_limit("MAX_CONTRACT_BYTES", MAX_CONTRACT_BYTES), "contract file")
    is_yaml = p.suffix in (".yaml", ".yml")
    try:
        text = raw.decode("utf-8")
        obj = safe_yaml(text) if is_yaml else strict_json(text)
    except UnicodeDecodeError as exc:
        raise InputError(p, f"not UTF-8 text (byte {exc.start})") from None
    except ValueError as exc:
        raise InputError(p, f"bad contract {'YAML' if is_yaml else 'JSON'}: {exc}") from None
    if not isinstance(obj, dict):
        raise InputError(p, "a contract must be a mapping")
    try:
        return AuxContract.model_validate(obj)
    except ValidationError as exc:
        raise InputError(p, f"invalid contract at {validation_line(exc)}") from None


def validation_line(exc: ValidationError) -> str:
    """``loc: message`` of pydantic's first error, on one line, bounded."""
    e = exc.errors()[0]
    loc = ".".join(str(x) for x in e["loc"]) or "(root)"
    return " ".join(f"{loc[:120]}: {e['msg']}".split())[:300]
