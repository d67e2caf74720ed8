"""Causes that are not a property of one tensor's values against one reference tensor.

* **Root cause first**: one divergence propagates (a missing embedding all-reduce makes
  every later stream differ). The first divergent stream in forward order is the cause;
  later streams that differ without an explanation of their own are its consequences, so
  the headline names one fix.
* **A few bad tokens**: EAGLE accepts token by token, so one wrong position (BOS, position
  0) is a defect even when the mean over 1,200 tokens is within the floor.
* **Zeros are not a norm**: an all-zero slot or a zeroed feature column fits "a norm with
  a weight" perfectly (the weight is zero); it is reported as what it is.
* **Thin references**: training files that hold only the aux slots cannot rule out an
  off-by-one layer; say so instead of calling it drift, and say where the slot lies
  between the streams they do record (diagnose.thin).
"""

from __future__ import annotations

import numpy as np

from consistency.compare.engine import Comparison, Result, Status
from consistency.contract.codes import C
from consistency.contract.findings import Finding, with_property
from consistency.diagnose import rownames, shards, thin
from consistency.diagnose.evidence import Evidence
from consistency.diagnose.rootcause import fold_consequences
from consistency.dump import names

CONSEQUENCE_CODES = tuple(sorted(with_property("consequence", "stream")))
SHOW_TOKENS = 8


def _fmt_rows(rows: list[int]) -> str:
    more = f", ... ({len(rows)} in all)" if len(rows) > SHOW_TOKENS else ""
    return "[" + ", ".join(str(i) for i in rows[:SHOW_TOKENS]) + more + "]"


def bad_tokens(ev: Evidence, r: Result, label: str, base: dict, metrics: dict) -> Finding:
    """The tensor agrees except at a few positions: name them (first few and a count)."""
    shard = shards.partial_shard(ev, r)
    if shard is not None and _is_shard(ev, r, shard.detail):
        return Finding.make(C.PARTIAL_SHARD, f"{label} {shard.message}",
                            identified_as=ev.cmp.name_by_values(shard.identified_as),
                            metrics=metrics, evidence={"before": shard.before, "after": shard.after, **shard.detail},
                            **base)
    m = r.metrics
    assert m is not None and m.per_row is not None and r.floor is not None
    rows = r.bad_tokens
    found = rownames.locate(ev.cmp, r, rows[:256])
    positions = sorted(rownames.positions(found))
    zero = _zero_among(r, rows)
    worst = max(float(m.per_row[i]) for i in rows)
    what = f"{len(rows)} of {m.per_row.size} token rows differ far beyond the floor (worst token rel_diff " \
           f"{worst:.3g}, > {r.floor * 10:.2g}) while the rest agree: compared rows {_fmt_rows(rows)}"
    if not rownames.identity(r, found, rows[:256]):
        what += f" -- in the files: {rownames.sentence(ev.cmp, r, rows[:256], found)}"
    if zero:
        what += f"; {len(zero)} of them are all zeros"
    if 0 in positions:
        what += "; position 0 is among them (BOS handling, the first token's embedding)"
    return Finding.make(C.BAD_TOKENS, f"{label}: {what}", identified_as=r.holds, metrics=metrics,
                        evidence={"token_rows": rows[:256], "count": len(rows), "positions": positions[:256],
                                  "zero_rows": zero[:256], "rows_in_files": rownames.evidence(found)}, **base)


SHARD_SUM_FLOORS = 3.0  # rank files: their sum must come within 3 floors of the expected tensor


def _is_shard(ev: Evidence, r: Result, detail: dict) -> bool:
    """A few bad rows are a missing all-reduce only with evidence: the rank files' sum is
    the expected tensor, or the zero rows follow a shard (shards.partial_shard, which
    returns nothing for rows that follow none, whatever the metadata's world size)."""
    if detail.get("ranks"):
        shard = shards.partial_shard(ev, r)
        return shard is not None and shard.after <= SHARD_SUM_FLOORS * ev.cmp.pair_floor(r, user=False)[0]
    return True


def _zero_among(r: Result, rows: list[int]) -> list[int]:
    if not rows or len(rows) > 4096:
        return []
    vals = r.cand.take_rows(np.asarray(rows[:4096]), np.float64)
    return [rows[i] for i in np.flatnonzero(~(vals != 0).any(axis=1))]


def zeroed(ev: Evidence, r: Result, label: str, base: dict, metrics: dict) -> Finding | None:
    """All zeros, or feature columns that are zero on every sampled token."""
    c, e = ev.cand(r), ev.expected(r)
    if c is None or e is None or not np.any(e):
        return None
    if not np.any(c):
        return Finding.make(C.ZERO_VALUES, f"{label} is all zeros on every sampled token; the reference is not "
                            f"(an unfilled capture buffer, or a capture that never ran)", metrics=metrics,
                            evidence={"columns": "all"}, **base)
    zc = np.flatnonzero(~(c != 0).any(axis=0) & (e != 0).any(axis=0) & ~_model_zero_columns(ev, r))
    if len(zc) == 0:
        return None
    cols = [int(i) for i in zc]
    return Finding.make(C.ZERO_VALUES, f"{label}: {len(cols)} of {c.shape[1]} feature columns are zero on every "
                        f"sampled token where the reference is not: columns {_fmt_rows(cols)} (a missing gather of "
                        f"a column shard, or a partly written buffer)", metrics=metrics,
                        evidence={"columns": cols[:256], "count": len(cols)}, **base)


def _model_zero_columns(ev: Evidence, r: Result) -> np.ndarray:
    """Columns some recorded reference tensor of the slot's shape is zero in on every sampled
    row: the model's own (a norm weight of 0 in one channel zeroes it in that norm's outputs
    and every block delta after it), not a missing gather of a column shard."""
    fp = ev.cmp.ref_fp.get(ev.key(r))
    out = np.zeros(r.cand.cols, dtype=bool)
    if fp is None:
        return out
    for n in fp.names:
        x = fp.rows(n)
        if x is not None and x.shape[1] == out.size and np.any(x):
            out |= ~(x != 0).any(axis=0)
    return out


def zero_rows(ev: Evidence, r: Result, label: str, base: dict, metrics: dict) -> Finding | None:
    """Most token rows of a slot all zeros where the reference's are not, following no shard
    (that is PARTIAL_SHARD, tried first): an unwritten buffer, not an unexplained difference.
    Slots only: a stream or block output downstream of a divergence stays UNKNOWN, so it
    folds into its root cause (an EP partial on a diverged input also has zero rows)."""
    c, e = ev.cand(r), ev.expected(r)
    if c is None or e is None or r.slot is None:
        return None
    zero = ~(c != 0).any(axis=1) & (e != 0).any(axis=1)
    if zero.sum() < 2 or zero.mean() <= 0.5:
        return None
    idx = ev.index(r)
    rows = [int(idx[i]) for i in np.flatnonzero(zero)] if idx is not None else [int(i) for i in np.flatnonzero(zero)]
    return Finding.make(C.ZERO_VALUES, f"{label}: {int(zero.sum())} of {len(zero)} sampled token rows are all zeros "
                        f"where the reference's are not (rows {_fmt_rows(rows)}), and they follow no vocab or expert "
                        f"shard: a capture buffer written for some tokens only", metrics=metrics,
                        evidence={"token_rows": rows[:256], "count": len(rows), "sampled_rows": len(zero)}, **base)


def thin_note(ev: Evidence, r: Result) -> str:
    """Why an unexplained difference may still be another layer, and where the slot lies
    between the streams a thin reference records (diagnose.thin)."""
    return thin.note(ev, r)


def group_consequences(cmp: Comparison, findings: list[Finding]) -> list[Finding]:
    """Later unexplained differences become consequences of the first divergent stream.

    Only recorded streams and block outputs (by-name pairs) take part: each aux slot is
    what the draft reads, so its finding stays its own."""
    by_name = {r.name: r for r in cmp.results if r.slot is None and r.concat_of is None}  # streams, not slots

    def order(f: Finding) -> int | None:
        return _stream_of_result(cmp, by_name[f.tensor]) if f.tensor in by_name else None

    return fold_consequences(
        findings, order, follows=lambda f, _root: f.code in CONSEQUENCE_CODES, where=lambda f: f.tensor or "?",
        scope="tensor", root_ok=lambda f: by_name[f.tensor or ""].status not in (Status.unpaired, Status.unverified),
        consequence_codes=CONSEQUENCE_CODES)


def _stream_of_result(cmp: Comparison, r: Result) -> int | None:
    if r.expected_stream is not None:
        return r.expected_stream
    k = r.identity
    if k.kind in (names.MLP_OUT, names.ATTN_OUT) and k.index is not None:
        return k.index + 1  # layer k's block output feeds stream k+1
    return None


def slot_positions(cmp: Comparison, slots: list[Result]) -> tuple[list[int | None], list[int | None]]:
    """Slot indices for the story of a thin reference: which reference slot each candidate
    slot was meant to equal, and which one it does equal (None: none of them)."""
    ref_slots = {v.name: i for i, v in cmp.plan.ref.slots.items()}
    expected: list[int | None] = []
    actual: list[int | None] = []
    for r in slots:
        expected.append(ref_slots.get(r.expected or ""))
        held = r.verdict.held
        group = r.ident.group if r.ident and held and r.ident.best and r.ident.best.name == held else (held,)
        actual.append(next((ref_slots[g] for g in group if g in ref_slots), None))
    return expected, actual
