"""The replay report: what the draft would do on each side, and what the difference costs.

Pydantic only (no torch), so ``consistency schema`` can publish it and a CI gate can read
it. Its finding codes live in the shared registry (consistency/contract/findings.py).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from consistency.contract import findings as F
from consistency.contract.findings import ReportHeader
from consistency.contract.models import ConsumerSpec
from consistency.contract.schema import register


class StepStats(BaseModel):
    step: int = Field(description="1-based position in the draft chain")
    reached: int = Field(description="Anchors whose earlier steps were all accepted")
    accepted: int
    conditional: float | None = Field(None, description="accepted / reached (vLLM's per-position acceptance)")
    cumulative: float | None = Field(None, description="Share of anchors whose steps 1..step were all accepted")


class Figures(BaseModel):
    top1: float
    acceptance_rate: float
    accept_length: float
    anchors: int


class SideReplay(BaseModel):
    path: str
    tokens: int
    anchors: int = Field(description="Anchors a chain server verifies at: from each request's first drafted anchor, "
                         "a pass that accepts a drafts moves the next one a + 1 tokens on (docs/replay.md)")
    slots: list[str]
    claimed_streams: list[int] | None = None
    aux_dtype: str | None = None
    label_source: Literal["logits", "target", "input_ids"]
    label_dtype: str | None = Field(None, description="The dtype of the target forward behind the labels: the serving "
                                    "dtype for a bf16/fp16 capture (its server verifies with that argmax), else float32")
    label_changed: int | None = Field(None, description="Positions whose label in label_dtype differs from float32's")
    greedy_agreement: float | None = Field(None, description="Share of positions whose next recorded token is the target's own")
    top1: float = Field(description="Step-1 top-1 accuracy against the target's next token, at the anchors a server "
                        "verifies at")
    acceptance_rate: float = Field(description="Accepted draft tokens over drafted tokens, greedy verification")
    accept_length: float = Field(description="Mean tokens per verification step, bonus token included (1..steps+1)")
    per_step: list[StepStats]
    scored_on: Literal["loss_mask", "response", "all"] = Field(
        "all", description="Which positions the figures above score: a loss mask's, the candidate's decode/verify "
        "rows (what a server drafts on), or every position")
    all_positions: Figures | None = Field(None, description="The same figures over every position, prompt included "
                                          "(when scored_on narrowed them)")
    every_anchor: Figures | None = Field(None, description="The mean over every drafted anchor (not only those a "
                                         "server verifies at): higher than a server measures, more so as steps grow")
    hits: list[int] = Field(default_factory=list, description="Step-1 hit (1) or miss (0) per position")
    recycle_fed: str | None = Field(None, description="MTP / EAGLE-1: what steps >= 2 were fed (recorded recycle.k, "
                                    "or the draft's contract when the dump records none)")


class DraftSummary(BaseModel):
    path: str
    layout: str
    hidden_size: int
    target_hidden_size: int
    num_aux: int
    num_layers: int
    draft_vocab_size: int
    target_vocab_size: int
    norm_before_residual: bool
    norm_before_fc: bool
    fc_norm: bool
    norm_output: bool
    aux_layer_ids: list[int] | None = None
    aux_ids_meaning: str | None = None
    sources: dict[str, str] = Field(default_factory=dict, description="Where embed_tokens, lm_head and d2t came from")
    method: Literal["eagle3", "mtp", "eagle1"] = Field("eagle3", description="The draft's kind (docs/replay.md)")
    consumer: ConsumerSpec | None = Field(None, description="MTP / EAGLE-1: how the draft consumes its inputs "
                                          "(recycle, concat order, position-0 rule)")


class Drop(BaseModel):
    top1_points: float = Field(description="Reference minus candidate, percentage points")
    acceptance_points: float
    accept_length: float = Field(description="Reference minus candidate, tokens per step")
    speedup_ratio: float | None = Field(None, description="Candidate accept length over the reference's")
    lost: int = Field(0, description="Positions the draft got right on the reference and wrong on the candidate")
    gained: int = Field(0, description="Positions wrong on the reference and right on the candidate")
    all_top1_points: float | None = Field(None, description="The top-1 drop over every position, prompt included "
                                          "(when the figures above score only the drafted positions)")
    all_acceptance_points: float | None = None


class ReplayReport(ReportHeader):
    """The JSON report of ``consistency replay`` (schemas/replay-report.schema.json)."""

    kind: Literal["replay"] = "replay"
    method: Literal["eagle3", "mtp", "eagle1"] = Field("eagle3", description="The draft's kind: EAGLE-3 (aux streams), "
                                                       "MTP (DeepSeek-V3 style NextN) or EAGLE-1/2")
    steps: int
    prediction: str = Field("walk", description="The model behind the figures: 'walk' is a chain server (topk 1, "
                            "greedy verification) verifying at anchor i, then i + accepted + 1 (docs/replay.md)")
    feed: Literal["own", "teacher"] = Field("own", description="What chained steps were fed: the draft's own proposals or the recorded tokens")
    max_drop_points: float
    min_acceptance: float | None = Field(None, description="Required floor on the candidate's acceptance rate (0..1)")
    draft: DraftSummary
    target: str | None = None
    reference: SideReplay
    candidate: SideReplay
    drop: Drop
    findings: list[F.Finding] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)
    seconds: float | None = None


register("replay-report.schema.json", ReplayReport)
