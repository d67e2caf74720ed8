"""Drafts beyond EAGLE-3 (MTP, EAGLE-1/2, Medusa): what their step-0 slot and per-step tensors are.

Three answers compare needs before diagnosis can speak (docs/methods.md, docs/format.md):

* **Which consumer.** The contract's ``consumer``, else the one a reference dump declares in
  ``metadata.extra["consumer"]`` (a ConsumerSpec as JSON, or just its kind), else none.
* **What ``aux.0`` should equal.** An MTP / EAGLE-1 / Medusa draft reads the target's last
  state *after* the final norm, fnorm(s=N) = ``final_norm``, not ``hidden.N``.
* **What ``recycle.k`` is.** The hidden state fed at step k >= 1 is resolved once, on each
  side, among the draft's own step k-1 outputs (``draft_norm.{k-1}`` = d_norm,
  ``draft_out.{k-1}`` = d_raw) and the target's state at the same rows (``aux.0`` /
  ``final_norm`` / ``hidden.N``); :class:`StepHeld` carries the answer in ``Result.step``.
  Each side is matched against its own tensors first, so a recycle rule is told apart even
  when an earlier step already diverged, then against the other side's (a thin reference
  that records only ``recycle.k`` is told by the candidate's own states, where they agree).
  Rows meet at equal anchors (``token_index``, compare/rows.py); when the reference has no
  row at the candidate's anchors (a serving step >= 1), only the candidate's own states are
  tried, and the recycle rule of the contract or either dump's consumer judges them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from pydantic import ValidationError

from consistency.compare import rows
from consistency.compare.identify import sample_index, token_distance
from consistency.contract import consumers
from consistency.contract.models import Consumer, ConsumerSpec, NormState, Recycle, SlotSpec
from consistency.dump import names
from consistency.dump.reader import Dump, TensorView

if TYPE_CHECKING:
    from consistency.compare.engine import Comparison

LAST_STATE = (Consumer.mtp, Consumer.eagle1, Consumer.medusa)  # one slot: the target's last state, post-norm
EXTRA_KEY = "consumer"  # metadata.extra["consumer"] of a reference dump (docs/format.md)
SAMPLE_ROWS = 512
MATCH_FACTOR = 3.0  # as compare.result.MATCH_FACTOR: a side "is" a source within 3x the noise floor
STEP_RANK = {names.DRAFT_IDS: 0, names.DRAFT_EMBED: 1, names.RECYCLE: 2, names.DRAFT_CAT: 3, names.DRAFT_OUT: 4,
             names.DRAFT_NORM: 5}
KIND_OF_SOURCE = {names.DRAFT_NORM: Recycle.d_norm, names.DRAFT_OUT: Recycle.d_raw}


@dataclass
class StepHeld:
    """What ``recycle.k`` holds on each side: a kind (d_norm, d_raw, target) and the tensor
    that showed it ("candidate:draft_norm.0", "reference:final_norm[+1]" for rows one later),
    matched row by row at equal anchors (``token_index``, compare/rows.py).

    ``own_only``: the reference has no row at the candidate's anchors (a serving step >= 1
    drafts from the sampled token), so only the candidate's own states could be tried;
    ``rule`` is then the judge: the recycle the contract, else either dump's declared
    consumer, says (None: nothing says it, so it is not verified)."""

    cand_kind: Recycle | None
    cand_source: str | None
    ref_kind: Recycle | None
    ref_source: str | None
    distances: dict[str, float] = field(default_factory=dict)  # candidate to each source tried (sample)
    own_only: bool = False
    rule: Recycle | None = None
    rule_origin: str = ""  # "the contract's mtp consumer", "the candidate metadata's mtp consumer", ...
    anchors: list[int] = field(default_factory=list)  # the candidate rows' anchors (first few), for the report


def consumer_of(contract: Any, ref: Dump) -> tuple[ConsumerSpec | None, str]:
    """The draft's consumer and where it came from ("contract" / "reference metadata")."""
    if contract is not None:
        return contract.consumer, "contract"
    spec = declared_consumer(ref)
    return (spec, "reference metadata") if spec is not None else (None, "")


def declared_consumer(d: Dump) -> ConsumerSpec | None:
    """``metadata.extra["consumer"]``: a ConsumerSpec object, or a kind ("mtp") read as that
    method's majority serving behaviour. Untrusted: anything else is ignored."""
    raw = d.metadata.extra.get(EXTRA_KEY) if d.metadata is not None else None
    try:
        if isinstance(raw, dict):
            return ConsumerSpec.model_validate(raw)
        if isinstance(raw, str):
            kind = Consumer(raw)
            rows = [r for r in consumers.rows(kind) if r.side == "serving" and r.max_version is None]
            return rows[0].spec() if rows else ConsumerSpec(kind=kind)
    except (ValidationError, ValueError):
        return None
    return None


def slot_expectation(ref: Dump, slot: SlotSpec, i: int, ref_slots: list[TensorView]) -> tuple[str | None, str]:
    """The reference tensor a post-norm slot should equal: ``final_norm``, else the
    reference's own slot i when its metadata says it is post-norm; None: not recorded."""
    what = f"fnorm(stream {slot.stream}), the target's final norm applied"
    if names.FINAL_NORM in ref.tensors:
        return names.FINAL_NORM, f"contract: {what}"
    meta = ref.metadata.tensors if ref.metadata else {}
    if i < len(ref_slots) and (tm := meta.get(ref_slots[i].name)) is not None and tm.norm == NormState.final_norm:
        return ref_slots[i].name, f"contract: {what} (the reference's {ref_slots[i].name} is marked post-norm)"
    return None, f"contract: {what}, which the reference does not record"


def last_state_default(ref: Dump, spec: ConsumerSpec | None, has_ref_slots: bool) -> tuple[str | None, str] | None:
    """No contract and no reference slot: a reference that declares a last-state consumer
    says its draft reads fnorm(s=N)."""
    if spec is None or spec.kind not in LAST_STATE or has_ref_slots or names.FINAL_NORM not in ref.tensors:
        return None
    return names.FINAL_NORM, f"reference metadata: a {spec.kind.value} draft reads fnorm(s=N) (final_norm)"


def step_missing(ref: Dump, cand: Dump, not_compared: list[str]) -> list[str]:
    """Per-step names the candidate should have had. A draft kind the candidate records is
    recorded for every step (one absent step is MISSING, not "not compared"); once it records
    any per-step tensor, the recycled state of every step the reference has is expected too."""
    kinds = {names.parse(n).kind for n in cand.tensors}
    steps = bool(kinds & set(names.DRAFT_KINDS))
    out = []
    for n in not_compared:
        kind = names.parse(n).kind
        if kind in names.DRAFT_KINDS and (kind in kinds or (steps and kind == names.RECYCLE)):
            out.append(n)
    return out


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


RULES = (Recycle.d_norm, Recycle.d_raw, Recycle.target)


def recycle_rule(cmp: Comparison) -> tuple[Recycle | None, str]:
    """The recycle rule and who says it: the contract, else the reference's declared
    consumer, else the candidate's (a runtime patch names the table row it serves)."""
    for spec, origin in ((cmp.plan.consumer, cmp.plan.consumer_origin), (declared_consumer(cmp.cand),
                                                                         "candidate metadata")):
        if spec is not None and spec.recycle in RULES:
            return spec.recycle, f"the {origin}'s {spec.kind.value} consumer"
    return None, ""


def resolve(cmp: Comparison) -> None:
    """Fill ``Result.step`` for every ``recycle.k`` (float, k >= 1) with rows: compared
    ones and, when the reference has no row at its anchors, the candidate's own."""
    rule, origin = recycle_rule(cmp)
    for r in cmp.results:
        n = names.parse(r.name)
        if n.kind != names.RECYCLE or not n.index or not r.cand.is_float or r.cand.rows == 0:
            continue
        k = n.index
        idx = sample_index(r.cand.rows, min(r.cand.rows, SAMPLE_ROWS))
        dr = cmp.dtype("ref", r.ref) if r.ref is not None else cmp.dtype("cand", r.cand)
        floor = cmp.tol.dtype_floor(cmp.dtype("cand", r.cand), dr)
        ck = rows.view_keys(r, "cand")
        at = [ck[int(i)] for i in idx]
        dist: dict[str, float] = {}
        own_only = r.ref is None and r.rows is not None and r.rows.compared == 0
        sides = [("candidate", cmp.cand)] + ([] if own_only else [("reference", cmp.ref)])
        cand_kind, cand_src = _identify(_rows(r.cand, idx), k, at, floor, sides, dist)
        ref_kind = ref_src = None
        if r.ref is not None and r.ref.is_float and r.ref.rows:
            ridx = sample_index(r.ref.rows, min(r.ref.rows, SAMPLE_ROWS))
            rk = rows.view_keys(r, "ref")
            ref_kind, ref_src = _identify(_rows(r.ref, ridx), k, [rk[int(i)] for i in ridx], floor,
                                          [("reference", cmp.ref), ("candidate", cmp.cand)], {})
        r.step = StepHeld(cand_kind, cand_src, ref_kind, ref_src, dist, own_only, rule, origin,
                          sorted({a for a, _ in at})[:rows.MAX_LISTED])


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


def _identify(x: np.ndarray, k: int, at: list[rows.Key], floor: float, sides: list[tuple[str, Dump]],
              dist: dict[str, float]) -> tuple[Recycle | None, str | None]:
    """The first side whose sources hold ``x`` (its own dump first) decides; row i of ``x``
    meets the source's row at anchor ``at[i]`` (+ the source's offset)."""
    for label, d in sides:
        best: tuple[float, str, Recycle] | None = None
        for name, off, kind in _sources(d, k):
            v = d.tensors[name]
            where = rows.row_map(d, v)
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
