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
from dataclasses import dataclass, field

import numpy as np

from consistency.compare import align, identify, precision, rows, steps, stream
from consistency.compare.metrics import exact_compare, median
from consistency.compare.result import (  # noqa: F401 - re-exported: the value types of a comparison
    CLEAR_BEST_RATIO,
    DRIFT_TOKEN_CAP,
    DRIFT_WITHOUT_GAP,
    MATCH_FACTOR,
    MAX_BAD_FRACTION,
    TOKEN_FACTOR,
    ProgressFactory,
    Result,
    Status,
)
from consistency.compare.tolerance import ToleranceModel
from consistency.contract.models import AuxContract
from consistency.dump import names
from consistency.dump.reader import Dump, TensorView


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
    effective: dict[str, str] = field(default_factory=dict)  # "ref:name"/"cand:name" -> dtype the values carry
    _streams: dict[tuple[int, int], frozenset[int]] = field(default_factory=dict, repr=False)

    def canonical(self, ref_name: str | None) -> str | None:
        """Prefer the meaningful name: a reference slot that equals ``hidden.3`` is ``hidden.3``."""
        if ref_name is None:
            return None
        n = names.parse(ref_name)
        if n.kind == names.AUX and n.index is not None and n.index < len(self.ref_slot_names):
            return self.ref_slot_names[n.index] or ref_name
        return ref_name

    def dtype(self, side: str, view: TensorView | None) -> str:
        """The dtype the values carry (a float32 file may hold bf16 values)."""
        if view is None:
            return "float32"
        return self.effective.get(f"{side}:{view.name}", view.dtype)

    def ref_view(self, name: str) -> TensorView | None:
        if name in self.ref.tensors:
            return self.ref.tensors[name]
        return next((v for v in self.plan.ref.slots if v.name == name), None)

    def noise_floor(self, r: Result, gap: float | None = None, user: bool = True) -> tuple[float, str]:
        """The pair's floor: user rules first (unless ``user`` is False: identity is judged
        against noise, never against a tolerance), else the dtype floor of the precision
        the values really carry; a float8 side earns a floor measured on these values."""
        dr, dc = self.dtype("ref", r.ref), self.dtype("cand", r.cand)
        narrow = [d for d in (dr, dc) if d in precision.NARROW]
        tol = self.tol if user else ToleranceModel()
        if not narrow or (user and (any(rule.matches(r.name) for rule in self.tol.rules)
                                    or self.tol.floor_override is not None)):
            return tol.floor(r.name, dr, dc, gap)
        wide = [d for d in (dr, dc) if d not in precision.NARROW] or ["bfloat16"]
        compute = self.tol.dtype_floor(wide[0], wide[-1])
        fp = self.ref_fp.get(_key(r.cand))
        side_view = r.ref if dr not in precision.NARROW else r.cand
        fps = self.ref_fp if side_view is r.ref else self.cand_fp
        fp = fps.get(_key(r.cand))
        sample = fp.rows(side_view.name) if fp is not None and side_view is not None and side_view.name in fp else None
        if sample is None:
            return tol.floor(r.name, dr, dc, gap)
        measured = precision.storage_floor(sample, narrow[0])
        f = max(compute, measured)
        why = f"{narrow[0]} storage floor {f:.2g} (measured {measured / precision.STORAGE_MARGIN:.2g} on these values)"
        if gap is not None and gap > 0 and gap / 10 < f:
            return gap / 10, f"neighbour gap {gap:.3g}/10"
        return f, why

    def recorded_streams(self, key: tuple[int, int]) -> frozenset[int]:
        """Streams the reference records at this shape (computed once per shape: a dump of
        30,000 tensors must not re-scan every name once per tensor)."""
        if key not in self._streams:
            fp = self.ref_fp.get(key)
            got = (self.stream_of(n) for n in (fp.names if fp is not None else []))
            self._streams[key] = frozenset(x for x in got if x is not None)
        return self._streams[key]

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
    ref_slot_view = {v.name: v for v in plan.ref.slots}
    for sp in plan.slots:
        rv = ref.tensors.get(sp.expected) if sp.expected else None
        if rv is None and sp.expected:
            rv = ref_slot_view.get(sp.expected)
        results.append(Result(sp.cand.name, sp.cand, sp.expected, rv, sp.index, sp.expected_stream, sp.why))
    for i, view in enumerate(plan.cand.concat):
        twin = next((r for r in results if r.slot == i), None)
        if twin is not None:
            results.append(Result(view.name, view, twin.expected, twin.ref, None, twin.expected_stream,
                                  f"concatenated aux beside {twin.name}", concat_of=i))
    for n, rv, cv in plan.pairs:
        results.append(Result(n, cv, n, rv, None, names.stream_of(n), "same name"))
    paired = rows.pair(ref, cand, results, plan)  # by anchor (token_index) where either side has one

    # fingerprints: every float reference tensor that shares (rows, cols) with a candidate
    ref_pool = _unique([v for v in list(ref.tensors.values()) + list(plan.ref.slots) if v.is_float and v.cols > 1])
    ref_pool = rows.with_subsets(ref_pool, paired)  # row-paired reference subsets beside the full views
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
    labels = {("ref", v.name): v.dtype for v in ref_pool} | {("cand", v.name): v.dtype for v in cand_float}
    effective, note = precision.effective_dtypes({"ref": ref_fp, "cand": cand_fp}, labels)
    if note:
        plan.notes.append(note)

    ref_slot_streams, ref_slot_names = _reference_slots(plan, ref_fp, tol)
    for r in results:
        if r.slot is not None and r.expected_stream is None and r.expected:
            n = names.parse(r.expected)
            if n.kind == names.AUX and n.index is not None and n.index < len(ref_slot_streams):
                r.expected_stream = ref_slot_streams[n.index]
    cmp = Comparison(ref, cand, plan, results, tol, ref_fp, cand_fp, ref_slot_streams, ref_slot_names,
                     effective=effective)
    _screen(cmp)
    _measure(cmp, progress)
    _judge(cmp)
    steps.resolve(cmp)  # what each side's recycle.k holds (drafts beyond EAGLE-3)
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
                floor = tol.dtype_floor(v.dtype, "bfloat16")
                if ident.best and (ident.best.distance <= floor or _most_rows_equal(fp, v.name, ident.best.name, floor)):
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


def _most_rows_equal(fp: identify.Fingerprints, a: str, b: str, floor: float) -> bool:
    """A reference slot that equals a stream except at a few bad tokens is still that
    stream (the bad tokens are judged where they are compared, not here)."""
    x, y = fp.rows(a), fp.rows(b)
    d = x - y
    den = np.einsum("ij,ij->i", x, x) + np.einsum("ij,ij->i", y, y)
    per_row = np.divide(np.einsum("ij,ij->i", d, d), den, out=np.zeros(len(den)), where=den > 0)
    return bool(per_row.size) and median(per_row) <= floor and \
        float(np.mean(per_row <= floor)) >= 1 - MAX_BAD_FRACTION


def _screen(cmp: Comparison) -> None:
    """Rank references for every float candidate on the sample (slots always, pairs when off)."""
    tol = cmp.tol
    identify.prefetch(cmp.cand_fp, cmp.ref_fp, [(r.cand, r.ref) for r in cmp.results  # slots are always ranked
                                                 if r.slot is not None or r.concat_of is not None])
    for r in cmp.results:
        if not (r.cand.is_float and r.cand.cols > 1) or _key(r.cand) not in cmp.ref_fp:
            continue
        rfp, cfp = cmp.ref_fp[_key(r.cand)], cmp.cand_fp[_key(r.cand)]
        same = _same_floor(tol)
        expected_in = r.expected is not None and r.ref is not None and r.ref.name in rfp
        if expected_in and r.slot is None and r.concat_of is None:
            d = cfp.distance(r.cand.name, r.ref.name, rfp)
            if d <= cmp.noise_floor(r)[0]:
                continue  # same-name pair that already agrees: no identification needed
        r.ident = identify.rank(r.cand.name, cfp, rfp, None, same)  # None: every reference of this shape
        if expected_in:
            r.ident.expected = r.ref.name
            r.ident.expected_distance = cfp.distance(r.cand.name, r.ref.name, rfp)
            r.ident.gap = identify.neighbour_gap(r.ref.name, rfp, rfp.of_kind(names.HIDDEN), same)
    _assign_slots(cmp, [r for r in cmp.results if r.slot is not None and r.ident])


def _assign_slots(cmp: Comparison, slots: list[Result]) -> None:
    """Joint assignment over slots; when the expected reference is as good as the best
    (within noise), it wins the tie, so equal layers never cause a false alarm."""
    options = []
    for r in slots:
        assert r.ident is not None
        best = r.ident.best.distance if r.ident.best else math.inf
        floor = cmp.tol.dtype_floor(cmp.dtype("cand", r.cand), "float32")
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


def _measure(cmp: Comparison, progress: ProgressFactory | None) -> None:
    """Full streaming metrics for (cand, expected); identification already has what it
    needs from the fingerprints, so nothing else is read in full."""
    tol = cmp.tol
    jobs: dict[tuple[int, int], list[tuple[Result, str, TensorView, TensorView, float, float]]] = defaultdict(list)
    for r in cmp.results:
        if r.status != Status.pending:
            continue  # judged before measuring (compare.rows: no common anchor)
        if r.ref is None:
            r.status = Status.unverified if r.expected_stream is not None else Status.unpaired
            continue
        if r.cand.numel == 0 or r.ref.numel == 0:
            same = r.cand.numel == r.ref.numel == 0 and tuple(r.cand.shape) == tuple(r.ref.shape)
            r.status = Status.empty if same else Status.shape
            continue
        if (r.cand.rows, r.cand.cols) != (r.ref.rows, r.ref.cols):
            r.status = Status.shape
            continue
        if not (r.cand.is_float and r.ref.is_float):
            if r.cand.numel * 8 > 2 * 1024**3:
                r.notes.append("integer tensor too large to compare exactly")
                continue
            r.exact = exact_compare(r.ref.read_all().reshape(-1), r.cand.read_all().reshape(-1))
            r.status = Status.ok if r.exact["mismatched"] == 0 else Status.exact_mismatch
            continue
        rtol, atol = tol.element_tol(cmp.dtype("ref", r.ref), cmp.dtype("cand", r.cand))
        jobs[_key(r.cand)].append((r, "expected", r.ref, r.cand, rtol, atol))
    total = sum(v.rows for group in jobs.values() for v in [group[0][3]])
    tick = progress("measuring", total) if progress and total else None
    for group in jobs.values():
        ms = stream.measure([(j[2], j[3], j[4], j[5]) for j in group], tick)
        for (r, _what, *_rest), m in zip(group, ms, strict=True):
            r.metrics = m


def _judge(cmp: Comparison) -> None:
    """ok: within the effective floor, every token within reach of it, and identified as
    the expected tensor; drift: still the expected tensor, with error; bad_tokens: the
    tensor agrees but a few positions do not; else mismatch. Diagnosis explains them."""
    tol = cmp.tol
    for r in cmp.results:
        if r.status in (Status.unpaired, Status.unverified):
            r.matched = _matches_something(cmp, r)
            continue
        if r.metrics is None or r.ref is None:
            continue
        m = r.metrics
        if m.nonfinite_cand or m.nonfinite_ref:
            r.status = Status.nonfinite
            continue
        gap = r.ident.gap if r.ident else None
        r.floor, r.floor_why = cmp.noise_floor(r, gap)
        noise = cmp.noise_floor(r, gap, user=False)[0]
        d = m.token_rel_diff
        ident_ok = r.ident is None or r.ident.best is None or r.ref.name in r.ident.group \
            or r.identified == r.ref.name \
            or (r.ident.expected_distance is not None and r.ident.expected_distance <= noise)
        r.matched = r.ident is not None and r.ident.best is not None and \
            r.ident.best.distance <= MATCH_FACTOR * cmp.noise_floor(r, user=False)[0]
        strict_bad = tol.elementwise_strict and m.mismatched > 0
        per_row = m.per_row if m.per_row is not None else np.zeros(0)
        bad = np.flatnonzero(per_row > TOKEN_FACTOR * r.floor) if per_row.size else np.zeros(0, dtype=np.int64)
        r.bad_tokens = [int(i) for i in bad]
        rest_ok = bool(per_row.size) and 0 < len(bad) <= MAX_BAD_FRACTION * per_row.size and \
            float(np.delete(per_row, bad).mean()) <= r.floor
        if d <= r.floor and ident_ok and not strict_bad and not len(bad):
            r.status = Status.ok
            r.tolerated = _user_floor(r) and d > noise  # passes only because the user allowed it
        elif rest_ok and not strict_bad:
            r.status = Status.bad_tokens
        elif d <= r.floor and not ident_ok and not strict_bad and _user_floor(r):
            r.status, r.tolerated = Status.ok, True  # the user's tolerance allows it; say what it holds
        elif ident_ok and d <= DRIFT_WITHOUT_GAP * r.floor and (gap is None or d < gap / 2) \
                and not (per_row.size and float(per_row.max()) > DRIFT_TOKEN_CAP * r.floor):
            r.status = Status.drift  # still closest to the expected tensor: the same tensor, with error
        elif ident_ok and _clear_best(r) and _adjacent_recorded(cmp, r):
            r.status = Status.drift  # beyond 10x, but the expected stream is still clearly the nearest
        else:
            r.status = Status.mismatch


def _user_floor(r: Result) -> bool:
    return r.floor_why.startswith(("rule ", "--threshold"))


def _matches_something(cmp: Comparison, r: Result) -> bool:
    """An unpaired slot *is* a reference tensor only when it is within noise of it."""
    if r.ident is None or r.ident.best is None:
        return False
    best = cmp.ref_view(r.ident.best.name)
    low = cmp.tol.dtype_floor(cmp.dtype("cand", r.cand), cmp.dtype("ref", best) if best is not None else "float32")
    return r.ident.best.distance <= MATCH_FACTOR * low


def _adjacent_recorded(cmp: Comparison, r: Result) -> bool:
    """Drift past 10x the floor needs the neighbouring streams in the reference to rule
    out an off-by-one: a thin reference cannot tell a one-layer offset from drift."""
    s = r.expected_stream if r.expected_stream is not None else cmp.stream_of(r.expected)
    if s is None:
        return False
    have = cmp.recorded_streams(_key(r.cand))
    return (s - 1 in have or s == 0) and (s + 1 in have or s == max(have, default=s))


def _clear_best(r: Result) -> bool:
    """The expected tensor is the best match and the runner-up is clearly farther."""
    if r.ident is None or r.ident.best is None or r.ref is None:
        return False
    conf = r.ident.confidence
    return r.ref.name in r.ident.group and conf is not None and conf >= CLEAR_BEST_RATIO
