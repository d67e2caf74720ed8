"""A lint rule: one row of data (code, severity, one-line title, source, fix, the drafts it
applies to) plus one small check.

Codes are stable and grouped by prefix, so ``--select IDS`` picks every layer-id rule the
way ruff's selectors do. Each rule's page ``docs/rules/<CODE>.md`` is generated from its row
and its hand-written why and example (lint/rules_doc.py, lint/pages/<CODE>.md), and it has a
failing and a passing test (tests/lint/test_lint_rules.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from consistency.contract.findings import Severity
from consistency.lint.context import Context

E, W, I = Severity.error, Severity.warning, Severity.info  # noqa: E741
# What kind of draft a rule concerns. EAGLE3: the aux streams, fc, vocabulary map and norm flags
# of a draft fed several target streams; for a draft that reads one last state (MTP, EAGLE-1,
# Medusa) such a rule is "not applicable", never passed (lint/engine.py not_applicable).
ANY, EAGLE3 = "any draft", "aux-stream drafts (EAGLE-3)"


@dataclass
class Hit:
    """One thing a rule found: the message, and where (file and config key) it lives."""

    message: str
    severity: Severity | None = None  # None: the rule's default
    key: str | None = None  # dotted config key, for the line number in SARIF/annotations
    file: Path | None = None  # default: the draft config
    fix: str | None = None  # a fix computed for this case (e.g. the ids to write)
    evidence: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Rule:
    code: str
    name: str  # kebab-case slug, e.g. ids-stream-mismatch
    severity: Severity
    title: str  # one line: what the rule flags
    source: str  # upstream path / PR the rule rests on
    fix: str
    check: Callable[[Context], Iterable[Hit]]
    applies_to: str = ANY

    @property
    def doc(self) -> str:
        return f"docs/rules/{self.code}.md"


def rule(code: str, name: str, severity: Severity, title: str, source: str, fix: str, applies_to: str = ANY) -> \
        Callable[[Callable[[Context], Iterable[Hit]]], Rule]:
    """Decorator: turn a check function into a :class:`Rule`, the rule's one row (the function stays testable)."""
    def wrap(fn: Callable[[Context], Iterable[Hit]]) -> Rule:
        return Rule(code, name, severity, title, source, fix, fn, applies_to)
    return wrap


def fmt_streams(streams: list[int] | None, n: int | None) -> str:
    """'[3, 31, 59] (layer 2's output, layer 30's output, layer 58's output)'."""
    from consistency.contract.resolve import describe_streams

    if streams is None:
        return "unknown"
    return f"{list(streams)} ({', '.join(describe_streams(streams, n))})" if streams else "[] (nothing)"
