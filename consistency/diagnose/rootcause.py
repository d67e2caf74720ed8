"""Root cause first: one divergence, every later difference named after it.

Streams (diagnose/causes.py) and a draft's per-step tensors (diagnose/draft_steps.py) share
this one mechanism; each supplies its own forward order and what counts as a consequence.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from consistency.contract.codes import C
from consistency.contract.findings import Finding, Severity


def fold_consequences(findings: list[Finding], order: Callable[[Finding], Any], follows: Callable[[Finding, Finding], bool],
                      where: Callable[[Finding], str], scope: str,
                      consequence_codes: tuple[str, ...],
                      root_ok: Callable[[Finding], bool] = lambda f: True) -> list[Finding]:
    """Root cause first, one mechanism for streams and draft steps: the earliest failing
    finding in ``order`` (a cause of its own preferred over a consequence code) stays, and
    every later error that ``follows(f, root)`` from it becomes ``PROPAGATED``, named after it."""
    placed = [(o, f) for f in findings if f.severity == Severity.error and (o := order(f)) is not None and root_ok(f)]
    if len(placed) < 2:
        return findings
    root_o, root = min(placed, key=lambda x: (x[0], x[1].code in consequence_codes))
    out: list[Finding] = []
    later: list[str] = []
    for f in findings:
        o = order(f)
        if f is not root and o is not None and o > root_o and f.severity == Severity.error and follows(f, root):
            later.append(f.tensor or "?")
            out.append(Finding.make(C.PROPAGATED, f"{f.tensor}: differs as a consequence of the first divergence at "
                                    f"{where(root)} ({root.code}); was: {f.message}", tensor=f.tensor,
                                    expected=f.expected, metrics=f.metrics,
                                    evidence={"root": where(root), "root_code": root.code, "was": f.code}))
        else:
            out.append(f)
    if later:
        root.message += f" -- the first divergence in {'the draft' + chr(39) + 's ' if scope == 'draft tensor' else ''}" \
                        f"forward order; {len(later)} later {scope}{'s' if len(later) != 1 else ''} differ as a " \
                        f"consequence ({', '.join(later[:6])}{', ...' if len(later) > 6 else ''})"
        root.evidence = dict(root.evidence, consequences=later)
        out.remove(root)
        out.insert(0, root)
    return out
