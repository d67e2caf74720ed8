"""Word what row pairing by anchor decided (compare/rows.py, compare/steps.py; issue 19).

* A pair compared on some anchors only: its finding says how many rows were compared and
  which anchors only one side has (e.g. the serving step 0's last row, drafted from the
  sampled token) -- never silently.
* A pair with no common anchor is NOT_VERIFIED, never OK: a warning for a draft step
  k >= 1 whose candidate rows all lie past the reference's last anchor (what a runtime
  drafts after the prompt, which no training reference holds), an error otherwise.
* ``recycle.k`` with no reference row is judged within the candidate: which of its own
  step k-1 states, at the same anchors, it was fed (``Result.step``), against the recycle
  rule of the contract or either dump's consumer -> OK / RECYCLE_NORM_MISSING /
  RECYCLE_NORM_APPLIED / RECYCLE_TARGET; nothing says the rule -> NOT_VERIFIED.
"""

from __future__ import annotations

import numpy as np

from consistency.compare.engine import Result, Status
from consistency.compare.plan import OWN_STEP
from consistency.compare.types import Source, StepHeld
from consistency.contract.codes import C
from consistency.contract.findings import Finding, Severity
from consistency.contract.models import Recycle
from consistency.diagnose import words
from consistency.dump import names

_WHAT = {Recycle.d_norm: "its own step {j} output after the draft's final norm (d_norm)",
         Recycle.d_raw: "its own step {j} output before the draft's final norm (d_raw)",
         Recycle.target: "the target's hidden state"}
_CODE = {(Recycle.d_raw, Recycle.d_norm): C.RECYCLE_NORM_MISSING,
         (Recycle.d_norm, Recycle.d_raw): C.RECYCLE_NORM_APPLIED}


def no_rows(r: Result) -> bool:
    """The pair shares no anchor: nothing of it was compared (compare.rows.pair), or it is a
    ``recycle.k`` the reference does not record (compare.plan OWN_STEP): judged within the
    candidate either way."""
    if r.why == OWN_STEP and r.step is not None:
        return True
    return r.rows is not None and r.rows.compared == 0 and r.status == Status.unverified


def _label(r: Result) -> str:
    return f"slot {r.slot} ({r.name})" if r.slot is not None else r.name


def _num(v: float | None) -> float | None:
    return float(f"{v:.4g}") if v is not None and np.isfinite(v) else None


def unpaired_rows(r: Result) -> list[Finding]:
    """Findings for a pair with no common anchor."""
    n = r.identity
    base = {"tensor": r.name, "expected": r.expected, "evidence": {"rows": r.rows.as_dict() if r.rows else None}}
    if n.kind == names.RECYCLE and n.index and r.step is not None:
        return [_recycle_own(r, n.index, base)]
    assert r.rows is not None
    late = n.kind in names.DRAFT_KINDS and n.kind != names.RECYCLE and bool(n.index) and r.rows.past_end
    msg = f"{_label(r)}: {words.no_rows(r.rows)}, so it was not compared"
    if late:
        msg += f"; what step {n.index} was fed is checked on {names.recycle(n.index)} against the candidate's " \
               "own states"
    return [Finding.make(C.NOT_VERIFIED, msg, severity=Severity.warning if late else None, **base)]


def _recycle_own(r: Result, k: int, base: dict) -> Finding:
    st = r.step
    assert st is not None
    where = f"anchor{'s' if len(st.anchors) > 1 else ''} {st.anchors}"
    held = f"{_WHAT[st.cand_kind].format(j=k - 1)} ({st.cand_source} at the same {where})" \
        if st.cand_kind is not None else f"none of the candidate's own states at the same {where}"
    why = words.no_rows(r.rows) if r.rows is not None else f"the reference records no {r.name}"
    head = f"{_label(r)} (the hidden state step {k} is fed): {why}; checked within the candidate: it is {held}"
    ev = dict(base.pop("evidence"), holds=st.cand_source, recycle=st.cand_kind.value if st.cand_kind else None,
              expected_recycle=st.rule.value if st.rule else None, rule_from=rule_origin(st) or None,
              candidate_claims=st.claimed_rule.value if st.claimed_rule else None,
              distances={key: _num(v) for key, v in st.distances.items()})
    own_name = {Recycle.d_norm: names.DRAFT_NORM, Recycle.d_raw: names.DRAFT_OUT}.get(st.rule) if st.rule else None
    own = f"candidate:{names.draft(own_name, k - 1)}" if own_name else ""
    if st.rule is None:
        claim = f" (the candidate's metadata claims {st.claimed_rule.value}; a side never certifies itself)" \
            if st.claimed_rule is not None else ""
        return Finding.make(C.NOT_VERIFIED, f"{head}; neither the reference (its values or its metadata) nor the "
                            f"contract says what the draft recycles, so it is not verified{claim} (give --contract, "
                            f"or a reference with per-step tensors or metadata.extra['consumer'])", evidence=ev, **base)
    rule = f"{rule_origin(st)} recycles {st.rule.value}"
    if st.cand_kind == st.rule:
        return Finding.make(C.OK, f"{head}, as {rule}", identified_as=_tensor(st.cand_source), evidence=ev, **base)
    if st.cand_kind is None:
        if own and own not in st.distances:
            return Finding.make(C.NOT_VERIFIED, f"{head}; {rule}, which the candidate does not record at these "
                                f"anchors ({own.split(':')[1]}), so it is not verified", evidence=ev, **base)
        gap = f" (token rel_diff {st.distances[own]:.3g} to {own.split(':')[1]})" if own in st.distances else ""
        return Finding.make(C.MISMATCH, f"{head}; {rule}, and it is not that state{gap}", evidence=ev, **base)
    code = _CODE.get((st.cand_kind, st.rule), C.RECYCLE_TARGET)
    return Finding.make(code, f"{head}, but {rule}", identified_as=_tensor(st.cand_source), evidence=ev, **base)


def rule_origin(st: StepHeld) -> str:
    """Who says the recycle rule, in words: the reference's own values, its consumer, the contract."""
    if st.rule_source == Source.ref_values:
        return "the reference's own recycle (its values)"
    if st.rule_source == Source.ref_claim:
        return f"the reference metadata's {st.rule_kind} consumer"
    if st.rule_source == Source.declared:
        return f"the contract's {st.rule_kind} consumer"
    return ""


def _tensor(source: str | None) -> str | None:
    return (source or "").split(":")[-1].split("[")[0] or None


def annotate(r: Result, findings: list[Finding]) -> list[Finding]:
    """Say on a pair's finding how its rows met: the counts always (``evidence.rows``), in
    the message when some anchors were one-sided."""
    if r.rows is None or no_rows(r):
        return findings
    for f in findings:
        if f.tensor == r.name:
            if r.rows.one_sided:
                f.message += f" -- {words.rows(r.rows)}"
            f.evidence = dict(f.evidence or {}, rows=r.rows.as_dict())
            break
    return findings
