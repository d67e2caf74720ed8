"""Anchors are claims: each ``tensors.{name}.token_index`` is checked against values before
any row is paired by it (issue 34).

A ``token_index`` says which reference row each row of a tensor stands for, and the rows
stage (compare/rows.py) pairs by it. Written by a recorder it is the pass's positions minus
the draft step; written by anyone else it is a claim, and a claim that pairs a row with the
state of another token turns a fault into a PASS (the draft fed the next token's state, its
``token_index`` shifted by one; 26 copies of one state at ``token_index=[0]*26``). What the
file's own values say, and the reference's tokens, decide:

* ``positions``: a step-0 tensor with as many rows as its forward pass has tokens holds that
  pass's tokens, row for row: its anchors are the pass's positions (recorded, or the row
  order), and an anchor the pass does not hold is no token of it;
* ``repeat``: one anchor at most once per sequence the file's own ids hold (a batch of B
  requests may hold it B times; a file without ids may batch several requests of the
  reference's one prompt, so only its own tokens bound its repeats);
* ``tokens``: rows that hold token ids (``input_ids``, a draft's step-0 ``draft_ids.0``,
  which embeds the token after its anchor) hold the token the file's own ids, and the
  reference's, have at that anchor;
* ``disagree``: tensors of one step and one pass with the same rows are row-aligned (the
  draft's input, ids, embedding, output), so they claim the same anchors.

A refuted ``token_index`` is dropped from a copy of the dump (never from the caller's): its
rows pair by order, as a file without one does, and the values decide. The problems are
numbers; diagnose words them (``TOKEN_INDEX_FALSE``).
"""

from __future__ import annotations

import copy
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from consistency.compare.types import Pair
from consistency.dump import names
from consistency.dump.reader import Dump
from consistency.dump.stitch import LAYOUT_NAMES, POSITIONS, layout, split_key
from consistency.errors import InputError

MAX_ANCHOR = 1 << 40
MAX_IDS = 1 << 24  # ids and positions read whole (8 bytes each), as dump/stitch.py bounds them
TARGET_KINDS = frozenset({names.HIDDEN, names.AUX, names.FINAL_NORM, names.RESID_MID, names.ATTN_OUT, names.MLP_OUT,
                          names.LOGITS, names.INPUT_IDS})


@dataclass(frozen=True)
class AnchorProblem:
    """One refuted claim: ``kind`` is positions / absent / repeat / tokens / disagree."""

    side: str  # "reference" or "candidate"
    tensor: str  # the capture key (``aux.0#2``)
    kind: str
    detail: dict[str, Any] = field(default_factory=dict)


def _claims(d: Dump) -> dict[str, np.ndarray]:
    """Each tensor's token_index that fits its rows (one that does not is ignored, and said, by rows.py)."""
    meta = d.metadata
    out: dict[str, np.ndarray] = {}
    for key, tm in (meta.tensors.items() if meta is not None else ()):
        idx, view = tm.token_index, d.tensors.get(key)
        if idx is None or view is None or len(idx) != view.rows or not idx:
            continue
        if all(isinstance(a, int) and 0 <= a < MAX_ANCHOR for a in idx):
            out[key] = np.asarray(idx, dtype=np.int64)
    return out


def _ints(d: Dump, key: str) -> np.ndarray | None:
    v = d.tensors.get(key)
    if v is None or v.is_float or v.numel > MAX_IDS:
        return None
    return v.read_all().reshape(-1).astype(np.int64)


def _key(base: str, c: int) -> str:
    return base if c == 1 else f"{base}#{c}"


@dataclass
class _Axis:
    """A side's own tokens: per pass its ids and positions, the sequences it holds, and
    position -> id when it holds one sequence (positions unique)."""

    ids: dict[int, np.ndarray]
    positions: dict[int, np.ndarray]
    sequences: int | None
    token_at: tuple[np.ndarray, np.ndarray] | None  # (sorted unique positions, the token at each)

    def tokens(self, at: np.ndarray) -> np.ndarray:
        """The token at each position of ``at``; -1 where this side holds none."""
        if self.token_at is None or not len(self.token_at[0]):
            return np.full(len(at), -1, dtype=np.int64)
        pos, tok = self.token_at
        i = np.clip(np.searchsorted(pos, at), 0, len(pos) - 1)
        return np.where(pos[i] == at, tok[i], -1)


def _axis(d: Dump) -> _Axis:
    ids: dict[int, np.ndarray] = {}
    pos: dict[int, np.ndarray] = {}
    for key in d.tensors:
        base, c = split_key(key)
        if base == names.INPUT_IDS and (a := _ints(d, key)) is not None:
            ids[c] = a
            v = d.tensors[key]
            if len(v.shape) == 2 and v.shape[0] > 1:  # an HF batch [B, T]: B sequences of positions 0..T-1
                pos.setdefault(c, np.tile(np.arange(v.shape[1], dtype=np.int64), v.shape[0]))
        elif base == POSITIONS and (a := _ints(d, key)) is not None:
            pos[c] = a
    for c, a in ids.items():
        if c in pos and len(pos[c]) != len(a):
            pos.pop(c)
        pos.setdefault(c, np.arange(len(a), dtype=np.int64))
    sequences = None
    if ids or pos:
        try:
            sequences = max(1, len(layout(d).segments))
        except InputError:  # stitching refuses it later, in one line; here the count is unknown
            sequences = None
    token_at = None
    if sequences == 1 and ids:  # one sequence: each position holds one token (arrays, not a dict: 2^24 ids)
        p = np.concatenate([pos[c] for c in sorted(ids)])
        t = np.concatenate([ids[c] for c in sorted(ids)])
        order = np.argsort(p, kind="stable")
        p, t = p[order], t[order]
        same = p[1:] == p[:-1]
        if not (same & (t[1:] != t[:-1])).any():  # one position, two tokens: more than one sequence
            keep = np.concatenate(([True], ~same))
            token_at = (p[keep], t[keep])
    return _Axis(ids, pos, sequences, token_at)


def _step(base: str) -> int | None:
    """The draft step a tensor belongs to (0 for the target's tensors and a draft's step-0 input)."""
    n = names.parse(base)
    if n.kind in TARGET_KINDS:
        return 0
    if n.kind in names.DRAFT_KINDS and n.index is not None:
        return n.index
    return None


def _first_diff(a: np.ndarray, b: np.ndarray) -> int:
    return int(np.flatnonzero(a != b)[0])


def _own(side: str, key: str, anchors: np.ndarray, axis: _Axis) -> AnchorProblem | None:
    """A step-0 tensor against its own pass's positions."""
    base, c = split_key(key)
    pos = axis.positions.get(c)
    if pos is None or _step(base) != 0 or base in LAYOUT_NAMES:
        return None
    if len(anchors) == len(pos):
        if not np.array_equal(anchors, pos):
            i = _first_diff(anchors, pos)
            return AnchorProblem(side, key, "positions", {"row": i, "anchor": int(anchors[i]), "position": int(pos[i]),
                                                         "rows": len(anchors), "differ": int((anchors != pos).sum())})
    elif len(anchors) < len(pos):
        outside = ~np.isin(anchors, pos)
        if outside.any():
            i = int(np.flatnonzero(outside)[0])
            return AnchorProblem(side, key, "absent", {"row": i, "anchor": int(anchors[i]), "count": int(outside.sum()),
                                                       "span": [int(pos.min()), int(pos.max())]})
    return None


def _repeat(side: str, key: str, anchors: np.ndarray, sequences: int | None) -> AnchorProblem | None:
    if sequences is None:
        return None
    anchor, times = Counter(anchors.tolist()).most_common(1)[0]
    if times <= sequences:
        return None
    return AnchorProblem(side, key, "repeat", {"anchor": int(anchor), "times": int(times), "sequences": sequences,
                                               "rows": len(anchors)})


def _tokens(side: str, key: str, anchors: np.ndarray, held: np.ndarray, own: _Axis, ref: _Axis | None) -> \
        AnchorProblem | None:
    """Rows of token ids hold the token at their anchor (``input_ids``) or the one after it
    (``draft_ids.0``: the draft's step 0 at anchor r embeds token r + 1)."""
    base, _c = split_key(key)
    n = names.parse(base)
    if base == names.INPUT_IDS:
        shift = 0
    elif n.kind == names.DRAFT_IDS and n.index == 0:
        shift = 1
    else:
        return None
    for who, axis in (("its own input_ids", own), ("the reference's input_ids", ref)):
        if axis is None or axis.token_at is None:
            continue
        want = axis.tokens(anchors + shift)
        known = want >= 0  # a position the side does not hold (the sampled token after the last) says nothing
        bad = known & (want != held)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            return AnchorProblem(side, key, "tokens", {"row": i, "anchor": int(anchors[i]), "held": int(held[i]),
                                                       "expected": int(want[i]), "by": who, "count": int(bad.sum()),
                                                       "checked": int(known.sum()), "shift": shift})
    return None


DRAFT_INPUTS = frozenset(names.DRAFT_KINDS) | {names.AUX}  # one draft step's row-aligned tensors


def _disagree(side: str, d: Dump, claims: dict[str, np.ndarray]) -> list[AnchorProblem]:
    """Row-aligned tensors (a draft step's input, ids, embedding, output: one step, one pass,
    the same rows) claiming different anchors. A draft tensor without a token_index pairs as
    rows 0..n-1 (compare/rows.py), so that is its claim here too: shifting the input's anchors
    alone leaves its ids, embedding and output on the others."""
    groups: dict[tuple[int, int, int], list[str]] = {}
    implicit: dict[str, np.ndarray] = {}
    for key, v in d.tensors.items():
        base, c = split_key(key)
        step = _step(base)
        if step is None or names.parse(base).kind not in DRAFT_INPUTS:
            continue
        if key not in claims:
            implicit[key] = np.arange(v.rows, dtype=np.int64)
        groups.setdefault((step, c, v.rows), []).append(key)
    every = {**implicit, **claims}
    out = []
    for keys in groups.values():
        told = sorted((k for k in keys if k in claims), key=names.sort_key)
        if not told:
            continue
        first = told[0]
        for other in sorted(keys, key=names.sort_key):
            if other != first and not np.array_equal(every[first], every[other]):
                i = _first_diff(every[first], every[other])
                out.append(AnchorProblem(side, first if other not in claims else other, "disagree",
                                         {"with": other if other not in claims else first, "row": i,
                                          "anchor": int(every[first if other not in claims else other][i]),
                                          "other": int(every[other if other not in claims else first][i])}))
    return out


def _check_side(side: str, d: Dump, ref_axis: _Axis | None) -> list[AnchorProblem]:
    claims = _claims(d)
    if not claims:
        return []
    own = _axis(d)
    # only the file's own tokens bound its repeats: a capture without ids may batch several
    # requests of the reference's one prompt, each standing for the same reference rows
    sequences = own.sequences
    out: list[AnchorProblem] = []
    for key, a in sorted(claims.items()):
        base, _c = split_key(key)
        got = _own(side, key, a, own) or _repeat(side, key, a, sequences)
        if got is None and base in (names.INPUT_IDS, names.draft(names.DRAFT_IDS, 0)):
            held = _ints(d, key)
            got = _tokens(side, key, a, held, own, ref_axis) if held is not None and len(held) == len(a) else None
        if got is not None:
            out.append(got)
    said = {p.tensor for p in out}
    return out + [p for p in _disagree(side, d, claims) if p.tensor not in said]


def _group(d: Dump, key: str) -> tuple[int, int, int] | None:
    """(step, pass, rows) of a draft step's tensor: the row-aligned group it belongs to."""
    base, c = split_key(key)
    step, v = _step(base), d.tensors.get(key)
    if step is None or v is None or names.parse(base).kind not in DRAFT_INPUTS:
        return None
    return step, c, v.rows


def _aligned(d: Dump, keys: set[str]) -> set[str]:
    """``keys`` and every tensor row-aligned with one of them: the draft's ids at step 0 and its
    input are one row each per anchor, so anchors refuted on one are refuted on all."""
    groups = {g for k in keys if (g := _group(d, k)) is not None}
    return set(keys) | {k for k in d.tensors if _group(d, k) in groups}


def _without(d: Dump, keys: set[str]) -> Dump:
    """A shallow copy of ``d`` whose refuted token_index entries are gone (the caller's dump is never written)."""
    meta = d.metadata.model_copy(deep=True)  # type: ignore[union-attr]
    for k in keys:
        tm = meta.tensors.get(k)
        if tm is not None:
            tm.token_index = None
    out = copy.copy(d)
    out.metadata = meta
    return out


def check(dumps: Pair[Dump]) -> tuple[Pair[Dump], tuple[AnchorProblem, ...]]:
    """Both sides' anchors against values; the dumps with refuted anchors dropped."""
    ref_claims = _claims(dumps.ref)
    cand_claims = _claims(dumps.cand)
    if not ref_claims and not cand_claims:
        return dumps, ()
    ref_axis = _axis(dumps.ref) if cand_claims or ref_claims else None
    problems = _check_side("reference", dumps.ref, None) + _check_side("candidate", dumps.cand, ref_axis)
    if not problems:
        return dumps, ()
    refuted = {side: _aligned(d, {p.tensor for p in problems if p.side == side} |
                              {p.detail["with"] for p in problems if p.side == side and p.kind == "disagree"})
               for side, d in (("reference", dumps.ref), ("candidate", dumps.cand))}
    ref = _without(dumps.ref, refuted["reference"]) if refuted["reference"] else dumps.ref
    cand = _without(dumps.cand, refuted["candidate"]) if refuted["candidate"] else dumps.cand
    return Pair(ref, cand), tuple(problems)
