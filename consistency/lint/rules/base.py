"""A lint rule: data (code, severity, one-line title, source, fix) plus one small check.

Codes are stable and grouped by prefix, so ``--select IDS`` picks every layer-id rule the
way ruff's selectors do. Each rule has a page ``docs/rules/<CODE>.md`` with its source,
its fix and an example, and a failing and a passing test (tests/test_lint_rules.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from consistency.contract.findings import Severity
from consistency.lint.context import Context

E, W, I = Severity.error, Severity.warning, Severity.info  # noqa: E741


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

    @property
    def doc(self) -> str:
        return f"docs/rules/{self.code}.md"


def rule(code: str, name: str, severity: Severity, title: str, source: str, fix: str) -> Callable[
        [Callable[[Context], Iterable[Hit]]], Rule]:
    """Decorator: turn a check function into a :class:`Rule` (the function stays testable)."""
    def wrap(fn: Callable[[Context], Iterable[Hit]]) -> Rule:
        return Rule(code, name, severity, title, source, fix, fn)
    return wrap


def fmt_streams(streams: list[int] | None, n: int | None) -> str:
    """'[3, 31, 59] (layer 2's output, layer 30's output, layer 58's output)'."""
    from consistency.contract.resolve import describe_streams

    if streams is None:
        return "unknown"
    return f"{list(streams)} ({', '.join(describe_streams(streams, n))})" if streams else "[] (nothing)"
