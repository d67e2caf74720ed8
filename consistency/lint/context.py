"""Everything a rule may look at, and one way to say "I cannot check this".

A rule asks the context for what it needs (``ctx.need_plan()``, ``ctx.need_checkpoint()``);
when an input is missing the context raises :class:`NotEvaluated` with the option that
would provide it, and the engine reports that as an info finding, so a rule never passes
silently for lack of input.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from consistency.lint.configs import TargetInfo
from consistency.contract.models import Consumer
from consistency.lint.draft import Checkpoint, DraftInfo
from consistency.lint.kind import Kind
from consistency.lint.plan import Alternative, StreamPlan
from consistency.lint.serve import ServeInfo
from consistency.lint.trained import TrainingInfo


class NotEvaluated(Exception):
    """Raised by a rule (or the context) when an input it needs was not given."""


@dataclass
class Context:
    draft: DraftInfo | None = None
    target: TargetInfo | None = None
    serve: ServeInfo | None = None
    training: TrainingInfo | None = None
    runtime: str | None = None  # sglang | vllm
    version: tuple[int, ...] | None = None  # pinned runtime version
    arch: str | None = None  # the key per-architecture rules are registered under
    n: int | None = None  # the target's layer count
    plan: StreamPlan | None = None
    alternatives: list[Alternative] = field(default_factory=list)
    any_runtime: list[Alternative] = field(default_factory=list)  # no runtime named: every runtime's reading
    draft_kind: Kind = field(default_factory=lambda: Kind(None, "not detected"))  # what the draft files are
    requested: Kind = field(default_factory=lambda: Kind(None, "not detected"))  # what the flags run

    # -- inputs ---------------------------------------------------------------------------
    def need_draft(self) -> DraftInfo:
        if self.draft is None:
            raise NotEvaluated("no draft given (--draft DIR_OR_CONFIG)")
        return self.draft

    def need_config(self) -> DraftInfo:
        d = self.need_draft()
        if not d.config:
            raise NotEvaluated("the draft has no config.json (only a checkpoint was given)")
        return d

    def need_checkpoint(self) -> Checkpoint:
        d = self.need_draft()
        if d.checkpoint is None:
            raise NotEvaluated(f"no draft checkpoint: {d.checkpoint_note or 'none found'}")
        return d.checkpoint

    def need_target(self) -> TargetInfo:
        if self.target is None:
            raise NotEvaluated("no target config (--target CONFIG)")
        return self.target

    def need_runtime(self) -> str:
        if self.runtime is None:
            raise NotEvaluated("no serving runtime (--serve COMMAND or --runtime sglang@VER|vllm@VER)")
        return self.runtime

    def need_plan(self) -> StreamPlan:
        self.need_runtime()
        assert self.plan is not None
        return self.plan

    def need_serve(self) -> ServeInfo:
        if self.serve is None:
            raise NotEvaluated("no serving command line (--serve \"COMMAND\")")
        return self.serve

    def need_training(self) -> TrainingInfo:
        if self.training is None:
            raise NotEvaluated("training side unknown (--trained-with DUMP|CONTRACT|FRAMEWORK:IDS, or a draft "
                               "config in a training framework's format)")
        return self.training

    def need_n(self) -> int:
        if self.n is None:
            raise NotEvaluated("the target's layer count is unknown (--target CONFIG)")
        return self.n

    # -- derived --------------------------------------------------------------------------
    @property
    def kind(self) -> Consumer | None:
        """The draft's kind when its files say, else what the serving flags run (lint/kind.py)."""
        return self.draft_kind.kind if self.draft_kind.kind is not None else self.requested.kind

    @property
    def target_hidden(self) -> int | None:
        if self.target is not None and self.target.hidden_size:
            return self.target.hidden_size
        m = self.training.model if self.training else None
        return m.hidden_size if m is not None else None

    @property
    def target_vocab(self) -> int | None:
        if self.target is not None and self.target.vocab_size:
            return self.target.vocab_size
        m = self.training.model if self.training else None
        return m.vocab_size if m is not None else None

    @property
    def runtime_label(self) -> str:
        return self.plan.label if self.plan else (self.runtime or "the server")
