"""The measuring and judging stages: full metrics for (candidate, expected), then a verdict.

ok: within the effective floor, every token within reach of it, and identified as the
expected tensor; drift: still the expected tensor, with error; bad_tokens: the tensor agrees
but a few positions do not; else mismatch. Identity is judged against noise, never against
a user tolerance: a tensor positively identified as another one fails whatever
``--tolerance``/``--threshold`` allow; within a tolerance but matching nothing, it is
``tolerated`` (a warning that says what it is not).
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from consistency.compare import identify, rowbar, stream
from consistency.compare.context import Context, key
from consistency.compare.metrics import PairMetrics, exact_compare
from consistency.compare.result import (CLEAR_BEST_RATIO, DRIFT_TOKEN_CAP, DRIFT_WITHOUT_GAP, MATCH_FACTOR,
                                        MAX_BAD_FRACTION, TOKEN_FACTOR, ProgressFactory)
from consistency.compare.tolerance import USER_FLOORS
from consistency.compare.types import Entry, Rows, Status, Verdict
from consistency.dump.reader import TensorView

MAX_EXACT_BYTES = 2 * 1024**3  # integer tensors compared exactly are read whole


def precheck(e: Entry, rw: Rows) -> Verdict | None:
    """A verdict that needs no metrics (nothing to compare with, shapes, empty, integers too
    large), else None."""
    cv, rv = rw.cand, rw.ref
    if rw.none_common:
        return Verdict(Status.unverified)  # rows paired by anchor, none in common
    if rv is None:
        return Verdict(Status.unverified if e.expect.tensor is not None or e.expect.stream is not None
                       else Status.unpaired)
    if cv.numel == 0 or rv.numel == 0:
        same = cv.numel == rv.numel == 0 and tuple(cv.shape) == tuple(rv.shape)
        return Verdict(Status.empty if same else Status.shape)
    if (cv.rows, cv.cols) != (rv.rows, rv.cols):
        return Verdict(Status.shape)
    if not (cv.is_float and rv.is_float) and max(cv.numel, rv.numel) * 8 > MAX_EXACT_BYTES:
        return Verdict(Status.skipped, skipped="int_too_large")
    return None


def measure(ctx: Context, rows: dict[str, Rows], pre: dict[str, Verdict | None],
            progress: ProgressFactory | None) -> tuple[dict[str, PairMetrics], dict[str, dict]]:
    """Streaming metrics for every float pair still to judge; exact comparison for integers."""
    jobs: dict[tuple[int, int], list[tuple[str, TensorView, TensorView, float, float]]] = defaultdict(list)
    exact: dict[str, dict] = {}
    for e in ctx.plan.entries:
        if pre[e.name] is not None:
            continue
        rw = rows[e.name]
        cv, rv = rw.cand, rw.ref
        assert rv is not None
        if not (cv.is_float and rv.is_float):
            exact[e.name] = exact_compare(rv.read_all().reshape(-1), cv.read_all().reshape(-1))
            continue
        rtol, atol = ctx.tol.element_tol(ctx.dtype("ref", rv), ctx.dtype("cand", cv))
        jobs[key(cv)].append((e.name, rv, cv, rtol, atol))
    total = sum(group[0][2].rows for group in jobs.values())
    tick = progress("measuring", total) if progress and total else None
    out: dict[str, PairMetrics] = {}
    for group in jobs.values():
        ms = stream.measure([(j[1], j[2], j[3], j[4]) for j in group], tick)
        for j, m in zip(group, ms, strict=True):
            out[j[0]] = m
    return out, exact


def judge(ctx: Context, e: Entry, rw: Rows, pre: Verdict | None, m: PairMetrics | None, ex: dict | None,
          ident: identify.Identification | None) -> Verdict:
    if pre is not None:
        if pre.status in (Status.unpaired, Status.unverified):
            matched = _matches_something(ctx, rw.cand, ident)
            return _with_holds(ctx, e, rw, Verdict(pre.status, matched=matched), ident)
        return pre
    if ex is not None:
        return Verdict(Status.ok if ex["mismatched"] == 0 else Status.exact_mismatch, exact=ex)
    assert m is not None and rw.ref is not None
    if m.nonfinite_cand or m.nonfinite_ref:
        return Verdict(Status.nonfinite)
    tol = ctx.tol
    gap = ident.gap if ident else None
    floor, floor_why = ctx.noise_floor(e.name, rw.ref, rw.cand, gap)
    noise = ctx.noise_floor(e.name, rw.ref, rw.cand, gap, user=False)[0]
    user = floor_why.key in USER_FLOORS
    d = m.token_rel_diff
    ident_ok = ident is None or ident.best is None or rw.ref.name in ident.group \
        or ident.best.name == rw.ref.name \
        or (ident.expected_distance is not None and ident.expected_distance <= noise)
    matched = ident is not None and ident.best is not None and \
        ident.best.distance <= MATCH_FACTOR * ctx.noise_floor(e.name, rw.ref, rw.cand, user=False)[0]
    strict_bad = tol.elementwise_strict and m.mismatched > 0
    per_row = m.per_row if m.per_row is not None else np.zeros(0)
    bad = rowbar.bad_rows(per_row, floor, TOKEN_FACTOR, rw.ref)  # bounded by the distance between tokens too
    rest_ok = bool(per_row.size) and 0 < len(bad) <= MAX_BAD_FRACTION * per_row.size and \
        float(np.delete(per_row, bad).mean()) <= floor
    tolerated = False
    if d <= floor and ident_ok and not strict_bad and not len(bad):
        status = Status.ok
        tolerated = user and d > noise  # passes only because the user allowed it
    elif rest_ok and not strict_bad:
        status = Status.bad_tokens
    elif d <= floor and not ident_ok and not strict_bad and user and not matched:
        status, tolerated = Status.ok, True  # within the user's tolerance and positively nothing else
    elif ident_ok and d <= DRIFT_WITHOUT_GAP * floor and (gap is None or d < gap / 2) \
            and not (per_row.size and float(per_row.max()) > DRIFT_TOKEN_CAP * floor):
        status = Status.drift  # still closest to the expected tensor: the same tensor, with error
    elif ident_ok and _clear_best(rw, ident) and _adjacent_recorded(ctx, e, rw):
        status = Status.drift  # beyond 10x, but the expected stream is still clearly the nearest
    else:
        status = Status.mismatch  # (identified as another tensor within noise: whatever a tolerance says)
    v = Verdict(status, floor, floor_why, tuple(int(i) for i in bad), matched, tolerated)
    return _with_holds(ctx, e, rw, v, ident)


def _with_holds(ctx: Context, e: Entry, rw: Rows, v: Verdict, ident: identify.Identification | None) -> Verdict:
    """What the values say the candidate is, under its canonical name, once."""
    best = ident.best.name if ident and ident.best else None
    if v.status in (Status.ok, Status.drift, Status.bad_tokens) and rw.ref is not None and not v.tolerated:
        raw = best if ident and rw.ref.name in ident.group and best is not None else rw.ref.name
    else:
        raw = best if v.matched else None
    if raw is None:
        return v
    stream = ctx.stream_by_values(raw)
    if stream is None and rw.ref is not None and raw == rw.ref.name and not e.expect.post_norm:
        stream = e.expect.stream  # the expected tensor itself, whose stream the plan knows
    from dataclasses import replace

    return replace(v, holds=ctx.name_by_values(raw), holds_stream=stream, held=raw)


def _matches_something(ctx: Context, cand: TensorView, ident: identify.Identification | None) -> bool:
    """An unpaired slot *is* a reference tensor only when it is within noise of it."""
    if ident is None or ident.best is None:
        return False
    best = ctx.ref_view(ident.best.name)
    low = ctx.tol.dtype_floor(ctx.dtype("cand", cand), ctx.dtype("ref", best) if best is not None else "float32")
    return ident.best.distance <= MATCH_FACTOR * low


def _adjacent_recorded(ctx: Context, e: Entry, rw: Rows) -> bool:
    """Drift past 10x the floor needs the neighbouring streams in the reference to rule
    out an off-by-one: a thin reference cannot tell a one-layer offset from drift. Stream
    s + 1 may be missing only at the model's top, N from the plan (the metadata or a
    declaration): the highest stream a reference records is not the top."""
    s = e.expect.stream
    if s is None:
        return False
    have = ctx.recorded_streams(key(rw.cand))
    return (s - 1 in have or s == 0) and (s + 1 in have or (ctx.plan.num_layers is not None and s == ctx.plan.num_layers))


def _clear_best(rw: Rows, ident: identify.Identification | None) -> bool:
    """The expected tensor is the best match and the runner-up is clearly farther."""
    if ident is None or ident.best is None or rw.ref is None:
        return False
    conf = ident.confidence
    return rw.ref.name in ident.group and conf is not None and conf >= CLEAR_BEST_RATIO
