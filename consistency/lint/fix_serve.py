"""Edits of the serving command line, and the corrected command they make.

The command is a string the user runs; we print the corrected one and never execute it.
Flags are matched the way :mod:`consistency.lint.serve` parses them (``--x v``, ``--x=v``,
underscores, aliases, ``-sc``), the value replaced in place, a missing flag appended, and
the line rejoined with ``shlex`` quoting so a JSON ``--speculative-config`` stays one word.
"""

from __future__ import annotations

import json
import shlex
from typing import Any

from consistency.contract.fixes import SERVE, Edit
from consistency.lint.draft import DraftInfo
from consistency.lint.serve import _ALIASES, _SHORT, ServeInfo

_SPEC_CONFIG = "speculative-config"


def flag_edit(s: ServeInfo, flag: str, value: Any) -> Edit:
    """Set ``--flag value`` (old: the value on the command line, None when absent)."""
    return Edit(file=SERVE, key=f"--{flag}", old=s.flags.get(flag), new=str(value))


def method_edit(s: ServeInfo, method: str, draft: DraftInfo | None) -> list[Edit] | None:
    """SGLang: ``--speculative-algorithm``; vLLM: ``"method"`` inside ``--speculative-config``
    (None when there is none: the draft model and the token count are not ours to choose)."""
    if s.runtime == "sglang":
        edits = [flag_edit(s, "speculative-algorithm", method)]
        if s.draft_model is None and draft is not None and method != "NEXTN":
            folder = draft.path if draft.path.is_dir() or draft.config_path is None else draft.config_path.parent
            edits.append(flag_edit(s, "speculative-draft-model-path", str(folder)))
        return edits
    raw = s.flags.get(_SPEC_CONFIG)
    if raw is None:
        return None
    try:
        cfg = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(cfg, dict):
        return None
    return [Edit(file=SERVE, key=f"--{_SPEC_CONFIG}.method", old=cfg.get("method"), new=method)]


def _name(tok: str) -> str | None:
    if not tok.startswith("-") or len(tok) < 2 or tok.lstrip("-")[:1].isdigit():
        return None
    name = tok.lstrip("-").partition("=")[0].replace("_", "-")
    name = _SHORT.get(name, name) if not tok.startswith("--") else name
    return _ALIASES.get(name, name)


def corrected_command(command: str, edits: list[Edit]) -> str:
    """The command line with the edits applied (flags in place; missing ones appended)."""
    toks = shlex.split(command.replace("\\\n", " "), posix=True)
    for e in edits:
        if e.file != SERVE:
            continue
        flag, _, sub = e.key.lstrip("-").partition(".")
        i = next((k for k, t in enumerate(toks) if _name(t) == flag), None)
        if sub:  # a key inside a JSON flag value
            if i is None:
                continue
            inline = "=" in toks[i]
            raw = toks[i].partition("=")[2] if inline else toks[i + 1]
            cfg = json.loads(raw)
            cfg[sub] = e.new
            val = json.dumps(cfg, separators=(",", ":"))
        else:
            val, inline = str(e.new), i is not None and "=" in toks[i]
        if i is None:
            toks += [f"--{flag}", val]
        elif inline:
            toks[i] = toks[i].partition("=")[0] + "=" + val
        elif i + 1 < len(toks) and not toks[i + 1].startswith("--"):
            toks[i + 1] = val
        else:
            toks.insert(i + 1, val)
    return shlex.join(toks)
