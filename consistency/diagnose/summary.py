"""The one-sentence headline, built once from the final findings (no prose is re-read).

It claims only what was verified: a pass says how many tensors were compared and what the
slots hold; anything not verified is said as such; a failure leads with what changes how
every other finding reads (the token story, a swap, a layout hole, a conflict), then the
slot-list story, then the first error.
"""

from __future__ import annotations

from consistency.contract.codes import C
from consistency.compare.engine import Comparison, Status
from consistency.contract.findings import CODES, Finding, Severity
from consistency.diagnose import story as story_mod
from consistency.dump import names


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def summarize(cmp: Comparison, findings: list[Finding], st: story_mod.Story | None,
              token_error: Finding | None = None, context_demoted: bool = False) -> str:
    errors = [f for f in findings if f.severity == Severity.error]
    warnings = [f for f in findings if f.severity == Severity.warning]
    body = _body(cmp, findings, errors, warnings, st)
    leading = next((f for f in errors if CODES[f.code].leads), None)
    if token_error is None:
        return body
    head = f"{token_error.code}: {token_error.message}"
    if body.startswith(head):  # the token error is itself the leading one: its headline is said once
        return body
    if leading is not None:  # a layout fact (a token no rank holds) explains the tokens
        return f"{body} -- {head}"
    # the token story comes first: it changes what every state means
    return head if context_demoted or head in body else f"{head} -- {body}"


def _body(cmp: Comparison, findings: list[Finding], errors: list[Finding], warnings: list[Finding],
          st: story_mod.Story | None) -> str:
    leading = next((f for f in errors if CODES[f.code].leads), None)
    if leading is not None:
        return _first(leading, errors)
    if st is not None and st.code != C.LAYER_MISMATCH:
        return st.sentence
    if not errors:
        return _pass(cmp, warnings)
    if st is not None and st.detail.get("actual") and None not in st.detail["actual"]:
        return st.sentence
    return _first(errors[0], errors)


def _first(first: Finding, errors: list[Finding]) -> str:
    more = f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})" if len(errors) > 1 else ""
    return f"{first.code}: {first.message}{more}"


def _held(held: list, slots: list, expected: list, cand_side: str, ref_side: str) -> str:
    """A slot whose values match but whose stream no recorded stream names is verified by value
    only: the headline says so rather than print it as a known stream. A slot that passes
    holding a stream the values cannot tell from the expected one (neighbours closer than the
    noise) is not said to hold the expected stream."""
    if None not in held and all(isinstance(h, int) for h in held) and None not in expected and held != expected:
        return (f"; {cand_side} slots hold streams {story_mod._fmt(held)}, which {ref_side}'s values cannot tell "
                f"apart within noise from the {story_mod._fmt(expected)} {ref_side} expects")
    if None not in held:
        return f"; {cand_side} slots hold streams {story_mod._fmt(held)} as {ref_side} expects"
    unnamed = [s for s, h in zip(slots, held, strict=True) if h is None]
    one = len(unnamed) == 1
    return (f"; {cand_side} slots match {ref_side}'s values; which stream slot{'' if one else 's'} "
            f"{story_mod._fmt(unnamed)} hold{'s' if one else ''} is not identified among the streams {ref_side} records")


def _pass(cmp: Comparison, warnings: list[Finding]) -> str:
    compared = [r for r in cmp.results if r.status in (Status.ok, Status.drift)]
    s = f"pass: {_count(len(compared), 'tensor')} compared"
    slots = sorted((r for r in cmp.results if r.slot is not None), key=lambda r: r.slot or 0)
    held: list = ["final_norm" if r.holds == names.FINAL_NORM else r.holds_stream for r in slots]
    cand_side, ref_side = cmp.plan.cand.label, cmp.plan.ref.label
    if slots and all(r.status in (Status.ok, Status.drift) and not r.tolerated for r in slots):
        s += _held(held, [r.slot for r in slots], [r.expected_stream for r in slots], cand_side, ref_side)
    elif slots:
        unverified = [r.slot for r in slots if r.status not in (Status.ok, Status.drift) or r.tolerated]
        s += f"; {cand_side} slots hold streams {story_mod._fmt(held)}; slot{'s' if len(unverified) != 1 else ''} " \
             f"{story_mod._fmt(unverified)} not verified against what {ref_side} expects"
    skipped = [r.name for r in cmp.results if r.status == Status.skipped]
    if skipped:
        s += f"; {_count(len(skipped), 'tensor')} not evaluated ({', '.join(skipped[:3])})"
    if warnings:
        s += f" ({_count(len(warnings), 'warning')})"
    return s
