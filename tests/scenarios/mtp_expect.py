"""What an MTP scenario's report must say, and the check (the MTP twin of expect.py).

The expectation is built in tests/scenarios/mtp.py from the construction; :func:`check`
names every way a compare report contradicts it, worst first: ``false_pass``,
``false_fail``, ``crash``, then ``cause`` (the documented code is not an error on the
right tensor, another story's code is, or an error lands on a tensor equal on both sides)
and ``counts``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from tests.scenarios.expect import Miss, _check_counts

# The story codes (design19.md); a fault's expected code is one of them, the others must not
# be among the errors (a second, wrong explanation).
STORY = frozenset({"NORM_MISSING", "NORM_APPLIED", "RECYCLE_NORM_MISSING", "RECYCLE_NORM_APPLIED", "RECYCLE_TARGET",
                   "CONCAT_ORDER", "POS0_EMBED", "TOKEN_SHIFT"})


@dataclass
class MtpExpect:
    verdict: str  # "pass" | "fail" | "any" (the construction does not decide: no crash, no story code)
    # | "flagged": the fault's only trace lies in the documented drift band (over the floor, within
    # 10x: NUMERIC_DRIFT, a warning), so a pass is allowed only with a warning on a tensor that differs
    codes: frozenset[str] = frozenset()  # one of these must be an error on one of ``on`` (empty: any error)
    on: frozenset[str] = frozenset()  # the tensors the code may name (empty: any)
    forbidden: frozenset[str] = frozenset()
    clean: frozenset[str] = frozenset()  # equal on both sides: no error may name them


FLOORS = {"float32": 1e-5, "bfloat16": 2e-3}  # docs/tolerance.md, "Scale 1: the dtype floor"


def visible(ref: dict[str, np.ndarray], cand: dict[str, np.ndarray], dtype: str, margin: float = 3.0) -> bool:
    """Some tensor both sides record differs beyond what docs/tolerance.md calls noise for
    ``dtype`` (mean token rel_diff over the floor, or one token over 10x it), with ``margin``:
    the fault shows in what compare can see. Below that a pass is the documented answer."""
    floor = FLOORS[dtype] * margin
    for k in ref.keys() & cand.keys():
        x, y = np.asarray(ref[k], np.float64), np.asarray(cand[k], np.float64)
        if x.shape != y.shape:
            return True
        if x.dtype.kind in "iu" or x.ndim < 2:
            if np.any(x != y):
                return True
            continue
        den = (x * x).sum(-1) + (y * y).sum(-1)
        d = ((x - y) ** 2).sum(-1) / np.where(den > 0, den, 1.0)
        if d.mean() > floor or d.max() > 10 * floor:
            return True
    return False


def _sev(f: Any) -> str:
    return getattr(f.severity, "value", f.severity)


def check(report: Any, exc: BaseException | None, exp: MtpExpect) -> list[Miss]:
    """Every way the report contradicts the construction (false pass first)."""
    from consistency.errors import InputError, UsageError

    if exc is not None:
        if isinstance(exc, (InputError, UsageError)):
            return [Miss("false_fail" if exp.verdict == "pass" else "cause",
                         f"exit 2: {type(exc).__name__}: {str(exc)[:200]}")]
        return [Miss("crash", f"{type(exc).__name__}: {str(exc)[:200]}")]
    errors = [f for f in report.findings if _sev(f) == "error"]
    # a finding names the candidate tensor; one the candidate lacks (MISSING) names the reference's
    got = sorted({(f.code, f.tensor or getattr(f, "expected", None)) for f in errors})
    misses: list[Miss] = []
    if exp.verdict == "fail" and report.verdict == "pass":
        return [Miss("false_pass", f"verdict pass; findings {sorted({(f.code, f.tensor) for f in report.findings})}")]
    if exp.verdict == "flagged" and report.verdict == "pass":
        warned = [f for f in report.findings if _sev(f) == "warning" and f.code not in ("DTYPE_MISMATCH", "EXTRA")
                  and f.tensor not in exp.clean]
        if not warned:
            return [Miss("false_pass", f"verdict pass without a warning on a differing tensor; findings "
                                       f"{sorted({(f.code, f.tensor) for f in report.findings})}")]
    if exp.verdict == "pass" and report.verdict != "pass":
        return [Miss("false_fail", f"verdict {report.verdict}; errors {got[:6]}: "
                                   f"{errors[0].message[:160] if errors else report.summary[:160]}")]
    if exp.verdict in ("fail", "any", "flagged"):
        named = any((not exp.codes or c in exp.codes) and (not exp.on or tn in exp.on) for c, tn in got)
        if exp.verdict == "fail" and (exp.codes or exp.on) and not named:
            misses.append(Miss("cause", f"expected {sorted(exp.codes)} on {sorted(exp.on) or 'any tensor'}; "
                                        f"errors {got[:8]}"))
        bad = sorted({c for c, _ in got} & exp.forbidden)
        if bad:
            misses.append(Miss("cause", f"wrong explanation(s) {bad} among errors {got[:8]}"))
        wrong_place = sorted((c, tn) for c, tn in got if tn in exp.clean)
        if wrong_place:
            misses.append(Miss("cause", f"error(s) on tensors equal on both sides: {wrong_place[:4]}"))
    misses += _check_counts(report)
    return misses
