"""``consistency.toml``: the checks a project declares (docs/ci.md#configuration).

Unknown keys are errors, not ignored: a typo such as ``trained-with`` for
``trained_with`` would otherwise silently drop the check it was meant to configure.
Paths are relative to the config file's directory, so the gate runs the same from any
working directory.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from consistency.errors import InputError, UsageError

LINT_KEYS = {"name", "draft", "target", "serve", "runtime", "trained_with", "select", "ignore", "fail_on"}
COMPARE_KEYS = {"name", "reference", "candidate", "contract", "rtol", "atol", "threshold", "tolerance", "layer_ids",
                "convention"}
GATE_KEYS = {"fail_on", "json", "junit", "sarif", "summary", "annotations", "force"}
PATH_KEYS = {"draft", "target", "reference", "candidate", "contract", "trained_with", "dump", "train", "serve_dump"}


@dataclass
class Check:
    kind: str  # lint | compare | replay
    name: str
    options: dict[str, Any]


@dataclass
class GateConfig:
    path: Path
    settings: dict[str, Any] = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)


def _toml(path: Path) -> dict[str, Any]:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - exercised on Python 3.10 only
        try:
            import tomli as tomllib
        except ImportError:
            raise UsageError("reading consistency.toml on Python 3.10 needs the tomli package") from None
    if not path.is_file():
        raise InputError(path, "no such gate config (write one: docs/ci.md#configuration)")
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(path, f"cannot read: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise InputError(path, f"not valid TOML: {exc}") from None


def _resolve(base: Path, key: str, value: Any) -> Any:
    if key not in PATH_KEYS or not isinstance(value, str):
        return value
    if key == "trained_with" and not (base / value).exists() and ":" in value:
        return value  # FRAMEWORK:IDS
    p = Path(value)
    return str(p if p.is_absolute() else base / p)


def load(path: str | Path) -> GateConfig:
    p = Path(path)
    raw = _toml(p)
    base = p.parent
    unknown = set(raw) - {"gate", "lint", "compare", "replay"}
    if unknown:
        raise InputError(p, f"unknown section(s) {sorted(unknown)}; expected [gate], [[lint]], [[compare]], [[replay]]")
    cfg = GateConfig(path=p, settings=dict(raw.get("gate", {})))
    bad = set(cfg.settings) - GATE_KEYS
    if bad:
        raise InputError(p, f"[gate] has unknown key(s) {sorted(bad)}; known: {sorted(GATE_KEYS)}")
    for key in ("json", "junit", "sarif", "summary"):
        if isinstance(cfg.settings.get(key), str):
            cfg.settings[key] = str(base / cfg.settings[key])
    for kind, allowed in (("lint", LINT_KEYS), ("compare", COMPARE_KEYS), ("replay", None)):
        entries = raw.get(kind, [])
        if not isinstance(entries, list):
            raise InputError(p, f"[{kind}] must be an array of tables: write [[{kind}]]")
        for i, entry in enumerate(entries):
            if not isinstance(entry, dict):
                raise InputError(p, f"[[{kind}]] entry {i + 1} is not a table")
            if allowed is not None and set(entry) - allowed:
                raise InputError(p, f"[[{kind}]] entry {i + 1} has unknown key(s) {sorted(set(entry) - allowed)}; "
                                    f"known: {sorted(allowed)}")
            name = str(entry.get("name") or f"{kind}-{i + 1}")
            opts = {k: _resolve(base, k, v) for k, v in entry.items() if k != "name"}
            cfg.checks.append(Check(kind, name, opts))
    names = [f"{c.kind}/{c.name}" for c in cfg.checks]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise InputError(p, f"check names must be unique: {dup}")
    if not cfg.checks:
        raise InputError(p, "declares no checks: add [[lint]], [[compare]] or [[replay]] entries")
    return cfg
