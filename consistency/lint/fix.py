"""``lint --diff`` and ``lint --fix``: the findings' fixes as a unified diff, and written.

Each finding carries its fix as data (:class:`consistency.contract.fixes.Fix`, computed in
:mod:`consistency.lint.fix_rules`). This module gathers the determined ones into one plan
(edits per file, the corrected command line), renders it with :mod:`difflib`, and writes
it safely: only the draft config lint read, never through a symlink or outside the draft
directory, atomically, with a backup; then lints the fixed setup again, so ``--fix`` exits
0 only when what it wrote passes. Fixes that depend on an input not given, or that no edit
can make, are listed with the input that decides them and never applied.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from consistency.contract.fixes import SERVE, Edit, Fix
from consistency.contract.fixtext import apply_edits, unified
from consistency.errors import InputError
from consistency.escape import term
from consistency.lint.fix_serve import corrected_command
from consistency.lint.report import LintReport

BACKUP_SUFFIX = ".orig"


@dataclass
class FixPlan:
    edits: dict[str, list[Edit]] = field(default_factory=dict)  # file -> edits (determined, deduplicated)
    serve_edits: list[Edit] = field(default_factory=list)
    command: str | None = None  # the corrected serving command line (printed, never run)
    held: list[tuple[str, Fix]] = field(default_factory=list)  # (code, fix) not applied: ambiguous/impossible
    conflicts: list[str] = field(default_factory=list)
    texts: dict[str, tuple[str, str]] = field(default_factory=dict)  # file -> (old text, new text)

    @property
    def empty(self) -> bool:
        return not self.edits and not self.serve_edits


def plan(rep: LintReport, read: bool = True) -> FixPlan:
    """The determined edits of every finding, grouped by file; two findings proposing two
    different values for one key is a conflict, and neither is applied."""
    p = FixPlan()
    seen: dict[tuple[str, str], Edit] = {}
    bad: set[tuple[str, str]] = set()
    held_keys: set[tuple[str, str, str]] = set()
    for f in rep.findings:
        fx = f.autofix
        if fx is None:
            continue
        if fx.status != "determined":
            k = (f.code, fx.status, fx.summary)
            if k not in held_keys and (fx.summary, fx.status) not in {(h.summary, h.status) for _c, h in p.held}:
                p.held.append((f.code, fx))
            held_keys.add(k)
            continue
        for e in fx.edits:
            k2 = (e.file, e.key)
            if k2 in seen and (seen[k2].new, seen[k2].remove) != (e.new, e.remove):
                bad.add(k2)
                p.conflicts.append(f"{e.key}: {seen[k2].new} and {e.new} proposed by two findings")
            seen.setdefault(k2, e)
    for k2, e in seen.items():
        if k2 in bad:
            continue
        if e.file == SERVE:
            p.serve_edits.append(e)
        else:
            p.edits.setdefault(e.file, []).append(e)
    if p.serve_edits and rep.inputs.serve:
        p.command = corrected_command(rep.inputs.serve, p.serve_edits)
    for file, edits in (p.edits.items() if read else ()):
        old = _read(Path(file))
        p.texts[file] = (old, apply_edits(old, edits, file))
    return p


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(path, f"cannot read it to fix it: {exc.__class__.__name__}") from None


def diff_text(p: FixPlan) -> str:
    """The whole plan as text: unified diffs, the corrected command, what was held back.
    Every line passes through :func:`consistency.escape.term` (the config is a PR's bytes)."""
    out: list[str] = []
    for file, (old, new) in p.texts.items():
        for line in unified(file, old, new).splitlines():
            out.append(term(line))
    if p.command:
        out.append("# corrected serving command (printed, not run):")
        out.append(term(p.command))
    for code, fx in p.held:
        tail = f" (decided by {fx.decided_by})" if fx.decided_by else ""
        out.append(term(f"# {code} not fixed, {fx.status}: {fx.summary}{tail}"))
    for c in p.conflicts:
        out.append(term(f"# not fixed, conflicting fixes: {c}"))
    if not out:
        out.append("# nothing to fix")
    return "\n".join(out) + "\n"


def check_target(file: str, draft_dir: Path, names: tuple[str, ...] = ("config.json",)) -> Path:
    """Refuse a write that is not the draft config lint read, as a plain file directly inside
    the linted draft directory, reached by no symbolic link (an HF cache snapshot's config.json
    is a link into the blob store: it is refused, never rewritten)."""
    p = Path(file)
    if p.is_symlink():
        raise InputError(p, "is a symbolic link; --fix never writes through one")
    d = Path(os.path.abspath(draft_dir))
    if os.path.realpath(d) != str(d):
        raise InputError(draft_dir, f"is reached through a symbolic link ({os.path.realpath(d)}); --fix writes only "
                                    "under a real path: pass that directory")
    if Path(os.path.abspath(p)).parent != d or p.name not in names:
        raise InputError(p, f"is not the draft config lint read in {draft_dir}; --fix writes nothing else")
    if not p.is_file():
        raise InputError(p, "is not a regular file; nothing is fixed")
    return p


def write(p: FixPlan, draft_dir: Path, force: bool, names: tuple[str, ...] = ("config.json",)) -> list[str]:
    """Back up and atomically replace each fixed file; returns the paths written.

    Every check runs before the first write, so a refused fix leaves every file as it was."""
    from consistency.dump.atomic import write_text_atomic

    targets = [(check_target(f, draft_dir, names), old, new) for f, (old, new) in p.texts.items() if old != new]
    for path, old, _new in targets:
        bak = path.with_name(path.name + BACKUP_SUFFIX)
        if (bak.exists() or bak.is_symlink()) and not force:
            raise InputError(bak, "exists (the backup of an earlier --fix?); pass --force to replace it")
        if bak.is_symlink():
            raise InputError(bak, "is a symbolic link; --fix never writes through one")
        if _read(path) != old:
            raise InputError(path, "changed while it was linted; nothing is fixed")
    written = []
    for path, old, new in targets:
        write_text_atomic(path.with_name(path.name + BACKUP_SUFFIX), old, force=True)
        write_text_atomic(path, new, force=True)
        written.append(str(path))
    return written
