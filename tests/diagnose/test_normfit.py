"""The norm tests of diagnose/normfit.py, on tensors whose story is known by construction.

A norm's output with a learned gain is told apart from its look-alikes: a global scale, a
per-column scale and a per-token scale of the same rows. (A per-token scale of *flat* rows
is a tensor whose norm is those rows: NORM_* is a true description of it, not a look-alike.) The hard case is a raw stream
nearly as flat as the norm's output (a tiny model over 16 tokens): the column scale alone
then comes within a couple of floors, and only the size of the per-row division's gain
over it says "norm".
"""

from __future__ import annotations

import numpy as np
import pytest

from consistency.compare.identify import token_distance
from consistency.diagnose.evidence import fit_column_scale
from consistency.diagnose.normfit import FLAT_SPREAD, looks_normed, needs_the_norm, norm_fit, row_spread

FLOOR = 2e-3  # the bf16 floor these scenarios are judged at (compare/tolerance.py)


def _rms_norm(x: np.ndarray, gain: np.ndarray) -> np.ndarray:
    return x / np.sqrt((x * x).mean(axis=1, keepdims=True) + 1e-6) * gain


def _gain(rng: np.random.Generator, cols: int = 64) -> np.ndarray:
    """A learned gain far from 1 (DeepSeek-V3-like) with a few loud channels, so the norm's
    rows are uneven (row-RMS spread well above FLAT_SPREAD) whatever the seed."""
    g = 1 + 0.5 * rng.standard_normal(cols)
    g[:4] = 3.0
    return g


def _stream(rng: np.random.Generator, rows: int, cols: int, uneven: float) -> np.ndarray:
    """Rows of a residual stream; ``uneven`` sets how much the row RMS varies."""
    x = rng.standard_normal((rows, cols))
    return x * (1 + uneven * rng.standard_normal((rows, 1))) ** 2


@pytest.mark.parametrize("seed", range(8))
def test_a_norm_of_a_nearly_flat_stream_is_a_norm(seed: int) -> None:
    rng = np.random.default_rng(seed)
    raw = _stream(rng, 16, 64, uneven=0.04)  # as flat as a tiny model's stream over 16 tokens
    normed = _rms_norm(raw, _gain(rng))
    after = norm_fit(normed, raw)[0]
    assert after <= 0.1 * FLOOR
    assert row_spread(normed) >= FLAT_SPREAD
    assert looks_normed(normed, raw, after, FLOOR)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("fault", ["global", "column", "token"])
def test_scales_of_uneven_normed_rows_are_not_a_norm(seed: int, fault: str) -> None:
    """Scale faults of a norm's output with a learned gain (uneven rows) must not read as a
    norm, in either direction: the norm does not fit them within the 0.1-floor gate."""
    rng = np.random.default_rng(100 + seed)
    normed = _rms_norm(_stream(rng, 16, 64, uneven=0.3), _gain(rng))
    if fault == "global":
        other = 1.7 * normed
    elif fault == "column":
        other = normed * (1 + 0.3 * rng.standard_normal(64))
    else:
        other = normed * (1 + 0.3 * rng.standard_normal((16, 1)))
    for a, b in ((normed, other), (other, normed)):
        after = norm_fit(a, b)[0]
        assert after > 0.1 * FLOOR and not looks_normed(a, b, after, FLOOR), (fault, after)


@pytest.mark.parametrize("seed", range(8))
def test_the_per_row_rule_asks_for_each_of_its_conditions(seed: int) -> None:
    """needs_the_norm's second rule on its own, with the norm's fit handed in: it needs the
    per-column scale to miss by more than a floor, the norm to beat it 100-fold, and the
    normed rows to be uneven; a global or per-column scale (which the column scale fits
    exactly) never passes, whatever fit is claimed for the norm."""
    rng = np.random.default_rng(200 + seed)
    raw = _stream(rng, 16, 64, uneven=0.04)
    normed = _rms_norm(raw, _gain(rng))
    col = token_distance(normed, raw * fit_column_scale(normed, raw))
    assert FLOOR < col <= 10 * FLOOR  # the hard case: the old 10-floor rule alone says no
    assert needs_the_norm(normed, raw, FLOOR, after=col / 200)
    assert not needs_the_norm(normed, raw, FLOOR, after=col / 50)  # not 100x better
    assert not needs_the_norm(normed, raw, FLOOR)  # no fit handed in: the old rule only
    assert not needs_the_norm(normed, raw, 2 * col, after=0.0)  # the column scale is within a floor
    flat = _rms_norm(raw, np.ones(64))  # a unit-gain norm: flat rows, the per-token look-alike
    assert row_spread(flat) < FLAT_SPREAD
    flat_col = token_distance(flat, raw * fit_column_scale(flat, raw))
    assert not (FLOOR < flat_col <= 10 * FLOOR) or not needs_the_norm(flat, raw, FLOOR, after=0.0)
    for other in (1.7 * normed, normed * (1 + 0.3 * rng.standard_normal(64))):
        assert not needs_the_norm(other, normed, FLOOR, after=0.0)
        assert not needs_the_norm(normed, other, FLOOR, after=0.0)


def test_a_bias_fitted_to_near_constant_rows_is_no_norm() -> None:
    """A padded batch's rows read for a real request (H200 graph_padrow): one pad token's
    state, nearly the same row again and again. A LayerNorm with a fitted weight and bias
    'fits' them by its bias alone (weight ~0); that is no evidence of a norm."""
    from consistency.diagnose.normfit import norm_fit

    rng = np.random.default_rng(3)
    expected = rng.standard_normal((20, 64)) * rng.uniform(0.5, 3.0, (20, 1))  # real tokens' rows
    pad = rng.standard_normal(64)
    cand = pad + 1e-3 * rng.standard_normal((20, 64))  # the same pad row, 20 times
    d, kind, _w = norm_fit(cand, expected)
    assert kind != "LayerNorm (weight and bias)", (d, kind)
    # a real LayerNorm with weight and bias over the same rows is still found
    x = expected - expected.mean(1, keepdims=True)
    ln = x / np.sqrt((x * x).mean(1, keepdims=True)) * rng.uniform(0.5, 1.5, 64) + rng.standard_normal(64) * 0.3
    d, kind, w = norm_fit(ln, expected)
    assert kind == "LayerNorm (weight and bias)" and w and d < 1e-12
