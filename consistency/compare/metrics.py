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

BLOCK_ELEMS = 1 << 18  # elements per block (1 MB in fp32): fewer GIL trips per byte than 1<<17, still cache-sized (bench: 16-core 0.116 s vs 0.135 s at 4 workers, Kimi 3 pairs)


class Scratch:
    """Per-thread block buffers, allocated once and reused for every block of every pair:
    fresh multi-MB temporaries per chunk cost page faults and DRAM traffic on every pass."""

    def __init__(self) -> None:
        self._bufs: dict[tuple[str, int, object], np.ndarray] = {}

    def get(self, what: str, rows: int, cols: int, dtype: np.dtype | type) -> np.ndarray:
        """A C-contiguous ``[rows, cols]`` buffer (the first rows of a reused one)."""
        key = (what, cols, dtype)
        buf = self._bufs.get(key)
        if buf is None or buf.shape[0] < rows:
            if len(self._bufs) > 64:  # many widths in one run: keep the memory bounded
                self._bufs.clear()
            buf = self._bufs[key] = np.empty((max(rows, block_rows(cols)), cols), dtype=dtype)
        return buf if buf.shape[0] == rows else buf[:rows]


def _rowdot(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row dot products; numpy >= 2 has a BLAS-backed ``vecdot`` (~1.4x einsum's speed)."""
    return np.vecdot(a, b) if _VECDOT else np.einsum("ij,ij->i", a, b)


_VECDOT = hasattr(np, "vecdot")


def block_rows(cols: int) -> int:
    return max(1, BLOCK_ELEMS // max(1, cols))


@dataclass
class PairAccumulator:
    """Fold blocks of rows into the statistics of one pair; memory is O(rows), not O(size).

    Per-row sums (Σd², Σx², Σy², Σxy) are kept per row in fp64 and summed once at the end,
    so the result does not depend on how rows were split into chunks, blocks or threads
    (except in a block redone in fp64 because its squares pass the fp32 range);
    :meth:`shard` gives another thread its own scalars over the same per-row arrays."""

    rows: int
    cols: int
    rtol: float
    atol: float
    numel: int = 0
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
    sums: np.ndarray = field(default_factory=lambda: np.zeros((4, 0)))  # rows of Σd², Σx², Σy², Σxy

    def __post_init__(self) -> None:
        if self.per_row.shape != (self.rows,):
            self.per_row = np.zeros(self.rows, dtype=np.float64)
            self.sums = np.zeros((4, self.rows), dtype=np.float64)

    def shard(self) -> PairAccumulator:
        """An accumulator for other rows of the same pair, sharing the per-row arrays."""
        return PairAccumulator(self.rows, self.cols, self.rtol, self.atol, per_row=self.per_row, sums=self.sums)

    def merge(self, other: PairAccumulator) -> None:
        """Fold a shard's scalars in (its per-row values are already in the shared arrays)."""
        self.numel += other.numel
        self.mismatched += other.mismatched
        self.nonfinite_ref += other.nonfinite_ref
        self.nonfinite_cand += other.nonfinite_cand
        for side in ("ref", "cand"):
            at = [x for x in (getattr(self, f"first_nonfinite_{side}"), getattr(other, f"first_nonfinite_{side}"))
                  if x is not None]
            setattr(self, f"first_nonfinite_{side}", min(at) if at else None)
        if other.max_abs > self.max_abs or (other.max_abs == self.max_abs and 0 <= other.max_at < self.max_at):
            self.max_abs, self.max_at = other.max_abs, other.max_at
            self.max_ref, self.max_cand = other.max_ref, other.max_cand

    def add(self, start: int, ref: np.ndarray, cand: np.ndarray, scratch: Scratch | None = None) -> None:
        """``ref`` and ``cand`` are float chunks [n, cols] of rows [start, start+n), folded
        block by block (see :meth:`add_block`)."""
        scratch = scratch or Scratch()
        step = block_rows(self.cols)
        for a in range(0, ref.shape[0], step):
            self.add_block(start + a, ref[a:a + step], cand[a:a + step], scratch)

    def add_block(self, start: int, x: np.ndarray, y: np.ndarray, scratch: Scratch) -> None:
        """One block of rows, in one fused sweep: the difference once into a reused buffer,
        four row dot products (BLAS), |d| in place, its arg-max, and the element-wise
        tolerance test only when some |d| exceeds ``atol`` (below it nothing can fail).

        Elementwise work stays in float32 (half the memory traffic of fp64); per-row sums of
        squares are exact enough there (positive terms, a few ulps), and every total is
        accumulated in fp64. A block whose row sums are not finite (a NaN/inf value, or
        squares past the fp32 range) is redone by :meth:`_add_careful`."""
        n = x.shape[0]
        if n == 0:
            return
        if x.dtype != y.dtype:
            x, y = x.astype(np.float64), y.astype(np.float64)
        d = scratch.get("d", n, self.cols, x.dtype)
        with np.errstate(over="ignore", invalid="ignore"):
            np.subtract(x, y, out=d)
            sums = self.sums[:, start:start + n]
            sums[0], sums[1], sums[2] = _rowdot(d, d), _rowdot(x, x), _rowdot(y, y)
        if not math.isfinite(float(sums[:3].sum())):
            self._add_careful(start, x, y)
            return
        sums[3] = _rowdot(x, y)
        self.numel += x.size
        den = sums[1] + sums[2]
        np.divide(sums[0], den, out=self.per_row[start:start + n], where=den > 0)  # 0 stays where den is 0
        np.abs(d, out=d)
        flat = int(np.argmax(d))
        top = float(d.flat[flat])
        if top > self.max_abs:
            self.max_abs, self.max_at = top, start * self.cols + flat
            self.max_ref, self.max_cand = float(x.flat[flat]), float(y.flat[flat])
        if top > self.atol:
            bound = scratch.get("bound", n, self.cols, x.dtype)
            np.abs(x, out=bound)
            with np.errstate(over="ignore"):  # an rtol past the dtype's range bounds nothing: inf, as meant
                bound *= self.rtol
                bound += self.atol
            mask = scratch.get("mask", n, self.cols, np.bool_)
            np.greater(d, bound, out=mask)
            self.mismatched += int(np.count_nonzero(mask))

    def _add_careful(self, start: int, ref: np.ndarray, cand: np.ndarray) -> None:
        """A block with non-finite values (counted, then left out of the sums) or squares
        past the fp32 range (redone in fp64)."""
        self.numel += ref.size
        fin_r, fin_c = np.isfinite(ref), np.isfinite(cand)
        if not (fin_r.all() and fin_c.all()):
            self._note_nonfinite(start, fin_r, fin_c)
            both = fin_r & fin_c
            ref, cand = np.where(both, ref, 0), np.where(both, cand, 0)
        x, y = ref, cand
        with np.errstate(over="ignore", invalid="ignore"):  # the same row products as add_block: a finite
            d = x - y  # row gets the same sums whichever block it falls in
            rows_sq_d = _rowdot(d, d).astype(np.float64)
            rows_sq_x = _rowdot(x, x).astype(np.float64)
            rows_sq_y = _rowdot(y, y).astype(np.float64)
        if x.dtype != np.float64 and not (np.isfinite(rows_sq_d).all() and np.isfinite(rows_sq_x).all()
                                          and np.isfinite(rows_sq_y).all()):
            x, y = x.astype(np.float64), y.astype(np.float64)  # squares past the fp32 range: redo in fp64
            d = x - y
            rows_sq_d = _rowdot(d, d)
            rows_sq_x = _rowdot(x, x)
            rows_sq_y = _rowdot(y, y)
        n = len(rows_sq_d)
        sums = self.sums[:, start:start + n]
        sums[0], sums[1], sums[2] = rows_sq_d, rows_sq_x, rows_sq_y
        sums[3] = _rowdot(x, y)
        den = rows_sq_x + rows_sq_y
        part = np.zeros_like(rows_sq_d)
        np.divide(rows_sq_d, den, out=part, where=den > 0)
        self.per_row[start:start + n] = part
        if d.size:
            np.abs(d, out=d)
            flat = int(np.argmax(d))
            if d.flat[flat] > self.max_abs:
                self.max_abs = float(d.flat[flat])
                self.max_at = start * self.cols + flat
                self.max_ref, self.max_cand = float(x.flat[flat]), float(y.flat[flat])
            bound = np.abs(x)
            with np.errstate(over="ignore"):  # as in _add_fast: an rtol past the range bounds nothing
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
        sq_diff, sq_ref, sq_cand, dot = (float(v) for v in self.sums.sum(axis=1))
        den = sq_ref + sq_cand
        rel = sq_diff / den if den > 0 else 0.0
        norms = math.sqrt(sq_ref) * math.sqrt(sq_cand)
        cos = dot / norms if norms > 0 else (1.0 if sq_diff == 0 else 0.0)
        trd = float(self.per_row.mean()) if self.rows else 0.0
        worst = int(np.argmax(self.per_row)) if self.rows else 0
        return PairMetrics(
            numel=self.numel, rel_diff=rel, token_rel_diff=trd, worst_row=worst,
            worst_row_rel_diff=float(self.per_row[worst]) if self.rows else 0.0, cosine=cos,
            max_abs_diff=max(self.max_abs, 0.0), max_abs_at=self.max_at, max_ref=self.max_ref,
            max_cand=self.max_cand, mismatched=self.mismatched, rtol=self.rtol, atol=self.atol,
            nonfinite_ref=self.nonfinite_ref, nonfinite_cand=self.nonfinite_cand,
            first_nonfinite_ref=self.first_nonfinite_ref, first_nonfinite_cand=self.first_nonfinite_cand,
            ref_rms=math.sqrt(sq_ref / self.numel) if self.numel else 0.0,
            cand_rms=math.sqrt(sq_cand / self.numel) if self.numel else 0.0,
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


def median(x: np.ndarray) -> float:
    """``np.median`` of the values of ``x`` (NaN if any is NaN), without the ``numpy.ma``
    import ``np.median`` triggers on its first call (~2% of a small compare's start-up)."""
    v = np.asarray(x, dtype=np.float64).reshape(-1)
    n = v.size
    if n == 0 or np.isnan(v).any():
        return math.nan
    k = n // 2
    if n % 2:
        return float(np.partition(v, k)[k])
    p = np.partition(v, [k - 1, k])
    return float((p[k - 1] + p[k]) / 2)


def percentiles(x: np.ndarray, qs: list[float]) -> list[float]:
    """``np.percentile(x, qs)`` (linear method, NaN if any value is NaN) without the
    ``numpy.ma`` import it triggers."""
    v = np.sort(np.asarray(x, dtype=np.float64).reshape(-1))
    if v.size == 0 or np.isnan(v[-1]):
        return [math.nan] * len(qs)
    out = []
    for q in qs:
        pos = q / 100 * (v.size - 1)
        lo = int(math.floor(pos))
        hi = min(lo + 1, v.size - 1)
        t = pos - lo
        a, b = float(v[lo]), float(v[hi])
        out.append(b - (b - a) * (1 - t) if t >= 0.5 else a + (b - a) * t)  # numpy's _lerp
    return out


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
