"""The JSON report of ``consistency gate`` (schemas/gate-report.schema.json): one entry per
declared check, each broken into cases (one per lint rule, one per compared tensor, one
per replay finding) — the unit JUnit XML and CI dashboards count."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from consistency.contract import schema

Status = Literal["passed", "failed", "skipped", "error"]


class GateCase(BaseModel):
    id: str = Field(description="Stable id: <kind>/<check>/<rule code or tensor>")
    name: str
    status: Status
    severity: Literal["error", "warning", "info"] | None = None
    message: str = ""
    code: str | None = None
    file: str | None = None
    line: int | None = None
    fix: str | None = None
    doc: str | None = None


class GateCheck(BaseModel):
    kind: Literal["lint", "compare", "replay"]
    name: str
    verdict: Literal["pass", "fail", "error", "skipped"]
    summary: str
    seconds: float | None = None
    cases: list[GateCase] = Field(default_factory=list)
    report: dict[str, Any] | None = Field(None, description="The check's own JSON report (lint, compare or replay)")


class GateReport(BaseModel):
    tool: Literal["consistency"] = "consistency"
    kind: Literal["gate"] = "gate"
    version: str
    verdict: Literal["pass", "fail", "error"]
    summary: str
    config: str
    checks: list[GateCheck] = Field(default_factory=list)
    counts: dict[str, int] = Field(default_factory=dict)
    seconds: float | None = None
    outputs: dict[str, str] = Field(default_factory=dict, description="The files this run wrote, by kind (json, "
                                    "junit, sarif, summary, step_summary): what a CI step may read back")

    @property
    def exit_code(self) -> int:
        return {"pass": 0, "fail": 1, "error": 2}[self.verdict]


schema.register("gate-report.schema.json", GateReport)
