"""STALE_ROWS: rows that hold an earlier row of the reference, a buffer not refreshed in time.

A runtime that reuses a buffer across steps (a CUDA graph's static input or output buffer
above all: SGLang PRs #23037 and #35546 clone graph outputs a later replay overwrites;
TensorRT-LLM PR #18207 tests for stale static inputs) feeds the draft what the buffer's last
refresh wrote. Stitched serving rows run request by request, position by position, so such
a row equals the reference's row one or more steps before it, while the rows of a fresh step
agree. The test is strict: every sampled row must agree or equal an earlier reference row
within the noise floor; a mixture (a row matching neither) is not this.
"""

from __future__ import annotations

import numpy as np

from consistency.compare.engine import Result
from consistency.compare.rowbar import NEIGHBOUR_SHARE
from consistency.contract.codes import C
from consistency.diagnose.evidence import Evidence, Explanation

MAX_STALE = 16  # how many rows back a stale row may be
MAX_BAD = 65_536  # BAD_TOKENS rows read whole to test them (two rows each per step back)
HOLD_ROW = 3.0  # a row "agrees" within 3x the slot's noise floor (engine.HOLD_FACTOR, per row)


def _earlier(ev: Evidence, r: Result, c: np.ndarray, idx: np.ndarray, same: np.ndarray,
             tol: float) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Per row: the distance to the nearest earlier reference row that matches (inf: none), how
    far back, and the bar each row was held to. A row holds an earlier row when it is within
    the floor of it *and* half as far from it as from its own row (compare.rowbar): on a
    model with massive activations neighbouring rows are closer than the floor, so the floor
    alone would neither tell a stale row from a fresh one nor find it."""
    assert r.ref is not None
    bar = np.minimum(tol, NEIGHBOUR_SHARE * same)
    back = np.full(len(idx), np.inf)
    lag = np.zeros(len(idx), dtype=np.int64)
    for k in range(1, MAX_STALE + 1):
        todo = (back > bar) & (idx >= k) & (same > 0)
        if not todo.any():
            break
        earlier = ev.ref_rows_at(r.ref.name, idx[todo] - k)
        if earlier is None:
            return None
        d = _row_rel(c[todo], earlier)
        ok = d <= bar[todo]
        hit = np.flatnonzero(todo)[ok]
        back[hit], lag[hit] = d[ok], k
    return back, lag, bar


def _explanation(before: float, after: float, rows: list[int], of: int, lags: list[int], name: str,
                 sampled: bool) -> Explanation:
    shown = ", ".join(map(str, rows[:8])) + (", ..." if len(rows) > 8 else "")
    what = f"{len(rows)} of {of} {'sampled ' if sampled else ''}token rows"
    return Explanation(C.STALE_ROWS, f"holds an earlier row of the reference ({'/'.join(map(str, lags[:4]))}"
                       f"{'...' if len(lags) > 4 else ''} step(s) back) at {what}, rows [{shown}], and agrees at the "
                       f"rest: a buffer not refreshed between steps (under CUDA graphs: a static buffer between "
                       f"replays)", before, after, name,
                       {"stale_rows": rows[:256], "stale_count": len(rows), "rows_checked": of, "steps_back": lags[:16]})


def bad_rows_stale(ev: Evidence, r: Result) -> Explanation | None:
    """The rows BAD_TOKENS would name (every one of them, not a sample) each hold an earlier
    reference row: the cause is a stale buffer, said with the same rows."""
    bad = r.bad_tokens
    if r.ref is None or not bad or len(bad) > MAX_BAD or r.metrics is None:
        return None
    idx = np.asarray(sorted(bad), dtype=np.int64)
    c = r.cand.take_rows(idx, np.float64)
    e = ev.ref_rows_at(r.ref.name, idx)
    if e is None or not np.isfinite(c).all():
        return None
    tol = HOLD_ROW * max(ev.cmp.pair_floor(r)[0], 1e-12)
    same = _row_rel(c, e)
    found = _earlier(ev, r, c, idx, same, tol)
    if found is None or not (found[0] <= found[2]).all():
        return None
    back, lag, _bar = found
    before = float(same.mean())
    return _explanation(before, float(back.mean()), [int(i) for i in idx], int(r.metrics.per_row.size),
                        sorted({int(x) for x in lag}), r.ref.name, sampled=False)


def stale_rows(ev: Evidence, r: Result) -> Explanation | None:
    """Some rows hold an earlier row of the reference (the state of a step before: stitched
    rows run request by request, position by position) and every other row agrees: a buffer
    the runtime did not refresh between steps, a CUDA graph's static buffer between replays
    (it holds what its last refresh wrote). Every sampled row must be one or the other."""
    before, c, e, idx = ev.before(r), ev.cand(r), ev.expected(r), ev.index(r)
    if before is None or c is None or e is None or idx is None or r.ref is None or len(idx) < 4:
        return None
    tol = HOLD_ROW * max(ev.cmp.pair_floor(r)[0], 1e-12)
    same = _row_rel(c, e)
    found = _earlier(ev, r, c, idx, same, tol)
    if found is None:
        return None
    back, lag, bar = found
    stale = back <= bar
    if not stale.any() or not ((same <= tol) | stale).all():
        return None
    after = float(np.where(stale, back, same).mean())
    return _explanation(before, after, sorted(int(i) for i in idx[stale]), len(idx), sorted({int(x) for x in lag[stale]}),
                        r.ref.name, sampled=True)


def _row_rel(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per-row Σ(a-b)²/(Σa²+Σb²), the rows of token_distance."""
    d = a - b
    num, den = np.einsum("ij,ij->i", d, d), np.einsum("ij,ij->i", a, a) + np.einsum("ij,ij->i", b, b)
    out = np.zeros_like(num)
    np.divide(num, den, out=out, where=den > 0)
    return out
