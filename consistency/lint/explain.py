"""``consistency lint --explain CODE``: a rule's page, where a user reads it (the terminal).

The page is rendered from the rule's row and its hand-written text shipped inside the package
(lint/rules_doc.py), the same text as docs/rules/CODE.md: a pip install prints the whole page,
not only the row, and never a page that disagrees with the registry.
"""

from __future__ import annotations

from consistency.errors import UsageError
from consistency.lint.rules import REGISTRY
from consistency.lint.rules_doc import render


def explain(selector: str) -> str:
    """The explanation of a rule given by code (``MTP001``) or name (``mtp-layers-missing``)."""
    key = selector.strip()
    rule = REGISTRY.get(key.upper()) or next((r for r in REGISTRY.values() if r.name == key.lower()), None)
    if rule is None:
        raise UsageError(f"--explain {selector!r}: no such rule; codes: {', '.join(sorted(REGISTRY))}")
    return render(rule)
