"""Pair rows by anchor (``TensorMeta.token_index``), not by row number (issue 19).

A serving capture of a draft does not hold the rows a training reference holds: its step 0
is the prompt pass (T rows; the last is paired with the sampled token, which a reference
never has) and its steps >= 1 are one row per request, all at anchor T-1 after the
prefill (docs/integrations/mtp.md). The recorder writes each row's anchor (the draft row
r it is: position minus k) into ``token_index``; a side without it is rows 0..n-1. When
either side of a pair has one, the pair is compared on the anchors both sides hold, in
the reference's order, and what only one side holds is said (never dropped silently):
:class:`RowPairing` in ``Result.rows``. A pair with no common anchor is not compared at
all (``Status.unverified``, the reference view dropped): never OK.

Repeated anchors (several requests in one batch) pair occurrence by occurrence: the i-th
row at anchor a on one side meets the i-th at anchor a on the other, the batch order the
runtime keeps across a chain's steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from consistency.compare.result import Status
from consistency.dump import names
from consistency.dump.reader import Dump, TensorView

if TYPE_CHECKING:
    from consistency.compare.align import Plan
    from consistency.compare.result import Result

MAX_LISTED = 16  # anchors listed per side in a report; the count is always given
MAX_ANCHOR = 1 << 40
MAX_BYTES = 1 << 30  # a paired subset is held in memory: larger tensors keep strict row pairing
Key = tuple[int, int]  # (anchor, occurrence)


@dataclass
class RowPairing:
    """How one pair's rows met: compared on ``compared`` common anchors; the rest one-sided."""

    compared: int
    cand_rows: int
    ref_rows: int
    cand_only: list[int] = field(default_factory=list)  # anchors only the candidate has (first MAX_LISTED)
    ref_only: list[int] = field(default_factory=list)
    n_cand_only: int = 0
    n_ref_only: int = 0
    origin: str = ""  # which side's token_index paired them
    past_end: bool = False  # every candidate-only anchor lies past the reference's last one (drafted continuation)
    ref_span: tuple[int, int] | None = None  # the reference's first and last anchor
    cand_keys: list[Key] = field(default_factory=list)  # (anchor, occurrence) of each row of ``Result.cand`` as held
    ref_keys: list[Key] = field(default_factory=list)  # ... of ``Result.ref`` (empty when it was dropped)

    @property
    def one_sided(self) -> bool:
        return bool(self.n_cand_only or self.n_ref_only)

    def words(self) -> str:
        """One clause for a report: how many rows were compared and what was left out."""
        s = f"{self.compared} of {self.cand_rows} candidate rows compared by anchor ({self.origin})"
        if self.n_cand_only:
            s += f"; not compared, candidate only: anchor{'s' if self.n_cand_only > 1 else ''} " \
                 f"{_fmt(self.cand_only, self.n_cand_only)}"
            if self.past_end:
                s += " (past the reference's last anchor: a runtime drafts it from the sampled token, which no " \
                     "training reference holds)"
        if self.n_ref_only:
            s += f"; reference only: anchor{'s' if self.n_ref_only > 1 else ''} {_fmt(self.ref_only, self.n_ref_only)}"
        return s

    def as_dict(self) -> dict:
        return {"compared": self.compared, "candidate_rows": self.cand_rows, "reference_rows": self.ref_rows,
                "candidate_only": self.cand_only, "candidate_only_count": self.n_cand_only,
                "reference_only": self.ref_only, "reference_only_count": self.n_ref_only,
                "paired_by": self.origin, "past_reference_end": self.past_end,
                "reference_span": list(self.ref_span) if self.ref_span else None}

    def none_words(self) -> str:
        """One clause for a pair with no common anchor."""
        span = f"anchors {self.ref_span[0]}..{self.ref_span[1]}" if self.ref_span else "no rows"
        pl = "s" if self.n_cand_only > 1 else ""
        s = f"the candidate's row{pl} at anchor{pl} " \
            f"{_fmt(self.cand_only, self.n_cand_only)} {'have' if self.n_cand_only > 1 else 'has'} no reference row " \
            f"(the reference holds {span}; paired by {self.origin})"
        if self.past_end:
            s += ": past the reference's last anchor, where a runtime drafts from the sampled token"
        return s


def _fmt(xs: list[int], n: int) -> str:
    return str(xs) if n <= len(xs) else f"{xs} ... ({n} in all)"


def anchors(d: Dump, view: TensorView, notes: list[str] | None = None, side: str = "") -> list[int] | None:
    """The validated ``token_index`` of a tensor, one anchor per row, or None (absent, or
    one that does not fit: the file is untrusted, so a bad one is ignored and said)."""
    meta = d.metadata.tensors.get(view.name) if d.metadata is not None else None
    idx = meta.token_index if meta is not None else None
    if idx is None:
        return None
    ok = len(idx) == view.rows and all(isinstance(a, int) and 0 <= a < MAX_ANCHOR for a in idx)
    if not ok:
        if notes is not None:
            notes.append(f"{side} {view.name}: token_index ignored ({len(idx)} entries for {view.rows} rows, or "
                         f"not anchors >= 0); its rows are paired by order")
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


def step0_prefixes(ref: Dump, results: list[Result], made: list[TensorView]) -> list[TensorView]:
    """Rows 0..n-1 of the reference's target streams (``hidden.*``, ``final_norm``) for each
    row count n of a draft's step-0 input (``aux.0`` on either side) shorter than them, so
    identification sees what that input is across the row offset: row r of a draft's step 0
    is position r (shift pairing drops the last row, which has no next token)."""
    if not any(names.parse(n).kind in names.DRAFT_KINDS for n in ref.tensors):
        return []
    counts = {v.rows for v in [r.cand for r in results if r.slot == 0] + [ref.tensors.get(names.aux(0))]
              if v is not None and v.is_float}
    have = {(v.name, v.rows) for v in made}
    out = []
    for v in ref.tensors.values():
        if not v.is_float or v.cols < 2 or names.parse(v.name).kind not in (names.HIDDEN, names.FINAL_NORM):
            continue
        out += [prefix(v, n) for n in sorted(counts) if 0 < n < v.rows and (v.name, n) not in have]
    return out


def pair(ref: Dump, cand: Dump, results: list[Result], plan: Plan) -> list[TensorView]:
    """Pair every result whose sides carry a token_index by anchor; returns the reference
    subsets made (fingerprinted beside the full views of their names: :func:`with_subsets`).

    Without any token_index, one pair still meets by anchor: a last-state draft's step-0
    input (``aux.0``, a post-norm slot) with fewer rows than the target stream it expects.
    Row r of a draft step 0 is position r by the names' definition (shift pairing drops the
    last row, which has no next token: docs/format.md), so it meets rows 0..n-1 of the stream."""
    made: list[TensorView] = []
    notes = plan.notes
    post_norm = {sp.index for sp in plan.slots if sp.post_norm}
    if plan.consumer is not None and plan.consumer.kind.value in ("mtp", "eagle1", "medusa"):
        post_norm.add(0)  # a last-state draft's one slot, whatever norm state its contract names
    for r in results:
        if r.ref is None or r.concat_of is not None:
            continue
        ca, ra = anchors(cand, r.cand, notes, "candidate"), anchors(ref, r.ref, notes, "reference")
        prefix = ca is None and ra is None and r.slot in post_norm and r.cand.cols == r.ref.cols \
            and 0 < r.cand.rows < r.ref.rows and names.parse(r.ref.name).kind in (names.HIDDEN, names.FINAL_NORM)
        if ca is None and ra is None and not prefix:
            continue
        if max(r.cand.nbytes, r.ref.nbytes) > MAX_BYTES:
            notes.append(f"{r.name}: too large to pair by token_index; its rows are paired by order")
            continue
        origin = "token_index of both sides" if ca is not None and ra is not None else \
            "the candidate's token_index" if ca is not None else "the reference's token_index" if ra is not None \
            else "row r of a draft's step 0 is position r"
        ca = ca if ca is not None else list(range(r.cand.rows))
        ra = ra if ra is not None else list(range(r.ref.rows))
        ck, rk = keys(ca), keys(ra)
        rpos = {k: j for j, k in enumerate(rk)}
        cpos = {k: i for i, k in enumerate(ck)}
        common = [k for k in rk if k in cpos]  # the reference's order
        c_rows, r_rows = [cpos[k] for k in common], [rpos[k] for k in common]
        c_only = [k[0] for k in ck if k not in rpos]
        r_only = [k[0] for k in rk if k not in cpos]
        last = max(ra) if ra else -1
        r.rows = RowPairing(len(common), r.cand.rows, r.ref.rows, c_only[:MAX_LISTED], r_only[:MAX_LISTED],
                            len(c_only), len(r_only), origin, bool(c_only) and min(c_only) > last,
                            (min(ra), last) if ra else None)
        if not common:
            r.rows.cand_keys = ck
            r.ref = None
            r.status = Status.unverified  # judged here: nothing of the pair can be compared
            continue
        if c_rows != list(range(r.cand.rows)):
            r.cand = _rows_of(r.cand, c_rows)
        if r_rows != list(range(r.ref.rows)):
            r.ref = _rows_of(r.ref, r_rows)
            made.append(r.ref)
        r.rows.cand_keys = r.rows.ref_keys = common
    return made + step0_prefixes(ref, results, made)


def with_subsets(pool: list[TensorView], made: list[TensorView]) -> list[TensorView]:
    """The fingerprint pool with the paired reference subsets: a subset sits beside the full
    view of its name (another shape, so another fingerprint group; the full one still pairs
    with a candidate of its own shape) and replaces it only where the shape is the same."""
    subs = [v for v in made if v.is_float and v.cols > 1]
    taken = {(v.name, v.rows, v.cols) for v in subs}
    return subs + [v for v in pool if (v.name, v.rows, v.cols) not in taken]


def view_keys(r: Result, side: str) -> list[Key]:
    """(anchor, occurrence) of the rows ``Result.cand`` / ``Result.ref`` hold now."""
    got = (r.rows.cand_keys if side == "cand" else r.rows.ref_keys) if r.rows is not None else []
    if got:
        return got
    v = r.cand if side == "cand" else r.ref
    return [(i, 0) for i in range(v.rows)] if v is not None else []
