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

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import numpy as np

from consistency.compare.matching import MIN_BLOCK, match  # noqa: F401 - re-exported (replay, bench, tests)
from consistency.compare.types import Note


@dataclass(frozen=True)
class Span:
    """Tokens on one side with no counterpart on the other."""

    side: str  # 'reference' or 'candidate'
    segment: str
    start: int  # rows of that side's stitched token axis
    stop: int
    where: str  # 'start', 'end', 'middle' of its request, or 'whole'
    ids: list[int]
    positions: list[int] | None = None
    text: str | None = None  # decoded, when a tokenizer is at hand (untrusted: escape when shown)
    special: tuple[str, ...] = ()  # names of special tokens in the span

    @property
    def length(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Replacement:
    """Both sides hold other tokens at the same place: a sampled continuation (at the end),
    an edit (in the middle), another preamble (at the start). Neither span is compared."""

    ref: Span
    cand: Span

    @property
    def where(self) -> str:
        return self.cand.where if self.cand.where == self.ref.where else self.ref.where


@dataclass(frozen=True, eq=False)
class TokenAlignment:
    """The token stage's value: frozen, so a later stage (prepare's restriction, the values'
    verdict on an unproven prefix) returns a new one (``dataclasses.replace``), never edits
    this one. What the stage assumed is data (:class:`Note`); diagnose words it."""

    ref_rows: np.ndarray  # aligned pairs: reference row i <-> candidate row j
    cand_rows: np.ndarray
    ref_tokens: int
    cand_tokens: int
    method: str  # identical, offset, diff, positions, rows, none
    extra: tuple[Span, ...] = ()  # candidate tokens the reference lacks
    missing: tuple[Span, ...] = ()  # reference tokens the candidate lacks
    replaced: tuple[Replacement, ...] = ()  # both sides differ at one place
    context: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))  # per pair: context differs
    unknown: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))  # per pair: context unproven (no positions)
    not_captured: int = 0  # reference tokens the candidate had in its context but did not record
    uncaptured: tuple[Span, ...] = ()  # those tokens: a prefix cache, a gap its positions jump
    cached_by_values: int = 0  # of them, tokens only the values proved cached (a capture without positions)
    ref_uncaptured: tuple[Span, ...] = ()  # candidate tokens in the reference's context, not recorded
    prefix_values: str = ""  # unproven contexts after the values were read: "same", "differ" ("": not read)
    stitching: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))  # side -> what stitching did
    notes: tuple[Note, ...] = ()  # what the stage did or assumed (diagnose.words.note words each)
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
        """The alignment as JSON data; ``notes`` are the Notes as data (the report puts its
        worded ones in their place)."""
        return {"method": self.method, "reference_tokens": self.ref_tokens, "candidate_tokens": self.cand_tokens,
                "compared": self.compared, "same_context": self.same_context_rows,
                "context_differs": self.context_differs, "not_captured": self.not_captured,
                "not_captured_spans": [_span_json(s) for s in self.uncaptured],
                "cached_by_values": self.cached_by_values,
                "reference_not_captured_spans": [_span_json(s) for s in self.ref_uncaptured],
                "ids_checked": self.ids_checked,
                "notes": [{"key": n.key, **dict(n.data)} for n in self.notes],
                "extra": [_span_json(s) for s in self.extra], "missing": [_span_json(s) for s in self.missing],
                "replaced": [{"where": r.where, "reference": _span_json(r.ref), "candidate": _span_json(r.cand)}
                             for r in self.replaced],
                "stitching": dict(self.stitching)}


def _span_json(s: Span) -> dict[str, Any]:
    return {"side": s.side, "segment": s.segment, "start": s.start, "stop": s.stop, "where": s.where,
            "ids": s.ids[:64], "positions": (s.positions or [])[:1] + (s.positions or [])[-1:], "text": s.text,
            "special": list(s.special)}


# -- alignment of stitched sides --------------------------------------------------------------

@dataclass
class Side:
    """One side's stitched token axis, as segments (requests) of ids and positions."""

    name: str  # 'reference' / 'candidate'
    ids: np.ndarray
    positions: np.ndarray | None
    bounds: list[tuple[int, int]]  # [start, stop) rows of each segment
    labels: list[str]
    split: frozenset[int] = frozenset()  # segments cut from one capture at another request's tokens
    declared: bool = False  # positions declared (DP ownership), not recorded: where they differ, the values decide


def split_requests(ref: Side, cand: Side) -> Side:
    """Cut a candidate segment where its tokens go on as *another* reference request.

    A capture that records neither request ids nor positions (or whose positions run on)
    is one segment even when it holds several requests back to back. Matched against one
    reference request, the others' tokens would be left over as "decode steps" and never
    compared. Where the tokens after (or before) the best match match another reference
    request of at least MIN_BLOCK tokens, the segment is cut there and each part aligned
    on its own; the part after a cut, in a capture without positions, has an unproven
    context (it ran after the part before it, or as a request of its own: the values
    decide, compare.prepare.context_by_values). With positions, the positions decide."""
    if len(ref.bounds) < 2:
        return cand
    bounds, labels, split = list(cand.bounds), list(cand.labels), set(cand.split)
    i = 0
    while i < len(bounds) and len(bounds) <= len(cand.bounds) + len(ref.bounds):
        c0, c1 = bounds[i]
        best = _best(ref, cand.ids[c0:c1])
        cut = None
        if best is not None:
            rs, blocks = best
            lo, hi = blocks[0][1], blocks[-1][1] + blocks[-1][2]
            rest = [k for k in range(len(ref.bounds)) if k != rs]
            if c1 - c0 - hi >= MIN_BLOCK and _best(ref, cand.ids[c0 + hi:c1], rest) is not None:
                cut = c0 + hi
            elif lo >= MIN_BLOCK and _best(ref, cand.ids[c0:c0 + lo], rest) is not None:
                cut = c0 + lo
        if cut is None:
            i += 1
            continue
        bounds[i:i + 1] = [(c0, cut), (cut, c1)]
        labels[i:i + 1] = [labels[i], f"{labels[i]} (from row {cut})"]
        split = {k + 1 if k > i else k for k in split} | ({i + 1} if cand.positions is None else set())
    if len(bounds) == len(cand.bounds):
        return cand
    return Side(cand.name, cand.ids, cand.positions, bounds, labels, frozenset(split), cand.declared)


def _best(ref: Side, b: np.ndarray, among: list[int] | None = None) -> tuple[int, list] | None:
    """(reference segment, blocks) that ``b`` matches best, or None."""
    best: tuple[int, int, list] | None = None
    for rs in (among if among is not None else range(len(ref.bounds))):
        r0, r1 = ref.bounds[rs]
        _method, blocks = match(ref.ids[r0:r1], b)
        got = sum(n for _i, _j, n in blocks)
        if got >= min(MIN_BLOCK, len(b)) and got and (best is None or got > best[0]):
            best = (got, rs, blocks)
    return (best[1], best[2]) if best is not None else None


def align(ref: Side, cand: Side, tokenizer: Any = None) -> TokenAlignment:
    """Align every candidate segment with the reference segment it matches best; where
    candidate tokens were left over beside several reference requests, a segment may hold
    them back to back: it is cut (:func:`split_requests`) and aligned again."""
    out = _align(ref, cand, tokenizer)
    left = [sp.length for sp in out.extra] + [r.cand.length for r in out.replaced]
    if len(ref.bounds) > 1 and any(n >= MIN_BLOCK for n in left):
        cut = split_requests(ref, cand)
        if cut is not cand:
            return _align(ref, cut, tokenizer)
    return out


@dataclass
class _Parts:
    """What one alignment collects while it walks the segments (local to :func:`_align`; the
    value it returns is the frozen :class:`TokenAlignment`)."""

    extra: list[Span] = field(default_factory=list)
    missing: list[Span] = field(default_factory=list)
    replaced: list[Replacement] = field(default_factory=list)
    uncaptured: list[Span] = field(default_factory=list)
    ref_uncaptured: list[Span] = field(default_factory=list)
    not_captured: int = 0


def _align(ref: Side, cand: Side, tokenizer: Any) -> TokenAlignment:
    rr: list[np.ndarray] = []
    cr: list[np.ndarray] = []
    ctx: list[np.ndarray] = []
    unk: list[np.ndarray] = []
    out = _Parts()
    notes: list[Note] = []
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
        pairs_r, pairs_c, differs, unproven = _pairs(ref, cand, rs, cs, blocks, out, tokenizer)
        rr.append(pairs_r)
        cr.append(pairs_c)
        ctx.append(differs)
        unk.append(unproven)
    for rs, (r0, r1) in enumerate(ref.bounds):
        if rs not in used_ref and r1 > r0 and len(cand.bounds) and len(ref.bounds) > 1:
            notes.append(Note.of("request_unmatched", request=ref.labels[rs], tokens=r1 - r0))
    empty = np.zeros(0, np.int64)
    rows = (np.concatenate(rr), np.concatenate(cr)) if rr else (empty, empty)
    per_pair = {"context": np.concatenate(ctx), "unknown": np.concatenate(unk)} if rr else {}
    method = methods[0] if len(set(methods)) == 1 else ("mixed" if methods else "none")
    return TokenAlignment(rows[0], rows[1], len(ref.ids), len(cand.ids), method, extra=tuple(out.extra),
                          missing=tuple(out.missing), replaced=tuple(out.replaced), not_captured=out.not_captured,
                          uncaptured=tuple(out.uncaptured), ref_uncaptured=tuple(out.ref_uncaptured),
                          notes=tuple(notes), **per_pair)


def _pos(side: Side, row: int, seg: int) -> int:
    if side.positions is not None:
        return int(side.positions[row])
    return row - side.bounds[seg][0]


def _pairs(ref: Side, cand: Side, rs: int, cs: int, blocks: list[tuple[int, int, int]], out: _Parts,
           tokenizer: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Row pairs of one segment pair, the unaligned spans around them, and per pair whether
    its context differs and whether that is only unproven (nothing recorded the positions).

    Reference tokens the candidate lacks do not change the candidate's context when its own
    positions say it had them (they continue across the gap): a prefix cache, a token held
    by another data-parallel rank, a pass not captured. Without candidate positions, a
    missing prefix is unproven: the values decide (compare.prepare.context_by_values). The
    same holds the other way round (a serving capture given as the reference)."""
    r0, r1 = ref.bounds[rs]
    c0, c1 = cand.bounds[cs]
    pr, pc, differs, unproven = [], [], [], []
    ri, ci = 0, 0  # next unconsumed token in each segment
    changed = False  # an insertion/deletion/replacement inside the captured tokens so far
    unsure = False  # tokens in front only one side has, and no positions on the other side to tell
    definite = False  # a change the values cannot undo (tokens the candidate has and the reference lacks, ...)
    for k, (i, j, n) in enumerate(blocks + [(r1 - r0, c1 - c0, 0)]):
        first, last = k == 0, n == 0
        where = "end" if last else ("start" if first else "middle")
        ref_gap = _span(ref, rs, ri, i, tokenizer, where) if i > ri else None
        cand_gap = _span(cand, cs, ci, j, tokenizer, where) if j > ci else None
        if ref_gap is not None and cand_gap is not None:
            out.replaced.append(Replacement(ref_gap, cand_gap))
            changed = changed or not last
            definite = definite or not last
        elif ref_gap is not None:
            if not last and cand.positions is not None and _pos(cand, c0 + j, cs) == _pos(ref, r0 + i, rs) and \
                    (not first or _pos(cand, c0, cs) > 0):
                out.not_captured += ref_gap.length  # the candidate's positions continue across: it had these
                out.uncaptured.append(ref_gap)
            elif first and j == 0 and (cand.positions is None or cand.declared):
                out.missing.append(ref_gap)
                changed, unsure = True, True  # a prefix cache or a truncated prompt: the values tell
            else:
                out.missing.append(ref_gap)
                changed = changed or not last  # tokens before the next aligned ones differ
                definite = definite or not last
        elif cand_gap is not None:
            if first and not last and ref.positions is not None and _pos(ref, r0, rs) > 0 and \
                    _pos(ref, r0, rs) == _pos(cand, c0 + j, cs):
                out.ref_uncaptured.append(cand_gap)  # the reference's positions start after these: it had them
            elif first and not last and ref.positions is None:
                out.extra.append(cand_gap)
                changed, unsure = True, True  # the reference's prefix cache, or a template: the values tell
            else:
                out.extra.append(cand_gap)
                changed = changed or not last
                definite = definite or not last
        if n:
            rows_r = np.arange(r0 + i, r0 + i + n)
            rows_c = np.arange(c0 + j, c0 + j + n)
            pos_r = ref.positions[rows_r] if ref.positions is not None else rows_r - r0
            pos_c = cand.positions[rows_c] if cand.positions is not None else rows_c - c0
            pr.append(rows_r)
            pc.append(rows_c)
            moved = pos_r != pos_c
            d = moved | changed | (cs in cand.split)
            differs.append(d)
            claim = (ref.declared or cand.declared) and not definite  # declared positions: a claim the values test
            unproven.append(d & (((unsure or cs in cand.split) and not definite) | (moved & claim & (not changed))))
        ri, ci = i + n, j + n
    if not pr:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, bool), np.zeros(0, bool)
    return np.concatenate(pr), np.concatenate(pc), np.concatenate(differs), np.concatenate(unproven)


def _span(side: Side, seg: int, a: int, b: int, tokenizer: Any, where: str = "start") -> Span:
    s0 = side.bounds[seg][0]
    ids = side.ids[s0 + a:s0 + b].tolist()
    pos = side.positions[s0 + a:s0 + b].tolist() if side.positions is not None else None
    if a == 0 and b == side.bounds[seg][1] - s0:
        where = "whole"
    if tokenizer is None:
        return Span(side.name, side.labels[seg], s0 + a, s0 + b, where, ids, pos)
    from consistency.compare.tokenizer import decode

    text, special = decode(tokenizer, ids)
    return Span(side.name, side.labels[seg], s0 + a, s0 + b, where, ids, pos, text, tuple(special))
