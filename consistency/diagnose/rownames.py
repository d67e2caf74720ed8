"""Name compared rows as the files name them, on each side.

After stitching (verify passes, chunked prefill), alignment (a prefix-cache suffix, a
template in front) and row pairing (anchors), row i of a compared pair is some row of some
capture in each file: ``aux.0#3`` row 2 at position 107 on one side, ``aux.0`` row 107 on the
other. A finding that names "row 1" names nothing a user can open; every row, position and
token a finding names (bad tokens, the worst token, ``max_abs_at``) is said here as each
file's own tensor, row and position (dump.rows.origins).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from consistency.compare.engine import Comparison, Result
from consistency.dump.rows import Origin, origins

SHOW = 8


def locate(cmp: Comparison, r: Result, rows: Sequence[int]) -> dict[str, list[Origin]]:
    """{"reference": [...], "candidate": [...]}: each compared row's file row on each side."""
    out = {"candidate": origins(cmp.cand, r.cand, rows)}
    if r.ref is not None:
        out["reference"] = origins(cmp.ref, r.ref, rows)
    return out


def identity(r: Result, found: dict[str, list[Origin]], rows: Sequence[int]) -> bool:
    """Every compared row is the same row of the same-named tensor on both sides (nothing to say)."""
    names = {"candidate": r.cand.name, "reference": r.ref.name if r.ref is not None else None}
    return all(o.tensor == names[side] and o.row == i and o.file is None
               for side, os in found.items() for o, i in zip(os, rows, strict=True))


def _runs(xs: list[int]) -> str:
    """[1, 2, 3, 7] -> '1..3, 7' (the first few runs)."""
    if not xs:
        return ""
    out, a, b = [], xs[0], xs[0]
    for x in xs[1:]:
        if x == b + 1:
            b = x
            continue
        out.append(f"{a}..{b}" if b > a else f"{a}")
        a = b = x
    out.append(f"{a}..{b}" if b > a else f"{a}")
    return ", ".join(out[:SHOW]) + (", ..." if len(out) > SHOW else "")


def words(os: list[Origin]) -> str:
    """'aux.0#3 rows 2..3 (positions 107..108)', grouped by tensor (and file)."""
    groups: dict[tuple[str | None, str], list[Origin]] = {}
    for o in os:
        groups.setdefault((o.file, o.tensor), []).append(o)
    parts = []
    for (file, tensor), g in list(groups.items())[:4]:
        rows = [o.row for o in g]
        pos = [o.position for o in g if o.position is not None]
        s = f"{file + ' ' if file else ''}{tensor} row{'s' if len(rows) > 1 else ''} {_runs(rows)}"
        if len(pos) == len(g) and pos != rows:
            s += f" (position{'s' if len(pos) > 1 else ''} {_runs(pos)})"
        parts.append(s)
    return "; ".join(parts) + ("; ..." if len(groups) > 4 else "")


def sentence(cmp: Comparison, r: Result, rows: Sequence[int], found: dict[str, list[Origin]] | None = None) -> str:
    """'candidate aux.0#2 rows 22..23 (positions 22..23), reference aux.0 rows 22..23'."""
    found = found if found is not None else locate(cmp, r, rows)
    label = {"candidate": cmp.plan.cand.label, "reference": cmp.plan.ref.label}
    return ", ".join(f"{label[side]} {words(os)}" for side, os in (("candidate", found.get("candidate", [])),
                                                                   ("reference", found.get("reference", []))) if os)


def positions(found: dict[str, list[Origin]]) -> set[int]:
    """Every position the rows sit at, on either side (as the files say)."""
    return {o.position for os in found.values() for o in os if o.position is not None}


def evidence(found: dict[str, list[Origin]]) -> dict[str, Any]:
    return {side: [o.as_dict() for o in os[:256]] for side, os in found.items()}


def annotate(cmp: Comparison, r: Result, metrics: dict[str, Any]) -> dict[str, Any]:
    """``metrics`` (PairMetrics.as_dict) with ``worst_token_at`` / ``max_abs_at_rows``: where
    the worst token and the greatest difference sit in each file, when that is not simply
    the same row of the same tensor on both sides."""
    if not metrics or r.metrics is None or r.cand.rows == 0:
        return metrics
    at: dict[str, int] = {}
    if metrics.get("worst_token") is not None:
        at["worst_token_at"] = int(metrics["worst_token"])
    if metrics.get("max_abs_at") is not None and r.metrics.max_abs_at >= 0:
        at["max_abs_at_rows"] = int(r.metrics.max_abs_at) // max(r.cand.cols, 1)  # flat index -> row
    at = {k: v for k, v in at.items() if 0 <= v < r.cand.rows}
    if not at:
        return metrics
    rows = sorted(set(at.values()))
    found = locate(cmp, r, rows)
    if identity(r, found, rows):
        return metrics
    by_row = {i: {side: os[n].as_dict() for side, os in found.items()} for n, i in enumerate(rows)}
    return dict(metrics, **{k: by_row[v] for k, v in at.items()})


def at_max(cmp: Comparison, r: Result) -> str:
    """' -- in the files: ...' for the greatest difference's row, when the files name it otherwise."""
    if r.metrics is None or r.metrics.max_abs_at < 0 or r.cand.rows == 0:
        return ""
    row = int(r.metrics.max_abs_at) // max(r.cand.cols, 1)
    if not 0 <= row < r.cand.rows:
        return ""
    found = locate(cmp, r, [row])
    return "" if identity(r, found, [row]) else f" (row {row} compared: {sentence(cmp, r, [row], found)})"
