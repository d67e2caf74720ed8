"""Streaming, fp64-accumulated metrics of a (reference, candidate) tensor pair.

``rel_diff = 1 - 2Σxy/(Σx²+Σy²)`` (SGLang's comparator) is computed as the algebraically
equal ``Σ(x-y)²/(Σx²+Σy²)``, which does not cancel catastrophically when the tensors are
nearly equal. Because a few massive activations (attention-sink tokens) dominate global
sums in real models, the *token* rel_diff (the same ratio per row, averaged over rows) is
what identification and pass/fail use; the global one is reported for familiarity.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# torch.testing.assert_close defaults, by the less precise dtype of the pair.
ELEMENT_TOL: dict[str, tuple[float, float]] = {
    "float64": (1e-7, 1e-7),
    "float32": (1.3e-6, 1e-5),
    "float16": (1e-3, 1e-5),
    "bfloat16": (1.6e-2, 1e-5),
    "float8_e4m3fn": (1.25e-1, 1e-3),
    "float8_e5m2": (2.5e-1, 1e-3),
}


def row_rel_diff(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Per-row Σ(x-y)²/(Σx²+Σy²) in fp64; rows that are zero on both sides count as 0."""
    d = x - y
    num = np.einsum("ij,ij->i", d, d, dtype=np.float64)
    den = np.einsum("ij,ij->i", x, x, dtype=np.float64) + np.einsum("ij,ij->i", y, y, dtype=np.float64)
    out = np.zeros_like(num)
    np.divide(num, den, out=out, where=den > 0)
    return out


@dataclass
class PairAccumulator:
    """Fold chunks of rows into the statistics of one pair; memory is O(rows), not O(size)."""

    rows: int
    cols: int
    rtol: float
    atol: float
    numel: int = 0
    sq_diff: float = 0.0
    sq_ref: float = 0.0
    sq_cand: float = 0.0
    dot: float = 0.0
    max_abs: float = -1.0
    max_at: int = -1
    max_ref: float = math.nan
    max_cand: float = math.nan
    mismatched: int = 0
    nonfinite_ref: int = 0
    nonfinite_cand: int = 0
    first_nonfinite_ref: int | None = None
    first_nonfinite_cand: int | None = None
    per_row: np.ndarray = field(default_factory=lambda: np.zeros(0))

    def __post_init__(self) -> None:
        self.per_row = np.zeros(self.rows, dtype=np.float64)

    def add(self, start: int, ref: np.ndarray, cand: np.ndarray) -> None:
        """``ref`` and ``cand`` are float chunks [n, cols] of rows [start, start+n).

        Elementwise work stays in the chunk's float32 (half the memory traffic of fp64);
        per-row sums of squares are exact enough there (positive terms, a few ulps), and
        every running total is accumulated in fp64."""
        self.numel += ref.size
        fin_r, fin_c = np.isfinite(ref), np.isfinite(cand)
        if not (fin_r.all() and fin_c.all()):
            self._note_nonfinite(start, fin_r, fin_c)
            both = fin_r & fin_c
            ref, cand = np.where(both, ref, 0), np.where(both, cand, 0)
        x, y = ref, cand
        with np.errstate(over="ignore", invalid="ignore"):
            d = x - y
            rows_sq_d = np.einsum("ij,ij->i", d, d).astype(np.float64)
            rows_sq_x = np.einsum("ij,ij->i", x, x).astype(np.float64)
            rows_sq_y = np.einsum("ij,ij->i", y, y).astype(np.float64)
        if x.dtype != np.float64 and not (np.isfinite(rows_sq_d).all() and np.isfinite(rows_sq_x).all()
                                          and np.isfinite(rows_sq_y).all()):
            x, y = x.astype(np.float64), y.astype(np.float64)  # squares past the fp32 range: redo in fp64
            d = x - y
            rows_sq_d = np.einsum("ij,ij->i", d, d)
            rows_sq_x = np.einsum("ij,ij->i", x, x)
            rows_sq_y = np.einsum("ij,ij->i", y, y)
        self.sq_diff += float(rows_sq_d.sum())
        self.sq_ref += float(rows_sq_x.sum())
        self.sq_cand += float(rows_sq_y.sum())
        self.dot += float(np.einsum("ij,ij->i", x, y, dtype=np.float64).sum()) if x.dtype == np.float64 else \
            float(np.einsum("ij,ij->i", x, y).astype(np.float64).sum())
        den = rows_sq_x + rows_sq_y
        part = np.zeros_like(rows_sq_d)
        np.divide(rows_sq_d, den, out=part, where=den > 0)
        self.per_row[start:start + len(part)] = part
        if d.size:
            np.abs(d, out=d)
            flat = int(np.argmax(d))
            if d.flat[flat] > self.max_abs:
                self.max_abs = float(d.flat[flat])
                self.max_at = start * self.cols + flat
                self.max_ref, self.max_cand = float(x.flat[flat]), float(y.flat[flat])
            bound = np.abs(x)
            bound *= self.rtol
            bound += self.atol
            self.mismatched += int(np.count_nonzero(d > bound))

    def _note_nonfinite(self, start: int, fin_r: np.ndarray, fin_c: np.ndarray) -> None:
        bad_r, bad_c = ~fin_r, ~fin_c
        nr, nc = int(bad_r.sum()), int(bad_c.sum())
        if nr and self.first_nonfinite_ref is None:
            self.first_nonfinite_ref = start * self.cols + int(np.argmax(bad_r.reshape(-1)))
        if nc and self.first_nonfinite_cand is None:
            self.first_nonfinite_cand = start * self.cols + int(np.argmax(bad_c.reshape(-1)))
        self.nonfinite_ref += nr
        self.nonfinite_cand += nc

    def result(self) -> PairMetrics:
        den = self.sq_ref + self.sq_cand
        rel = self.sq_diff / den if den > 0 else 0.0
        norms = math.sqrt(self.sq_ref) * math.sqrt(self.sq_cand)
        cos = self.dot / norms if norms > 0 else (1.0 if self.sq_diff == 0 else 0.0)
        trd = float(self.per_row.mean()) if self.rows else 0.0
        worst = int(np.argmax(self.per_row)) if self.rows else 0
        return PairMetrics(
            numel=self.numel, rel_diff=rel, token_rel_diff=trd, worst_row=worst,
            worst_row_rel_diff=float(self.per_row[worst]) if self.rows else 0.0, cosine=cos,
            max_abs_diff=max(self.max_abs, 0.0), max_abs_at=self.max_at, max_ref=self.max_ref,
            max_cand=self.max_cand, mismatched=self.mismatched, rtol=self.rtol, atol=self.atol,
            nonfinite_ref=self.nonfinite_ref, nonfinite_cand=self.nonfinite_cand,
            first_nonfinite_ref=self.first_nonfinite_ref, first_nonfinite_cand=self.first_nonfinite_cand,
            ref_rms=math.sqrt(self.sq_ref / self.numel) if self.numel else 0.0,
            cand_rms=math.sqrt(self.sq_cand / self.numel) if self.numel else 0.0,
            per_row=self.per_row,
        )


@dataclass
class PairMetrics:
    numel: int
    rel_diff: float
    token_rel_diff: float
    worst_row: int
    worst_row_rel_diff: float
    cosine: float
    max_abs_diff: float
    max_abs_at: int
    max_ref: float
    max_cand: float
    mismatched: int
    rtol: float
    atol: float
    nonfinite_ref: int = 0
    nonfinite_cand: int = 0
    first_nonfinite_ref: int | None = None
    first_nonfinite_cand: int | None = None
    ref_rms: float = 0.0
    cand_rms: float = 0.0
    per_row: np.ndarray | None = None

    def as_dict(self, shape: tuple[int, ...] | None = None) -> dict[str, Any]:
        d: dict[str, Any] = {
            "rel_diff": _r(self.rel_diff), "token_rel_diff": _r(self.token_rel_diff),
            "cosine": _r(self.cosine), "max_abs_diff": _r(self.max_abs_diff),
            "max_abs_at": _unravel(self.max_abs_at, shape), "ref_value": _r(self.max_ref),
            "cand_value": _r(self.max_cand), "mismatched": self.mismatched, "numel": self.numel,
            "mismatched_frac": _r(self.mismatched / self.numel) if self.numel else 0.0,
            "rtol": self.rtol, "atol": self.atol, "worst_token": self.worst_row,
            "worst_token_rel_diff": _r(self.worst_row_rel_diff),
        }
        if self.nonfinite_ref or self.nonfinite_cand:
            d.update(nonfinite_ref=self.nonfinite_ref, nonfinite_cand=self.nonfinite_cand,
                     first_nonfinite_ref=_unravel(self.first_nonfinite_ref, shape),
                     first_nonfinite_cand=_unravel(self.first_nonfinite_cand, shape))
        return d

    def mismatch_sentence(self, shape: tuple[int, ...] | None = None) -> str:
        """torch.testing-style: how many elements, how far, where."""
        pct = 100.0 * self.mismatched / self.numel if self.numel else 0.0
        at = _unravel(self.max_abs_at, shape)
        return (f"Mismatched elements: {self.mismatched} / {self.numel} ({pct:.1f}%); greatest absolute difference "
                f"{self.max_abs_diff:.3g} at index {tuple(at) if at is not None else '?'} "
                f"(reference {self.max_ref:.4g}, candidate {self.max_cand:.4g})")


def _r(v: float) -> float | None:
    if v is None or not math.isfinite(v):
        return None if v is None or math.isnan(v) else (1e308 if v > 0 else -1e308)
    return float(f"{v:.6g}")


def _unravel(flat: int | None, shape: tuple[int, ...] | None) -> list[int] | None:
    if flat is None or flat < 0:
        return None
    if not shape:
        return [flat]
    return [int(i) for i in np.unravel_index(flat, shape)]


def exact_compare(ref: np.ndarray, cand: np.ndarray) -> dict[str, Any]:
    """Integer/bool tensors: equal or not, how many differ, where first."""
    r, c = ref.reshape(-1), cand.reshape(-1)
    diff = r != c
    n = int(diff.sum())
    out: dict[str, Any] = {"mismatched": n, "numel": int(r.size)}
    if n:
        i = int(np.argmax(diff))
        out.update(first_mismatch_at=_unravel(i, ref.shape), ref_value=r[i].item(), cand_value=c[i].item())
    return out
