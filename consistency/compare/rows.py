"""The rows stage: pair rows by anchor (``TensorMeta.token_index``), not by row number.

A serving capture of a draft does not hold the rows a training reference holds: its step 0
is the prompt pass (T rows; the last is paired with the sampled token, which a reference
never has) and its steps >= 1 are one row per request, all at anchor T-1 after the
prefill (docs/integrations/mtp.md). The recorder writes each row's anchor (the draft row
r it is: position minus k) into ``token_index``; a side without it is rows 0..n-1. When
either side of a pair has one, the pair is compared on the anchors both sides hold, in
the reference's order, and what only one side holds is said (never dropped silently):
:class:`RowPairing`. A pair with no common anchor is not compared at all (the reference
view dropped; judged ``Status.unverified``): never OK.

Repeated anchors (several requests in one batch) pair occurrence by occurrence: the i-th
row at anchor a on one side meets the i-th at anchor a on the other, the batch order the
runtime keeps across a chain's steps.
"""

from __future__ import annotations

import numpy as np

from consistency.compare.expect import LAST_STATE
from consistency.compare.types import Key, Note, Pair, Plan, RowPairing, Rows
from consistency.dump import names
from consistency.dump.reader import Dump, TensorView

MAX_LISTED = 16  # anchors listed per side in a report; the count is always given
MAX_ANCHOR = 1 << 40
MAX_BYTES = 1 << 30  # a paired subset is held in memory: larger tensors keep strict row pairing


def anchors(d: Dump, view: TensorView, notes: list[Note] | None = None, side: str = "") -> list[int] | None:
    """The validated ``token_index`` of a tensor, one anchor per row, or None (absent, or
    one that does not fit: the file is untrusted, so a bad one is ignored and said)."""
    meta = d.metadata.tensors.get(view.name) if d.metadata is not None else None
    idx = meta.token_index if meta is not None else None
    if idx is None:
        return None
    ok = len(idx) == view.rows and all(isinstance(a, int) and 0 <= a < MAX_ANCHOR for a in idx)
    if not ok:
        if notes is not None:
            notes.append(Note.of("token_index_ignored", side=side, tensor=view.name, entries=len(idx), rows=view.rows))
        return None
    return [int(a) for a in idx]


def keys(anchor_list: list[int]) -> list[Key]:
    """(anchor, occurrence): the i-th row at anchor a is (a, i)."""
    seen: dict[int, int] = {}
    out = []
    for a in anchor_list:
        n = seen.get(a, 0)
        seen[a] = n + 1
        out.append((a, n))
    return out


def row_map(d: Dump, view: TensorView) -> dict[Key, int]:
    """Row of each (anchor, occurrence) of a tensor (rows 0..n-1 without a token_index)."""
    a = anchors(d, view)
    return {k: i for i, k in enumerate(keys(a if a is not None else list(range(view.rows))))}


def subset(view: TensorView, rows: list[int]) -> TensorView:
    """An in-memory view of the given rows (in that order); the same name and dtype."""
    idx = np.asarray(rows, dtype=np.int64)
    raw = view.read_rows(0, view.rows)
    part = np.ascontiguousarray(raw[idx])
    shape = (len(rows),) if len(view.shape) == 1 else (len(rows), view.cols)
    return TensorView(view.name, view.dtype, shape, part.dtype, None, 0, view.path, part)


def prefix(view: TensorView, n: int) -> TensorView:
    """Rows 0..n-1 of a tensor, read lazily from the same file (no copy)."""
    if view._cols is not None:  # a column slice of a concatenated tensor: copy its rows
        return subset(view, list(range(n)))
    shape = (n,) if len(view.shape) == 1 else (n, view.cols)
    return TensorView(view.name, view.dtype, shape, view._storage, view._fd, view._offset, view.path, view._array)


def _rows_of(view: TensorView, rows: list[int]) -> TensorView:
    return prefix(view, len(rows)) if rows == list(range(len(rows))) else subset(view, rows)


def _ref_view(ref: Dump, plan: Plan, name: str | None) -> TensorView | None:
    if name is None:
        return None
    if name in ref.tensors:
        return ref.tensors[name]
    return next((v for v in plan.ref.slots.values() if v.name == name), None)


def pair(dumps: Pair[Dump], plan: Plan) -> tuple[dict[str, Rows], list[TensorView], list[Note]]:
    """The rows of every entry; the reference subsets made (fingerprinted beside the full
    views of their names); notes. Without any token_index, one pair still meets by anchor:
    a last-state draft's step-0 input (``aux.0``, a post-norm slot) with fewer rows than the
    target stream it expects (row r of a draft step 0 is position r: docs/format.md)."""
    ref, cand = dumps.ref, dumps.cand
    out: dict[str, Rows] = {}
    made: list[TensorView] = []
    notes: list[Note] = []
    post_norm = {e.slot for e in plan.slots if e.expect.post_norm}
    if plan.consumer is not None and plan.consumer.kind in LAST_STATE:
        post_norm.add(0)  # a last-state draft's one slot, whatever norm state its contract names
    for e in plan.entries:
        rv = _ref_view(ref, plan, e.expect.tensor)
        if rv is None or e.concat_of is not None:
            out[e.name] = Rows(e.cand, rv)
            continue
        got = _pair_one(ref, cand, e.name, e.cand, rv, e.slot in post_norm, notes)
        if got.ref is not None and got.ref is not rv:
            made.append(got.ref)
        out[e.name] = got
    return out, made + step0_prefixes(ref, plan, made, cand), notes


def _pair_one(ref: Dump, cand: Dump, name: str, cv: TensorView, rv: TensorView, post_norm: bool,
              notes: list[Note]) -> Rows:
    ca, ra = anchors(cand, cv, notes, "candidate"), anchors(ref, rv, notes, "reference")
    # a last-state draft's step 0 without anchors: row r is position r on both sides, whichever
    # holds more rows (SafeAILab-style data keeps all T; shift pairing drops the last; a serving
    # step 0 has T, the last drafted from the sampled token)
    step0 = ca is None and ra is None and post_norm and cv.cols == rv.cols and cv.rows != rv.rows \
        and min(cv.rows, rv.rows) > 0 and names.parse(rv.name).kind in (names.HIDDEN, names.FINAL_NORM, names.AUX)
    if ca is None and ra is None and not step0:
        return Rows(cv, rv)
    if max(cv.nbytes, rv.nbytes) > MAX_BYTES:
        notes.append(Note.of("too_large_to_pair", tensor=name))
        return Rows(cv, rv)
    origin = "both" if ca is not None and ra is not None else "candidate" if ca is not None else \
        "reference" if ra is not None else "step0"
    ca = ca if ca is not None else list(range(cv.rows))
    ra = ra if ra is not None else list(range(rv.rows))
    ck, rk = keys(ca), keys(ra)
    rpos = {k: j for j, k in enumerate(rk)}
    cpos = {k: i for i, k in enumerate(ck)}
    common = [k for k in rk if k in cpos]  # the reference's order
    c_rows, r_rows = [cpos[k] for k in common], [rpos[k] for k in common]
    c_only = [k[0] for k in ck if k not in rpos]
    r_only = [k[0] for k in rk if k not in cpos]
    last = max(ra) if ra else -1
    base = dict(compared=len(common), cand_rows=cv.rows, ref_rows=rv.rows, cand_only=tuple(c_only[:MAX_LISTED]),
                ref_only=tuple(r_only[:MAX_LISTED]), n_cand_only=len(c_only), n_ref_only=len(r_only), origin=origin,
                past_end=bool(c_only) and min(c_only) > last, ref_span=(min(ra), last) if ra else None)
    if not common:
        return Rows(cv, None, RowPairing(**base, cand_keys=tuple(ck)))
    c_view = cv if c_rows == list(range(cv.rows)) else _rows_of(cv, c_rows)
    r_view = rv if r_rows == list(range(rv.rows)) else _rows_of(rv, r_rows)
    return Rows(c_view, r_view, RowPairing(**base, cand_keys=tuple(common), ref_keys=tuple(common)))


def step0_prefixes(ref: Dump, plan: Plan, made: list[TensorView], cand: Dump | None = None) -> list[TensorView]:
    """Rows 0..n-1 of the reference's target streams (``hidden.*``, ``final_norm``) for each
    row count n of a draft's step-0 input (``aux.0`` on either side) shorter than them, so
    identification sees what that input is across the row offset: row r of a draft's step 0
    is position r (shift pairing drops the last row, which has no next token). A draft dump
    is one with per-step tensors on either side, or a last-state consumer (the reference's
    claim or the user's declaration): a reference of target streams only still names what
    a serving step 0 was fed."""
    drafts = [d for d in (ref, cand) if d is not None]
    last = plan.consumer is not None and plan.consumer.kind in LAST_STATE
    if not last and not any(names.parse(n).kind in names.DRAFT_KINDS for d in drafts for n in d.tensors):
        return []
    views = [e.cand for e in plan.slots if e.slot == 0] + [ref.tensors.get(names.aux(0))]
    counts = {v.rows for v in views if v is not None and v.is_float}
    have = {(v.name, v.rows) for v in made}
    out = []
    for v in ref.tensors.values():
        if not v.is_float or v.cols < 2 or names.parse(v.name).kind not in (names.HIDDEN, names.FINAL_NORM):
            continue
        out += [prefix(v, n) for n in sorted(counts) if 0 < n < v.rows and (v.name, n) not in have]
    return out


def with_subsets(pool: list[TensorView], made: list[TensorView]) -> list[TensorView]:
    """The fingerprint pool with the paired reference subsets: a subset sits beside the full
    view of its name (another shape, so another fingerprint group; the full one still pairs
    with a candidate of its own shape) and replaces it only where the shape is the same."""
    subs = [v for v in made if v.is_float and v.cols > 1]
    taken = {(v.name, v.rows, v.cols) for v in subs}
    return subs + [v for v in pool if (v.name, v.rows, v.cols) not in taken]


def view_keys(rows: Rows, side: str) -> list[Key]:
    """(anchor, occurrence) of the rows a compared view holds."""
    p = rows.pairing
    got = list(p.cand_keys if side == "cand" else p.ref_keys) if p is not None else []
    if got:
        return got
    v = rows.cand if side == "cand" else rows.ref
    return [(i, 0) for i in range(v.rows)] if v is not None else []
