"""Findings for one result: what its verdict says, and the explanation that holds.

An explanation *holds* when, once applied, the candidate is as close to the reference as
noise allows (exact hypotheses), or at least several times closer than before (hypotheses
inferred without the parts that would prove them, flagged ``approximate``). Among those
that hold, the one that explains most (smallest residual metric) wins.
"""

from __future__ import annotations

import math

from consistency.compare.engine import DRIFT_TOKEN_CAP, Comparison, Result, Status
from consistency.compare.tolerance import AMBIGUOUS_RATIO, DRIFT_ERROR_FACTOR
from consistency.contract.codes import C
from consistency.contract.findings import Finding, Severity
from consistency.diagnose import causes, draft_steps, hypotheses, partial, rowgroups, rownames, stale, words
from consistency.diagnose.evidence import Evidence, Explanation
from consistency.dump import names

HOLD_FACTOR = 3.0  # an exact explanation must leave at most 3x the noise floor
EXPLAINS = 0.25  # ... and remove at least 3/4 of the difference (a 3.9e-5 -> 3.8e-5 "scale" explains nothing)
APPROX_FACTOR = 0.5  # an approximate one must at least halve the distance (and pass its own checks)
NOT_DRIFT = 10 * DRIFT_TOKEN_CAP  # a token 1,000x the floor is a different vector, never drift (issue 24)


def _slot_label(r: Result) -> str:
    return f"slot {r.slot} ({r.name})" if r.slot is not None else r.name


def finding(ev: Evidence, r: Result) -> tuple[list[Finding], int | None]:
    """Findings for one result and the stream it was found to hold (for the story)."""
    cmp = ev.cmp
    base = {"tensor": r.name, "expected": r.identity.canonical}
    label = _slot_label(r)
    metrics = rownames.annotate(cmp, r, r.metrics.as_dict(r.cand.shape)) if r.metrics else {}
    if r.ident and r.ident.best:
        metrics["identification"] = _ident_dict(r)
    if r.floor is not None:
        metrics.update(floor=r.floor, floor_source=words.floor(r.floor_why))
    out: list[Finding] = []
    stream = None
    if r.status == Status.ok:
        held = r.holds
        stream = r.expected_stream
        if r.tolerated:
            stream = r.holds_stream
            what = f"holds {ev.stream_name(held)}" if held else "matches no recorded tensor within its noise floor"
            d = r.metrics.token_rel_diff if r.metrics else 0.0
            gap = r.ident.gap if r.ident else None
            blind = gap is None or (r.floor is not None and r.floor >= gap)  # it cannot tell the neighbour apart
            why = (f"; the tolerance is at or above the gap to the nearest other stream ({gap:.3g}), so it cannot "
                   "tell the expected stream from its neighbour: nothing was verified" if gap is not None and blind
                   else "; the reference records no neighbouring stream to tell it from, so nothing was verified"
                   if blind else "")
            out.append(Finding.make(C.TOLERATED, f"{label} passes {words.floor(r.floor_why)} (token rel_diff {d:.3g}, beyond its "
                                    f"noise floor) but {what}; expected {ev.stream_name(r.expected or '')}{why}",
                                    severity=Severity.error if blind else None, identified_as=held, metrics=metrics,
                                    **base))
            return out, stream
        out.append(Finding.make(C.OK, f"{label} matches {r.expected} (token rel_diff "
                                f"{r.metrics.token_rel_diff:.2e} <= {r.floor:.1e}, {words.floor(r.floor_why)})" if r.metrics else
                                f"{label} equals {r.expected}", identified_as=held, metrics=metrics, **base))
        if r.ref is not None and r.ref.dtype != r.cand.dtype:
            out.append(Finding.make(C.DTYPE_MISMATCH, f"{label} is {r.cand.dtype}, {r.expected} is {r.ref.dtype}; values "
                                    f"agree within {words.floor(r.floor_why) or 'exact equality'}", identified_as=held, **base))
        if r.ident and r.slot is not None and (r.ident.confidence or math.inf) < AMBIGUOUS_RATIO:
            out.append(Finding.make(C.IDENTIFICATION_AMBIGUOUS, f"{label} matches {r.identified} but "
                                    f"{r.ident.runner_up.name if r.ident.runner_up else '?'} is only "
                                    f"{r.ident.confidence:.1f}x farther", identified_as=cmp.name_by_values(r.identified),
                                    metrics=metrics, **base))
        return out, stream
    if r.status in (Status.unpaired, Status.unverified):
        return _unpaired(ev, r, label, base, metrics)
    if r.identity.kind in names.DRAFT_KINDS and (step := draft_steps.explain_step(ev, r, label, base, metrics)):
        return [step], None
    if r.status in (Status.shape, Status.empty):
        code = C.EMPTY if r.status == Status.empty else C.SHAPE_MISMATCH
        shp = lambda v: list(v.shape) if v is not None else None  # noqa: E731
        return [Finding.make(code, f"{label}: candidate shape {shp(r.cand)} vs reference {r.expected} {shp(r.ref)}",
                             metrics={"cand_shape": shp(r.cand), "ref_shape": shp(r.ref)}, **base)], None
    if r.status == Status.nonfinite:
        m = r.metrics
        assert m is not None
        sides = [f"{n} in the {side} (first at {metrics.get(key)})" for n, side, key in
                 ((m.nonfinite_cand, "candidate", "first_nonfinite_cand"), (m.nonfinite_ref, "reference", "first_nonfinite_ref"))
                 if n]
        return [Finding.make(C.NONFINITE, f"{label}: NaN/Inf values: " + "; ".join(sides), metrics=metrics, **base)], None
    if r.status == Status.exact_mismatch:
        ex = r.exact or {}
        return [Finding.make(C.MISMATCH, f"{label}: {ex.get('mismatched')} of {ex.get('numel')} values differ; first at "
                             f"{ex.get('first_mismatch_at')} (reference {ex.get('ref_value')}, candidate "
                             f"{ex.get('cand_value')})", metrics=ex, **base)], None
    zero = causes.zeroed(ev, r, label, base, metrics)
    if zero is not None:
        return [zero], None
    if r.status == Status.bad_tokens and (x := stale.bad_rows_stale(ev, r)) is not None:  # the named rows are stale
        where, groups = rowgroups.provenance(ev, r, x.detail.get("stale_rows", []))
        return [Finding.make(x.code, f"{label} {x.message}{where}", identified_as=cmp.name_by_values(x.identified_as),
                             metrics=metrics, evidence={"before": _g(x.before), "after": _g(x.after), **x.detail,
                                                        **({"row_groups": groups} if groups else {})},
                             **base)], r.expected_stream
    if r.status == Status.bad_tokens and (g := rowgroups.explain(ev, r, label, base, metrics)) is not None:
        return [g], r.expected_stream  # each group of disagreeing rows, by provenance, holds something known
    if r.status == Status.bad_tokens:
        return [causes.bad_tokens(ev, r, label, base, metrics)], r.expected_stream
    return _explain(ev, r, label, base, metrics)


def _unpaired(ev: Evidence, r: Result, label: str, base: dict, metrics: dict) -> tuple[list[Finding], int | None]:
    """No reference to compare with: say what the values are, never call it OK."""
    cmp = ev.cmp
    held = r.holds if r.matched else None
    stream = r.holds_stream if held else None
    near = ", ".join(f"{cmp.name_by_values(x.name)} ({x.distance:.3g})" for x in (r.ident.ranking[:3] if r.ident else []))
    holds = f"it holds {ev.stream_name(held)}" if held else \
        f"it matches no reference tensor (nearest: {near or 'none comparable'})"
    if r.status == Status.unverified:
        want = words.meaning(r.expectation.meaning, ev._num_layers())
        return [Finding.make(C.NOT_VERIFIED, f"{label} should hold {want}, which the reference does not record, so it "
                             f"was not verified; {holds}", identified_as=held, metrics=metrics, **base)], stream
    if held is None:
        return [Finding.make(C.UNMATCHED, f"{label} has no expected reference ({words.why(r.expectation)}) and {holds}",
                             metrics=metrics, **base)], None
    if r.slot is None:
        return [Finding.make(C.EXTRA, f"{label} has no reference of its name; {holds}", identified_as=held,
                             metrics=metrics, **base)], stream
    n_ref = cmp.plan.ref.slot_count or len(cmp.plan.ref.claimed_streams or [])
    if n_ref and r.slot >= n_ref:  # the reference defines the slot list: one more changes fc's input width
        return [Finding.make(C.EXTRA, f"{label}: the reference has {n_ref} slot{'s' if n_ref != 1 else ''}, so the "
                             f"draft's fc takes {n_ref} x hidden; an extra slot changes its input width; {holds}",
                             severity=Severity.error, identified_as=held, metrics=metrics, **base)], stream
    claim = _claimed_stream(cmp, r)
    own = ""
    if claim is not None:  # compared, never trusted: say whether the values agree with it
        verdict = "which its values contradict" if stream is not None and claim != stream else \
            "which its values agree with" if stream == claim else "which nothing could check"
        own = f"; the candidate's own metadata claims stream {claim}, {verdict} (a side never certifies itself)"
    return [Finding.make(C.EXPECTATION_UNKNOWN, f"{label}: {holds}; nothing says which stream it should hold "
                         f"({words.why(r.expectation)}){own}, so it was not verified", identified_as=held,
                         metrics=metrics, **base)], stream


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
    floor = max(r.floor, ev.cmp.pair_floor(r)[0]) if not r.floor_user else \
        ev.cmp.pair_floor(r)[0]
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
        stream = ev.cmp.stream_by_values(x.identified_as) if x.code == C.LAYER_MISMATCH else None
        ev_d = {"before": _g(x.before), "after": _g(x.after), "metric": "token_rel_diff (sampled rows)",
                "approximate": x.approximate, **x.detail}
        return [Finding.make(x.code, f"{label} {x.message}", identified_as=ev.cmp.name_by_values(x.identified_as), metrics=metrics,
                             evidence=ev_d, **base)], stream
    d = r.metrics.token_rel_diff
    part = partial.find(ev, r)
    if part is not None and part.split:  # a block only partly there: a missing all-reduce / MoE combine, not drift
        return [Finding.make(C.PARTIAL_SHARD, f"{label} {partial.sentence(ev, part)}", metrics=metrics,
                             evidence={"layer": part.layer, "block": part.block, "block_output": part.tensor,
                                       "missing_share": _g(part.share), "split_cos": _g(part.cos),
                                       "partial_rows": part.partial_rows, "whole_rows": part.whole_rows,
                                       "sampled_rows": part.rows, "proven_by_ranks": part.proven_by,
                                       "approximate": not part.proven_by}, **base)], None
    rows = rowgroups.explain(ev, r, label, base, metrics, every_row=True)
    if rows is not None:  # too many rows differ for BAD_TOKENS, yet each group of them holds something known
        return [rows], None
    worst = float(r.metrics.per_row.max()) if r.metrics.per_row is not None and r.metrics.per_row.size else d
    if r.status == Status.drift and worst <= NOT_DRIFT * r.floor:
        strict = ev.cmp.tol.elementwise_strict and r.metrics.mismatched > 0  # --rtol/--atol: any element outside fails
        sev = Severity.warning if d <= DRIFT_ERROR_FACTOR * r.floor and not strict else Severity.error
        gap = r.ident.gap if r.ident else None
        what = ev.stream_name(r.ref.name)
        near_other = f"; the nearest other stream is {gap:.2e} away" if gap else ""
        return [Finding.make(C.NUMERIC_DRIFT, f"{label} still holds {what} but differs by token rel_diff {d:.2e}, "
                             f"{d / r.floor:.0f}x its noise floor ({words.floor(r.floor_why)}){near_other}"
                             + (f"; {words.mismatch(r.metrics, r.cand.shape)}{rownames.at_max(ev.cmp, r)} "
                                f"(--rtol/--atol given)" if strict else ""),
                             severity=sev, identified_as=r.holds or r.identity.canonical, metrics=metrics,
                             **base)], r.expected_stream
    other = _matched_other(ev, r, label, base, metrics) or causes.zero_rows(ev, r, label, base, metrics)
    if other is not None:
        return [other], r.holds_stream if other.code == C.LAYER_MISMATCH else None
    near = ", ".join(f"{ev.cmp.name_by_values(x.name)} ({x.distance:.3g})" for x in (r.ident.ranking[:3] if r.ident else []))
    thin = causes.thin_note(ev, r)
    return [Finding.make(C.UNKNOWN, f"{label} differs from {ev.stream_name(r.expected or '')} (token rel_diff {d:.3g}, "
                         f"{d / r.floor:.0f}x its floor) and no explanation holds; nearest: {near or 'none'}.{thin} "
                         f"{words.mismatch(r.metrics, r.cand.shape)}{rownames.at_max(ev.cmp, r)}",
                         identified_as=None, metrics=metrics, **base)], None


def _matched_other(ev: Evidence, r: Result, label: str, base: dict, metrics: dict) -> Finding | None:
    """The values positively say the candidate is another recorded tensor (within noise):
    name it, whatever no hypothesis could build (a cause on what was recorded, never UNKNOWN)."""
    if not r.matched or r.holds is None or r.ident is None or r.ident.best is None or \
            (r.ref is not None and r.ref.name in r.ident.group):
        return None
    d = r.ident.best.distance
    return Finding.make(C.LAYER_MISMATCH, f"{label} holds {ev.stream_name(r.holds)} (token rel_diff {d:.3g}, within "
                        f"its noise floor); expected {words.meaning(r.expectation.meaning, ev._num_layers())}",
                        identified_as=r.holds, metrics=metrics,
                        evidence={"stream": r.holds_stream, "expected_stream": r.expected_stream,
                                  "distance": _g(d)}, **base)


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


