"""What precision do the values really have, and how much error does storing them cost?

Two facts a dtype label gets wrong on inputs other people write:

* numpy has no bfloat16, so most npz files hold bf16 (or fp16) values upcast to float32
  (``t.float().numpy()``). The label says float32; the values carry 8 (or 11) significant
  bits. Judging them against the float32 floor turns bf16 rounding into NUMERIC_DRIFT
  errors and real layer mismatches into UNKNOWN. :func:`effective_dtype` reads the
  precision off the values: bf16 values stored as float32 have their low 16 bits zero;
  fp16 values survive a round trip through float16 exactly.
* A float8 training file (speculators' FP8 connector) carries a storage error that depends
  on the data, not a constant: a 5e-2 floor lets a capture one layer off pass, while the
  measured error of a float8 copy is ~4e-4 (SmolLM2-135M). :func:`storage_floor` rounds the
  other side's values to the narrow format and measures what that costs on these tensors.
"""

from __future__ import annotations

import numpy as np

from consistency.dump import dtypes

MIN_VALUES = 64  # fewer non-zero sampled values than this say nothing about precision
MIN_SHARE = 0.9  # a few garbage tokens must not hide the precision of the rest (random fp32: 1/65536 pass)
STORAGE_MARGIN = 4.0  # storage error of both sides plus headroom (measured: SmolLM2 fp8 copy 4e-4 -> floor 1.6e-3)
NARROW = ("float8_e4m3fn", "float8_e5m2")
_F8_MAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}


def effective_dtype(label: str, sample: np.ndarray) -> str:
    """The dtype the values were computed in, where the label is wider than the values."""
    if label != "float32" or sample.size == 0:
        return label
    x = np.ascontiguousarray(sample, dtype=np.float32).reshape(-1)
    x = x[np.isfinite(x) & (x != 0)]
    if x.size < MIN_VALUES:
        return label
    if np.mean((x.view(np.uint32) & np.uint32(0xFFFF)) == 0) >= MIN_SHARE:
        return "bfloat16"
    with np.errstate(over="ignore"):
        if np.mean(x.astype(np.float16).astype(np.float32) == x) >= MIN_SHARE:
            return "float16"
    return label


def round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    """``x`` rounded to a narrow float format, per row scaled into its range (as the FP8
    hidden-state connectors store them: one scale per token)."""
    x = np.asarray(x, dtype=np.float64)
    if dtype == "bfloat16":
        return dtypes.to_float(dtypes.float32_to_bf16_bits(x.astype(np.float32)), "bfloat16", np.float64)
    if dtype == "float16":
        with np.errstate(over="ignore"):
            return x.astype(np.float16).astype(np.float64)
    if dtype not in NARROW:
        return x
    table = dtypes.to_float(np.arange(256, dtype=np.uint8), dtype, np.float64)
    grid = np.unique(table[np.isfinite(table)])
    scale = np.abs(x).max(axis=-1, keepdims=True) / _F8_MAX[dtype]
    scale[scale == 0] = 1.0
    y = x / scale
    i = np.clip(np.searchsorted(grid, y), 1, len(grid) - 1)
    lo, hi = grid[i - 1], grid[i]
    return np.where(np.abs(y - lo) <= np.abs(hi - y), lo, hi) * scale


def storage_error(sample: np.ndarray, dtype: str) -> float:
    """Token rel_diff between the values and their copy stored in ``dtype`` (mean over rows)."""
    if sample.size == 0:
        return 0.0
    x = np.asarray(sample, dtype=np.float64)
    d = x - round_to(x, dtype)
    num = np.einsum("ij,ij->i", d, d)
    den = 2.0 * np.einsum("ij,ij->i", x, x)
    out = np.zeros_like(num)
    np.divide(num, den, out=out, where=den > 0)
    return float(out.mean())


def storage_floor(sample: np.ndarray, dtype: str) -> float:
    """The floor a narrow storage format earns on these values (STORAGE_MARGIN x measured)."""
    return STORAGE_MARGIN * storage_error(sample, dtype)


def effective_dtypes(fingerprints: dict[str, dict], labels: dict[tuple[str, str], str]) -> dict[str, dict[str, str]]:
    """Every float32 tensor's real precision, read off its sampled rows: side -> name ->
    dtype, for those whose values are of a narrower dtype than their label."""
    out: dict[str, dict[str, str]] = {side: {} for side in fingerprints}
    for side, fps in fingerprints.items():
        for fp in fps.values():
            for name in fp.names:
                if labels.get((side, name)) != "float32":
                    continue
                eff = effective_dtype("float32", fp.rows(name))
                if eff != "float32":
                    out[side][name] = eff
    return out
