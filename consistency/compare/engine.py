"""Compare two dumps: the stages in order, each returning a value the next ones read.

    sides -> sample the reference slots -> what they hold -> plan (the evidence model)
    -> rows -> sample -> identify -> measure -> judge -> recycled state -> Comparison

The result is numbers, not words: :class:`Comparison` holds every entry's
:class:`~consistency.compare.result.Result` (frozen) and what every stage noted;
``consistency.diagnose`` turns them into findings. Keeping the two apart lets the
diagnosis test explanations on the same sampled evidence without re-reading the dumps.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from consistency.compare import identify, judge, plan as planner, precision, refslots, rows as rowpair, screen, sides
from consistency.compare import steps
from consistency.compare.context import Context, key
from consistency.compare.result import (  # noqa: F401 - re-exported: the value types of a comparison
    CLEAR_BEST_RATIO, DRIFT_TOKEN_CAP, DRIFT_WITHOUT_GAP, MATCH_FACTOR, MAX_BAD_FRACTION, TOKEN_FACTOR,
    ProgressFactory, Result)
from consistency.compare.sample import Sampler, unique
from consistency.compare.tolerance import ToleranceModel
from consistency.compare.types import Declared, Note, Pair, Status  # noqa: F401 - Status re-exported
from consistency.dump import names
from consistency.dump.reader import Dump


@dataclass(frozen=True)
class Comparison(Context):
    results: tuple[Result, ...] = ()
    seconds: float = 0.0

    def pair_floor(self, r: Result, gap: float | None = None, user: bool = True) -> tuple[float, Note]:
        """The noise floor of one result's pair (Context.noise_floor)."""
        return self.noise_floor(r.name, r.ref, r.cand, gap, user)

    def result(self, name: str) -> Result | None:
        return next((r for r in self.results if r.name == name), None)

    @property
    def ref_slot_names(self) -> list[str | None]:
        """What each reference slot is by its values (its canonical name), by slot index."""
        n = self.plan.ref.slot_count
        by = {s.index: s.values for s in self.plan.ref_slots}
        return [by.get(i) for i in range(n)]


def compare(ref: Dump, cand: Dump, contract: object | None = None, tol: ToleranceModel | None = None,
            progress: ProgressFactory | None = None, budget_bytes: int = identify.DEFAULT_BUDGET,
            declared: Declared | None = None) -> Comparison:
    """``contract`` (an AuxContract) or ``declared`` (what the user declares: a contract or
    ``--layer-ids`` already turned into meanings) is the user's word; the reference's values
    and claims outrank it (compare.expect)."""
    t0 = time.perf_counter()
    tol = tol or ToleranceModel()
    dumps = Pair(ref, cand)
    dec, dec_layers = planner.declared_from_contract(contract) if declared is None else (declared, None)
    width = contract.slots[0].width if contract is not None and contract.slots[0].width else None  # type: ignore[attr-defined]
    n_hint = len(dec.slots) if dec.slots else None
    facts = sides.describe_pair(ref, cand, width, n_hint)
    sampler = Sampler(budget_bytes)

    # what the reference's own slots hold decides what the candidate's should
    ref_pool = unique([v for v in list(ref.tensors.values()) + list(facts.ref.slots.values())])
    slot_shapes = {key(v) for v in facts.ref.slots.values() if v.is_float and v.cols > 1}
    # a slot with fewer rows than the streams (training drops the last row: shift pairing) is
    # identified against the streams' first rows (row r of a draft's step 0 is position r)
    heads = [rowpair.prefix(v, r) for v in ref.tensors.values() if v.is_float and v.cols > 1
             and names.parse(v.name).kind in (names.HIDDEN, names.FINAL_NORM)
             for r, c in slot_shapes if c == v.cols and 0 < r < v.rows]
    cand_pre = [v for v in list(facts.cand.slots.values()) + list(cand.tensors.values()) if key(v) in slot_shapes]
    fp_ref0, _ = sampler.groups(ref_pool + heads, cand_pre, slot_shapes)
    n_layers = next((n for n in (facts.ref.num_layers, dec_layers, sides.recorded_top(ref)) if n is not None), None)
    held, conflicts = refslots.identify_slots(facts.ref, fp_ref0, tol, n_layers)
    plan = planner.build(dumps, facts, held, conflicts, dec, n_layers)

    paired, made, row_notes = rowpair.pair(dumps, plan)
    pool = rowpair.with_subsets(ref_pool, made)
    cand_views = [paired[e.name].cand for e in plan.entries]
    ref_fp, cand_fp = sampler.groups(pool, cand_views)
    labels = {("ref", v.name): v.dtype for v in pool if v.is_float and v.cols > 1} | \
        {("cand", v.name): v.dtype for v in cand_views if v.is_float and v.cols > 1}
    effective = precision.effective_dtypes({"ref": ref_fp, "cand": cand_fp}, labels)
    eff = Pair(effective["ref"], effective["cand"])
    held_as = sorted(set(eff.ref) | set(eff.cand))
    notes = tuple(row_notes) + ((Note.of("effective_dtype", tensors=held_as,
                                         dtypes=sorted(set(eff.ref.values()) | set(eff.cand.values()))),)
                                if held_as else ())
    ctx = Context(dumps, plan, tol, Pair(ref_fp, cand_fp), eff, notes)

    idents = screen.identify_all(ctx, paired)
    pre = {e.name: judge.precheck(e, paired[e.name]) for e in plan.entries}
    metrics, exact = judge.measure(ctx, paired, pre, progress)
    verdicts = {e.name: judge.judge(ctx, e, paired[e.name], pre[e.name], metrics.get(e.name), exact.get(e.name),
                                    idents.get(e.name)) for e in plan.entries}
    held_steps = steps.resolve(ctx, paired)
    results = tuple(Result(e, paired[e.name], verdicts[e.name], idents.get(e.name), metrics.get(e.name),
                           held_steps.get(e.name)) for e in plan.entries)
    return Comparison(dumps, plan, tol, ctx.fp, eff, notes, results=results, seconds=time.perf_counter() - t0)
