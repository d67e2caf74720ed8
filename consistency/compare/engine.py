"""Compare two dumps: align, fingerprint, identify, then measure what matters in full.

The result is numbers, not words: :class:`Comparison` holds every pair's metrics, every
candidate's identification and the fingerprints, and ``consistency.diagnose`` turns them
into findings. Keeping the two apart lets the diagnosis test explanations on the same
sampled evidence without re-reading the dumps.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from consistency.compare import align, identify, stream
from consistency.compare.metrics import PairMetrics, exact_compare
from consistency.compare.tolerance import ToleranceModel
from consistency.contract.models import AuxContract
from consistency.dump import names
from consistency.dump.reader import Dump, TensorView

DRIFT_WITHOUT_GAP = 10.0  # with no neighbour stream to measure against, drift stays within 10x the floor
CLEAR_BEST_RATIO = 1.5  # drift larger than the neighbour gap still counts as drift past this margin
ProgressFactory = Callable[[str, int], Callable[[int], None]]


@dataclass
class Result:
    """One candidate tensor against the reference tensor it should equal."""

    name: str
    cand: TensorView
    expected: str | None
    ref: TensorView | None
    slot: int | None = None
    expected_stream: int | None = None
    why: str = ""
    status: str = "pending"  # ok, drift, mismatch, shape, nonfinite, empty, unpaired, exact_mismatch
    metrics: PairMetrics | None = None
    exact: dict | None = None
    floor: float | None = None
    floor_why: str = ""
    ident: identify.Identification | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def identified(self) -> str | None:
        return self.ident.best.name if self.ident and self.ident.best else None


@dataclass
class Comparison:
    ref: Dump
    cand: Dump
    plan: align.Plan
    results: list[Result]
    tol: ToleranceModel
    ref_fp: dict[tuple[int, int], identify.Fingerprints]
    cand_fp: dict[tuple[int, int], identify.Fingerprints]
    ref_slot_streams: list[int | None]
    ref_slot_names: list[str | None] = field(default_factory=list)  # what each reference slot is
    seconds: float = 0.0

    def canonical(self, ref_name: str | None) -> str | None:
        """Prefer the meaningful name: a reference slot that equals ``hidden.3`` is ``hidden.3``."""
        if ref_name is None:
            return None
        n = names.parse(ref_name)
        if n.kind == names.AUX and n.index is not None and n.index < len(self.ref_slot_names):
            return self.ref_slot_names[n.index] or ref_name
        return ref_name

    def stream_of(self, ref_name: str | None) -> int | None:
        """Stream index a reference name stands for (``aux.i`` through the reference's own slots)."""
        if ref_name is None:
            return None
        s = names.stream_of(ref_name)
        if s is not None:
            return s
        n = names.parse(ref_name)
        if n.kind == names.AUX and n.index is not None and n.index < len(self.ref_slot_streams):
            return self.ref_slot_streams[n.index]
        return None


def _key(v: TensorView) -> tuple[int, int]:
    return (v.rows, v.cols)


def compare(ref: Dump, cand: Dump, contract: AuxContract | None = None, tol: ToleranceModel | None = None,
            progress: ProgressFactory | None = None, budget_bytes: int = identify.DEFAULT_BUDGET) -> Comparison:
    t0 = time.perf_counter()
    tol = tol or ToleranceModel()
    plan = align.build(ref, cand, contract)
    results: list[Result] = []
    for sp in plan.slots:
        rv = ref.tensors.get(sp.expected) if sp.expected else None
        if rv is None and sp.expected and sp.expected in {v.name for v in plan.ref.slots}:
            rv = next(v for v in plan.ref.slots if v.name == sp.expected)
        results.append(Result(sp.cand.name, sp.cand, sp.expected, rv, sp.index, sp.expected_stream, sp.why))
    for n, rv, cv in plan.pairs:
        results.append(Result(n, cv, n, rv, None, names.stream_of(n), "same name"))

    # fingerprints: every float reference tensor that shares (rows, cols) with a candidate
    ref_pool = _unique([v for v in list(ref.tensors.values()) + list(plan.ref.slots) if v.is_float and v.cols > 1])
    cand_float = [r.cand for r in results if r.cand.is_float and r.cand.cols > 1]
    groups: dict[tuple[int, int], tuple[list[TensorView], list[TensorView]]] = defaultdict(lambda: ([], []))
    for v in cand_float:
        groups[_key(v)][1].append(v)
    for v in ref_pool:
        if _key(v) in groups:
            groups[_key(v)][0].append(v)
    ref_fp: dict[tuple[int, int], identify.Fingerprints] = {}
    cand_fp: dict[tuple[int, int], identify.Fingerprints] = {}
    for key, (rviews, cviews) in groups.items():
        k = identify.sample_size(key[0], key[1], len(rviews) + len(cviews), budget_bytes)
        idx = identify.sample_index(key[0], k)
        ref_fp[key] = identify.Fingerprints(_unique(rviews), idx)
        cand_fp[key] = identify.Fingerprints(_unique(cviews), idx)

    ref_slot_streams, ref_slot_names = _reference_slots(plan, ref_fp, tol)
    for r in results:
        if r.slot is not None and r.expected_stream is None and r.expected:
            n = names.parse(r.expected)
            if n.kind == names.AUX and n.index is not None and n.index < len(ref_slot_streams):
                r.expected_stream = ref_slot_streams[n.index]
    _screen(results, ref_fp, cand_fp, tol)
    _measure(results, tol, progress)
    _judge(results, tol)
    cmp = Comparison(ref, cand, plan, results, tol, ref_fp, cand_fp, ref_slot_streams, ref_slot_names)
    cmp.seconds = time.perf_counter() - t0
    return cmp


def _unique(views: list[TensorView]) -> list[TensorView]:
    seen: dict[str, TensorView] = {}
    for v in views:
        seen.setdefault(v.name, v)
    return list(seen.values())


def _same_floor(tol: ToleranceModel) -> float:
    """References closer than this are one tensor (e.g. ``aux.0`` recorded beside ``hidden.0``)."""
    return tol.dtype_floor("float32", "bfloat16") / 20


def _reference_slots(plan: align.Plan, ref_fp: dict, tol: ToleranceModel) -> tuple[list[int | None], list[str | None]]:
    """What each reference aux slot holds: its claimed stream, else identified in the
    reference itself against its own streams and final norm (no metadata needed)."""
    streams: list[int | None] = []
    found_names: list[str | None] = []
    for i, v in enumerate(plan.ref.slots):
        claimed = plan.ref.claimed_streams[i] if plan.ref.claimed_streams and i < len(plan.ref.claimed_streams) else None
        fp = ref_fp.get(_key(v))
        found = None
        if fp is not None and v.name in fp:
            pool = [n for n in fp.names if names.parse(n).kind in (names.HIDDEN, names.FINAL_NORM)]
            if pool:
                ident = identify.rank(v.name, fp, fp, pool, _same_floor(tol))
                if ident.best and ident.best.distance <= tol.dtype_floor(v.dtype, "bfloat16"):
                    found = ident.best.name
        s_found = names.stream_of(found) if found else None
        tm = plan.ref_meta_tensors.get(v.name) if plan.ref_meta_tensors else None
        if (found is not None and s_found is None) or (tm is not None and tm.norm is not None and tm.norm.value != "none"):
            claimed = None  # a post-norm (or otherwise transformed) slot is not a pre-norm stream
        if claimed is not None and found is not None and s_found is not None and s_found != claimed:
            plan.notes.append(f"reference {v.name} claims stream {claimed} but holds {found}; using what it holds")
            claimed = s_found
        streams.append(claimed if claimed is not None else s_found)
        if found is None and claimed is not None and fp is not None and names.hidden(claimed) in fp:
            found = names.hidden(claimed)
        found_names.append(found)
    return streams, found_names


def _screen(results: list[Result], ref_fp: dict, cand_fp: dict, tol: ToleranceModel) -> None:
    """Rank references for every float candidate on the sample (slots always, pairs when off)."""
    for r in results:
        if not (r.cand.is_float and r.cand.cols > 1) or _key(r.cand) not in ref_fp:
            continue
        rfp, cfp = ref_fp[_key(r.cand)], cand_fp[_key(r.cand)]
        same = _same_floor(tol)
        expected_in = r.expected is not None and r.ref is not None and r.ref.name in rfp
        if expected_in and r.slot is None:
            d = cfp.distance(r.cand.name, r.ref.name, rfp)
            if d <= tol.dtype_floor(r.ref.dtype, r.cand.dtype):
                continue  # same-name pair that already agrees: no identification needed
        pool = list(rfp.names)
        r.ident = identify.rank(r.cand.name, cfp, rfp, pool, same)
        if expected_in:
            r.ident.expected = r.ref.name
            r.ident.expected_distance = cfp.distance(r.cand.name, r.ref.name, rfp)
            hidden_pool = [n for n in pool if names.parse(n).kind == names.HIDDEN]
            r.ident.gap = identify.neighbour_gap(r.ref.name, rfp, hidden_pool, same)
    _assign_slots([r for r in results if r.slot is not None and r.ident], tol)


def _assign_slots(slots: list[Result], tol: ToleranceModel) -> None:
    """Joint assignment over slots; when the expected reference is as good as the best
    (within noise), it wins the tie, so equal layers never cause a false alarm."""
    options = []
    for r in slots:
        assert r.ident is not None
        best = r.ident.best.distance if r.ident.best else math.inf
        floor = tol.dtype_floor(r.cand.dtype, "float32")
        if best > 3 * floor:  # nothing matches: no tie to break, keep the plain ranking
            options.append([(x.name, x.distance) for x in r.ident.ranking[:1]])
            continue
        limit = max(floor, 2 * best)
        opts = [(x.name, x.distance) for x in r.ident.ranking if x.distance <= limit]
        exp, exp_d = r.ident.expected, r.ident.expected_distance
        if exp and exp_d is not None and exp_d <= limit:
            grp = next((g for g in r.ident.groups if exp in g), [exp])
            opts = [(exp, exp_d * 0.5)] + [o for o in opts if o[0] not in grp]
        options.append(opts)
    for r, name in zip(slots, identify.assign(options), strict=True):
        if name is not None and r.ident is not None and name not in r.ident.group:
            r.ident.promote(name, r.ident.expected_distance if name == r.ident.expected else None)


def _measure(results: list[Result], tol: ToleranceModel, progress: ProgressFactory | None) -> None:
    """Full streaming metrics for (cand, expected); identification already has what it
    needs from the fingerprints, so nothing else is read in full."""
    jobs: dict[tuple[int, int], list[tuple[Result, str, TensorView, TensorView, float, float]]] = defaultdict(list)
    for r in results:
        if r.ref is None:
            r.status = "unpaired"
            continue
        if r.cand.numel == 0 or r.ref.numel == 0:
            r.status = "empty" if r.cand.numel == r.ref.numel == 0 else "shape"
            continue
        if (r.cand.rows, r.cand.cols) != (r.ref.rows, r.ref.cols):
            r.status = "shape"
            continue
        if not (r.cand.is_float and r.ref.is_float):
            if r.cand.numel * 8 > 2 * 1024**3:
                r.notes.append("integer tensor too large to compare exactly")
                continue
            r.exact = exact_compare(r.ref.read_all().reshape(-1), r.cand.read_all().reshape(-1))
            r.status = "ok" if r.exact["mismatched"] == 0 and r.cand.dtype == r.ref.dtype or \
                (r.exact["mismatched"] == 0) else "exact_mismatch"
            continue
        rtol, atol = tol.element_tol(r.ref.dtype, r.cand.dtype)
        jobs[_key(r.cand)].append((r, "expected", r.ref, r.cand, rtol, atol))
    total = sum(v.rows for group in jobs.values() for v in [group[0][3]])
    tick = progress("measuring", total) if progress and total else None
    for group in jobs.values():
        ms = stream.measure([(j[2], j[3], j[4], j[5]) for j in group], tick)
        for (r, _what, *_rest), m in zip(group, ms, strict=True):
            r.metrics = m


def _judge(results: list[Result], tol: ToleranceModel) -> None:
    """ok: within the effective floor and identified as the expected tensor; else drift
    (still closest to the expected one) or mismatch. Diagnosis explains both."""
    for r in results:
        if r.metrics is None or r.ref is None:
            continue
        m = r.metrics
        if m.nonfinite_cand or m.nonfinite_ref:
            r.status = "nonfinite"
            continue
        gap = r.ident.gap if r.ident else None
        r.floor, r.floor_why = tol.floor(r.name, r.ref.dtype, r.cand.dtype, gap)
        d = m.token_rel_diff
        ident_ok = r.ident is None or r.ident.best is None or r.ref.name in r.ident.group \
            or r.identified == r.ref.name \
            or (r.ident.expected_distance is not None and r.ident.expected_distance <= r.floor)
        strict_bad = tol.elementwise_strict and m.mismatched > 0
        if d <= r.floor and ident_ok and not strict_bad:
            r.status = "ok"
        elif ident_ok and ((gap is None and d <= DRIFT_WITHOUT_GAP * r.floor) or
                           (gap is not None and (d < gap / 2 or _clear_best(r)))):
            r.status = "drift"  # still closest to the expected tensor: the same tensor, with error
        else:
            r.status = "mismatch"


def _clear_best(r: Result) -> bool:
    """The expected tensor is the best match and the runner-up is clearly farther."""
    if r.ident is None or r.ident.best is None or r.ref is None:
        return False
    conf = r.ident.confidence
    return r.ref.name in r.ident.group and conf is not None and conf >= CLEAR_BEST_RATIO
