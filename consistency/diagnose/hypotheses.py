"""The registry of explanations a mismatched tensor is tested against.

Each hypothesis is data (code, one-line meaning, source) plus a small test that applies
the explanation to the sampled evidence and returns the metric before and after. The
engine keeps the explanation that brings the candidate closest to the reference; nothing
is reported that the numbers do not support.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from consistency.compare.engine import Result
from consistency.compare.identify import token_distance
from consistency.compare.metrics import median
from consistency.contract.codes import C
from consistency.contract.findings import CODES
from consistency.diagnose import draft_steps, stale
from consistency.diagnose.evidence import Evidence, Explanation, fit_scalar
from consistency.diagnose.normfit import looks_normed, norm_fit, norm_words
from consistency.diagnose.shards import partial_shard
from consistency.dump import names

Test = Callable[[Evidence, Result], "Explanation | None"]
MAX_SHIFT = 3


@dataclass(frozen=True)
class Hypothesis:
    """A code (its title, fix and source live in the one registry, contract.findings.CODES)
    and the test that applies the explanation to the evidence."""

    code: str
    test: Test

    @property
    def title(self) -> str:
        return CODES[self.code].title

    @property
    def source(self) -> str:
        return CODES[self.code].source


def _best(r: Result) -> tuple[str, float] | None:
    if r.ident is None or r.ident.best is None:
        return None
    return r.ident.best.name, r.ident.best.distance


def layer_mismatch(ev: Evidence, r: Result) -> Explanation | None:
    """The candidate equals another reference stream."""
    b, before = _best(r), ev.before(r)
    if b is None or before is None or r.ref is None or r.ident is None or r.ref.name in r.ident.group:
        return None
    name, dist = b
    s_got, s_want = ev.cmp.stream_by_values(name), r.expected_stream
    if r.post_norm and s_got is not None:
        # fnorm(s=N) expected: stream N itself is a norm story (NORM_MISSING); another stream
        # is another layer, named only when the values positively say so
        if s_got == s_want or not r.matched:
            return None
        return Explanation(C.LAYER_MISMATCH, f"holds {ev.stream_name(name)}; expected fnorm(s={s_want}), the "
                           "target's final norm applied", before, dist, name,
                           {"stream": s_got, "expected_stream": s_want, "expected_norm": "final_norm",
                            **({"offset": s_got - s_want} if s_want is not None else {})})
    slot_got, want = names.parse(name), r.identity  # ``name``: the reference tensor identification ranked first
    if (s_got is None or s_want is None) and slot_got.kind == want.expected_kind == names.AUX \
            and slot_got.index is not None and slot_got.index != want.expected_index and r.matched:
        # a thin reference (aux slots only): say it in the reference's own slots
        return Explanation(C.LAYER_MISMATCH, f"holds what the reference put in slot {slot_got.index} ({name}); "
                           f"expected its slot {want.expected_index} ({r.ref.name})", before, dist, name,
                           {"slot": slot_got.index, "expected_slot": want.expected_index,
                            "stream": s_got, "expected_stream": s_want})
    if s_got is None or s_want is None or s_got == s_want:
        return None  # the expected tensor is not a (pre-norm) stream: a norm hypothesis applies
    detail: dict = {"stream": s_got, "expected_stream": s_want}
    if s_want is not None:
        detail["offset"] = s_got - s_want
    return Explanation(C.LAYER_MISMATCH, f"holds {ev.stream_name(name)}; expected {ev.stream_name(r.ref.name)}",
                       before, dist, name, detail)


def stream_for_unnamed_slot(ev: Evidence, r: Result) -> Explanation | None:
    """Last resort: a thin reference slot whose stream nothing says, and a candidate that is
    exactly a stream the reference does record (its appended last state). It holds that
    stream. Tried after every other explanation, so a slot that is that stream's norm, a
    scaled copy or a shifted one gets that cause instead."""
    b, before = _best(r), ev.before(r)
    if b is None or before is None or r.ref is None or r.ident is None or r.ref.name in r.ident.group:
        return None
    name, dist = b
    want = r.identity
    if not r.matched or ev.cmp.stream_by_values(name) is None or want.ref_stream is not None \
            or want.expected_kind != names.AUX or want.canonical_kind != names.AUX:
        return None
    return Explanation(C.LAYER_MISMATCH, f"holds {ev.stream_name(name)}, not what the reference put in slot "
                       f"{want.expected_index} ({r.ref.name})", before, dist, name,
                       {"stream": ev.cmp.stream_by_values(name), "expected_slot": want.expected_index})


def residual_missing(ev: Evidence, r: Result) -> Explanation | None:
    """hidden_states.clone() where hidden_states + residual was meant: a block delta.

    Only the blocks next to the expected stream s are tried (layers s-1 and s: their
    attention and MLP outputs, and for parallel blocks -- GPT-NeoX, Cohere, Falcon, one
    residual add per layer -- their sum), pair by pair: O(1) per mismatched tensor, never a
    distance row over every reference tensor (thousands of differing tensors stay linear)."""
    before, c = ev.before(r), ev.cand(r)
    if before is None or c is None or r.ref is None:
        return None
    proof = _from_components(ev, r, c, before)
    if proof is not None:
        return proof
    s = r.expected_stream if not r.post_norm else None
    if s is None or s == 0:
        return None
    alone = _residual_alone(ev, r, c, s, before)
    if alone is not None:
        return alone
    best = _nearest_delta(ev, r, c, s)
    if best is not None:
        d, k, kind, name = best
        what = f"layer {k}'s whole delta (attention + MLP: {name})" if kind == "layer" else \
            f"layer {k}'s {kind} delta ({name})"
        return Explanation(C.RESIDUAL_MISSING, f"holds {what}, not the residual stream: residual not added", before, d,
                           name if kind != "layer" else None, {"layer": k, "block": kind})
    if r.ident and r.ident.best and r.ident.best.distance <= ev.cmp.tol.dtype_floor(r.cand.dtype, r.ref.dtype):
        return None
    prev, cur = ev.ref(r, names.hidden(s - 1)), ev.expected(r)
    if prev is None or cur is None:
        return None
    after = token_distance(c + prev, cur)  # add back the residual we can see (stream s-1)
    if after <= HOLD_EXACT * ev.cmp.pair_floor(r, user=False)[0]:  # stream s minus stream s-1: the layer's delta
        return Explanation(C.RESIDUAL_MISSING, f"holds layer {s - 1}'s whole delta (stream {s} minus stream {s - 1}), "
                           "not the residual stream: residual not added", before, after, None,
                           {"layer": s - 1, "block": "layer", "proof": "streams"})
    # No parts recorded: judge by the norm profile. A block delta is much smaller than the
    # stream, matches no stream, and removing it from the stream moves it toward the
    # previous stream (what is left is stream s-1 plus the other block's delta).
    ratio = median(np.linalg.norm(c, axis=1) / np.maximum(np.linalg.norm(cur, axis=1), 1e-30))
    toward = token_distance(cur - c, prev) / max(token_distance(cur, prev), 1e-30)
    if ratio < 0.5 and toward < 1.0 and after < 0.5 * before:
        return Explanation(C.RESIDUAL_MISSING, f"looks like layer {s - 1}'s block delta, not stream {s}: its norm is "
                           f"{ratio:.2f}x the stream's and removing it moves stream {s} toward stream {s - 1} "
                           f"(record attn_out/mlp_out, or the components, to prove it)", before, after, None,
                           {"layer": s - 1, "norm_ratio": round(ratio, 4), "toward_previous": round(toward, 4)},
                           approximate=True)
    return None


HOLD_EXACT = 3.0  # results.HOLD_FACTOR: an exact explanation leaves at most 3x the noise floor


def _residual_alone(ev: Evidence, r: Result, c: np.ndarray, s: int, before: float) -> Explanation | None:
    """A fused-residual runtime's ``residual`` alone after layer s-1: what enters its MLP,
    stream s-1 plus the attention's output (or stream s minus the MLP's), without the MLP
    output the layer returns as ``hidden_states``. Tried from what the reference records."""
    prev, att = ev.ref(r, names.hidden(s - 1)), ev.ref(r, names.attn_out(s - 1))
    cur, mlp = ev.ref(r, names.hidden(s)), ev.ref(r, names.mlp_out(s - 1))
    got = [(prev + att, f"stream {s - 1} + attn_out.{s - 1}") if prev is not None and att is not None else None,
           (cur - mlp, f"stream {s} - mlp_out.{s - 1}") if cur is not None and mlp is not None else None]
    floor = ev.cmp.pair_floor(r, user=False)[0]
    for x in got:
        if x is None:
            continue
        after = token_distance(c, x[0])
        if after <= HOLD_EXACT * floor and after < EXPLAINS_ALONE * before:
            return Explanation(C.RESIDUAL_MISSING, f"holds the fused layer's residual alone ({x[1]}: what enters "
                               f"layer {s - 1}'s MLP), without the MLP output it returns as hidden_states: "
                               "hidden_states + residual not taken", before, after, None,
                               {"layer": s - 1, "block": "MLP", "holds": x[1], "proof": "streams"})
    return None


EXPLAINS_ALONE = 0.25  # results.EXPLAINS


def _nearest_delta(ev: Evidence, r: Result, c: np.ndarray, s: int) -> tuple[float, int, str, str] | None:
    """The block delta of layer s-1 or s nearest the candidate: (distance, layer, kind, name)."""
    fp, cfp = ev.cmp.ref_fp.get(ev.key(r)), ev.cmp.cand_fp.get(ev.key(r))
    if fp is None or cfp is None or r.cand.name not in cfp:
        return None
    best: tuple[float, int, str, str] | None = None
    for k in (s - 1, s):
        a, m = names.attn_out(k), names.mlp_out(k)
        got = [(cfp.distance(r.cand.name, n, fp), k, kind, n) for n, kind in ((m, "MLP"), (a, "attention")) if n in fp]
        if a in fp and m in fp:
            got.append((token_distance(c, fp.rows(a) + fp.rows(m)), k, "layer", f"{a} + {m}"))
        for g in got:
            if best is None or g[0] < best[0]:
                best = g
    return best


def _from_components(ev: Evidence, r: Result, c: np.ndarray, before: float) -> Explanation | None:
    """The serving dump recorded the slot's parts: if the slot equals ``hidden_states`` and
    ``hidden_states + residual`` equals the expected stream, the missing add is proven."""
    hs = ev.cand_component(r, "hidden_states")
    res = ev.cand_component(r, "residual")
    e = ev.expected(r)
    if hs is None or res is None or e is None:
        return None
    if token_distance(c, hs) > 1e-6:
        return None
    after = token_distance(hs + res, e)
    return Explanation(C.RESIDUAL_MISSING, "is the fused layer's hidden_states alone (its recorded components show "
                       "hidden_states + residual is the expected stream): residual not added", before, after,
                       None, {"proof": "components"})


NORM_FIT_FLOORS = 2.0  # a bf16 forward's final norm fits within 1.6 floors (tiny DeepSeek-V3, last stream)


def _exact_enough(ev: Evidence, r: Result, after: float) -> bool:
    """A norm fits with a free per-column weight, so it must fit within 2 noise floors (not
    the 3 of other explanations): a real norm fits within rounding (SmolLM2 final norm:
    2e-15 in fp64) or a bf16 forward's drift; a per-token scale of a flat tensor, no closer
    than its row-norm spread allows."""
    return after <= NORM_FIT_FLOORS * ev.cmp.pair_floor(r, user=False)[0]


def _ref_is_normed(ev: Evidence, r: Result) -> bool:
    if r.ref is None:
        return False
    if r.post_norm or r.identity.canonical_kind == names.FINAL_NORM:
        return True
    tm = ev.cmp.ref.metadata.tensors.get(r.ref.name) if ev.cmp.ref.metadata is not None else None
    return tm is not None and tm.norm is not None and tm.norm.value != "none"


def norm_applied(ev: Evidence, r: Result) -> Explanation | None:
    before, c, e = ev.before(r), ev.cand(r), ev.expected(r)
    if before is None or c is None or e is None:
        return None
    if r.ident and r.ident.best and names.parse(r.ident.best.name).kind == names.FINAL_NORM and r.matched:
        return Explanation(C.NORM_APPLIED, "holds the final norm's output (post-norm); expected the pre-norm stream",
                           before, r.ident.best.distance, r.ident.best.name, {"norm": "final_norm"})
    d, kind, weighted = norm_fit(c, e)
    if c.shape[0] < 8 and weighted:
        return None  # too few rows to fit a weight honestly
    noise = ev.cmp.pair_floor(r, user=False)[0]
    if not looks_normed(c, e, d, noise) or _ref_is_normed(ev, r) or not _exact_enough(ev, r, d):
        return _last_stream_normed(ev, r, c, before, noise)
    s, n = (r.expected_stream if not r.post_norm else None), ev._num_layers()
    where = "HF's post-norm last hidden state" if s is not None and s == n else \
        "a fused add+RMSNorm output: the next layer's input norm captured instead of the stream" if kind == "RMSNorm" \
        else "the next layer's input norm captured instead of the stream"
    return Explanation(C.NORM_APPLIED, f"equals the expected tensor after {norm_words(kind, weighted)} "
                       f"({where})", before, d, r.ref.name if r.ref else None,
                       {"norm": kind, "weighted": weighted})


def _last_stream_normed(ev: Evidence, r: Result, c: np.ndarray, before: float, noise: float) -> Explanation | None:
    """HF's ``output_hidden_states[-1]`` in a slot meant for another stream: the top stream N
    after the final norm, provable from a reference that records stream N pre-norm (and no
    ``final_norm`` to name). Only stream N is tried: it is the one post-norm state a side
    reads by mistake."""
    n, s = ev._num_layers(), (r.expected_stream if not r.post_norm else None)
    top = ev.ref(r, names.hidden(n)) if n is not None and s is not None and s != n else None
    if top is None or _ref_is_normed(ev, r):
        return None
    d, kind, weighted = norm_fit(c, top)
    if (c.shape[0] < 8 and weighted) or not looks_normed(c, top, d, noise) or not _exact_enough(ev, r, d):
        return None
    return Explanation(C.NORM_APPLIED, f"holds stream {n} (the last layer's output) after {norm_words(kind, weighted)}"
                       f": HF's post-norm last hidden state "
                       f"(output_hidden_states[-1]), not stream {s}", before, d, names.hidden(n),
                       {"norm": kind, "weighted": weighted, "stream": n, "expected_stream": s})


def norm_missing(ev: Evidence, r: Result) -> Explanation | None:
    before, c, e = ev.before(r), ev.cand(r), ev.expected(r)
    if before is None or c is None or e is None:
        return None
    d, kind, weighted = norm_fit(e, c)
    if c.shape[0] < 8 and weighted:
        return None
    noise = ev.cmp.pair_floor(r, user=False)[0]
    if not (_ref_is_normed(ev, r) or looks_normed(e, c, d, noise)) or not _exact_enough(ev, r, d):
        return None  # nothing says the expected tensor is a norm's output
    # the raw stream is named only when the values hold it: against an HF output_hidden_states
    # reference (its last entry post-norm) the nearest recorded raw stream is N-1, not this one
    best = r.ident.best if r.ident and r.ident.best and names.parse(r.ident.best.name).kind == names.HIDDEN else None
    raw = best.name if best is not None and best.distance <= HOLD_EXACT * noise else None
    n = ev._num_layers()
    top = raw is None and n is not None and (r.expected_stream in (None, n))
    what = f" {raw}" if raw else f" of the model's top (stream {n}), which the reference records only after its " \
        f"norm" if top else ""
    return Explanation(C.NORM_MISSING, f"is the raw (pre-norm) stream{what}; the expected tensor is its {kind} output",
                       before, d, raw, {"norm": kind, "weighted": weighted, **({"stream": n} if top else {})})


def token_shift(ev: Evidence, r: Result) -> Explanation | None:
    before, c, idx = ev.before(r), ev.cand(r), ev.index(r)
    if before is None or c is None or idx is None or r.ref is None:
        return None
    targets = [r.ref.name]
    if r.ident and r.ident.best and r.ident.best.name != r.ref.name:
        targets.append(r.ident.best.name)
    seq = r.cand.shape[-2] if len(r.cand.shape) >= 2 else r.cand.rows
    best: tuple[float, int, str] | None = None
    for k in [k for j in range(1, MAX_SHIFT + 1) for k in (j, -j)]:
        pos = idx % seq + k
        ok = (pos >= 0) & (pos < seq)
        if ok.sum() < max(2, len(idx) // 2):
            continue
        for t in targets:
            shifted = ev.ref_rows_at(t, idx[ok] + k)
            if shifted is None:
                continue
            d = token_distance(c[ok], shifted)
            if best is None or d < best[0]:
                best = (d, k, t)
    if best is None:
        return None
    d, k, t = best
    where = "later" if k > 0 else "earlier"
    return Explanation(C.TOKEN_SHIFT, f"matches {ev.stream_name(t)} shifted by {k:+d} position(s): row i holds the "
                       f"reference's row i{k:+d} ({abs(k)} {where})", before, d, t, {"shift": k})


def scale_mismatch(ev: Evidence, r: Result) -> Explanation | None:
    before, c, e = ev.before(r), ev.cand(r), ev.expected(r)
    if before is None or c is None or e is None:
        return None
    a = fit_scalar(c, e)
    if not math.isfinite(a) or abs(a - 1.0) < 1e-3 or a == 0:
        return None
    d = token_distance(c, a * e)
    detail: dict = {"factor": round(a, 6)}
    hint = ""
    h = r.cand.cols
    for label, v in (("sqrt(hidden_size)", math.sqrt(h)), ("1/sqrt(hidden_size)", 1 / math.sqrt(h))):
        if abs(a / v - 1) < 0.01:
            hint = f" = {label}, an embedding scale applied on one side only"
            detail["matches"] = label
    if not hint and abs(a) > 1e-6:
        inv = 1 / a
        for v, label in ((a, f"{round(a)}"), (inv, f"1/{round(inv)}")):
            if abs(v) >= 2 and abs(v - round(v)) <= 0.01 * abs(v):
                hint = f" (= {label})"
                break
    if r.expected_stream == 0 and not r.post_norm:
        arch = _architecture(ev)
        hint += ("; slot 0 holds the embedding, so it is an embedding multiplier applied on one side only "
                 "(Gemma's sqrt(hidden_size) normalizer, Granite's embedding_multiplier"
                 + (f"; the target is a {arch}" if arch else "") + ")") if "sqrt" not in hint else \
            (f" (the target is a {arch})" if arch else "")
        detail["embedding"] = True
    return Explanation(C.SCALE_MISMATCH, f"equals the expected tensor times {a:.4g}{hint}", before, d,
                       r.ref.name if r.ref else None, detail)


def _architecture(ev: Evidence) -> str | None:
    for meta in (ev.cmp.ref.metadata, ev.cmp.cand.metadata):
        if meta is not None and meta.model is not None and meta.model.architecture:
            return meta.model.architecture
    return None


REGISTRY: tuple[Hypothesis, ...] = (
    Hypothesis(C.LAYER_MISMATCH, layer_mismatch),
    Hypothesis(C.RESIDUAL_MISSING, residual_missing),
    Hypothesis(C.NORM_APPLIED, norm_applied),
    Hypothesis(C.NORM_MISSING, norm_missing),
    Hypothesis(C.TOKEN_SHIFT, token_shift),
    Hypothesis(C.STALE_ROWS, stale.stale_rows),  # after TOKEN_SHIFT: a whole-sequence shift is that
    Hypothesis(C.PARTIAL_SHARD, partial_shard),
    Hypothesis(C.SCALE_MISMATCH, scale_mismatch),
    Hypothesis(C.CONCAT_ORDER, draft_steps.concat_order),  # draft_cat.k only (drafts beyond EAGLE-3)
    Hypothesis(C.LAYER_MISMATCH, stream_for_unnamed_slot),  # last: only when nothing else explains it
)
