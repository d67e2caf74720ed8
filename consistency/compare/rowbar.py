"""The per-row bar: how far one token row may be from its reference row before it is another row.

The dtype floor (x ``TOKEN_FACTOR``) bounds a row's error by the precision and by the gap
between layers, but not by the distance between *tokens*. On a model whose every row carries
massive activations (an attention sink, a large constant direction in the residual stream),
neighbouring tokens' rows are only ~1e-2 apart in token rel_diff: a row holding the previous
token's state sits below ``10 x floor`` and passed (issue 36). So each row's bar is also
bounded by the reference's own distance from that row to its neighbouring rows: a row at half
of that distance is most of the way to another token, never within the bar. The bar never goes below what this pair's own rows
show as noise (``TOKEN_FACTOR`` x their median) nor below a tenth of the floor: neighbours
that are equal (a repeated embedding) cannot make benign rounding a defect.

Only rows between the low and the high bar are read again (with their two neighbours), so
the measuring pass stays one pass; a tensor where many rows sit there reads at most
``MAX_READ`` of them (the rest keep the high bar, and the notes say so).
"""

from __future__ import annotations

import numpy as np

from consistency.compare.metrics import median
from consistency.dump.reader import TensorView

# a row half as far (rel_diff, a squared ratio: ~0.7 of the way in L2) from its own row as its
# nearest neighbour is is not this row: a row holding the neighbour sits at 1x, 2x the bar;
# SmolLM2-135M's bf16 rows are >= 3x below it (its sink row's neighbour is 6e-3 away, its bf16
# error 1e-3 at stream 3)
NEIGHBOUR_SHARE = 0.5
MAX_READ = 65_536  # suspect rows re-read with their neighbours
FLOOR_SHARE = 0.1  # the bar never falls below a tenth of the floor


def neighbour_distance(ref: TensorView, rows: np.ndarray) -> np.ndarray:
    """Per row of ``rows`` (sorted): token rel_diff between the reference's row and the nearer
    of its neighbouring rows (inf where it has none)."""
    want = np.unique(np.concatenate([rows - 1, rows, rows + 1]))
    want = want[(want >= 0) & (want < ref.rows)]
    vals = ref.take_rows(want, np.float64)
    sq = np.einsum("ij,ij->i", vals, vals)
    me = np.searchsorted(want, rows)
    out = np.full(len(rows), np.inf)
    for step in (-1, 1):
        nb = np.searchsorted(want, rows + step)
        nb_ok = (nb < len(want)) & (want[np.minimum(nb, len(want) - 1)] == rows + step)
        i, k = me[nb_ok], nb[nb_ok]
        d = vals[i] - vals[k]
        den = sq[i] + sq[k]
        rel = np.full(len(i), np.inf)
        np.divide(np.einsum("ij,ij->i", d, d), den, out=rel, where=den > 0)
        out[nb_ok] = np.minimum(out[nb_ok], rel)
    return out


def bad_rows(per_row: np.ndarray, floor: float, factor: float, ref: TensorView | None) -> np.ndarray:
    """Rows beyond their bar: ``factor x floor``, lowered to half the row's distance to its
    neighbouring reference rows (never below the pair's own noise)."""
    high = factor * floor
    if not per_row.size:
        return np.zeros(0, dtype=np.int64), np.zeros(0)
    bad = per_row > high
    low = max(factor * median(per_row), FLOOR_SHARE * floor)
    suspect = np.flatnonzero(~bad & (per_row > low))
    if ref is None or not suspect.size or low >= high or ref.rows != per_row.size:
        return np.flatnonzero(bad)
    if suspect.size > MAX_READ:
        suspect = suspect[np.argsort(per_row[suspect])[::-1][:MAX_READ]]
        suspect.sort()
    nd = neighbour_distance(ref, suspect)
    bar = np.clip(NEIGHBOUR_SHARE * nd, low, high)
    bad[suspect] = per_row[suspect] > bar
    return np.flatnonzero(bad)
