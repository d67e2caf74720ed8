"""``lint --diff`` / ``lint --fix``: show, or write and re-lint, the determined fixes."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

from consistency.errors import UsageError
from consistency.escape import term
from consistency.lint.engine import LintRequest, run_lint
from consistency.lint.fix import diff_text, plan, write
from consistency.lint.swapped import builtin
from consistency.lint.report import LintReport


def _draft_dir(req: LintRequest, files: list[str]) -> Path:
    if req.draft:
        p = Path(req.draft)
        return p if p.is_dir() else p.parent
    return Path(files[0]).parent  # the command line's draft directory (engine read it from there)


def diff_or_fix(req: LintRequest, rep: LintReport, apply: bool, force: bool, to_stderr: bool) -> LintReport:
    """Print the plan; with ``apply``, write it and return the report of the fixed setup."""
    out = sys.stderr if to_stderr else sys.stdout
    p = plan(rep)
    out.write(diff_text(p))
    if not apply:
        return rep
    if p.empty:
        out.write("nothing written: no finding has a determined fix\n")
        return rep
    files = [f for f, (old, new) in p.texts.items() if old != new]
    if files and req.draft and builtin(req.draft, "--draft") is not None:
        raise UsageError(f"--draft {req.draft} is a built-in draft: --fix never writes into the package (copy its "
                         "directory and fix the copy)")
    names = ("config.json",) + ((Path(req.draft).name,) if req.draft and Path(req.draft).is_file() else ())
    written = write(p, _draft_dir(req, files), force, names) if files else []
    for f in written:
        out.write(term(f"fixed {f} (backup: {f}.orig)") + "\n")
    again = replace(req, serve=p.command) if p.command else req
    if p.command:
        out.write("re-linted with the corrected serving command above (run it yourself; lint never runs it)\n")
    fixed = run_lint(again)
    out.write(term(f"after the fix: {fixed.verdict.upper()} — {fixed.summary}") + "\n")
    return fixed
