"""The norm tests of diagnose/normfit.py, on tensors whose story is known by construction.

A norm's output with a learned gain is told apart from its look-alikes: a global scale, a
per-column scale and a per-token scale of the same rows. The hard case is a raw stream
nearly as flat as the norm's output (a tiny model over 16 tokens): the column scale alone
then comes within a couple of floors, and only the size of the per-row division's gain
over it says "norm".
"""

from __future__ import annotations

import numpy as np
import pytest

from consistency.diagnose.normfit import FLAT_SPREAD, looks_normed, needs_the_norm, norm_fit, row_spread

FLOOR = 2e-3  # the bf16 floor these scenarios are judged at (compare/tolerance.py)


def _rms_norm(x: np.ndarray, gain: np.ndarray) -> np.ndarray:
    return x / np.sqrt((x * x).mean(axis=1, keepdims=True) + 1e-6) * gain


def _stream(rng: np.random.Generator, rows: int, cols: int, uneven: float) -> np.ndarray:
    """Rows of a residual stream; ``uneven`` sets how much the row RMS varies."""
    x = rng.standard_normal((rows, cols))
    return x * (1 + uneven * rng.standard_normal((rows, 1))) ** 2


@pytest.mark.parametrize("seed", range(8))
def test_a_norm_of_a_nearly_flat_stream_is_a_norm(seed: int) -> None:
    rng = np.random.default_rng(seed)
    raw = _stream(rng, 16, 64, uneven=0.04)  # as flat as a tiny model's stream over 16 tokens
    gain = 1 + 0.5 * rng.standard_normal(64)  # DeepSeek-V3-like learned gain
    normed = _rms_norm(raw, gain)
    after = norm_fit(normed, raw)[0]
    assert after <= 0.1 * FLOOR
    assert row_spread(normed) >= FLAT_SPREAD
    assert looks_normed(normed, raw, after, FLOOR)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("fault", ["global", "column", "token"])
def test_scales_of_a_normed_tensor_are_not_a_norm(seed: int, fault: str) -> None:
    """Scale faults must not read as a norm, in either direction."""
    rng = np.random.default_rng(100 + seed)
    normed = _rms_norm(_stream(rng, 16, 64, uneven=0.3), 1 + 0.5 * rng.standard_normal(64))
    if fault == "global":
        other = 1.7 * normed
    elif fault == "column":
        other = normed * (1 + 0.3 * rng.standard_normal(64))
    else:
        other = normed * (1 + 0.3 * rng.standard_normal((16, 1)))
    for a, b in ((normed, other), (other, normed)):
        after = norm_fit(a, b)[0]
        assert not (after <= 0.1 * FLOOR and needs_the_norm(a, b, FLOOR, after)), (fault, after)
