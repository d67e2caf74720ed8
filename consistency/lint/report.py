"""The JSON report of ``consistency lint`` (schemas/lint-report.schema.json).

``training_streams`` and ``serving_streams`` are stream indices slot by slot (null where
unknown), so a CI script can assert on them without knowing any runtime's convention.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from consistency.contract import schema
from consistency.contract.findings import ReportHeader, Severity
from consistency.contract.fixes import Fix


class Location(BaseModel):
    file: str | None = None
    key: str | None = Field(None, description="Dotted config key, e.g. eagle_config.eagle_aux_hidden_state_layer_ids")
    line: int | None = Field(None, description="1-based line of the key in the file, when found")


class LintFinding(BaseModel):
    code: str
    name: str
    severity: Severity
    message: str
    source: str
    fix: str | None = None
    doc: str | None = None
    location: Location | None = None
    evidence: dict[str, Any] = Field(default_factory=dict)
    autofix: Fix | None = Field(None, description="The fix as data (file, key, old, new) and whether `lint --fix` "
                                "may apply it (docs/lint.md#the-fix-model)")


class RuleResult(BaseModel):
    """One rule's outcome: what a JUnit test case or a SARIF rule entry is built from."""

    code: str
    name: str
    title: str
    severity: Severity = Field(description="The rule's default severity")
    status: Literal["pass", "fail", "warn", "not_evaluated", "not_applicable"] = Field(
        description="not_applicable: the rule is about another kind of draft (e.g. an EAGLE-3 aux rule for an MTP "
                    "draft); neither a pass nor a lack of input")
    reason: str | None = Field(None, description="Why the rule was not applicable")
    source: str
    fix: str
    doc: str


class SlotRow(BaseModel):
    slot: int
    training_stream: int | None = None
    serving_stream: int | None = None
    serving_id: int | None = Field(None, description="The config id that makes the server capture this stream")
    training_meaning: str | None = None
    serving_meaning: str | None = None
    match: bool | None = None


class ServingSide(BaseModel):
    runtime: str
    version: str | None = None
    label: str
    runner: str | None = Field(None, description="vLLM model runner (v1/v2) and why")
    key: str | None = Field(None, description="Config key the ids were read from; null: the runtime default")
    ids: list[int] | None = None
    default_used: bool = False
    ignored: dict[str, list[int]] = Field(default_factory=dict, description="Id lists present but not read")
    convention: str
    meaning: str
    source: str = ""


class Inputs(BaseModel):
    draft: str | None = None
    draft_format: str | None = None
    target: str | None = None
    serve: str | None = None
    runtime: str | None = None
    trained_with: str | None = None


class TrainingReading(BaseModel):
    """One plausible meaning of the training side's ids (SpecForge by the SGLang it captured with)."""

    label: str
    streams: list[int] | None = None
    matches_serving: bool | None = Field(None, description="null: the serving streams are unknown")


class LintReport(ReportHeader):
    kind: Literal["lint"] = "lint"
    verdict: Literal["pass", "fail", "not_evaluated"] = Field(  # type: ignore[assignment]
        description="not_evaluated: every selected rule lacked an input, so nothing was checked (exit 1)")
    inputs: Inputs
    training_streams: list[int | None] | None = None
    training_source: str | None = None
    training_checked: bool = Field(False, description="true: the training streams come from --trained-with (a dump, "
                                   "a contract or FRAMEWORK:IDS); false: only assumed from the draft config, so the "
                                   "train/serve contract itself was not checked")
    training_readings: list[TrainingReading] = Field(default_factory=list, description="more than one: the training "
                                                     "streams depend on a version lint cannot see")
    training_evidence: str | None = None
    serving_streams: list[int | None] | None = None
    serving: ServingSide | None = None
    slots: list[SlotRow] = Field(default_factory=list)
    findings: list[LintFinding] = Field(default_factory=list)
    rules: list[RuleResult] = Field(default_factory=list)
    counts: dict[str, int] = Field(default_factory=dict)
    assumptions: list[str] = Field(default_factory=list)
    fixed_serve: str | None = Field(None, description="The serving command with every determined fix applied "
                                    "(printed, never run)")
    seconds: float | None = None


schema.register("lint-report.schema.json", LintReport)
