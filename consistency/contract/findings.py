"""Findings and reports: the machine-readable output every command shares.

Finding codes are a registry (data): each has a default severity, a one-line title, the
fix a user should apply and where the rule comes from, so docs/findings.md, the JSON
report and the terminal report never disagree about what a code means.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from consistency.contract.codes import CODES, DOCS_URL, C, CodeSpec, Severity, lookup, with_property  # noqa: F401
from consistency.contract.fixes import Fix


class Finding(BaseModel):
    model_config = ConfigDict(extra="forbid")

    code: str
    severity: Severity
    tensor: str | None = Field(None, description="Candidate tensor name")
    expected: str | None = Field(None, description="Reference name it should equal")
    identified_as: str | None = Field(None, description="Reference name it matches best")
    message: str
    metrics: dict[str, Any] = Field(default_factory=dict)
    evidence: dict[str, Any] = Field(default_factory=dict, description="Metric before/after the explanation")
    fix: str | None = None
    source: str | None = None
    doc: str | None = None
    autofix: Fix | None = Field(None, description="The fix as data (file, key, old, new) when the candidate's runtime "
                                "is known: shown by the gate and SARIF, written only by `lint --fix`")

    @classmethod
    def make(cls, code: str, message: str, severity: Severity | None = None, **kw: Any) -> Finding:
        c = CODES[code]
        kw.setdefault("fix", c.fix)
        kw.setdefault("source", c.source or None)
        kw.setdefault("doc", c.doc)
        return cls(code=code, severity=severity or c.severity, message=message, **kw)


class DumpSummary(BaseModel):
    path: str
    format: str
    tensors: int
    runtime: str | None = None
    claimed_streams: list[int] | None = None
    ranks: int | None = None


class SlotReport(BaseModel):
    slot: int
    tensor: str
    expected: str | None = None
    expected_stream: int | None = None
    identified_as: str | None = None
    identified_stream: int | None = None
    token_rel_diff: float | None = None
    confidence: float | None = Field(None, description="Distance to the runner-up over distance to the match")
    runner_up: str | None = None
    code: str = "OK"


class MetaDiff(BaseModel):
    path: str
    reference: Any = None
    candidate: Any = None
    change: str
    severity: Severity = Severity.info


class SimilarityMatrix(BaseModel):
    """Candidate slots x reference streams: the heatmap where a slot shift shows as a shifted diagonal."""

    metric: str = "token_rel_diff"
    rows: list[str]
    cols: list[str]
    values: list[list[float]]
    expected: list[str | None]
    identified: list[str | None]


class ReportHeader(BaseModel):
    """What every report starts with, so a CI script can read any of them the same way."""

    tool: Literal["consistency"] = "consistency"
    version: str
    verdict: Literal["pass", "fail"]
    summary: str


class CompareReport(ReportHeader):
    """The JSON report of ``consistency compare`` (schema in schemas/compare-report.schema.json)."""

    kind: Literal["compare"] = "compare"
    reference: DumpSummary
    candidate: DumpSummary
    slots: list[SlotReport] = Field(default_factory=list)
    findings: list[Finding] = Field(default_factory=list)
    metadata_diff: list[MetaDiff] = Field(default_factory=list)
    counts: dict[str, int] = Field(default_factory=dict)
    assumptions: list[str] = Field(default_factory=list)
    not_compared: int = Field(0, description="Reference tensors of kinds the candidate never records")
    similarity: SimilarityMatrix | None = None
    per_token: dict[str, list[float]] = Field(default_factory=dict, description="Token rel_diff per row, mismatched tensors")
    alignment: dict[str, Any] | None = Field(None, description="How the two sides' tokens were stitched and aligned: "
                                             "tokens compared, spans only one side has, context differences")
    seconds: float | None = None


def verdict_of(findings: list[Finding]) -> Literal["pass", "fail"]:
    return "fail" if any(f.severity == Severity.error for f in findings) else "pass"
