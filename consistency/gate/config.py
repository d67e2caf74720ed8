"""``consistency.toml``: the checks a project declares (docs/ci.md#configuration).

Unknown keys are errors, not ignored: a typo such as ``trained-with`` for
``trained_with`` would otherwise silently drop the check it was meant to configure.
Paths are relative to the config file's directory, so the gate runs the same from any
working directory. A config travels with the repository under test, so it is treated as
someone else's file: the outputs it names stay inside its directory tree and out of
``.git/`` and every dot-directory (after symlinks are resolved), it cannot ask for
``force`` (only the command line can), it cannot turn off what GitHub Actions shows (the
CLI decides that), and a value of the wrong type is an error. A check may say
``optional = true``: it is then *skipped* where its dependencies are missing instead of
failing the gate as an error.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from consistency.compare.request import CompareRequest
from consistency.dump.atomic import hidden_by_symlink, workspace
from consistency.errors import InputError, UsageError
from consistency.lint.engine import FAIL_ON, LintRequest
from consistency.replay.request import ALIASES as REPLAY_ALIASES
from consistency.replay.request import ReplayRequest

# A [[lint]] / [[compare]] / [[replay]] table sets its request's own fields (the request says what
# a check can be asked, and validates it), less what only an in-process caller can hand over, plus
# the gate's two (the check's name, optional). A field added to a request is a gate key at once.
IN_PROCESS_ONLY = {"tokenizer", "progress"}  # an object or a callback (a tokenizer path would load a PR's files)
GATE_OWN = {"name", "optional"}
LINT_KEYS = {f.name for f in fields(LintRequest)} | GATE_OWN
COMPARE_KEYS = ({f.name for f in fields(CompareRequest)} - IN_PROCESS_ONLY) | GATE_OWN
REPLAY_KEYS = {f.name for f in fields(ReplayRequest)} | set(REPLAY_ALIASES) | GATE_OWN
GATE_KEYS = {"fail_on", "json", "junit", "sarif", "summary", "annotations", "force"}
OUTPUT_KEYS = ("json", "junit", "sarif", "summary")
PATH_KEYS = {"draft", "target", "reference", "candidate", "contract", "trained_with"}

# The type each key must have (a value of another type is an error, never a silent
# default): "str", "num" (int or float, not bool), "bool", "strs" (a string or a list of
# strings), "ids" (a list of ints or a "0,3,31" string), "tolerance" (a table or strings).
TYPES: dict[str, str] = {
    "name": "str", "draft": "str", "target": "str", "serve": "str", "runtime": "str", "trained_with": "str",
    "select": "strs", "ignore": "strs", "fail_on": "str", "reference": "str", "candidate": "str", "contract": "str",
    "rtol": "num", "atol": "num", "threshold": "num", "tolerance": "tolerance", "layer_ids": "ids",
    "ref_layer_ids": "ids", "cand_layer_ids": "ids", "consumer": "str",
    "convention": "str", "json": "str", "junit": "str", "sarif": "str", "summary": "str", "annotations": "bool",
    "steps": "int", "max_drop_points": "num", "max_drop": "num", "min_acceptance": "num", "feed": "str",
    "labels": "str", "optional": "bool", "method": "str", "overrides": "bools",
}
_TYPE_WORDS = {"str": "a string", "num": "a number", "int": "an integer", "bool": "true or false",
               "strs": "a string or a list of strings", "ids": "a list of integers or a \"0,3,31\" string",
               "tolerance": "a table (e.g. {bfloat16 = 0.02}) or a list of strings",
               "bools": "a table of true/false values (e.g. {norm_output = true})"}


def _typed(value: Any, kind: str) -> bool:
    if kind == "str":
        return isinstance(value, str)
    if kind == "num":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "strs":
        return isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value))
    if kind == "ids":
        return isinstance(value, str) or (isinstance(value, list) and all(
            isinstance(v, int) and not isinstance(v, bool) for v in value))
    if kind == "bools":
        return isinstance(value, dict) and all(isinstance(v, bool) for v in value.values())
    if kind == "tolerance":
        return isinstance(value, (dict, str)) or (isinstance(value, list) and all(isinstance(v, str) for v in value))
    return True


def _check_types(p: Path, where: str, table: dict[str, Any]) -> None:
    for key, value in table.items():
        kind = TYPES.get(key)
        if kind is not None and not _typed(value, kind):
            raise InputError(p, f"{where} {key} = {value!r}: expected {_TYPE_WORDS[kind]}")
    if "fail_on" in table and table["fail_on"] not in FAIL_ON:
        raise InputError(p, f"{where} fail_on = {table['fail_on']!r}: expected \"error\" or \"warning\"")


def _output(p: Path, base: Path, key: str, value: str) -> str:
    """An output path of the config, kept inside the config's directory tree.

    A config comes with the repository under test; a pull request must not be able to make
    the gate write over ``~/.bashrc`` or ``/etc/...``. Paths given on the command line are
    the runner's own choice and are not restricted.
    """
    if value == "-" and key == "json":
        return value
    if not value or not value.isprintable():
        raise InputError(p, f"[gate] {key} = {value!r}: not a usable file name (empty or with control characters)")
    lexical = Path(os.path.abspath(base / value))
    target = lexical.resolve()
    root = base.resolve()
    moved = hidden_by_symlink(lexical, target)
    if moved is not None:  # the config's directory or a parent of the output is a symlink into .git/
        raise InputError(p, f"[gate] {key} = {value!r} resolves through a symlink into {moved!r} ({target}): outputs "
                            "a config names never go into .git/, a dot-directory or a dotfile (pass --"
                            f"{key} on the command line to write there)")
    if target == root or root not in target.parents:
        raise InputError(p, f"[gate] {key} = {value!r} points outside the config's directory {root}; outputs a "
                            f"config names stay inside it (pass --{key} on the command line to write elsewhere)")
    anchors = [root] + [w for w in _workspace() if w in target.parents]  # a config in .github/ writes no workflow
    hidden = next((part for a in anchors for part in target.relative_to(a).parts if part.startswith(".")), None)
    if hidden is not None:  # .git/config, .venv/bin/activate, .pre-commit hooks: never ours to write
        raise InputError(p, f"[gate] {key} = {value!r} lands in {hidden!r}: outputs a config names never go into "
                            f".git/, a dot-directory or a dotfile (pass --{key} on the command line to write there)")
    return str(base / value)


def _workspace() -> list[Path]:
    """The checkout a CI job runs in (``GITHUB_WORKSPACE``) and the working directory (where
    a hook or a job runs the gate: the repository root): dot-directories are judged from
    there too, so a config under ``.github/`` cannot write ``.github/workflows/...``."""
    out = []
    for w in (workspace(), Path.cwd()):
        try:
            if w is not None:
                out.append(w.resolve())
        except OSError:
            continue
    return out


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
    except UnicodeDecodeError:  # a dump, an archive, an .npz given where the config goes
        raise InputError(path, "not a TOML file (binary, not UTF-8 text); --config takes a consistency.toml "
                               "(docs/ci.md#configuration)") from None
    except OSError as exc:
        raise InputError(path, f"cannot read: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise InputError(path, f"not valid TOML: {exc}") from None


def _exists(p: Path) -> bool:
    try:
        return p.exists()
    except OSError:  # ENAMETOOLONG, ELOOP: not a file we could read either
        return False


def _resolve(base: Path, key: str, value: Any, builtins: frozenset[str]) -> Any:
    if key not in PATH_KEYS or not isinstance(value, str):
        return value
    if key == "trained_with" and not _exists(base / value) and ":" in value:
        return value  # FRAMEWORK:IDS
    if value in builtins and not _exists(base / value):
        return value  # a built-in model or draft name, wherever the config sits
    p = Path(value)
    return str(p if p.is_absolute() else base / p)


def load(path: str | Path, builtins: Iterable[str] = ()) -> GateConfig:
    """Parse and validate a gate config; ``builtins`` are the model and draft names the
    commands know without a file (``tiny-llama``, ``tiny-llama-eagle3``)."""
    p = Path(path)
    raw = _toml(p)
    base = p.parent
    known = frozenset(builtins)
    unknown = set(raw) - {"gate", "lint", "compare", "replay"}
    if unknown:
        raise InputError(p, f"unknown section(s) {sorted(unknown)}; expected [gate], [[lint]], [[compare]], [[replay]]")
    if not isinstance(raw.get("gate", {}), dict):
        raise InputError(p, "[gate] must be a table: write [gate]")
    cfg = GateConfig(path=p, settings=dict(raw.get("gate", {})))
    bad = set(cfg.settings) - GATE_KEYS
    if bad:
        raise InputError(p, f"[gate] has unknown key(s) {sorted(bad)}; known: {sorted(GATE_KEYS)}")
    if "force" in cfg.settings:
        raise InputError(p, "[gate] force: overwriting files is the runner's decision, not the config's; "
                            "remove it and pass --force on the command line")
    _check_types(p, "[gate]", cfg.settings)
    for key in OUTPUT_KEYS:
        if key in cfg.settings:
            cfg.settings[key] = _output(p, base, key, cfg.settings[key])
    for kind, allowed in (("lint", LINT_KEYS), ("compare", COMPARE_KEYS), ("replay", REPLAY_KEYS)):
        entries = raw.get(kind, [])
        if not isinstance(entries, list):
            raise InputError(p, f"[{kind}] must be an array of tables: write [[{kind}]]")
        for i, entry in enumerate(entries):
            if not isinstance(entry, dict):
                raise InputError(p, f"[[{kind}]] entry {i + 1} is not a table")
            if set(entry) - allowed:
                raise InputError(p, f"[[{kind}]] entry {i + 1} has unknown key(s) {sorted(set(entry) - allowed)}; "
                                    f"known: {sorted(allowed)}")
            _check_types(p, f"[[{kind}]] entry {i + 1}", entry)
            name = str(entry.get("name") or f"{kind}-{i + 1}")
            opts = {k: _resolve(base, k, v, known) for k, v in entry.items() if k != "name"}
            cfg.checks.append(Check(kind, name, opts))
    names = [f"{c.kind}/{c.name}" for c in cfg.checks]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise InputError(p, f"check names must be unique: {dup}")
    if not cfg.checks:
        raise InputError(p, "declares no checks: add [[lint]], [[compare]] or [[replay]] entries")
    return cfg
