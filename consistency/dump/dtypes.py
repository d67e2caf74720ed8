"""One table of dtypes shared by both file formats and by the recorder.

numpy has no bfloat16 (nor float8), so such tensors are *stored* as unsigned integers of
the same width and *named* in metadata; :func:`to_float` widens them to float32 without
torch, by bit manipulation, which keeps ``compare`` torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass

from typing import Any

import numpy as np


@dataclass(frozen=True)
class DType:
    name: str  # canonical name, as torch spells it without the "torch." prefix
    st_code: str  # safetensors header code
    storage: str  # numpy dtype of the raw bytes (little-endian)
    kind: str  # "float", "int", "bool"
    bits: int


_TABLE = [
    DType("float64", "F64", "<f8", "float", 64),
    DType("float32", "F32", "<f4", "float", 32),
    DType("float16", "F16", "<f2", "float", 16),
    DType("bfloat16", "BF16", "<u2", "float", 16),
    DType("float8_e4m3fn", "F8_E4M3", "u1", "float", 8),
    DType("float8_e5m2", "F8_E5M2", "u1", "float", 8),
    DType("int64", "I64", "<i8", "int", 64),
    DType("int32", "I32", "<i4", "int", 32),
    DType("int16", "I16", "<i2", "int", 16),
    DType("int8", "I8", "i1", "int", 8),
    DType("uint64", "U64", "<u8", "int", 64),
    DType("uint32", "U32", "<u4", "int", 32),
    DType("uint16", "U16", "<u2", "int", 16),
    DType("uint8", "U8", "u1", "int", 8),
    DType("bool", "BOOL", "|b1", "bool", 8),
]

BY_NAME: dict[str, DType] = {d.name: d for d in _TABLE}
BY_ST_CODE: dict[str, DType] = {d.st_code: d for d in _TABLE}
# numpy dtypes that map to exactly one canonical name (bf16/f8 are never inferred).
_BY_NUMPY: dict[str, DType] = {
    np.dtype(d.storage).str: d for d in _TABLE if d.name not in {"bfloat16"} and not d.name.startswith("float8")
}

# Unit round-off of each float format: the floor for "values agree within the lower
# precision". bf16 keeps 8 significant bits, fp16 11, fp32 24.
UNIT_ROUNDOFF: dict[str, float] = {
    "float64": 2.0**-53,
    "float32": 2.0**-24,
    "float16": 2.0**-11,
    "bfloat16": 2.0**-8,
    "float8_e4m3fn": 2.0**-4,
    "float8_e5m2": 2.0**-3,
}


def lookup(name: str) -> DType:
    """Canonical dtype by name; accepts ``torch.bfloat16`` and ``bf16`` spellings."""
    key = name.removeprefix("torch.").strip().lower()
    key = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
           "float": "float32", "fp64": "float64", "double": "float64", "long": "int64",
           "int": "int32"}.get(key, key)
    if key not in BY_NAME:
        raise KeyError(name)
    return BY_NAME[key]


def from_numpy(dtype: np.dtype) -> DType:
    """Canonical dtype of a numpy array's storage (never bf16: that needs metadata)."""
    d = np.dtype(dtype)
    if d.kind == "b":
        return BY_NAME["bool"]
    key = d.newbyteorder("<").str if d.itemsize > 1 else d.str
    if key not in _BY_NUMPY:
        raise KeyError(str(d))
    return _BY_NUMPY[key]


def is_float(name: str) -> bool:
    return BY_NAME[name].kind == "float"


def lower_precision(a: str, b: str) -> str:
    """The less precise of two dtypes: the one whose rounding bounds the comparison."""
    ua, ub = UNIT_ROUNDOFF.get(a, 0.0), UNIT_ROUNDOFF.get(b, 0.0)
    return a if ua >= ub else b


def _e4m3_table() -> np.ndarray:
    v = np.arange(256, dtype=np.uint16)
    sign = np.where(v & 0x80, -1.0, 1.0)
    exp = (v >> 3) & 0xF
    man = v & 0x7
    val = np.where(exp == 0, man / 8.0 * 2.0**-6, (1 + man / 8.0) * 2.0 ** (exp.astype(np.float64) - 7))
    val = sign * val
    val[(v & 0x7F) == 0x7F] = np.nan
    return val.astype(np.float32)


def _e5m2_table() -> np.ndarray:
    v = np.arange(256, dtype=np.uint16)
    sign = np.where(v & 0x80, -1.0, 1.0)
    exp = (v >> 2) & 0x1F
    man = v & 0x3
    val = np.where(exp == 0, man / 4.0 * 2.0**-14, (1 + man / 4.0) * 2.0 ** (exp.astype(np.float64) - 15))
    val = sign * val
    val[(exp == 31) & (man == 0)] = np.inf * sign[(exp == 31) & (man == 0)]
    val[(exp == 31) & (man != 0)] = np.nan
    return val.astype(np.float32)


_F8_TABLES: dict[str, np.ndarray] = {}


def to_float(raw: np.ndarray, dtype_name: str, out_dtype: type = np.float32) -> np.ndarray:
    """Widen stored values to a float array (bf16 bits -> float32 exactly)."""
    if dtype_name == "bfloat16":
        wide = raw.astype(np.uint32) << 16
        res = wide.view(np.float32)
        return res if out_dtype is np.float32 else res.astype(out_dtype)
    if dtype_name.startswith("float8"):
        if dtype_name not in _F8_TABLES:
            _F8_TABLES[dtype_name] = _e4m3_table() if dtype_name == "float8_e4m3fn" else _e5m2_table()
        return _F8_TABLES[dtype_name][raw].astype(out_dtype, copy=False)
    with np.errstate(over="ignore"):  # float64 -> float32 past its range is inf, counted as non-finite
        return raw.astype(out_dtype, copy=False)


def float32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even float32 -> bf16 bit pattern (what torch does), NaN kept NaN."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    bits = x.view(np.uint32)
    rounding = ((bits >> 16) & 1) + np.uint32(0x7FFF)
    out = ((bits + rounding) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        out[nan] = 0x7FC0
    return out


VIEW_AS = {"bfloat16": "int16", "float8_e4m3fn": "uint8", "float8_e5m2": "uint8"}  # dtypes numpy cannot hold


def torch_storage(t: Any) -> tuple[np.ndarray, str]:
    """A torch tensor's host copy as (numpy storage, canonical dtype name), bits kept for
    dtypes numpy lacks (bf16 as uint16, float8 as uint8). The one conversion the recorder
    and in-memory dumps share; torch is imported only by the caller that holds a tensor."""
    import torch

    name = str(t.dtype).removeprefix("torch.")
    x = t.detach()
    if x.device.type != "cpu":
        x = x.to("cpu")
    x = x.contiguous()
    if name in VIEW_AS:
        raw = x.view(getattr(torch, VIEW_AS[name])).numpy()
        return (raw.view(np.uint16) if raw.dtype == np.int16 else raw).copy(), name
    return x.numpy().copy(), name
