"""Where a report's finding codes link to: documentation whoever reads the report can open.

Reports travel (a ticket, a chat, a CI artifact): a ``file://`` link into the author's
checkout or a ``docs/...`` path relative to wherever the file was saved leads nowhere on
another machine, and a SARIF ``helpUri`` relative to the scanned repository points into
*that* repository. So links go to the published docs (the repository's default branch; the
anchors are finding codes and rule ids, which do not move), or to ``$CONSISTENCY_DOCS_URL``
(a mirror, or docs published next to the reports).
"""

from __future__ import annotations

import os

from consistency import HOME

DOCS_ENV = "CONSISTENCY_DOCS_URL"
PUBLISHED_DOCS = f"{HOME}/blob/main/docs/"


def docs_base() -> str:
    """Where finding docs live: $CONSISTENCY_DOCS_URL, else the project's published docs.

    A report is read by whoever it is sent to, on another machine: a ``file://`` link into
    the author's checkout, or a ``docs/`` path relative to wherever the page was saved,
    leads nowhere there. The published docs (the repository's default branch; anchors are
    finding codes, which do not move) can be read by anyone with the page."""
    env = os.environ.get(DOCS_ENV, "").strip()
    if env:
        return env if env.endswith("/") else env + "/"
    return PUBLISHED_DOCS


def doc_href(doc: str | None, base: str) -> str | None:
    """Resolve a finding's ``doc`` ('docs/findings.md#anchor') against base; None for anything odd."""
    if not doc or any(ch in doc for ch in "\"'<>\\ \t\r\n") or ":" in doc or doc.startswith("/"):
        return None
    rel = doc[len("docs/"):] if doc.startswith("docs/") else doc
    return base + rel


def published(doc: str | None) -> str | None:
    """``doc`` ('docs/rules/IDS002.md') as a link anyone can open, or None for anything odd."""
    return doc_href(doc, docs_base())
