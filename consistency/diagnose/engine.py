"""Turn a :class:`Comparison` into findings; the headline is built from them by
diagnose.summary once every finding is known (the report's metadata ones included).

Order: what makes every other finding moot first (the same file on both sides, conflicts
between the sources of what a slot should hold, a concatenation that disagrees with its
slots), then each result's findings (diagnose.results), what is missing or extra, and the
causes that span tensors (root cause first, the slot-list story).
"""

from __future__ import annotations

import os
from typing import Any

from consistency.compare.engine import Comparison, Status
from consistency.compare.types import CHECKED
from consistency.contract.codes import C
from consistency.contract.findings import CODES, Finding, Severity
from consistency.diagnose import causes, draft_steps, row_pairs, story, thin, words
from consistency.diagnose.evidence import Evidence
from consistency.diagnose.results import finding
from consistency.dump import names
from consistency.dump.reader import Dump

TOKEN_IDS = {names.INPUT_IDS, "token_ids"}  # which tokens a side ran, not what it computed


def explain(cmp: Comparison) -> tuple[list[Finding], story.Story | None]:
    """All findings of a comparison, and the slot-list story when there is one."""
    ev = Evidence(cmp)
    findings: list[Finding] = []
    actual: dict[int, int | None] = {}
    unexplained: dict[int, bool] = {}
    for r in cmp.results:
        f, stream = (row_pairs.unpaired_rows(r), None) if row_pairs.no_rows(r) else _result(ev, r)
        findings.extend(row_pairs.annotate(r, f))  # rows paired by anchor: what was compared, what one side has
        if r.slot is not None:
            actual[r.slot] = stream
            errors = [x.code for x in f if x.severity == Severity.error]
            unexplained[r.slot] = bool(errors) and set(errors) == {C.UNKNOWN}
    for name in cmp.plan.missing:
        findings.append(Finding.make(C.MISSING, f"{name}: the reference has it (or the contract expects it); "
                                     f"the candidate does not", tensor=None, expected=name))
    findings += _replicas(cmp) + _cand_claims(cmp)
    if not (type(cmp.cand) is type(cmp.ref) is Dump):  # rank/stage sets only: a plain compare never loads it
        from consistency.diagnose import layout

        findings[:0] = layout.findings(cmp.cand, "candidate") + layout.findings(cmp.ref, "reference")
    findings[:0] = _concat_checks(cmp) + _conflicts(cmp) + draft_steps.recycle_claims(cmp) + _same_input(cmp)
    sides, by_values = _sides(cmp), _swapped_by_values(cmp)
    findings[:0] = [f for f in sides if f.severity == Severity.error] + by_values  # a clear swap leads: it changes
    findings += [f for f in sides if f.severity != Severity.error]  # every reading (so do the values, said as such)
    checked = [r for r in cmp.results if r.status in CHECKED]
    if not any(r.name.split("#")[0] not in TOKEN_IDS for r in checked):  # equal token ids verify no activation
        only = "only token ids were compared, and " if checked else ""
        findings.append(Finding.make(C.NOTHING_COMPARED, f"{only}no tensor of the candidate could be compared with "
                                     f"the reference (reference: {_names(cmp.ref.names)}; candidate: "
                                     f"{_names(cmp.cand.names)})"))
    for name in cmp.plan.extra:
        findings.append(Finding.make(C.EXTRA, f"{name}: only in the candidate; not compared", tensor=name))
    findings = causes.group_consequences(cmp, findings)
    findings = draft_steps.group_steps(cmp, draft_steps.annotate_step0(cmp, findings))  # MTP, EAGLE-1, Medusa
    st = _story(cmp, ev, actual, unexplained)
    if st is not None and st.code != C.LAYER_MISMATCH:
        findings.insert(0, Finding.make(st.code, st.sentence, tensor=names.AUX, evidence=st.detail))
    lead = [f for f in findings if f.severity == Severity.error and CODES[f.code].leads]
    first = {id(f) for f in lead}
    return lead + [f for f in findings if id(f) not in first], st  # what changes every reading comes first


def _result(ev: Evidence, r: Any) -> tuple[list[Finding], int | None]:
    if r.status == Status.skipped:  # not evaluated: never OK; an error where the draft reads it
        sev = Severity.error if r.slot is not None else Severity.warning
        return [Finding.make(C.NOT_VERIFIED, f"{r.name}: not evaluated ({words.skipped(r.verdict.skipped)}), so it was not "
                             "verified", severity=sev, tensor=r.name, expected=r.expected)], None
    return finding(ev, r)


def _story(cmp: Comparison, ev: Evidence, actual: dict[int, int | None],
           unexplained: dict[int, bool]) -> story.Story | None:
    cand_side, ref_side = cmp.plan.cand.label, cmp.plan.ref.label
    slots = sorted((r for r in cmp.results if r.slot is not None), key=lambda r: r.slot or 0)
    if not slots or [r.slot for r in slots] != list(range(len(slots))):
        return None  # a story is about the slot list as a whole: slots missing in front are MISSING first
    expected = [r.expected_stream if not r.post_norm else None for r in slots]
    got = [actual.get(r.slot or 0) for r in slots]
    st = story.tell(expected, got, cand_side, ref_side, ev._num_layers())
    if st is None:  # a thin reference: where the slots lie between the streams it records (values, not claims)
        unexp = [unexplained.get(r.slot or 0, False) for r in slots]
        st = thin.story(ev, slots, unexp, cand_side, ref_side) or \
            thin.mixed(ev, slots, expected, got, unexp, cand_side, ref_side)
    claimed = cmp.plan.cand.claimed_streams
    if st is None and all(g is None for g in got) and claimed and len(claimed) == len(slots) \
            and not any(r.status in (Status.unpaired, Status.ok) for r in slots):
        st = story.tell(expected, claimed, cand_side, ref_side, ev._num_layers())  # values could not tell
        if st is not None:
            st.sentence += f" (from the streams {cand_side} claims in its metadata; the values did not identify them)"
            st.detail["claimed"] = True
    if st is None and any(x is None for x in expected):  # a thin reference: its own slots tell it
        st = story.tell_by_slot(*causes.slot_positions(cmp, slots), cand_side, ref_side)
    return st


def _conflicts(cmp: Comparison) -> list[Finding]:
    """Two sources that disagree on what a slot is: the stronger won, the other is named."""
    n = ev_n(cmp)
    out = []
    for c in cmp.plan.conflicts:  # about the sources, not a candidate tensor: the slot is in the evidence
        ev = {"slot": c.slot, "winner": c.winner.value, "by": c.by, **{k: v for k, v in c.detail.items()}}
        out.append(Finding.make(c.kind, words.conflict(c, n), tensor=None, evidence=ev))
    return out


def _cand_claims(cmp: Comparison) -> list[Finding]:
    """The candidate's claims are compared, never trusted: a slot whose values the reference's
    streams identify as another stream than the candidate claims is said (the values were used)."""
    claimed = cmp.plan.cand.claimed_streams
    if not claimed:
        return []
    out = []
    for r in sorted((r for r in cmp.results if r.slot is not None), key=lambda r: r.slot or 0):
        said = claimed[r.slot] if r.slot < len(claimed) else None
        held = r.holds_stream
        if said is None or held is None or said == held or r.holds == names.FINAL_NORM:
            continue
        out.append(Finding.make(C.CAND_CLAIM_CONTRADICTED, f"slot {r.slot} ({r.name}): the candidate claims stream "
                                f"{said}; its values are stream {held} (identified against the reference's recorded "
                                "streams), and the values are what was compared", tensor=r.name,
                                evidence={"slot": r.slot, "claimed": said, "values": held}))
    return out


def ev_n(cmp: Comparison) -> int | None:
    return cmp.plan.num_layers if cmp.plan.num_layers is not None else cmp.plan.cand.num_layers


def _same_input(cmp: Comparison) -> list[Finding]:
    """A file compared with itself verifies nothing (and is not "swapped")."""
    a, b = cmp.ref.path, cmp.cand.path
    same_data = getattr(cmp.ref, "same_data", None)
    if cmp.ref is cmp.cand or (same_data is not None and same_data(cmp.cand)):  # in memory: the same tensors twice
        return [Finding.make(C.SAME_INPUT, f"the reference and the candidate are the same tensors in memory ({a} and "
                             f"{b} hold the same arrays): everything agrees with itself, so nothing was verified")]
    try:
        same = os.path.exists(a) and os.path.exists(b) and os.path.samefile(a, b)
    except OSError:
        same = False
    if not same:
        return []
    return [Finding.make(C.SAME_INPUT, f"the reference and the candidate are the same file ({a}): everything "
                         "agrees with itself, so nothing was verified")]


def _names(xs: list[str]) -> str:
    return (", ".join(xs[:6]) + (f", ... ({len(xs)} in all)" if len(xs) > 6 else "")) if xs else "none"


def _concat_checks(cmp: Comparison) -> list[Finding]:
    """A file holding both ``aux`` and ``aux.{i}``: they must agree with each other."""
    out = []
    for which, side in (("candidate", cmp.plan.cand), ("reference", cmp.plan.ref)):
        if not side.concat:
            continue
        bad = []
        for i, (part, slot) in enumerate(zip(side.concat, side.slots.values(), strict=False)):
            d = _read_distance(part, slot)
            floor = cmp.tol.dtype_floor(part.dtype, slot.dtype) / 20
            if d > floor:
                bad.append((i, d))
        if bad:
            where = ", ".join(f"slot {i} (token rel_diff {d:.3g})" for i, d in bad)
            out.append(Finding.make(C.AUX_CONCAT_MISMATCH, f"{which} 'aux' and its per-slot aux.{{i}} disagree at "
                                    f"{where}: which one did the draft get?", tensor=names.AUX if which == "candidate"
                                    else None, evidence={"side": which, "slots": [i for i, _ in bad]}))
    return out


def _read_distance(a: Any, b: Any) -> float:
    from consistency.compare import stream

    if (a.rows, a.cols) != (b.rows, b.cols):
        return float("inf")
    m = stream.measure([(a, b, 0.0, 0.0)])[0]
    return m.token_rel_diff if m.nonfinite_ref == m.nonfinite_cand == 0 else float("inf")


def _sides(cmp: Comparison) -> list[Finding]:
    """Metadata that says the reference is the serving side, or the candidate the training
    side: the arguments are probably swapped (both sides training: maybe, say so)."""
    r, c = cmp.plan.ref.side, cmp.plan.cand.side
    if _same_input(cmp):
        return []
    if r == "serving" or c == "training":
        clear = (r, c) == ("serving", "training")  # both files say so: every expected/holds below reads backwards
        how = "look swapped" if (r, c) != ("training", "training") else "may be swapped (both files say training)"
        return [Finding.make(C.SIDES_SWAPPED, f"the reference's metadata says {r or 'nothing'} and the candidate's "
                             f"{c or 'nothing'}: the arguments {how} (expected TRAINING first, SERVING second); "
                             f"if so, read expected/holds below the other way round",
                             severity=Severity.error if clear else None)]
    return []


MAX_SWAP_READS = 512  # slot x stream reads a values-only swap check may make (a thin reference has few slots)


def _swapped_by_values(cmp: Comparison) -> list[Finding]:
    """No file says which side it is (hand-written npz, foreign dumps), but the values can: the
    reference records only aux slots (as a server's dump does), the candidate every stream (as
    training's does), and the reference's failing slots equal streams the candidate recorded.
    Said with what each slot equals on both sides, read by the candidate's own stream names
    (compared by values, never trusted): the distance between the two slot lists holds in either
    reading; which side is training is the part the values cannot prove, so the swap is said as
    "if". An error that leads, as a swap both files state: it changes how every slot below reads."""
    if cmp.plan.ref.side or cmp.plan.cand.side:
        return []  # metadata spoke: _sides says it
    hidden = [n for n in cmp.cand.names if names.parse(n).kind == names.HIDDEN]
    if not hidden or any(names.parse(n).kind == names.HIDDEN for n in cmp.ref.names):
        return []
    bad = [r for r in cmp.results if r.slot is not None and r.ref is not None and r.status not in (Status.ok,)
           and r.status in CHECKED]
    if not bad or 2 * len(bad) * len(hidden) > MAX_SWAP_READS:
        return []

    def nearest(view: Any) -> str | None:
        floor = cmp.tol.dtype_floor(view.dtype, view.dtype)
        near = [(d, n) for n in hidden if (d := _read_distance(view, cmp.cand[n])) <= floor]
        return min(near)[1] if near else None

    equal: list[str] = []
    ref_at, cand_at = [], []
    for r in sorted(bad, key=lambda r: r.slot or 0):
        got = nearest(r.ref)
        if got is None:
            return []  # a slot the candidate's streams do not hold: no evidence either way
        equal.append(f"reference {r.ref.name} = candidate {got}")
        ref_at.append(names.stream_of(got))
        cand_at.append(nearest(r.cand) if r.cand is not None else None)
    held = [names.stream_of(c) if c is not None else None for c in cand_at]
    apart = {h - s for h, s in zip(held, ref_at, strict=True) if h is not None and s is not None}
    rel = ""
    if len(apart) == 1 and None not in held:
        d = apart.pop()
        rel = (f"; the candidate's own slots hold its streams {held}: each is {abs(d)} stream"
               f"{'s' if abs(d) != 1 else ''} {'later' if d > 0 else 'earlier'} than the reference's") if d else ""
    return [Finding.make(C.SIDES_SWAPPED, "no file says which side it is; by the values, the reference's slots equal "
                         "streams the candidate recorded (" + "; ".join(equal) + ")" + rel + ". The reference "
                         "records only aux slots, as a server's dump does, and the candidate every stream, as "
                         "training's does: if so, the arguments are swapped (TRAINING first) and expected/holds "
                         "below read the other way round", severity=Severity.error,
                         evidence={"by": "values", "equal": equal, "reference_streams": ref_at,
                                   "candidate_streams": held})]


def _replicas(cmp: Comparison) -> list[Finding]:
    """Tensor-parallel copies that should be identical and are not (rank files only)."""
    out = []
    for which, d in (("candidate", cmp.cand), ("reference", cmp.ref)):
        for name, (spread, rank) in sorted(d.replica_checks.items()):
            v = d.tensors.get(name)
            floor = cmp.tol.dtype_floor(v.dtype, v.dtype) if v is not None else 0.0
            if spread > floor:
                out.append(Finding.make(C.REPLICA_MISMATCH, f"{which} {name}: rank {rank}'s copy differs from rank 0's "
                                        f"(token rel_diff {spread:.3g} > {floor:g}); a replicated tensor should be "
                                        f"identical on every rank", tensor=name if which == "candidate" else None,
                                        metrics={"rank": rank, "token_rel_diff": float(f"{spread:.4g}")}))
    return out


