"""Fixes as text: a config with its edits applied, as a unified diff, as SARIF replacements.

Shared by ``lint --diff/--fix`` (which writes the text), the SARIF writer (``fixes``) and the
gate's step summary (which shows the diff and never applies it). The config is re-serialised
in its own indentation, so for a config written by ``json.dumps(indent=k)`` (every published
one we read) the diff is exactly the edited keys.
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any

from consistency.contract.fixes import Edit
from consistency.errors import InputError


def _indent(text: str) -> int | str | None:
    for line in text.splitlines()[1:]:
        stripped = line.lstrip(" \t")
        if stripped and len(stripped) < len(line):
            ws = line[: len(line) - len(stripped)]
            return "\t" if ws.startswith("\t") else len(ws)
    return None


def apply_edits(text: str, edits: list[Edit], where: str) -> str:
    """The config text with the edits applied, re-serialised in its own indentation."""
    try:
        cfg = json.loads(text)
    except ValueError:
        raise InputError(where, "is not valid JSON; nothing is fixed") from None
    if not isinstance(cfg, dict):
        raise InputError(where, "is not a JSON object; nothing is fixed")
    for e in edits:
        _set(cfg, e, where)
    out = json.dumps(cfg, indent=_indent(text), ensure_ascii=not _non_ascii(text))
    return out + ("\n" if text.endswith("\n") else "")


def _non_ascii(text: str) -> bool:
    return any(ord(c) > 127 for c in text)


def _set(cfg: dict[str, Any], e: Edit, where: str) -> None:
    *parents, last = e.key.split(".")
    cur = cfg
    for part in parents:
        nxt = cur.get(part)
        if nxt is not None and not isinstance(nxt, dict):
            raise InputError(where, f"{part} is not a JSON object; nothing is fixed")
        if nxt is None:
            if e.remove:
                return
            nxt = cur[part] = {}
        cur = nxt
    if e.remove:
        cur.pop(last, None)
    else:
        cur[last] = e.new


def unified(file: str, old: str, new: str) -> str:
    p = Path(file)
    try:
        p = p.resolve().relative_to(Path.cwd().resolve()) if p.is_absolute() else p
    except ValueError:
        pass
    a, b = (str(p), str(p)) if p.is_absolute() else (f"a/{p.as_posix()}", f"b/{p.as_posix()}")
    return "".join(difflib.unified_diff(old.splitlines(keepends=True), new.splitlines(keepends=True),
                                        fromfile=a, tofile=b))


def replacements(old: str, new: str) -> list[dict[str, Any]]:
    """SARIF ``replacements`` (character offsets) that turn ``old`` into ``new``."""
    a, b = old.splitlines(keepends=True), new.splitlines(keepends=True)
    starts_a = [0]
    for line in a:
        starts_a.append(starts_a[-1] + len(line))
    out = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        out.append({"deletedRegion": {"charOffset": starts_a[i1], "charLength": starts_a[i2] - starts_a[i1]},
                    "insertedContent": {"text": "".join(b[j1:j2])}})
    return out
