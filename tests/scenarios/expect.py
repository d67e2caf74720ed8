"""What a scenario's report must say, derived from how the scenario was built, and the check.

Misses are sorted by how bad they are: ``false_pass`` (a fault with verdict pass, the worst
defect), ``false_fail`` (a benign pair failing), ``cause`` (the expected code is not among
the errors, or a forbidden explanation is), ``identity`` (a slot's identified stream/tensor
contradicts the construction), ``tokens`` (bad token positions not named), ``counts``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

ANY = "any"  # sentinel: a field the construction does not decide

# Codes that are explanations of a *whole slot*: naming one for a fault that is not that
# story is a wrong cause (scale is not a norm, zeros are not a norm, ...).
NORM_CODES = frozenset({"NORM_APPLIED", "NORM_MISSING"})


@dataclass
class SlotExpect:
    slot: int
    holds: frozenset[str]  # reference names holding the same values as this candidate slot
    streams: frozenset[int | None] | str = ANY  # allowed identified_stream values
    strict_names: bool = False  # identified_as must be in holds (or None when holds is empty)
    not_ok: bool = False  # the slot's code must not be "OK"


@dataclass
class Expect:
    verdict: str  # "pass" | "fail"
    codes: frozenset[str] = frozenset()  # one of these must be among error findings (empty: any error)
    forbidden: frozenset[str] = frozenset()  # codes that must not be among error findings
    slots: list[SlotExpect] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)  # token positions an error finding must name
    factor: float | None = None  # the constant factor a SCALE_MISMATCH must report
    root: str | None = None  # the root-cause tensor (first divergent stream)
    clean: frozenset[str] = frozenset()  # tensors equal on both sides: no error finding may name them
    input_error_ok: bool = False  # exit 2 (InputError/UsageError) is an acceptable outcome
    input_error_if: str | None = None  # ... or acceptable when its one line matches this regex
    mentions: str | None = None  # regex the report's words (summary, findings, assumptions) must match
    not_mentions: str | None = None  # regex the summary must not match (a false claim)


@dataclass
class Miss:
    kind: str  # false_pass | false_fail | cause | identity | tokens | counts | crash
    detail: str


def _errors(report: Any) -> list[Any]:
    return [f for f in report.findings if _sev(f) == "error"]


def _sev(f: Any) -> str:
    s = f.severity
    return getattr(s, "value", s)


def _numbers(text: str) -> list[float]:
    out = []
    for m in re.finditer(r"[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?", text):
        try:
            out.append(float(m.group(0)))
        except ValueError:
            pass
    return out


def _finding_text(f: Any) -> str:
    return " ".join([f.message or "", json.dumps(f.metrics, default=str), json.dumps(f.evidence, default=str)])


def check(report: Any, exc: BaseException | None, exp: Expect) -> list[Miss]:
    """Every way ``report`` (or the exception the run raised) contradicts ``exp``."""
    from consistency.errors import InputError, UsageError

    if exc is not None:
        if isinstance(exc, (InputError, UsageError)):
            if exp.input_error_if and re.search(exp.input_error_if, str(exc)):
                return []
            if exp.verdict == "pass":
                return [Miss("false_fail", f"exit 2: {type(exc).__name__}: {str(exc)[:160]}")]
            return [] if exp.input_error_ok else [Miss("cause", f"exit 2 instead of a diagnosis: {str(exc)[:160]}")]
        return [Miss("crash", f"{type(exc).__name__}: {str(exc)[:200]}")]
    misses: list[Miss] = []
    errors = _errors(report)
    codes = sorted({f.code for f in errors})
    if exp.verdict == "fail" and report.verdict == "pass":
        misses.append(Miss("false_pass", f"verdict pass; findings {sorted({f.code for f in report.findings})}"))
    if exp.verdict == "pass" and report.verdict != "pass":
        misses.append(Miss("false_fail", f"verdict {report.verdict}; errors {codes}: "
                                         f"{errors[0].message[:160] if errors else ''}"))
    if exp.verdict == "fail" and report.verdict == "fail":
        if exp.codes and not (exp.codes & set(codes)):
            misses.append(Miss("cause", f"expected one of {sorted(exp.codes)} among errors; got {codes}"))
        bad = exp.forbidden & set(codes)
        if bad:
            misses.append(Miss("cause", f"forbidden explanation(s) {sorted(bad)} among errors {codes}"))
    misses += _check_slots(report, exp)
    if exp.positions and report.verdict == "fail":
        first = exp.positions[0]
        pat = re.compile(rf"(?<![\d.]){first}(?![\d.])")
        if not any(pat.search(_finding_text(f)) for f in errors):
            misses.append(Miss("tokens", f"no error finding names token position {first} "
                                         f"(bad positions {exp.positions[:5]}, {len(exp.positions)} in all)"))
    if exp.factor is not None and "SCALE_MISMATCH" in codes:
        f = next(f for f in errors if f.code == "SCALE_MISMATCH")
        if not any(abs(x - exp.factor) <= 0.01 * abs(exp.factor) for x in _numbers(_finding_text(f))):
            misses.append(Miss("cause", f"SCALE_MISMATCH does not report the factor {exp.factor:.4g}: {f.message[:160]}"))
    words = " ".join([report.summary or "", *[f.message or "" for f in report.findings],
                      *[str(a) for a in (report.assumptions or [])]])
    if exp.mentions and not re.search(exp.mentions, words, re.I):
        misses.append(Miss("cause", f"the report never says /{exp.mentions}/: {(report.summary or '')[:160]}"))
    if exp.not_mentions and re.search(exp.not_mentions, report.summary or "", re.I):
        misses.append(Miss("identity", f"false claim in the summary: {(report.summary or '')[:200]}"))
    if exp.root is not None:
        misses += _check_root(report, errors, exp)
    for f in errors:
        if f.tensor in exp.clean:
            misses.append(Miss("cause", f"error {f.code} on {f.tensor}, which is equal on both sides"))
            break
    misses += _check_counts(report)
    return misses


def _check_slots(report: Any, exp: Expect) -> list[Miss]:
    out: list[Miss] = []
    by_slot = {s.slot: s for s in report.slots}
    for se in exp.slots:
        got = by_slot.get(se.slot)
        if got is None:
            if se.not_ok or se.streams != ANY or se.strict_names:
                out.append(Miss("identity", f"slot {se.slot} missing from the slot table"))
            continue
        if se.streams != ANY and got.identified_stream not in se.streams:
            want = sorted(se.streams, key=lambda v: -1 if v is None else v)
            out.append(Miss("identity", f"slot {se.slot}: identified_stream {got.identified_stream}, construction "
                                        f"allows {want} (identified_as {got.identified_as})"))
        if se.strict_names and got.identified_as is not None and got.identified_as not in se.holds:
            out.append(Miss("identity", f"slot {se.slot}: identified_as {got.identified_as}, but the values are "
                                        f"held by {sorted(se.holds) or 'no reference tensor'}"))
        if se.not_ok and got.code == "OK":
            out.append(Miss("identity", f"slot {se.slot} reported OK"))
    return out


def _check_root(report: Any, errors: list[Any], exp: Expect) -> list[Miss]:
    out = []
    if not any(f.tensor == exp.root for f in errors):
        out.append(Miss("cause", f"no error finding on the root cause {exp.root}"))
    s = exp.root.split(".")[-1]
    if not re.search(rf"(hidden\.{s}\b|stream {s}\b|layer {int(s) - 1}\b)", report.summary or ""):
        out.append(Miss("cause", f"summary does not name the first divergent stream {exp.root}: "
                                 f"{(report.summary or '')[:160]}"))
    return out


def _check_counts(report: Any) -> list[Miss]:
    counts = dict(report.counts or {})
    if not counts:
        return [Miss("counts", "report.counts is empty")] if report.findings else []
    by_code: dict[str, int] = {}
    by_sev: dict[str, int] = {}
    for f in report.findings:
        by_code[f.code] = by_code.get(f.code, 0) + 1
        by_sev[_sev(f)] = by_sev.get(_sev(f), 0) + 1
    sev_keys = {k: v for k, v in counts.items() if k in ("error", "warning", "info", "errors", "warnings")}
    code_keys = {k: v for k, v in counts.items() if k.isupper()}
    out = []
    if sev_keys:
        for k, v in sev_keys.items():
            want = by_sev.get(k.rstrip("s"), 0)
            if v != want:
                out.append(Miss("counts", f"counts[{k}]={v} but {want} {k.rstrip('s')} findings"))
    if code_keys:
        for code, n in by_code.items():
            if code_keys.get(code, 0) != n:
                out.append(Miss("counts", f"counts[{code}]={code_keys.get(code, 0)} but {n} findings"))
    m = re.search(r"\((\d+) warnings?\)", report.summary or "")
    if m and int(m.group(1)) != by_sev.get("warning", 0):
        out.append(Miss("counts", f"summary says {m.group(1)} warnings; the report has {by_sev.get('warning', 0)}"))
    if not sev_keys and not code_keys:
        out.append(Miss("counts", f"counts has neither severity nor code keys: {sorted(counts)}"))
    return out
