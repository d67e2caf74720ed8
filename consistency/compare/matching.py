"""Sequence matching of two id streams: an exact offset, else a diff anchored on unique ids.

The aligner (:mod:`consistency.compare.tokens`) calls :func:`match` once per request
pair. Identical ids, one sequence inside the other (a byte search over the packed ids, C
speed), else a diff: common prefix and suffix trimmed, a patience diff on ids unique to
both sides (O(n log n)), short gaps finished by :mod:`difflib`. Blocks shorter than
:data:`MIN_BLOCK` are dropped, and a diff covering less than :data:`MIN_COVER` of the shorter
side without one :data:`LONG_BLOCK` run is no alignment (different prompts share n-grams).
"""

from __future__ import annotations

import difflib
from bisect import bisect_left

import numpy as np

MIN_BLOCK = 4  # shorter matching blocks are coincidence, unless a sequence is that short
DIFFLIB_CELLS = 4_096  # gaps larger than this (len a * len b) are split on unique anchors first
SMALL = 24  # gaps this short on both sides go straight to difflib
MIN_COVER = 0.2  # an alignment covers at least this share of the shorter side ...
LONG_BLOCK = 64  # ... or holds one run this long; else the sides share no prompt


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
