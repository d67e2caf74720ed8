"""Turn a :class:`Comparison` into findings: test explanations, keep the one that holds.

An explanation *holds* when, once applied, the candidate is as close to the reference as
noise allows (exact hypotheses), or at least several times closer than before (hypotheses
inferred without the parts that would prove them, flagged ``approximate``). Among those
that hold, the one that explains most (smallest residual metric) wins.
"""

from __future__ import annotations

import math

from consistency.compare.engine import Comparison, Result
from consistency.compare.tolerance import AMBIGUOUS_RATIO, DRIFT_ERROR_FACTOR
from consistency.contract.findings import Finding, Severity
from consistency.diagnose import hypotheses, story
from consistency.diagnose.evidence import Evidence, Explanation
from consistency.dump import names

HOLD_FACTOR = 3.0  # an exact explanation must leave at most 3x the noise floor
APPROX_FACTOR = 0.5  # an approximate one must at least halve the distance (and pass its own checks)


def explain(cmp: Comparison) -> tuple[list[Finding], str]:
    """All findings of a comparison and the one-sentence summary for the top of the report."""
    ev = Evidence(cmp)
    findings: list[Finding] = []
    actual: dict[int, int | None] = {}
    for r in cmp.results:
        f, stream = _finding(ev, r)
        findings.extend(f)
        if r.slot is not None:
            actual[r.slot] = stream
    for name in cmp.plan.missing:
        findings.append(Finding.make("MISSING", f"{name}: the reference has it (or the contract expects it); "
                                     f"the candidate does not", tensor=None, expected=name))
    findings += _replicas(cmp)
    if not cmp.results:
        findings.append(Finding.make("NOTHING_COMPARED", f"no tensor of the candidate pairs with the reference "
                                     f"(reference: {', '.join(cmp.ref.names[:6]) or 'none'}; candidate: "
                                     f"{', '.join(cmp.cand.names[:6]) or 'none'})"))
    for name in cmp.plan.extra:
        findings.append(Finding.make("EXTRA", f"{name}: only in the candidate; not compared", tensor=name))
    cand_side, ref_side = _side(cmp, "cand"), _side(cmp, "ref")
    slots = sorted((r for r in cmp.results if r.slot is not None), key=lambda r: r.slot or 0)
    expected = [r.expected_stream if r.expected_stream is not None else cmp.stream_of(r.expected) for r in slots]
    got = [actual.get(r.slot or 0) for r in slots]
    st = story.tell(expected, got, cand_side, ref_side, ev._num_layers())
    claimed = cmp.plan.cand.claimed_streams
    if st is None and slots and all(g is None for g in got) and claimed and len(claimed) == len(slots):
        st = story.tell(expected, claimed, cand_side, ref_side, ev._num_layers())  # values could not tell
        if st is not None:
            st.sentence += f" (from the streams {cand_side} claims in its metadata; the values did not identify them)"
            st.detail["claimed"] = True
    if st is not None and st.code != "LAYER_MISMATCH":
        findings.insert(0, Finding.make(st.code, st.sentence, tensor=names.AUX, evidence=st.detail))
    for f in findings:
        f.identified_as = cmp.canonical(f.identified_as)
    return findings, _summary(cmp, findings, st, cand_side, ref_side)


def _replicas(cmp: Comparison) -> list[Finding]:
    """Tensor-parallel copies that should be identical and are not (rank files only)."""
    out = []
    for which, d in (("candidate", cmp.cand), ("reference", cmp.ref)):
        for name, (spread, rank) in sorted(getattr(d, "replica_checks", {}).items()):
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
    if r.status == "ok":
        stream = r.expected_stream if r.expected_stream is not None else cmp.stream_of(r.expected)
        ident = r.ref.name if r.ident is None else (r.identified if r.ref and r.ref.name in r.ident.group else r.ref.name)
        out.append(Finding.make("OK", f"{label} matches {r.expected} (token rel_diff "
                                f"{r.metrics.token_rel_diff:.2e} <= {r.floor:.1e}, {r.floor_why})" if r.metrics else
                                f"{label} equals {r.expected}", identified_as=ident, metrics=metrics, **base))
        if r.ref is not None and r.ref.dtype != r.cand.dtype:
            out.append(Finding.make("DTYPE_MISMATCH", f"{label} is {r.cand.dtype}, {r.expected} is {r.ref.dtype}; values "
                                    f"agree within {r.floor_why or 'exact equality'}", identified_as=ident, **base))
        if r.ident and r.slot is not None and (r.ident.confidence or math.inf) < AMBIGUOUS_RATIO:
            out.append(Finding.make("IDENTIFICATION_AMBIGUOUS", f"{label} matches {r.identified} but "
                                    f"{r.ident.runner_up.name if r.ident.runner_up else '?'} is only "
                                    f"{r.ident.confidence:.1f}x farther", identified_as=r.identified, metrics=metrics, **base))
        return out, stream
    if r.status == "unpaired":
        sev = Severity.error if r.slot is not None and cmp.plan.ref.slots else Severity.info
        best = r.identified
        msg = f"{label} has no reference to compare with ({r.why})"
        if best:
            msg += f"; it holds {ev.stream_name(best)}"
            stream = cmp.stream_of(best)
        code = "EXTRA" if r.slot is not None and cmp.plan.ref.slots else "OK"
        return [Finding.make(code, msg, severity=sev, identified_as=best, metrics=metrics, **base)], stream
    if r.status in ("shape", "empty"):
        code = "EMPTY" if r.status == "empty" else "SHAPE_MISMATCH"
        shp = lambda v: list(v.shape) if v is not None else None  # noqa: E731
        return [Finding.make(code, f"{label}: candidate shape {shp(r.cand)} vs reference {r.expected} {shp(r.ref)}",
                             metrics={"cand_shape": shp(r.cand), "ref_shape": shp(r.ref)}, **base)], None
    if r.status == "nonfinite":
        m = r.metrics
        assert m is not None
        sides = [f"{n} in the {side} (first at {metrics.get(key)})" for n, side, key in
                 ((m.nonfinite_cand, "candidate", "first_nonfinite_cand"), (m.nonfinite_ref, "reference", "first_nonfinite_ref"))
                 if n]
        return [Finding.make("NONFINITE", f"{label}: NaN/Inf values: " + "; ".join(sides), metrics=metrics, **base)], None
    if r.status == "exact_mismatch":
        ex = r.exact or {}
        return [Finding.make("MISMATCH", f"{label}: {ex.get('mismatched')} of {ex.get('numel')} values differ; first at "
                             f"{ex.get('first_mismatch_at')} (reference {ex.get('ref_value')}, candidate "
                             f"{ex.get('cand_value')})", metrics=ex, **base)], None
    return _explain(ev, r, label, base, metrics)


def _holds(x: Explanation, floor: float) -> bool:
    if x.approximate:
        return x.after <= APPROX_FACTOR * x.before
    return x.after <= HOLD_FACTOR * floor and x.after < x.before


def _explain(ev: Evidence, r: Result, label: str, base: dict, metrics: dict) -> tuple[list[Finding], int | None]:
    assert r.metrics is not None and r.ref is not None and r.floor is not None
    floor = max(r.floor, ev.cmp.tol.dtype_floor(r.ref.dtype, r.cand.dtype))
    tried = []
    for h in hypotheses.REGISTRY:
        x = h.test(ev, r)
        if x is not None:
            tried.append(x)
            if not x.approximate and x.after <= floor:
                break  # explained down to the noise floor: no other explanation can do better
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
    if r.status == "drift":
        sev = Severity.warning if d <= DRIFT_ERROR_FACTOR * r.floor else Severity.error
        gap = r.ident.gap if r.ident else None
        what = ev.stream_name(r.ref.name)
        near_other = f"; the nearest other stream is {gap:.2e} away" if gap else ""
        return [Finding.make("NUMERIC_DRIFT", f"{label} still holds {what} but differs by token rel_diff {d:.2e}, "
                             f"{d / r.floor:.0f}x its noise floor ({r.floor_why}){near_other}",
                             severity=sev, identified_as=r.expected, metrics=metrics, **base)], r.expected_stream
    near = ", ".join(f"{ev.cmp.canonical(x.name)} ({x.distance:.3g})" for x in (r.ident.ranking[:3] if r.ident else []))
    return [Finding.make("UNKNOWN", f"{label} differs from {ev.stream_name(r.expected or '')} (token rel_diff {d:.3g}) "
                         f"and no explanation "
                         f"holds; nearest: {near or 'none'}. {r.metrics.mismatch_sentence(r.cand.shape)}",
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
    errors = [f for f in findings if f.severity == Severity.error]
    warnings = [f for f in findings if f.severity == Severity.warning]
    n = len(cmp.results)
    if st is not None and st.code != "LAYER_MISMATCH":
        return st.sentence
    if not errors:
        slots = [r for r in cmp.results if r.slot is not None]
        streams = [r.expected_stream for r in slots]
        s = f"pass: {n} tensor{'s' if n != 1 else ''} compared"
        if slots:
            s += f"; {cand_side} slots hold streams {story._fmt(streams)} as {ref_side} expects"
        if warnings:
            s += f" ({len(warnings)} warning{'s' if len(warnings) != 1 else ''})"
        return s
    if st is not None:
        return st.sentence
    first = errors[0]
    more = f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})" if len(errors) > 1 else ""
    return f"{first.code}: {first.message}{more}"
