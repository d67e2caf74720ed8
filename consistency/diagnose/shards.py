"""Zero rows and rank files: a tensor-parallel or expert-parallel partial, when its rows
follow a shard (hypotheses.REGISTRY's PARTIAL_SHARD test; a partial *block* of a stream,
measured against the reference's block outputs, is diagnose.partial).
"""

from __future__ import annotations

import numpy as np

from consistency.compare.engine import Result
from consistency.compare.identify import token_distance
from consistency.contract.codes import C
from consistency.diagnose.evidence import Evidence, Explanation
from consistency.dump import names


def partial_shard(ev: Evidence, r: Result) -> Explanation | None:
    """A missing all-reduce. With every rank's file: the ranks' copies sum to the expected
    tensor. With one rank's file: zero token rows are a shard only when they follow one --
    the non-zero rows are exactly one vocab shard's id range (a vocab-parallel embedding), or
    the tensor is a block output of a rank file (an expert-parallel MoE output before its
    combine: the zero rows are the tokens routed to other ranks' experts). A few zeroed or
    swapped rows that follow nothing are bad tokens, whatever the metadata says."""
    before, c, e = ev.before(r), ev.cand(r), ev.expected(r)
    if before is None or c is None or e is None:
        return None
    summed = _rank_sum(ev, r)
    if summed is not None:
        d = token_distance(summed[0], e)
        zero = _zero_rows_by_rank(ev, r)
        where = "; ".join(f"rank {k}: {len(v)} zero token rows {v[:8]}{'...' if len(v) > 8 else ''}"
                          for k, v in zero.items() if v)
        return Explanation(C.PARTIAL_SHARD, f"is rank 0's partial result: the {summed[1]} ranks' copies sum to the "
                           f"expected tensor, so an all-reduce is missing" + (f" ({where})" if where else ""),
                           before, d, r.ref.name if r.ref else None,
                           {"ranks": summed[1], "zero_token_rows_by_rank": {str(k): v[:64] for k, v in zero.items()}})
    zero = np.linalg.norm(c, axis=1) == 0
    if not zero.any() or zero.all():
        return None
    kept = ~zero
    d_kept = token_distance(c[kept], e[kept])
    masked = np.where(zero[:, None], 0.0, e)
    d = token_distance(c, masked)
    detail: dict = {"zero_rows": int(zero.sum()), "sampled_rows": int(len(zero)), "kept_rel_diff": d_kept}
    msg = f"{int(zero.sum())} of {len(zero)} sampled token rows are zero and the rest match"
    follows = _embedding(ev, r) and _follows_vocab_shard(ev, r, zero, kept, detail)
    meta = ev.cmp.cand.metadata
    ranked = meta is not None and meta.rank is not None and (meta.world_size or 1) > 1
    block = r.identity.canonical_kind in (names.MLP_OUT, names.ATTN_OUT) if r.ref else False
    if follows:
        msg += f"; the non-zero rows are exactly the tokens with ids in {detail['shard_token_range']}"
        vs = detail.get("vocab_shard")
        if vs:
            msg += f", inside rank {vs['rank']}'s slice [{vs['ids'][0]}, {vs['ids'][1]}) of a vocabulary split " \
                   f"{vs['world_size']} ways"
        what = "a vocab-parallel embedding without its all-reduce"
    elif block and ranked:
        what = "an expert-parallel MoE output before its combine (the zero rows: tokens routed to other ranks' experts)"
        detail["approximate"] = True
    else:
        return None
    all_rows = _zero_rows(r)
    if all_rows is not None:
        detail["zero_token_rows"] = all_rows[:64]
        detail["zero_token_count"] = len(all_rows)
        msg += f"; zero token rows: {all_rows[:8]}{'...' if len(all_rows) > 8 else ''} ({len(all_rows)} in all)"
    if ranked:
        assert meta is not None
        detail["rank"], detail["world_size"] = meta.rank, meta.world_size
        msg = f"rank {meta.rank} of {meta.world_size}: " + msg
    return Explanation(C.PARTIAL_SHARD, f"{msg}: {what}", before, d, r.ref.name if r.ref else None, detail)


def _embedding(ev: Evidence, r: Result) -> bool:
    """A vocab-parallel embedding's missing all-reduce zeroes rows of the embedding only
    (stream 0, a draft's ``draft_embed.k``): any later stream mixes tokens in attention, so
    its rows are never exactly zero for that reason. Unknown streams are not ruled out."""
    kind = r.identity.kind
    if kind == names.DRAFT_EMBED:
        return True
    held = r.identity if r.ref is not None else None
    if held is not None and held.canonical_kind == names.HIDDEN and held.canonical_index is not None:
        return held.canonical_index == 0
    return not r.post_norm and r.expected_stream in (None, 0)


SHARD_WORLDS = (2, 4, 8, 16, 32, 64)  # world sizes tried when the metadata does not say one


def _follows_vocab_shard(ev: Evidence, r: Result, zero: np.ndarray, kept: np.ndarray, detail: dict) -> bool:
    """The non-zero rows are exactly the tokens of one rank's slice of the vocabulary: their
    ids span [lo, hi] with no zero row inside it and, when the vocabulary size is known, that
    span lies inside one slice ceil(V / W) wide for the metadata's world size (or some W a
    runtime uses), with the zero rows' ids outside it. Without the vocabulary size, two zero
    rows at least (one row of the 48 can sit at either end of the span by chance)."""
    ids = ev.input_ids("cand") if ev.input_ids("cand") is not None else ev.input_ids("ref")
    idx = ev.index(r)
    if ids is None or idx is None or len(ids) < r.cand.rows:
        return False
    tok = ids[idx]
    lo, hi = int(tok[kept].min()), int(tok[kept].max())
    inside_zero = int(((tok >= lo) & (tok <= hi) & zero).sum())
    detail.update(shard_token_range=[lo, hi], zero_rows_inside_range=inside_zero)
    if inside_zero:
        return False
    metas = [m for m in (ev.cmp.ref.metadata, ev.cmp.cand.metadata) if m is not None and m.model is not None]
    v = next((m.model.vocab_size for m in metas if m.model.vocab_size), None)
    w = ev.cmp.cand.metadata.world_size if ev.cmp.cand.metadata is not None else None
    if not v:
        return int(zero.sum()) >= 2
    zero_ids = tok[zero]
    for world in ((w,) if w and w > 1 else SHARD_WORLDS):
        size = -(-v // world)
        rank = lo // size
        if lo // size == hi // size and not np.any((zero_ids >= rank * size) & (zero_ids < (rank + 1) * size)):
            detail["vocab_shard"] = {"world_size": world, "rank": rank, "ids": [rank * size, min(v, (rank + 1) * size)]}
            return True
    return False


def _rank_sum(ev: Evidence, r: Result) -> tuple[np.ndarray, int] | None:
    """Sampled rows of the candidate summed over tensor-parallel ranks (rank files only)."""
    idx = ev.index(r)
    views = ev.cmp.cand.rank_views(r.cand.name)
    if not views or len(views) < 2 or idx is None or any(v.rows != r.cand.rows or v.cols != r.cand.cols for v in views):
        return None
    total = np.zeros((len(idx), r.cand.cols))
    for v in views:
        x = v.take_rows(idx, np.float64)
        x[~np.isfinite(x)] = 0.0
        total += x
    return total, len(views)


def _zero_rows_by_rank(ev: Evidence, r: Result) -> dict[int, list[int]]:
    views = ev.cmp.cand.rank_views(r.cand.name)
    out: dict[int, list[int]] = {}
    for k, v in enumerate(views or []):
        if v.nbytes > 256 * 1024 * 1024:
            continue
        rows: list[int] = []
        for start in range(0, v.rows, 4096):
            chunk = v.rows_float(start, start + 4096)
            rows.extend(int(start + i) for i in np.flatnonzero(~(chunk != 0).any(axis=1)))
        out[k] = rows
    return out


def _zero_rows(r: Result) -> list[int] | None:
    """Every all-zero token row of the candidate (bounded: skipped for huge tensors)."""
    if r.cand.nbytes > 512 * 1024 * 1024:
        return None
    rows: list[int] = []
    for start in range(0, r.cand.rows, 4096):
        chunk = r.cand.rows_float(start, start + 4096)
        rows.extend(int(start + i) for i in np.flatnonzero(~(chunk != 0).any(axis=1)))
    return rows
