"""The noise model: when is a difference noise, and when is it a different tensor?

Two scales decide it (docs/tolerance.md):

* the **dtype floor**: the token rel_diff that rounding in the less precise dtype produces
  after a whole forward pass (measured on SmolLM2-135M, 30 layers: bf16 against fp32
  reaches ~4e-4; the floor leaves 5x headroom for deeper targets);
* the **neighbour gap**: how far the expected stream is from the nearest *other*
  reference stream. Adjacent layers of a real model can be only ~1e-2 apart, so a
  tolerance must stay well under the gap or it would accept the neighbour. The effective
  floor is ``min(dtype floor, gap / GAP_DIVISOR)`` -- the idea of torch._dynamo's
  ``same``: judge an error against a scale measured from the reference itself.

Per-name rules (regex -> floor), as in SGLang's comparator, override the dtype floor.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from consistency.compare.metrics import ELEMENT_TOL
from consistency.compare.pattern import PatternError, compile_pattern
from consistency.compare.types import Note
from consistency.dump import dtypes

# token rel_diff floors, by the less precise dtype of the pair
DTYPE_FLOOR: dict[str, float] = {
    "float64": 1e-9,
    "float32": 1e-5,
    "float16": 3e-4,
    "bfloat16": 2e-3,
    "float8_e4m3fn": 5e-2,
    "float8_e5m2": 8e-2,
}
GAP_DIVISOR = 10.0  # effective floor stays 10x below the neighbour gap
DRIFT_ERROR_FACTOR = 10.0  # drift beyond 10x the floor is an error, not a warning
AMBIGUOUS_RATIO = 3.0  # runner-up closer than 3x the match: identification is ambiguous
USER_FLOORS = frozenset({"floor_rule", "floor_threshold"})  # floors the user set (a tolerance, not noise)


@dataclass(frozen=True)
class Rule:
    pattern: str
    floor: float

    def matches(self, name: str) -> bool:
        """Linear in the name whatever the pattern (compare/pattern.py): a rule from a
        repository under test cannot hang a compare with ``(a+)+$``."""
        return compile_pattern(self.pattern).fullmatch(name)


@dataclass
class ToleranceModel:
    rules: list[Rule] = field(default_factory=list)
    floor_override: float | None = None  # --threshold
    rtol: float | None = None  # --rtol (element-wise, reported; fails only if given)
    atol: float | None = None

    def dtype_floor(self, dtype_a: str, dtype_b: str) -> float:
        low = dtypes.lower_precision(dtype_a, dtype_b)
        return DTYPE_FLOOR.get(low, DTYPE_FLOOR["float32"])

    def floor(self, name: str, dtype_a: str, dtype_b: str, gap: float | None = None) -> tuple[float, Note]:
        """Effective token rel_diff floor and where it came from (a Note: the caller may be
        the CLI or the Python API, so diagnose words it)."""
        for r in self.rules:
            if r.matches(name):
                return r.floor, Note.of("floor_rule", pattern=r.pattern, floor=r.floor)
        if self.floor_override is not None:
            return self.floor_override, Note.of("floor_threshold", floor=self.floor_override)
        f = self.dtype_floor(dtype_a, dtype_b)
        if gap is not None and gap > 0 and gap / GAP_DIVISOR < f:
            return gap / GAP_DIVISOR, Note.of("floor_gap", gap=gap, divisor=GAP_DIVISOR)
        return f, Note.of("floor_dtype", dtype=dtypes.lower_precision(dtype_a, dtype_b), floor=f)

    def element_tol(self, dtype_a: str, dtype_b: str) -> tuple[float, float]:
        low = dtypes.lower_precision(dtype_a, dtype_b)
        rtol, atol = ELEMENT_TOL.get(low, ELEMENT_TOL["float32"])
        return (self.rtol if self.rtol is not None else rtol, self.atol if self.atol is not None else atol)

    @property
    def elementwise_strict(self) -> bool:
        """User-given rtol/atol make element-wise mismatches count for pass/fail."""
        return self.rtol is not None or self.atol is not None


def parse_rules(specs: list[str]) -> list[Rule]:
    """``REGEX=FLOOR`` strings (CLI ``--tolerance``) to rules; bad ones raise ValueError."""
    out = []
    for s in specs:
        pat, sep, val = s.rpartition("=")
        if not sep or not pat:
            raise ValueError(f"tolerance rule {s[:80]!r} is not REGEX=FLOOR")
        try:
            compile_pattern(pat)
        except PatternError as exc:
            raise ValueError(f"pattern {pat[:80]!r} {exc}") from None
        out.append(Rule(pat, float(val)))
    return out
