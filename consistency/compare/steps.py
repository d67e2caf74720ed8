"""The recycled-state stage: what each side's ``recycle.k`` holds, and what it should hold.

A multi-step draft (MTP, EAGLE-1/2; docs/methods.md) is fed a hidden state at each step
k >= 1: its own step k-1 output after its final norm (``draft_norm.{k-1}`` = d_norm), before
it (``draft_out.{k-1}`` = d_raw), or the target's state at the same rows (``aux.0`` /
``final_norm`` / ``hidden.N``). Each side's ``recycle.k`` is matched against its *own*
tensors at equal anchors (``token_index``, compare/rows.py), so a recycle rule is told apart
even when an earlier step already diverged.

What it should hold follows the evidence model: the reference's values (its recycle.k equals
its own draft_norm/draft_out, or, for a thin reference that records only recycle.k, the
candidate's states at the same rows: a value comparison, which can name the cause but never
turn a difference into a pass), else the reference's declared consumer, else the user's
contract; never the candidate's claim, which is only carried to be compared
(``StepHeld.claimed_rule``). When the reference has no row at the candidate's anchors (a
serving step >= 1), only the candidate's own states are tried and that rule judges them.
"""

from __future__ import annotations

import numpy as np

from consistency.compare import rows as rowpair
from consistency.compare.context import Context
from consistency.compare.identify import sample_index, token_distance
from consistency.compare.result import MATCH_FACTOR
from consistency.compare.sides import declared_consumer
from consistency.compare.types import Key, Rows, Source, StepHeld
from consistency.contract.models import Recycle
from consistency.dump import names
from consistency.dump.reader import Dump, TensorView

SAMPLE_ROWS = 512
STEP_RANK = {names.DRAFT_IDS: 0, names.DRAFT_EMBED: 1, names.RECYCLE: 2, names.DRAFT_CAT: 3, names.DRAFT_OUT: 4,
             names.DRAFT_NORM: 5}
RULES = (Recycle.d_norm, Recycle.d_raw, Recycle.target)


def step_order(name: str | None) -> tuple[int, int] | None:
    """Forward order of the draft's tensors: step k's ids, embedding, hidden input (``aux.0``
    at step 0, ``recycle.k`` later), concatenation, output, normed output."""
    if name is None:
        return None
    n = names.parse(name)
    if n.kind == names.AUX and n.index == 0:
        return (0, STEP_RANK[names.RECYCLE])
    if n.kind in STEP_RANK and n.index is not None:
        return (n.index, STEP_RANK[n.kind])
    return None


def declared_rule(ctx: Context) -> tuple[Recycle | None, Source, str]:
    """The recycle rule the reference's consumer (else the user's) says; never the candidate's."""
    spec = ctx.plan.consumer
    if spec is not None and spec.recycle in RULES:
        return spec.recycle, ctx.plan.consumer_source, spec.kind.value
    return None, Source.none, ""


def resolve(ctx: Context, rows: dict[str, Rows]) -> dict[str, StepHeld]:
    """A StepHeld for every float ``recycle.k`` (k >= 1) with rows."""
    out: dict[str, StepHeld] = {}
    rule, source, kind = declared_rule(ctx)
    cand_spec = declared_consumer(ctx.cand)
    claimed = cand_spec.recycle if cand_spec is not None and cand_spec.recycle in RULES else None
    for e in ctx.plan.entries:
        n = e.identity  # the plan parsed the name (compare.plan.identity)
        rw = rows[e.name]
        cv = rw.cand
        if n is None or n.kind != names.RECYCLE or not n.index or not cv.is_float or cv.rows == 0:
            continue
        k = n.index
        idx = sample_index(cv.rows, min(cv.rows, SAMPLE_ROWS))
        dr = ctx.dtype("ref", rw.ref) if rw.ref is not None else ctx.dtype("cand", cv)
        floor = ctx.tol.dtype_floor(ctx.dtype("cand", cv), dr)
        ck = rowpair.view_keys(rw, "cand")
        at = [ck[int(i)] for i in idx]
        dist: dict[str, float] = {}
        own_only = rw.ref is None and rw.none_common
        x = _rows(cv, idx)
        cand_kind, cand_src = _identify(x, k, at, floor, "candidate", ctx.cand, dist)
        if cand_kind is None and not own_only:  # its own states absent or unlike: the reference's at the same rows
            cand_kind, cand_src = _identify(x, k, at, floor, "reference", ctx.ref, dist)
        ref_kind = ref_src = None
        if rw.ref is not None and rw.ref.is_float and rw.ref.rows:
            ridx = sample_index(rw.ref.rows, min(rw.ref.rows, SAMPLE_ROWS))
            rk = rowpair.view_keys(rw, "ref")
            y, rat = _rows(rw.ref, ridx), [rk[int(i)] for i in ridx]
            ref_kind, ref_src = _identify(y, k, rat, floor, "reference", ctx.ref, {})
            if ref_kind is None:  # a thin reference (recycle.k only): its values against the candidate's states
                ref_kind, ref_src = _identify(y, k, rat, floor, "candidate", ctx.cand, {})
        if ref_kind is not None:
            r_rule, r_source, r_kind = ref_kind, Source.ref_values, kind
        else:
            r_rule, r_source, r_kind = rule, source, kind
        out[e.name] = StepHeld(cand_kind, cand_src, ref_kind, ref_src, dist, own_only, r_rule, r_source, r_kind,
                               tuple(sorted({a for a, _ in at})[:rowpair.MAX_LISTED]), claimed)
    return out


def _rows(v: TensorView, idx: np.ndarray) -> np.ndarray:
    x = v.take_rows(idx, np.float64)
    x[~np.isfinite(x)] = 0.0
    return x


def _sources(d: Dump, k: int) -> list[tuple[str, int, Recycle]]:
    """(tensor, anchor offset, kind) a recycled state at step k may be: the draft's own step
    k-1 outputs at the same anchors, the target's last state at the same anchor or k later
    (TensorRT-LLM "MTP vanilla" feeds step k the target state of the token it embeds)."""
    out = [(names.draft(names.DRAFT_NORM, k - 1), 0, Recycle.d_norm),
           (names.draft(names.DRAFT_OUT, k - 1), 0, Recycle.d_raw)]
    n_layers = d.metadata.model.num_layers if d.metadata and d.metadata.model else None
    target = [names.aux(0), names.FINAL_NORM] + ([names.hidden(n_layers)] if n_layers else [])
    out += [(t, off, Recycle.target) for t in target for off in (0, k)]
    return [s for s in out if s[0] in d.tensors]


def _identify(x: np.ndarray, k: int, at: list[Key], floor: float, label: str, d: Dump,
              dist: dict[str, float]) -> tuple[Recycle | None, str | None]:
    """Which of the side's own sources holds ``x``; row i of ``x`` meets the source's row at
    anchor ``at[i]`` (+ the source's offset)."""
    best: tuple[float, str, Recycle] | None = None
    for name, off, kind in _sources(d, k):
        v = d.tensors[name]
        where = rowpair.row_map(d, v)
        got = [where.get((a + off, occ)) for a, occ in at]
        if v.cols != x.shape[1] or any(g is None for g in got):
            continue
        dd = token_distance(x, _rows(v, np.asarray(got, dtype=np.int64)))
        key = f"{label}:{name}" + (f"[+{off}]" if off else "")
        dist[key] = dd
        if best is None or dd < best[0]:
            best = (dd, key, kind)
    if best is not None and best[0] <= MATCH_FACTOR * floor:
        return best[2], best[1]
    return None, None
