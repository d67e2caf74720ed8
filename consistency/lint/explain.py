"""``consistency lint --explain CODE``: a rule's page, where a user reads it (the terminal).

The page is docs/rules/CODE.md of a source checkout; an installed wheel has no docs, so the
rule's own metadata (title, severity, source, fix) is printed either way and the page is
appended when it is found.
"""

from __future__ import annotations

from pathlib import Path

from consistency.errors import UsageError
from consistency.lint.rules import REGISTRY

DOCS = Path(__file__).resolve().parents[2] / "docs" / "rules"


def explain(selector: str) -> str:
    """The explanation of a rule given by code (``MTP001``) or name (``mtp-layers-missing``)."""
    key = selector.strip()
    rule = REGISTRY.get(key.upper()) or next((r for r in REGISTRY.values() if r.name == key.lower()), None)
    if rule is None:
        raise UsageError(f"--explain {selector!r}: no such rule; codes: {', '.join(sorted(REGISTRY))}")
    head = (f"{rule.code} {rule.name} ({rule.severity.value}): {rule.title}\n"
            f"source: {rule.source}\nfix: {rule.fix}\n")
    page = DOCS / f"{rule.code}.md"
    if page.is_file():
        return head + "\n" + page.read_text(encoding="utf-8")
    return head + f"(page {rule.doc} is not installed with the package)\n"
