"""Is one tensor another one after a norm? The structural tests the norm hypotheses share.

A norm story must survive two look-alikes: a per-column scale (a weight without the
per-row division) and a per-token scale of a tensor whose rows are already flat. The tests
below tell them apart by the rows' RMS spread and by which fit is exact.
"""

from __future__ import annotations

import math

import numpy as np

from consistency.compare.identify import token_distance
from consistency.compare.metrics import percentiles
from consistency.diagnose.evidence import fit_column_affine, fit_column_scale, rms_normalize

AFFINE_MIN_ROWS = 16  # a per-column bias is fitted only with enough rows to pin it down
AFFINE_OVER_MEAN = 10.0  # ... and claimed only when it fits 10x closer than the rows' own column mean


def norm_fit(c: np.ndarray, x: np.ndarray) -> tuple[float, str, bool]:
    """Best of RMSNorm/LayerNorm, with and without a fitted elementwise weight (and, for
    LayerNorm, a bias: GPT-NeoX's, Falcon's and Pythia's final norms have one)."""
    out = []
    for center, kind in ((False, "RMSNorm"), (True, "LayerNorm")):
        n = rms_normalize(x, center)
        plain = token_distance(c, n)
        w = fit_column_scale(c, n)
        weighted = token_distance(c, n * w)
        # a fitted weight always fits noise a little better: claim it only when it matters
        out.append((plain, kind, False) if plain <= 2 * weighted + 1e-12 else (weighted, kind, True))
        if center and c.shape[0] >= AFFINE_MIN_ROWS:
            w, b = fit_column_affine(c, n)
            biased = token_distance(c, n * w + b)
            # a bias alone fits rows that barely vary (a padded batch's rows: one pad token's
            # state, H200 graph_padrow): the norm must explain how the rows differ, not their mean
            const = token_distance(c, np.broadcast_to(c.mean(axis=0), c.shape))
            if biased * 2 + 1e-12 < out[-1][0] and biased * AFFINE_OVER_MEAN <= const:
                out.append((biased, "LayerNorm (weight and bias)", True))
    return min(out)


NORMED_SPREAD = 0.25  # a norm's output has near-equal row RMS: (p90 - p10) / median below this
FLAT_SPREAD = 0.1  # below this the rows are flat whatever the weight
# (unit weight: 0; SmolLM2-135M's final norm with its learned weight: 0.16; its streams: 0.35-0.52)


def row_spread(x: np.ndarray) -> float:
    """Spread of per-token RMS: ~0 for a norm's output (unit weight exactly), large for a
    residual stream (massive activations, growing norms); a per-token scale raises it."""
    rms = np.sqrt(np.mean(x * x, axis=1))
    rms = rms[rms > 0]
    if rms.size < 4:
        return math.inf
    p10, p50, p90 = percentiles(rms, [10, 50, 90])
    return float((p90 - p10) / p50) if p50 > 0 else math.inf


PER_ROW_EXCESS = 4.0  # flat streams: a column scale alone must leave 4x what the norm leaves ...
NORM_WITHIN = 1.0  # ... with the norm within one floor
PER_ROW_MARGIN = 0.1  # ... and the column scale past a tenth of a floor beyond it (not both within rounding)


def per_row_evidence(normed: np.ndarray, raw: np.ndarray, after: float, floor: float) -> bool:
    """Flat streams (sandwich norms, Gemma2/3; deep streams): the raw rows are nearly as
    even as the norm's output, so the spread test cannot see the norm, and in bf16 the norm
    fits only to the forward's drift (a fraction of a floor), not to 0.1 floor. What still
    says "norm" is that the per-row division explains what a per-column scale cannot: the
    column scale alone leaves PER_ROW_EXCESS times the norm's residual and a tenth of a floor
    more (a hand-made Gemma-2 dir, 8 layers, H=96, learned gains, bf16: the input norm of layer
    4 fits to 5e-5, the column scale to 1.0e-3, half a floor).
    Measured on the scenario families' real norms with learned gains in bf16: the column
    scale leaves 5-320x the norm's residual (Granite's final norm the least, 4.8x with the
    stream's own bf16 drift in the residual, which is 0.67 floor). Its look-alikes stay out: a
    global or per-column scale fits the column scale exactly (excess ~1), and a norm's uneven
    output against a per-token scale of itself fits a norm only to its own row spread (1.3-2.8
    floors over 16 rows, tests/diagnose/test_normfit.py), past NORM_WITHIN."""
    if after > NORM_WITHIN * floor:
        return False
    col = token_distance(normed, raw * fit_column_scale(normed, raw))
    return col >= PER_ROW_EXCESS * after and col - after >= PER_ROW_MARGIN * floor


def looks_normed(normed: np.ndarray, raw: np.ndarray, after: float, floor: float) -> bool:
    """The structural check a norm story needs: the normed side's rows have near-equal RMS
    and the raw side's do not. Flat rows (spread < FLAT_SPREAD: unit-weight norms, a bf16
    forward's final norm) need the usual fit; rows as uneven as a learned weight makes them
    (SmolLM2: 0.16) need a near-exact fit, because a tiny model's embedding is about that
    flat too (0.17-0.25) and a per-token scale of it would otherwise read as a norm."""
    if after <= 0.1 * floor and needs_the_norm(normed, raw, floor, after):
        return True  # exact only through the per-row division: that is what a norm is
    if per_row_evidence(normed, raw, after, floor):
        return True
    a, b = row_spread(normed), row_spread(raw)
    if b < 3 * a + 0.02:
        return False
    return a < FLAT_SPREAD or (a < NORMED_SPREAD and after <= 0.1 * floor)


PER_ROW_GAIN = 100.0  # the per-row division must bring the fit this much closer than a per-column scale alone


def needs_the_norm(normed: np.ndarray, raw: np.ndarray, floor: float, after: float | None = None) -> bool:
    """A learned gain far from 1 (DeepSeek-V3-like: 1 + 0.5 randn, a channel near 0) makes a
    norm's rows as uneven as a stream's, so the spread test above cannot see it; but a fit
    that is exact with the per-row division and far off with a per-column scale alone cannot
    be anything else (a per-token scale of a flat tensor fits neither way).

    "Far off" is 10 floors, or -- when the normed rows are not flat (spread >= FLAT_SPREAD)
    -- above one floor and PER_ROW_GAIN times the norm's own fit (``after``): a tiny model's
    raw stream over 16 tokens can be nearly as flat as its norm's output (spreads 0.18 and
    0.175: a column scale alone then comes within 1.8 floors while the norm fits to 5e-4 of
    one; tests/scenarios/mtp.py, thin reference, bf16). The look-alikes stay out: a per-token
    scale of uneven rows fits a norm only to about the square of their spread, and a
    global or per-column scale fits the column scale exactly."""
    w = fit_column_scale(normed, raw)
    col = token_distance(normed, raw * w)
    if col > 10 * floor:
        return True
    return after is not None and col > floor and after * PER_ROW_GAIN <= col and row_spread(normed) >= FLAT_SPREAD


def norm_words(kind: str, weighted: bool) -> str:
    """'RMSNorm with a weight', 'LayerNorm (weight and bias)': a fit that names its weight
    already is not said to have one twice."""
    return f"{kind} with a weight" if weighted and "weight" not in kind else kind
