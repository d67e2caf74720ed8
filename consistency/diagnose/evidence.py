"""Evidence for explanations: sampled rows of both dumps and the transforms hypotheses apply.

Hypotheses never read whole tensors: they work on the fingerprint's token sample (the
same rows for every tensor of a shape), plus a few extra rows for token shifts. That keeps
diagnosis cheap and its memory bounded whatever the dump size.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from consistency.compare.engine import Comparison, Result
from consistency.compare.identify import token_distance
from consistency.diagnose import words
from consistency.dump import names
from consistency.dump.reader import TensorView


@dataclass
class Explanation:
    code: str
    message: str
    before: float  # token rel_diff to the expected tensor (sample)
    after: float  # token rel_diff once the explanation is applied (sample)
    identified_as: str | None = None
    detail: dict[str, Any] = field(default_factory=dict)
    approximate: bool = False  # inferred without the reference parts that would prove it


class Evidence:
    def __init__(self, cmp: Comparison) -> None:
        self.cmp = cmp
        self._extra: dict[tuple[str, int], np.ndarray] = {}
        self._before: dict[tuple[str, int], float | None] = {}
        self._n_layers: tuple[int | None] | None = None

    def key(self, r: Result) -> tuple[int, int]:
        return (r.cand.rows, r.cand.cols)

    def index(self, r: Result) -> np.ndarray | None:
        fp = self.cmp.cand_fp.get(self.key(r))
        return fp.index if fp is not None else None

    def cand(self, r: Result) -> np.ndarray | None:
        fp = self.cmp.cand_fp.get(self.key(r))
        return fp.rows(r.cand.name) if fp is not None and r.cand.name in fp else None

    def ref(self, r: Result, name: str) -> np.ndarray | None:
        fp = self.cmp.ref_fp.get(self.key(r))
        if fp is None:
            return None
        return fp.rows(name) if name in fp else None

    def view(self, name: str) -> TensorView | None:
        if name in self.cmp.ref.tensors:
            return self.cmp.ref.tensors[name]
        return next((v for v in self.cmp.plan.ref.slots.values() if v.name == name), None)

    def ref_rows_at(self, name: str, rows: np.ndarray) -> np.ndarray | None:
        v = self.view(name)
        if v is None:
            return None
        arr = v.take_rows(np.clip(rows, 0, v.rows - 1), np.float64)
        arr[~np.isfinite(arr)] = 0.0
        return arr

    def cand_component(self, r: Result, part: str) -> np.ndarray | None:
        """Sampled rows of a candidate slot's recorded component (``aux.{i}.{part}``)."""
        v = self.cmp.cand.tensors.get(f"{r.cand.name}.{part}")
        idx = self.index(r)
        if v is None or idx is None or v.rows != r.cand.rows or v.cols != r.cand.cols:
            return None
        arr = v.take_rows(idx, np.float64)
        arr[~np.isfinite(arr)] = 0.0
        return arr

    def expected(self, r: Result) -> np.ndarray | None:
        return self.ref(r, r.ref.name) if r.ref is not None else None

    def before(self, r: Result) -> float | None:
        """The sampled distance to the expected tensor, once per result (every hypothesis asks)."""
        k = (r.name, id(r))
        if k not in self._before:
            c, e = self.cand(r), self.expected(r)
            self._before[k] = None if c is None or e is None else token_distance(c, e)
        return self._before[k]

    def input_ids(self, side: str = "cand") -> np.ndarray | None:
        d = self.cmp.cand if side == "cand" else self.cmp.ref
        v = d.tensors.get(names.INPUT_IDS)
        if v is None or v.is_float or v.numel > 10_000_000:
            return None
        return v.read_all().reshape(-1)

    def stream_name(self, name: str) -> str:
        """How to say a reference name in a sentence: 'stream 3 (layer 2's output)'."""
        s = self.cmp.stream_by_values(name)
        if s is None:
            canon = self.cmp.name_by_values(name)
            return canon if canon == name else f"{canon} ({name})"
        return words.stream_words(s, self._num_layers())

    def _num_layers(self) -> int | None:
        """N: the reference's metadata, else the declaration (the plan), else a reference that
        records every stream 0..M (M is then the top), else the candidate's metadata (words
        only). The highest recorded stream of a thin reference is not the model's top."""
        if self._n_layers is None:
            n = self.cmp.plan.num_layers
            if n is None:
                hs = {s for s in (names.stream_of(x) for x in self.cmp.ref.tensors) if s is not None}
                if hs and hs == set(range(max(hs) + 1)) and len(hs) > 2:
                    n = max(hs)
            if n is None:
                n = self.cmp.plan.cand.num_layers
            self._n_layers = (n,)  # computed once: diagnosis asks for every tensor
        return self._n_layers[0]


def rms_normalize(x: np.ndarray, center: bool = False, eps: float = 1e-6) -> np.ndarray:
    if center:
        x = x - x.mean(axis=1, keepdims=True)
    return x / np.sqrt((x * x).mean(axis=1, keepdims=True) + eps)


def fit_column_scale(target: np.ndarray, basis: np.ndarray) -> np.ndarray:
    """Least-squares per-column weight w with target ~= w * basis (a norm's elementwise weight)."""
    den = (basis * basis).sum(axis=0)
    w = np.ones(basis.shape[1])
    np.divide((target * basis).sum(axis=0), den, out=w, where=den > 0)
    return w


def fit_column_affine(target: np.ndarray, basis: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Least-squares per-column (w, b) with target ~= w * basis + b (a LayerNorm's weight and bias)."""
    bm, tm = basis.mean(axis=0), target.mean(axis=0)
    bc = basis - bm
    den = (bc * bc).sum(axis=0)
    w = np.ones(basis.shape[1])
    np.divide((bc * (target - tm)).sum(axis=0), den, out=w, where=den > 0)
    return w, tm - w * bm


def fit_scalar(target: np.ndarray, basis: np.ndarray) -> float:
    den = float((basis * basis).sum())
    return float((target * basis).sum()) / den if den > 0 else 1.0
