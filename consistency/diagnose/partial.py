"""A stream whose last block is only partly there: a missing all-reduce or MoE combine.

A capture placed before a parallel group's reduction (a tensor-parallel all-reduce deferred
into the next layer's fused add+norm, an expert-parallel combine) holds
``hidden.{s-1} + attn_out.{s-1} + p`` where ``p`` is this rank's share of the MLP's output
(its half of the intermediate features, or its own experts' picks): the stream is still
closest to stream s, by far more than rounding, and reads as "drift" to a distance test.

With the reference's block outputs the share is measurable, row by row: ``q = e - x`` is
what is missing and ``p = m - q`` what is present, where ``m`` is the block's whole output.
A partial sum splits ``m`` into two near-orthogonal parts (different features or experts
contribute each), so ``|cos(p, q)|`` is small; an error of the same size that is not a part
of ``m`` (rounding, a kernel, a wrong weight) is near-orthogonal to ``m`` instead, which
makes ``cos(p, q) = -share / sqrt(1 + share^2)``. The test asks for half of that at most.
With every rank's file the share is proven: the ranks' copies sum to ``W`` copies of the
replicated part plus ``m``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from consistency.compare.engine import Result
from consistency.compare.identify import token_distance
from consistency.compare.metrics import median
from consistency.diagnose.evidence import Evidence
from consistency.dump import names

SHARE_MIN, SHARE_MAX = 0.25, 0.98  # the missing share of the block's output (median over partial rows)
PARTIAL_ROWS = 0.5  # at least half the token rows miss part of it (EP: tokens whose experts are all local are whole)
WHOLE_ROW = 0.02  # a row missing less than 2% of the block's output is whole (rounding)
SPLIT_COS = 0.25  # and never more than this, whatever the share
PROOF_FLOORS = 3.0  # rank files: the sum must come within 3 floors


@dataclass(frozen=True)
class Partial:
    """What the reference's block output of layer s-1 says about the candidate's stream s.
    ``split``: a partial sum (PARTIAL_SHARD); else only that the error is a large share of
    what the block adds, so it is no drift."""

    layer: int
    block: str  # "MLP", "attention"
    tensor: str  # the reference block output (mlp_out.{s-1})
    share: float  # median missing share of its output on the partial rows
    cos: float  # median |cos(present, missing)|
    partial_rows: int
    whole_rows: int
    rows: int
    split: bool = False
    proven_by: int = 0  # the number of rank files whose sum proves it (0: inferred from one file)
    detail: dict[str, Any] = field(default_factory=dict)


def find(ev: Evidence, r: Result) -> Partial | None:
    """Layer s-1's block as the values show it: a partial sum of it (``split``), or an
    error of at least SHARE_MIN of it on most rows (``split`` False: said, never a cause by
    itself -- drift accumulated over every layer, a quantized target's, is easily as large as
    one late MLP's output: tiny Llama int8, 77% of layer 6's, near-parallel to it, |cos| 0.6);
    None when the reference does not record the block or the error is smaller."""
    s = r.expected_stream if not r.post_norm else None
    x, e = ev.cand(r), ev.expected(r)
    if s is None or s < 1 or x is None or e is None or x.shape[0] < 4:
        return None
    large: Partial | None = None
    for block, name in (("MLP", names.mlp_out(s - 1)), ("attention", names.attn_out(s - 1))):
        m = ev.ref(r, name)
        if m is None:
            continue
        got = _split(x, e, m)
        if got is None:
            continue
        share, cos, n_part, n_whole, split = got
        if split:
            return Partial(s - 1, block, name, share, cos, n_part, n_whole, x.shape[0], True, _proof(ev, r, e, m))
        large = large or Partial(s - 1, block, name, share, cos, n_part, n_whole, x.shape[0])
    if large is None and ev.ref(r, names.mlp_out(s - 1)) is None and ev.ref(r, names.attn_out(s - 1)) is None:
        prev = ev.ref(r, names.hidden(s - 1))  # no block outputs recorded: the whole layer's delta stands for them
        got = _split(x, e, e - prev) if prev is not None and prev.shape == e.shape else None
        if got is not None:
            share, cos, n_part, n_whole, split = got
            large = Partial(s - 1, "layer", f"{names.hidden(s)} - {names.hidden(s - 1)}", share, cos, n_part,
                            n_whole, x.shape[0], split, _proof(ev, r, e, e - prev) if split else 0)
    return large


def _split(x: np.ndarray, e: np.ndarray, m: np.ndarray) -> tuple[float, float, int, int, bool] | None:
    q = e - x  # what is missing
    p = m - q  # what is present
    nm, nq, np_ = (np.linalg.norm(v, axis=1) for v in (m, q, p))
    ok = nm > 0
    share = np.where(ok, nq / np.where(ok, nm, 1.0), 0.0)
    part = ok & (share > WHOLE_ROW) & (np_ > 0)
    n_part, n_whole = int(part.sum()), int((ok & (share <= WHOLE_ROW)).sum())
    if n_part < max(2, PARTIAL_ROWS * int(ok.sum())):
        return None
    sh = median(share[part])
    if sh < SHARE_MIN:
        return None
    cos = median(np.abs(np.einsum("ij,ij->i", p[part], q[part])) / (np_[part] * nq[part]))
    noise_cos = sh / math.sqrt(1 + sh * sh)  # what an error of this size that is no part of m gives
    return sh, cos, n_part, n_whole, sh <= SHARE_MAX and cos <= min(SPLIT_COS, 0.5 * noise_cos)


def _proof(ev: Evidence, r: Result, e: np.ndarray, m: np.ndarray) -> int:
    """Every rank's copy: sum_r x_r = W (e - m) + m, so sum_r x_r - (W - 1)(e - m) == e."""
    views = ev.cmp.cand.rank_views(r.cand.name)
    idx = ev.index(r)
    if not views or len(views) < 2 or idx is None or any(v.rows != r.cand.rows or v.cols != r.cand.cols for v in views):
        return 0
    total = np.zeros_like(e)
    for v in views:
        y = v.take_rows(idx, np.float64)
        y[~np.isfinite(y)] = 0.0
        total += y
    w = len(views)
    d = token_distance(total - (w - 1) * (e - m), e)
    return w if d <= PROOF_FLOORS * ev.cmp.pair_floor(r, user=False)[0] else 0


def sentence(ev: Evidence, p: Partial) -> str:
    """The finding's words (after the slot label)."""
    meta = ev.cmp.cand.metadata
    rank = f" (rank {meta.rank} of {meta.world_size})" if meta is not None and meta.rank is not None and \
        meta.world_size else ""
    where = "tensor-parallel all-reduce or expert-parallel MoE combine" if p.block == "MLP" else \
        "tensor-parallel all-reduce (the attention output projection is row-parallel)" if p.block == "attention" else \
        ("tensor-parallel all-reduce or expert-parallel MoE combine, or between the layer's attention and MLP (the "
         "reference records no block outputs, attn_out/mlp_out, to tell which block is short)")
    block = "output" if p.block == "layer" else f"{p.block} output"
    whole = f"; {p.whole_rows} rows are whole (tokens whose experts all live on this rank)" if p.whole_rows else ""
    how = f"the {p.proven_by} ranks' copies sum to it once the replicated part is counted once" if p.proven_by else \
        (f"what is present and what is missing are near-orthogonal parts of it (median |cos| {p.cos:.2f}): a "
         f"partial sum, not an error of that size")
    return (f"holds stream {p.layer + 1} with only part of layer {p.layer}'s {block} ({p.tensor}){rank}: "
            f"{p.share:.0%} of it is missing on {p.partial_rows} of {p.rows} sampled token rows{whole}, and {how}. "
            f"The capture is placed before the {where}")
