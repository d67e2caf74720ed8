"""Turn a :class:`Comparison` into findings: test explanations, keep the one that holds.

An explanation *holds* when, once applied, the candidate is as close to the reference as
noise allows (exact hypotheses), or at least several times closer than before (hypotheses
inferred without the parts that would prove them, flagged ``approximate``). Among those
that hold, the one that explains most (smallest residual metric) wins.
"""

from __future__ import annotations

import math

from typing import Any

from consistency.compare.engine import Comparison, Result, Status
from consistency.compare.tolerance import AMBIGUOUS_RATIO, DRIFT_ERROR_FACTOR
from consistency.contract.findings import Finding, Severity
from consistency.diagnose import causes, draft_steps, hypotheses, row_pairs, stale, story
from consistency.diagnose.evidence import Evidence, Explanation
from consistency.dump import names
from consistency.dump.reader import Dump

HOLD_FACTOR = 3.0  # an exact explanation must leave at most 3x the noise floor
EXPLAINS = 0.25  # ... and remove at least 3/4 of the difference (a 3.9e-5 -> 3.8e-5 "scale" explains nothing)
APPROX_FACTOR = 0.5  # an approximate one must at least halve the distance (and pass its own checks)


def explain(cmp: Comparison) -> tuple[list[Finding], str]:
    """All findings of a comparison and the one-sentence summary for the top of the report."""
    ev = Evidence(cmp)
    findings: list[Finding] = []
    actual: dict[int, int | None] = {}
    for r in cmp.results:
        f, stream = (row_pairs.unpaired_rows(r), None) if row_pairs.no_rows(r) else _finding(ev, r)
        findings.extend(row_pairs.annotate(r, f))  # rows paired by anchor: what was compared, what one side has
        if r.slot is not None:
            actual[r.slot] = stream
    for name in cmp.plan.missing:
        findings.append(Finding.make("MISSING", f"{name}: the reference has it (or the contract expects it); "
                                     f"the candidate does not", tensor=None, expected=name))
    findings += _replicas(cmp)
    if not (type(cmp.cand) is type(cmp.ref) is Dump):  # rank/stage sets only: a plain compare never loads it
        from consistency.dump.stages import layout_findings

        findings += layout_findings(cmp.cand, "candidate") + layout_findings(cmp.ref, "reference")
    findings[:0] = _concat_checks(cmp)  # first: the other findings depend on which one the draft got
    findings += _sides(cmp)
    if not any(r.status in (Status.ok, Status.drift, Status.bad_tokens, Status.mismatch, Status.nonfinite,
                            Status.exact_mismatch) for r in cmp.results):
        findings.append(Finding.make("NOTHING_COMPARED", f"no tensor of the candidate could be compared with the "
                                     f"reference (reference: {_names(cmp.ref.names)}; candidate: "
                                     f"{_names(cmp.cand.names)})"))
    for name in cmp.plan.extra:
        findings.append(Finding.make("EXTRA", f"{name}: only in the candidate; not compared", tensor=name))
    findings = causes.group_consequences(cmp, findings)
    findings = draft_steps.group_steps(cmp, draft_steps.annotate_step0(cmp, findings))  # MTP, EAGLE-1, Medusa
    cand_side, ref_side = _side(cmp, "cand"), _side(cmp, "ref")
    slots = sorted((r for r in cmp.results if r.slot is not None), key=lambda r: r.slot or 0)
    expected = [r.expected_stream if r.expected_stream is not None else cmp.stream_of(r.expected) for r in slots]
    got = [actual.get(r.slot or 0) for r in slots]
    st = story.tell(expected, got, cand_side, ref_side, ev._num_layers())
    claimed = cmp.plan.cand.claimed_streams
    if st is None and slots and all(g is None for g in got) and claimed and len(claimed) == len(slots) \
            and not any(r.status == Status.unpaired for r in slots):
        st = story.tell(expected, claimed, cand_side, ref_side, ev._num_layers())  # values could not tell
        if st is not None:
            st.sentence += f" (from the streams {cand_side} claims in its metadata; the values did not identify them)"
            st.detail["claimed"] = True
    if st is None and slots and any(x is None for x in expected):  # a thin reference: its own slots tell it
        st = story.tell_by_slot(*causes.slot_positions(cmp, slots), cand_side, ref_side)
    if st is not None and st.code != "LAYER_MISMATCH":
        findings.insert(0, Finding.make(st.code, st.sentence, tensor=names.AUX, evidence=st.detail))
    for f in findings:
        f.identified_as = cmp.canonical(f.identified_as)
    return findings, _summary(cmp, findings, st, cand_side, ref_side)


def _names(xs: list[str]) -> str:
    return (", ".join(xs[:6]) + (f", ... ({len(xs)} in all)" if len(xs) > 6 else "")) if xs else "none"


def _concat_checks(cmp: Comparison) -> list[Finding]:
    """A file holding both ``aux`` and ``aux.{i}``: they must agree with each other."""
    out = []
    for which, side in (("candidate", cmp.plan.cand), ("reference", cmp.plan.ref)):
        if not side.concat:
            continue
        bad = []
        for i, (part, slot) in enumerate(zip(side.concat, side.slots, strict=False)):
            d = _read_distance(part, slot)
            floor = cmp.tol.dtype_floor(part.dtype, slot.dtype) / 20
            if d > floor:
                bad.append((i, d))
        if bad:
            where = ", ".join(f"slot {i} (token rel_diff {d:.3g})" for i, d in bad)
            out.append(Finding.make("AUX_CONCAT_MISMATCH", f"{which} 'aux' and its per-slot aux.{{i}} disagree at "
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
    if r == "serving" or c == "training":
        how = "look swapped" if (r, c) != ("training", "training") else "may be swapped (both files say training)"
        return [Finding.make("SIDES_SWAPPED", f"the reference's metadata says {r or 'nothing'} and the candidate's "
                             f"{c or 'nothing'}: the arguments {how} (expected TRAINING first, SERVING second); "
                             f"if so, read expected/holds below the other way round")]
    return []


def _replicas(cmp: Comparison) -> list[Finding]:
    """Tensor-parallel copies that should be identical and are not (rank files only)."""
    out = []
    for which, d in (("candidate", cmp.cand), ("reference", cmp.ref)):
        for name, (spread, rank) in sorted(d.replica_checks.items()):
            v = d.tensors.get(name)
            floor = cmp.tol.dtype_floor(v.dtype, v.dtype) if v is not None else 0.0
            if spread > floor:
                out.append(Finding.make("REPLICA_MISMATCH", f"{which} {name}: rank {rank}'s copy differs from rank 0's "
                                        f"(token rel_diff {spread:.3g} > {floor:g}); a replicated tensor should be "
                                        f"identical on every rank", tensor=name if which == "candidate" else None,
                                        metrics={"rank": rank, "token_rel_diff": float(f"{spread:.4g}")}))
    return out


def _side(cmp: Comparison, which: str) -> str:
    meta = (cmp.cand if which == "cand" else cmp.ref).metadata
    if meta and meta.side in ("training", "serving"):
        return meta.side
    return "candidate" if which == "cand" else "reference"


def _slot_label(r: Result) -> str:
    return f"slot {r.slot} ({r.name})" if r.slot is not None else r.name


def _finding(ev: Evidence, r: Result) -> tuple[list[Finding], int | None]:
    """Findings for one result and the stream it was found to hold (for the story)."""
    cmp = ev.cmp
    base = {"tensor": r.name, "expected": r.expected}
    label = _slot_label(r)
    metrics = r.metrics.as_dict(r.cand.shape) if r.metrics else {}
    if r.ident and r.ident.best:
        metrics["identification"] = _ident_dict(r)
    if r.floor is not None:
        metrics.update(floor=r.floor, floor_source=r.floor_why)
    out: list[Finding] = []
    stream = None
    if r.status == Status.ok:
        held = r.holds
        stream = r.expected_stream if r.expected_stream is not None else cmp.stream_of(r.expected)
        if r.tolerated:
            stream = cmp.stream_of(held) if held else None
            what = f"holds {ev.stream_name(held)}" if held else "matches no recorded tensor within its noise floor"
            d = r.metrics.token_rel_diff if r.metrics else 0.0
            out.append(Finding.make("TOLERATED", f"{label} passes {r.floor_why} (token rel_diff {d:.3g}, beyond its "
                                    f"noise floor) but {what}; expected {ev.stream_name(r.expected or '')}",
                                    identified_as=held, metrics=metrics, **base))
            return out, stream
        out.append(Finding.make("OK", f"{label} matches {r.expected} (token rel_diff "
                                f"{r.metrics.token_rel_diff:.2e} <= {r.floor:.1e}, {r.floor_why})" if r.metrics else
                                f"{label} equals {r.expected}", identified_as=held, metrics=metrics, **base))
        if r.ref is not None and r.ref.dtype != r.cand.dtype:
            out.append(Finding.make("DTYPE_MISMATCH", f"{label} is {r.cand.dtype}, {r.expected} is {r.ref.dtype}; values "
                                    f"agree within {r.floor_why or 'exact equality'}", identified_as=held, **base))
        if r.ident and r.slot is not None and (r.ident.confidence or math.inf) < AMBIGUOUS_RATIO:
            out.append(Finding.make("IDENTIFICATION_AMBIGUOUS", f"{label} matches {r.identified} but "
                                    f"{r.ident.runner_up.name if r.ident.runner_up else '?'} is only "
                                    f"{r.ident.confidence:.1f}x farther", identified_as=r.identified, metrics=metrics, **base))
        return out, stream
    if r.status in (Status.unpaired, Status.unverified):
        return _unpaired(ev, r, label, base, metrics)
    if names.parse(r.name).kind in names.DRAFT_KINDS and (step := draft_steps.explain_step(ev, r, label, base, metrics)):
        return [step], None
    if r.status in (Status.shape, Status.empty):
        code = "EMPTY" if r.status == Status.empty else "SHAPE_MISMATCH"
        shp = lambda v: list(v.shape) if v is not None else None  # noqa: E731
        return [Finding.make(code, f"{label}: candidate shape {shp(r.cand)} vs reference {r.expected} {shp(r.ref)}",
                             metrics={"cand_shape": shp(r.cand), "ref_shape": shp(r.ref)}, **base)], None
    if r.status == Status.nonfinite:
        m = r.metrics
        assert m is not None
        sides = [f"{n} in the {side} (first at {metrics.get(key)})" for n, side, key in
                 ((m.nonfinite_cand, "candidate", "first_nonfinite_cand"), (m.nonfinite_ref, "reference", "first_nonfinite_ref"))
                 if n]
        return [Finding.make("NONFINITE", f"{label}: NaN/Inf values: " + "; ".join(sides), metrics=metrics, **base)], None
    if r.status == Status.exact_mismatch:
        ex = r.exact or {}
        return [Finding.make("MISMATCH", f"{label}: {ex.get('mismatched')} of {ex.get('numel')} values differ; first at "
                             f"{ex.get('first_mismatch_at')} (reference {ex.get('ref_value')}, candidate "
                             f"{ex.get('cand_value')})", metrics=ex, **base)], None
    zero = causes.zeroed(ev, r, label, base, metrics)
    if zero is not None:
        return [zero], None
    if r.status == Status.bad_tokens and (x := stale.bad_rows_stale(ev, r)) is not None:  # the named rows are stale
        return [Finding.make(x.code, f"{label} {x.message}", identified_as=x.identified_as, metrics=metrics,
                             evidence={"before": _g(x.before), "after": _g(x.after), **x.detail}, **base)], \
            r.expected_stream if r.expected_stream is not None else cmp.stream_of(r.expected)
    if r.status == Status.bad_tokens:
        return [causes.bad_tokens(ev, r, label, base, metrics)], \
            r.expected_stream if r.expected_stream is not None else cmp.stream_of(r.expected)
    return _explain(ev, r, label, base, metrics)


def _unpaired(ev: Evidence, r: Result, label: str, base: dict, metrics: dict) -> tuple[list[Finding], int | None]:
    """No reference to compare with: say what the values are, never call it OK."""
    cmp = ev.cmp
    held = r.identified if r.matched else None
    stream = cmp.stream_of(held) if held else None
    near = ", ".join(f"{cmp.canonical(x.name)} ({x.distance:.3g})" for x in (r.ident.ranking[:3] if r.ident else []))
    holds = f"it holds {ev.stream_name(held)}" if held else \
        f"it matches no reference tensor (nearest: {near or 'none comparable'})"
    if r.status == Status.unverified:
        want = story.describe(r.expected_stream or 0, ev._num_layers())
        if any(sp.index == r.slot and sp.post_norm for sp in cmp.plan.slots):
            want = f"fnorm(s={r.expected_stream}), the target's final norm applied to {want}"
        return [Finding.make("NOT_VERIFIED", f"{label} should hold {want}, which the reference does not record, so it "
                             f"was not verified; {holds}", identified_as=held, metrics=metrics, **base)], stream
    if held is None:
        return [Finding.make("UNMATCHED", f"{label} has no expected reference ({r.why}) and {holds}",
                             metrics=metrics, **base)], None
    claimed = _claimed_stream(cmp, r)
    if claimed is not None and stream is not None and claimed != stream:
        return [Finding.make("LAYER_MISMATCH", f"{label} claims stream {claimed} in its metadata but {holds}",
                             identified_as=held, metrics=metrics, evidence={"claimed": claimed, "stream": stream},
                             **base)], stream
    if r.slot is None:
        return [Finding.make("EXTRA", f"{label} has no reference of its name; {holds}", identified_as=held,
                             metrics=metrics, **base)], stream
    n_ref = len(cmp.plan.ref.slots) or len(cmp.plan.ref.claimed_streams or [])
    if n_ref and r.slot >= n_ref:  # the reference defines the slot list: one more changes fc's input width
        return [Finding.make("EXTRA", f"{label}: the reference has {n_ref} slot{'s' if n_ref != 1 else ''}, so the "
                             f"draft's fc takes {n_ref} x hidden; an extra slot changes its input width; {holds}",
                             severity=Severity.error, identified_as=held, metrics=metrics, **base)], stream
    return [Finding.make("EXPECTATION_UNKNOWN", f"{label}: {holds}; nothing says which stream it should hold "
                         f"({r.why})", identified_as=held, metrics=metrics, **base)], stream


def _claimed_stream(cmp: Comparison, r: Result) -> int | None:
    c = cmp.plan.cand.claimed_streams
    return c[r.slot] if r.slot is not None and c and r.slot < len(c) else None


def _holds(x: Explanation, floor: float) -> bool:
    """An explanation counts only when it removes most of the difference: exact ones
    down to the noise floor, approximate ones (no parts to prove them) by half."""
    if x.approximate:
        return x.after <= APPROX_FACTOR * x.before
    return x.after <= HOLD_FACTOR * floor and x.after <= EXPLAINS * x.before


def _explain(ev: Evidence, r: Result, label: str, base: dict, metrics: dict) -> tuple[list[Finding], int | None]:
    assert r.metrics is not None and r.ref is not None and r.floor is not None
    floor = max(r.floor, ev.cmp.noise_floor(r)[0]) if not r.floor_why.startswith(("rule ", "--threshold")) else \
        ev.cmp.noise_floor(r)[0]
    tried = []
    for h in hypotheses.REGISTRY:
        x = h.test(ev, r)
        if x is not None:
            tried.append(x)
            if not x.approximate and x.after <= floor and x.after <= EXPLAINS * x.before:
                break  # explained to the noise floor; the structural checks keep rivals (norm vs scale) apart
    held = [x for x in tried if _holds(x, floor)]
    metrics = dict(metrics, tried={x.code: {"before": _g(x.before), "after": _g(x.after)} for x in tried})
    if held:
        x = min(held, key=lambda x: (x.after > floor, x.approximate, x.after))
        stream = ev.cmp.stream_of(x.identified_as) if x.code == "LAYER_MISMATCH" else None
        ev_d = {"before": _g(x.before), "after": _g(x.after), "metric": "token_rel_diff (sampled rows)",
                "approximate": x.approximate, **x.detail}
        return [Finding.make(x.code, f"{label} {x.message}", identified_as=x.identified_as, metrics=metrics,
                             evidence=ev_d, **base)], stream
    d = r.metrics.token_rel_diff
    if r.status == Status.drift:
        strict = ev.cmp.tol.elementwise_strict and r.metrics.mismatched > 0  # --rtol/--atol: any element outside fails
        sev = Severity.warning if d <= DRIFT_ERROR_FACTOR * r.floor and not strict else Severity.error
        gap = r.ident.gap if r.ident else None
        what = ev.stream_name(r.ref.name)
        near_other = f"; the nearest other stream is {gap:.2e} away" if gap else ""
        return [Finding.make("NUMERIC_DRIFT", f"{label} still holds {what} but differs by token rel_diff {d:.2e}, "
                             f"{d / r.floor:.0f}x its noise floor ({r.floor_why}){near_other}"
                             + (f"; {r.metrics.mismatch_sentence(r.cand.shape)} (--rtol/--atol given)" if strict else ""),
                             severity=sev, identified_as=r.expected, metrics=metrics, **base)], r.expected_stream
    near = ", ".join(f"{ev.cmp.canonical(x.name)} ({x.distance:.3g})" for x in (r.ident.ranking[:3] if r.ident else []))
    thin = causes.thin_note(ev, r)
    return [Finding.make("UNKNOWN", f"{label} differs from {ev.stream_name(r.expected or '')} (token rel_diff {d:.3g}, "
                         f"{d / r.floor:.0f}x its floor) and no explanation holds; nearest: {near or 'none'}.{thin} "
                         f"{r.metrics.mismatch_sentence(r.cand.shape)}",
                         identified_as=None, metrics=metrics, **base)], None


def _g(v: float) -> float:
    return float(f"{v:.4g}") if math.isfinite(v) else 1e308


def _ident_dict(r: Result) -> dict:
    assert r.ident is not None
    conf = r.ident.confidence
    return {"best": r.ident.best.name if r.ident.best else None,
            "distance": _g(r.ident.best.distance) if r.ident.best else None,
            "same_as": r.ident.group[1:], "runner_up": r.ident.runner_up.name if r.ident.runner_up else None,
            "runner_up_distance": _g(r.ident.runner_up.distance) if r.ident.runner_up else None,
            "confidence": None if conf is None else _g(min(conf, 1e12)),
            "nearest": [[x.name, _g(x.distance)] for x in r.ident.ranking[:5]],
            "gap": None if r.ident.gap is None else _g(r.ident.gap)}


def _summary(cmp: Comparison, findings: list[Finding], st: story.Story | None, cand_side: str, ref_side: str) -> str:
    """One sentence that claims only what was verified."""
    errors = [f for f in findings if f.severity == Severity.error]
    warnings = [f for f in findings if f.severity == Severity.warning]
    if st is not None and st.code != "LAYER_MISMATCH":
        return st.sentence
    if not errors:
        compared = [r for r in cmp.results if r.status in (Status.ok, Status.drift)]
        n = len(compared)
        s = f"pass: {n} tensor{'s' if n != 1 else ''} compared"
        slots = sorted((r for r in cmp.results if r.slot is not None), key=lambda r: r.slot or 0)
        held: list = [cmp.stream_of(r.holds) if r.holds != names.FINAL_NORM else "final_norm" for r in slots]
        if slots and all(r.status in (Status.ok, Status.drift) and not r.tolerated for r in slots):
            s += f"; {cand_side} slots hold streams {story._fmt(held)} as {ref_side} expects"
        elif slots:
            unverified = [r.slot for r in slots if r.status not in (Status.ok, Status.drift) or r.tolerated]
            s += f"; {cand_side} slots hold streams {story._fmt(held)}; slot{'s' if len(unverified) != 1 else ''} " \
                 f"{story._fmt(unverified)} not verified against what {ref_side} expects"
        if warnings:
            s += f" ({len(warnings)} warning{'s' if len(warnings) != 1 else ''})"
        return s
    if st is not None and st.detail.get("actual") and None not in st.detail["actual"]:
        return st.sentence
    first = errors[0]
    more = f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})" if len(errors) > 1 else ""
    return f"{first.code}: {first.message}{more}"
