"""Align two token streams by their ids: which reference row each candidate row is.

A serving capture rarely holds the reference's tokens one for one: a prefix cache leaves
only the suffix, decode steps add tokens at the end, a chat template or system prompt adds
tokens in front, a BOS is added or dropped. The aligner tries, in order:

1. identical ids;
2. an exact offset: one sequence inside the other (suffix, prefix, window), found with a
   byte search over the packed ids (C speed);
3. a sequence diff (insertions, deletions, replacements): common prefix and suffix are
   trimmed, then a patience diff anchors on ids unique to both sides (O(n log n)), and
   the short gaps between anchors are finished by :mod:`difflib`. Matching blocks shorter
   than :data:`MIN_BLOCK` are dropped, and an alignment covering less than
   :data:`MIN_COVER` of the shorter side without one :data:`LONG_BLOCK` run is no
   alignment, so two different prompts never "align" on a few common n-grams.

Besides the aligned row pairs it says, per pair, whether the token's *context* differs
(its position differs, or tokens before it in its request differ). A causal model's state
depends on every earlier token, so a context difference moves every later state a little
and is the explanation, not a layer or a norm. Positions make the prefix-cache case exact:
a suffix capture whose positions continue the reference's has the same context.
"""

from __future__ import annotations

import difflib
from bisect import bisect_left
from dataclasses import dataclass, field
from typing import Any

import numpy as np

MIN_BLOCK = 4  # shorter matching blocks are coincidence, unless a sequence is that short
DIFFLIB_CELLS = 4_096  # gaps larger than this (len a * len b) are split on unique anchors first
SMALL = 24  # gaps this short on both sides go straight to difflib
MIN_COVER = 0.2  # an alignment covers at least this share of the shorter side ...
LONG_BLOCK = 64  # ... or holds one run this long; else the sides share no prompt


@dataclass
class Span:
    """Tokens on one side with no counterpart on the other."""

    side: str  # 'reference' or 'candidate'
    segment: str
    start: int  # rows of that side's stitched token axis
    stop: int
    where: str  # 'start', 'end' or 'middle' of its request
    ids: list[int]
    positions: list[int] | None = None
    text: str | None = None  # decoded, when a tokenizer is at hand (untrusted: escape when shown)
    special: list[str] = field(default_factory=list)  # names of special tokens in the span

    @property
    def length(self) -> int:
        return self.stop - self.start


@dataclass
class TokenAlignment:
    ref_rows: np.ndarray  # aligned pairs: reference row i <-> candidate row j
    cand_rows: np.ndarray
    ref_tokens: int
    cand_tokens: int
    method: str  # identical, offset, diff, positions, rows, none
    extra: list[Span] = field(default_factory=list)  # candidate tokens the reference lacks
    missing: list[Span] = field(default_factory=list)  # reference tokens the candidate lacks
    context: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))  # per pair: context differs
    not_captured: int = 0  # reference tokens before a suffix capture that the candidate had in its cache
    notes: list[str] = field(default_factory=list)
    ids_checked: bool = True  # False when one side had no input_ids (paired by position or row)
    only_same_context: bool = False  # prepare(same_context_only=True) kept only same-context tokens

    @property
    def compared(self) -> int:
        return int(len(self.ref_rows))

    @property
    def context_differs(self) -> bool:
        """True when some aligned token saw other tokens before it on the two sides."""
        return bool(self.context.any())

    @property
    def same_context_rows(self) -> int:
        return int((~self.context).sum())

    def summary(self) -> dict[str, Any]:
        return {"method": self.method, "reference_tokens": self.ref_tokens, "candidate_tokens": self.cand_tokens,
                "compared": self.compared, "same_context": self.same_context_rows,
                "context_differs": self.context_differs, "not_captured": self.not_captured,
                "ids_checked": self.ids_checked, "notes": list(self.notes),
                "extra": [_span_json(s) for s in self.extra], "missing": [_span_json(s) for s in self.missing]}


def _span_json(s: Span) -> dict[str, Any]:
    return {"side": s.side, "segment": s.segment, "start": s.start, "stop": s.stop, "where": s.where,
            "ids": s.ids[:64], "positions": (s.positions or [])[:1] + (s.positions or [])[-1:], "text": s.text,
            "special": s.special}


# -- sequence matching ----------------------------------------------------------------------

def _find(hay: np.ndarray, needle: np.ndarray) -> int:
    """First offset of ``needle`` inside ``hay`` (both int64), or -1."""
    if len(needle) == 0 or len(needle) > len(hay):
        return -1
    hb, nb = hay.astype("<i8").tobytes(), needle.astype("<i8").tobytes()
    at = hb.find(nb)
    while at != -1 and at % 8:
        at = hb.find(nb, at + 1)
    return at // 8 if at != -1 else -1


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    ne = np.flatnonzero(a[:n] != b[:n])
    return int(ne[0]) if len(ne) else n


def _common_suffix(a: np.ndarray, b: np.ndarray) -> int:
    return _common_prefix(a[::-1], b[::-1])


def _lis(seq: list[int]) -> list[int]:
    """Indices of a longest strictly increasing subsequence of ``seq`` (patience sorting)."""
    tails: list[int] = []
    tails_at: list[int] = []
    prev = [-1] * len(seq)
    for i, x in enumerate(seq):
        k = bisect_left(tails, x)
        if k == len(tails):
            tails.append(x)
            tails_at.append(i)
        else:
            tails[k] = x
            tails_at[k] = i
        prev[i] = tails_at[k - 1] if k else -1
    out, i = [], tails_at[-1] if tails_at else -1
    while i != -1:
        out.append(i)
        i = prev[i]
    return out[::-1]


def _unique_anchors(a: np.ndarray, b: np.ndarray) -> list[tuple[int, int]]:
    """(i, j) where a[i] == b[j] and that id occurs once in a and once in b, in LIS order."""
    va, ia, ca = np.unique(a, return_index=True, return_counts=True)
    vb, ib, cb = np.unique(b, return_index=True, return_counts=True)
    ua, ub = va[ca == 1], vb[cb == 1]
    common, xa, xb = np.intersect1d(ua, ub, assume_unique=True, return_indices=True)
    if len(common) == 0:
        return []
    pa = ia[ca == 1][xa]
    pb = ib[cb == 1][xb]
    order = np.argsort(pa)
    pa, pb = pa[order], pb[order]
    keep = _lis(pb.tolist())
    return [(int(pa[k]), int(pb[k])) for k in keep]


def _blocks(a: np.ndarray, b: np.ndarray, ao: int, bo: int, out: list[tuple[int, int, int]], depth: int = 0) -> None:
    """Matching blocks (i, j, n) of a vs b, offset by (ao, bo), appended in order."""
    if len(a) == 0 or len(b) == 0:
        return
    if len(a) <= SMALL and len(b) <= SMALL:  # tiny gaps (between anchors): plain Python is faster
        _small(a.tolist(), b.tolist(), ao, bo, out)
        return
    p = _common_prefix(a, b)
    if p:
        out.append((ao, bo, p))
        _blocks(a[p:], b[p:], ao + p, bo + p, out, depth)
        return
    s = _common_suffix(a, b)
    if s:
        _blocks(a[:len(a) - s], b[:len(b) - s], ao, bo, out, depth)
        out.append((ao + len(a) - s, bo + len(b) - s, s))
        return
    if len(a) * len(b) <= DIFFLIB_CELLS or depth > 12:
        if len(a) * len(b) > DIFFLIB_CELLS:
            return  # a large region with no unique common id: treated as replaced whole
        sm = difflib.SequenceMatcher(None, a.tolist(), b.tolist(), autojunk=False)
        out.extend((ao + i, bo + j, n) for i, j, n in sm.get_matching_blocks() if n)
        return
    anchors = _unique_anchors(a, b)
    if not anchors:
        return
    ai = np.asarray([x for x, _y in anchors], np.int64)
    aj = np.asarray([y for _x, y in anchors], np.int64)
    cut = np.flatnonzero((np.diff(ai) != 1) | (np.diff(aj) != 1)) + 1  # runs of adjacent anchors
    starts, stops = np.concatenate(([0], cut)), np.concatenate((cut, [len(ai)]))
    pi, pj = 0, 0
    for s0, s1 in zip(starts.tolist(), stops.tolist(), strict=True):
        i, j, n = int(ai[s0]), int(aj[s0]), s1 - s0
        _blocks(a[pi:i], b[pj:j], ao + pi, bo + pj, out, depth + 1)
        out.append((ao + i, bo + j, n))
        pi, pj = i + n, j + n
    _blocks(a[pi:], b[pj:], ao + pi, bo + pj, out, depth + 1)


def _small(a: list[int], b: list[int], ao: int, bo: int, out: list[tuple[int, int, int]]) -> None:
    p = 0
    while p < len(a) and p < len(b) and a[p] == b[p]:
        p += 1
    q = 0
    while q < len(a) - p and q < len(b) - p and a[len(a) - 1 - q] == b[len(b) - 1 - q]:
        q += 1
    if p:
        out.append((ao, bo, p))
    mid_a, mid_b = a[p:len(a) - q], b[p:len(b) - q]
    if mid_a and mid_b:
        sm = difflib.SequenceMatcher(None, mid_a, mid_b, autojunk=False)
        out.extend((ao + p + i, bo + p + j, n) for i, j, n in sm.get_matching_blocks() if n)
    if q:
        out.append((ao + len(a) - q, bo + len(b) - q, q))


def _merge(blocks: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    out: list[tuple[int, int, int]] = []
    for i, j, n in sorted(blocks):
        if out and out[-1][0] + out[-1][2] == i and out[-1][1] + out[-1][2] == j:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + n)
        else:
            out.append((i, j, n))
    return out


def _ngram_cover(a: np.ndarray, b: np.ndarray, n: int = MIN_BLOCK) -> int:
    """An upper bound on the tokens any kept alignment can hold: n times the number of b's
    n-grams that also occur in a (hash collisions only raise it, so it stays a bound)."""
    if len(a) < n or len(b) < n:
        return min(len(a), len(b))

    def grams(x: np.ndarray) -> np.ndarray:
        h = np.zeros(len(x) - n + 1, np.uint64)
        with np.errstate(over="ignore"):
            for k in range(n):
                h = h * np.uint64(0x9E3779B97F4A7C15) + x[k:len(x) - n + 1 + k].astype(np.uint64)
        return h

    return int(np.isin(grams(b), grams(a)).sum()) * n


def match(a: np.ndarray, b: np.ndarray) -> tuple[str, list[tuple[int, int, int]]]:
    """(method, matching blocks) of id sequences ``a`` (reference) and ``b`` (candidate)."""
    a, b = np.asarray(a, np.int64).reshape(-1), np.asarray(b, np.int64).reshape(-1)
    if len(a) == 0 or len(b) == 0:
        return "none", []
    if len(a) == len(b) and np.array_equal(a, b):
        return "identical", [(0, 0, len(a))]
    if len(b) <= len(a):
        o = _find(a, b)
        if o >= 0:
            return "offset", [(o, 0, len(b))]
    else:
        o = _find(b, a)
        if o >= 0:
            return "offset", [(0, o, len(a))]
    if _ngram_cover(a, b) < MIN_COVER * min(len(a), len(b)):
        return "none", []  # not enough shared 4-grams for any alignment to be kept: skip the diff
    raw: list[tuple[int, int, int]] = []
    _blocks(a, b, 0, 0, raw)
    blocks = _merge(raw)
    floor = min(MIN_BLOCK, len(a), len(b))
    blocks = [blk for blk in blocks if blk[2] >= floor]
    got = sum(n for _i, _j, n in blocks)
    if got < MIN_COVER * min(len(a), len(b)) and max((n for _i, _j, n in blocks), default=0) < LONG_BLOCK:
        return "none", []  # a few shared n-grams (" of the") between different prompts are not an alignment
    return ("diff" if blocks else "none"), blocks


# -- alignment of stitched sides --------------------------------------------------------------

@dataclass
class Side:
    """One side's stitched token axis, as segments (requests) of ids and positions."""

    name: str  # 'reference' / 'candidate'
    ids: np.ndarray
    positions: np.ndarray | None
    bounds: list[tuple[int, int]]  # [start, stop) rows of each segment
    labels: list[str]


def align(ref: Side, cand: Side, tokenizer: Any = None) -> TokenAlignment:
    """Align every candidate segment with the reference segment it matches best."""
    rr: list[np.ndarray] = []
    cr: list[np.ndarray] = []
    ctx: list[np.ndarray] = []
    out = TokenAlignment(np.zeros(0, np.int64), np.zeros(0, np.int64), len(ref.ids), len(cand.ids), "none")
    methods: list[str] = []
    used_ref: set[int] = set()
    for cs, (c0, c1) in enumerate(cand.bounds):
        b = cand.ids[c0:c1]
        best: tuple[int, int, str, list] | None = None
        for rs, (r0, r1) in enumerate(ref.bounds):
            method, blocks = match(ref.ids[r0:r1], b)
            got = sum(n for _i, _j, n in blocks)
            if got and (best is None or got > best[0] or (got == best[0] and rs == cs)):
                best = (got, rs, method, blocks)
        if best is None:
            out.extra.append(_span(cand, cs, 0, c1 - c0, tokenizer))
            continue
        _got, rs, method, blocks = best
        used_ref.add(rs)
        methods.append(method)
        r0, r1 = ref.bounds[rs]
        pairs_r, pairs_c, differs = _pairs(ref, cand, rs, cs, blocks, out, tokenizer)
        rr.append(pairs_r)
        cr.append(pairs_c)
        ctx.append(differs)
    for rs, (r0, r1) in enumerate(ref.bounds):
        if rs not in used_ref and r1 > r0 and len(cand.bounds) and len(ref.bounds) > 1:
            out.notes.append(f"reference {ref.labels[rs]} ({r1 - r0} tokens) matches no candidate request")
    if rr:
        out.ref_rows, out.cand_rows, out.context = np.concatenate(rr), np.concatenate(cr), np.concatenate(ctx)
    out.method = methods[0] if len(set(methods)) == 1 else ("mixed" if methods else "none")
    return out


def _pos(side: Side, row: int, seg: int) -> int:
    if side.positions is not None:
        return int(side.positions[row])
    return row - side.bounds[seg][0]


def _pairs(ref: Side, cand: Side, rs: int, cs: int, blocks: list[tuple[int, int, int]], out: TokenAlignment,
           tokenizer: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Row pairs of one segment pair, the unaligned spans around them, and the context flags."""
    r0, r1 = ref.bounds[rs]
    c0, c1 = cand.bounds[cs]
    pr, pc, differs = [], [], []
    ri, ci = 0, 0  # next unconsumed token in each segment
    changed = False  # an insertion/deletion/replacement inside the captured tokens so far
    for k, (i, j, n) in enumerate(blocks + [(r1 - r0, c1 - c0, 0)]):
        first, last = k == 0, n == 0
        if i > ri:
            sp = _span(ref, rs, ri, i, tokenizer, "end" if last else ("start" if first else "middle"))
            if first and j == 0 and _pos(cand, c0, cs) == _pos(ref, r0 + i, rs) and _pos(cand, c0, cs) > 0:
                out.not_captured += sp.length  # the candidate's own positions say it had these in its cache
            else:
                out.missing.append(sp)
                changed = changed or not last  # tokens before the next aligned ones differ
        if j > ci:
            out.extra.append(_span(cand, cs, ci, j, tokenizer, "end" if last else ("start" if first else "middle")))
            changed = changed or not last
        if n:
            rows_r = np.arange(r0 + i, r0 + i + n)
            rows_c = np.arange(c0 + j, c0 + j + n)
            pos_r = ref.positions[rows_r] if ref.positions is not None else rows_r - r0
            pos_c = cand.positions[rows_c] if cand.positions is not None else rows_c - c0
            pr.append(rows_r)
            pc.append(rows_c)
            differs.append((pos_r != pos_c) | changed)
        ri, ci = i + n, j + n
    if not pr:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, bool)
    return np.concatenate(pr), np.concatenate(pc), np.concatenate(differs)


def _span(side: Side, seg: int, a: int, b: int, tokenizer: Any, where: str = "start") -> Span:
    s0 = side.bounds[seg][0]
    ids = side.ids[s0 + a:s0 + b].tolist()
    pos = side.positions[s0 + a:s0 + b].tolist() if side.positions is not None else None
    if a == 0 and b == side.bounds[seg][1] - s0:
        where = "whole"
    sp = Span(side.name, side.labels[seg], s0 + a, s0 + b, where, ids, pos)
    if tokenizer is not None:
        from consistency.compare.tokenizer import decode

        sp.text, sp.special = decode(tokenizer, ids)
    return sp
