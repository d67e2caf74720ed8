"""Row groups: a slot that agrees on some rows and not others, explained group by group.

The bugs that exist only under CUDA graphs touch *some rows*: the decode steps a graph
replays (graphs captured before the runtime set its capture layers keep the old ones), one
request in a padded batch (the runner's row index), the graph path only (the residual
missing there). Each compared row has a provenance in the candidate's file -- its capture
key, whose metadata says eager or which graph (label, batch size, replay), and its forward
pass, prefill or decode or verify -- so the disagreeing rows are grouped by provenance and
each group identified the way compare identifies a slot, on those rows only: another
recorded stream at the same rows, a block delta (the stream minus the one before it: the
residual missing), the expected stream after a norm, another row of the reference (an earlier step of the same request is
STALE_ROWS, diagnose.stale; another request's row at the same position is ROWS_SWAPPED).
A group that matches nothing stays BAD_TOKENS; a finding is made only when every group of
disagreeing rows is explained, so the rows that match nothing are never hidden.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from consistency.compare.engine import Comparison, Result
from consistency.contract.codes import C
from consistency.contract.findings import Finding
from consistency.diagnose.evidence import Evidence
from consistency.diagnose.normfit import looks_normed, norm_fit, norm_words
from consistency.dump import names
from consistency.dump.rows import origins

MAX_ROWS = 4096  # disagreeing rows read whole (candidate, and the reference rows tried against them)
MAX_REF_ROWS = 65_536  # reference rows searched for another row the candidate holds
HOLD = 3.0  # a group holds a tensor within 3x the pair's noise floor at every row (stale.HOLD_ROW)
SHOW = 6
NORM_MIN_ROWS = 8  # a norm (with a fitted weight) is claimed for a group only on enough rows
NORM_FIT_FLOORS = 2.0  # hypotheses.NORM_FIT_FLOORS


@dataclass(frozen=True)
class Group:
    phase: str  # prefill, decode, verify
    graph: str | None  # the graph label (None: eager)
    sizes: tuple[int, ...]  # the graphs' batch sizes
    rows: tuple[int, ...]  # compared rows

    def words(self) -> str:
        if self.graph is None:
            return f"{self.phase} rows (eager)"
        return f"{self.phase} rows from graph replays ({self.graph}, bs {', '.join(map(str, self.sizes))})"


def _root_dump(d: Any) -> Any:
    for _ in range(16):
        nxt = getattr(d, "base", None)
        if nxt is None:
            return d
        d = nxt
    return d


def _passes(d: Any) -> list[np.ndarray] | None:
    for _ in range(16):
        got = getattr(d, "pass_positions", None)
        if got is not None:
            return got
        d = getattr(d, "base", None)
        if d is None:
            return None
    return None


def _phase(tag: Any, pos: np.ndarray | None) -> str:
    """decode: one token per request in the pass; verify: a graph of several tokens per
    request; prefill: an eager pass with consecutive positions."""
    if tag is not None:
        if tag.tokens is not None and tag.batch_size is not None and tag.tokens > tag.batch_size:
            return "verify"
        return "decode"
    if pos is not None and len(pos) > 1 and bool(np.any(np.diff(pos) == 1)):
        return "prefill"
    return "decode"


def groups(cmp: Comparison, r: Result, rows: list[int]) -> list[Group]:
    """The compared ``rows`` grouped by their provenance in the candidate's file."""
    root = _root_dump(cmp.cand)
    meta = root.metadata.tensors if getattr(root, "metadata", None) is not None else {}
    passes = _passes(cmp.cand)
    by: dict[tuple[str, str | None], tuple[set[int], list[int]]] = {}
    for i, o in zip(rows, origins(cmp.cand, r.cand, rows), strict=True):
        tm = meta.get(o.tensor)
        tag = getattr(tm, "graph", None)
        k = int(o.tensor.rsplit("#", 1)[1]) if "#" in o.tensor and o.tensor.rsplit("#", 1)[1].isdigit() else 1
        pos = passes[k - 1] if passes is not None and 0 < k <= len(passes) else None
        key = (_phase(tag, pos), tag.label if tag is not None else None)
        sizes, got = by.setdefault(key, (set(), []))
        if tag is not None and tag.batch_size is not None:
            sizes.add(int(tag.batch_size))
        got.append(int(i))
    return [Group(p, g, tuple(sorted(s)), tuple(rs)) for (p, g), (s, rs) in by.items()]


def _rel(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    d = a - b
    num, den = np.einsum("ij,ij->i", d, d), np.einsum("ij,ij->i", a, a) + np.einsum("ij,ij->i", b, b)
    out = np.zeros_like(num)
    np.divide(num, den, out=out, where=den > 0)
    return out


def _streams(ev: Evidence, r: Result) -> dict[int, Any]:
    """The reference's recorded streams of the slot's shape (the full views, by stream)."""
    out = {}
    assert r.ref is not None
    for n, v in ev.cmp.ref.tensors.items():
        s = ev.cmp.stream_by_values(n)  # a reference slot by what its values are (compare.refslots)
        if s is not None and s not in out and v.is_float and v.rows == r.ref.rows and v.cols == r.ref.cols:
            out[s] = v
    return out


def _identify(ev: Evidence, r: Result, rows: np.ndarray, c: np.ndarray, tol: float) -> tuple[str, str, dict] | None:
    """(code, words, detail) for one group's rows, or None: it matches nothing tried."""
    assert r.ref is not None
    streams = _streams(ev, r)
    best: tuple[float, int] | None = None
    for s, v in streams.items():
        d = float(_rel(c, v.take_rows(rows, np.float64)).max())
        if d <= tol and (best is None or d < best[0]):
            best = (d, s)
    want = r.expected_stream
    if best is not None and best[1] != want:
        return C.LAYER_MISMATCH, f"hold{'s' if len(rows) == 1 else ''} stream {best[1]}", {"holds_stream": best[1]}
    other = _other_slot(ev, r, rows, c, tol) if best is None else None
    if other is not None:
        return (C.LAYER_MISMATCH, f"hold{'s' if len(rows) == 1 else ''} what the reference put in slot "
                f"{names.parse(other).index} ({other})", {"holds": other})
    if want is not None and want - 1 in streams and want in streams:
        delta = streams[want].take_rows(rows, np.float64) - streams[want - 1].take_rows(rows, np.float64)
        if float(_rel(c, delta).max()) <= tol:
            return (C.RESIDUAL_MISSING, f"hold the block delta hidden.{want} - hidden.{want - 1} (the residual not "
                    f"added)", {"holds": f"hidden.{want} - hidden.{want - 1}"})
    if len(rows) >= NORM_MIN_ROWS:
        e = r.ref.take_rows(rows, np.float64)
        d, kind, weighted = norm_fit(c, e)
        if d <= NORM_FIT_FLOORS * tol / HOLD and looks_normed(c, e, d, tol / HOLD):
            return (C.NORM_APPLIED, f"hold the expected stream after {norm_words(kind, weighted)} "
                    "(a norm's output)", {"norm": kind, "weighted": weighted})
    if r.ref.rows <= MAX_REF_ROWS:
        j, dj = _nearest_rows(r.ref, c)
        if (dj <= tol).all() and (j != rows).all():
            both = sorted(set(j.tolist()) | set(rows.tolist()))
            at = dict(zip(both, [o.position for o in origins(ev.cmp.ref, r.ref, both)], strict=True))
            same_pos = all(at[int(a)] is not None and at[int(a)] == at[int(b)] for a, b in zip(j, rows, strict=True))
            pairs = {int(a): int(b) for a, b in zip(rows, j, strict=True)}
            shown = ", ".join(f"row {a} holds {b}" for a, b in list(pairs.items())[:SHOW])
            what = "another request's row at the same position" if same_pos else "other rows of the reference"
            more = ", ..." if len(pairs) > SHOW else ""
            return C.ROWS_SWAPPED, f"hold {what} (compared {shown}{more})", {"holds_rows": pairs}
    return None


def _other_slot(ev: Evidence, r: Result, rows: np.ndarray, c: np.ndarray, tol: float) -> str | None:
    """Another slot of a thin reference (no stream known for it) that the rows hold, the
    nearest within ``tol``: a slot list one slot off on those rows, said as the whole-slot
    LAYER_MISMATCH says it."""
    assert r.ref is not None
    best: tuple[float, str] | None = None
    for n, v in ev.cmp.ref.tensors.items():
        if n == r.ref.name or names.parse(n).kind != names.AUX or names.parse(n).index is None or \
                ev.cmp.stream_by_values(n) is not None or not v.is_float or v.rows != r.ref.rows or v.cols != r.ref.cols:
            continue
        d = float(_rel(c, v.take_rows(rows, np.float64)).max())
        if d <= tol and (best is None or d < best[0]):
            best = (d, n)
    return best[1] if best is not None else None


def _nearest_rows(ref: Any, c: np.ndarray, block: int = 4096) -> tuple[np.ndarray, np.ndarray]:
    """For each candidate row: the nearest reference row (token rel_diff) and its distance,
    the reference read block by block (memory: block x rows of ``c``)."""
    cs = np.einsum("ij,ij->i", c, c)
    best = np.full(len(c), np.inf)
    at = np.zeros(len(c), dtype=np.int64)
    for a in range(0, ref.rows, block):
        x = ref.rows_float(a, min(ref.rows, a + block), np.float64)
        sq = np.einsum("ij,ij->i", x, x)
        den = cs[:, None] + sq[None, :]
        dist = np.maximum(den - 2 * c @ x.T, 0) / np.maximum(den, 1e-300)
        j = np.argmin(dist, axis=1)
        dj = dist[np.arange(len(c)), j]
        better = dj < best
        best[better], at[better] = dj[better], j[better] + a
    return at, best


def provenance(ev: Evidence, r: Result, rows: list[int]) -> tuple[str, list[dict]]:
    """' (decode rows from graph replays (...))' and the groups, for a finding that names
    rows explained otherwise (STALE_ROWS)."""
    if not rows or len(rows) > MAX_ROWS:
        return "", []
    gs = groups(ev.cmp, r, sorted(rows))
    return (" -- " + "; ".join(f"{g.words()}: {len(g.rows)}" for g in gs),
            [{"group": g.words(), "phase": g.phase, "graph": g.graph, "batch_sizes": list(g.sizes),
              "rows": list(g.rows[:256]), "count": len(g.rows)} for g in gs])


PROBE = NORM_MIN_ROWS  # differing rows tried first as one group: most slots judged whole hold nothing row by row


def _differing(ev: Evidence, r: Result, tol: float) -> list[int]:
    """The rows of a slot judged whole that differ beyond ``tol``; none unless a probe of
    them is explained as one group (a cheap refusal for drift and for noise)."""
    assert r.ref is not None
    n = min(r.cand.rows, r.ref.rows)
    if n == 0 or n > MAX_ROWS or r.ref.rows > MAX_REF_ROWS or r.cand.rows != r.ref.rows:
        return []
    idx = np.arange(n, dtype=np.int64)
    d = _rel(r.cand.take_rows(idx, np.float64), r.ref.take_rows(idx, np.float64))
    bad = np.flatnonzero(~(d <= tol))
    probe = bad[np.linspace(0, len(bad) - 1, min(PROBE, len(bad))).astype(np.int64)] if len(bad) else bad
    c = r.cand.take_rows(probe, np.float64) if len(probe) else None
    if c is None or not np.isfinite(c).all() or _identify(ev, r, probe, c, tol) is None:
        return []
    return bad.tolist()


def explain(ev: Evidence, r: Result, label: str, base: dict, metrics: dict, every_row: bool = False) -> Finding | None:
    """One finding naming each group of disagreeing rows and what it holds, with the rows
    that agree; None unless every group is explained (BAD_TOKENS then says the rows).
    ``every_row``: the slot was judged whole (no BAD_TOKENS status: too many rows differ), so
    the differing rows are found here -- two requests' rows swapped whole, or one request's
    rows packed in the middle of another's, leave few or no rows agreeing, yet each
    differing row is one the reference recorded elsewhere."""
    if r.ref is None or r.metrics is None:
        return None
    tol = HOLD * max(ev.cmp.pair_floor(r, user=False)[0], 1e-12)
    bad = _differing(ev, r, tol) if every_row else sorted(r.bad_tokens)
    if not bad or len(bad) > MAX_ROWS:
        return None
    parts, found = [], []
    code = None
    for g in groups(ev.cmp, r, bad):
        idx = np.asarray(g.rows, dtype=np.int64)
        c = r.cand.take_rows(idx, np.float64)
        if not np.isfinite(c).all():
            return None
        got = _identify(ev, r, idx, c, tol)
        if got is None:
            return None
        code = code or got[0]
        parts.append(f"{g.words()} {got[1]} ({len(g.rows)} row{'s' if len(g.rows) > 1 else ''})")
        found.append({"group": g.words(), "phase": g.phase, "graph": g.graph, "batch_sizes": list(g.sizes),
                      "rows": list(g.rows[:256]), "count": len(g.rows), "cause": got[0], **got[2]})
    n = r.metrics.per_row.size if r.metrics.per_row is not None else 0
    good = [i for i in range(n) if i not in set(bad)]
    rest = groups(ev.cmp, r, good[:MAX_ROWS]) if good else []
    if rest:
        want = f"stream {r.expected_stream}" if r.expected_stream is not None else r.identity.canonical
        parts.append(" and ".join(g.words() for g in rest) + f" hold {want} as the reference expects")
    graphs_only = all(f["graph"] is not None for f in found) and rest and all(g.graph is None for g in rest)
    tail = ": a difference only under CUDA graphs" if graphs_only else ""
    return Finding.make(code or C.BAD_TOKENS, f"{label}: " + "; ".join(parts) + tail, identified_as=r.holds,
                        metrics=metrics, evidence={"row_groups": found, "token_rows": bad[:256], "count": len(bad)},
                        **base)
