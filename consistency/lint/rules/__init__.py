"""The lint rule registry and ruff-style selection (``--select IDS,SHP001 --ignore IDS005``)."""

from __future__ import annotations

from collections.abc import Iterable

from consistency.errors import UsageError
from consistency.lint.rules import eagle1, ids, mtp, norms, parallel, runtimes, serving, shapes, vocab
from consistency.lint.rules.base import Hit, Rule

REGISTRY: dict[str, Rule] = {r.code: r for m in (ids, shapes, vocab, norms, serving, parallel, mtp, eagle1, runtimes)
                           for r in m.RULES}

__all__ = ["REGISTRY", "Hit", "Rule", "select"]


def _matches(code: str, sel: str) -> bool:
    return sel == "ALL" or code.startswith(sel)


def _split(values: Iterable[str]) -> list[str]:
    return [p.strip().upper() for v in values for p in v.split(",") if p.strip()]


def select(chosen: Iterable[str] = (), ignored: Iterable[str] = ()) -> list[Rule]:
    """Rules whose code starts with a selected prefix and with no ignored one (default: all)."""
    sel, ign = _split(chosen) or ["ALL"], _split(ignored)
    by_name = {r.name.upper(): r.code for r in REGISTRY.values()}
    sel = [by_name.get(s, s) for s in sel]
    ign = [by_name.get(s, s) for s in ign]
    for s in (*sel, *ign):
        if s != "ALL" and not any(c.startswith(s) for c in REGISTRY):
            from consistency.errors import did_you_mean

            words = [*REGISTRY, *by_name, *{c[:3] for c in REGISTRY}]
            raise UsageError(f"unknown rule selector {s!r}; codes: {', '.join(sorted(REGISTRY))}"
                             f"{did_you_mean(s, words)}")
    return [r for c, r in sorted(REGISTRY.items())
            if any(_matches(c, s) for s in sel) and not any(_matches(c, s) for s in ign)]
