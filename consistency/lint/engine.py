"""Run the lint: read the inputs, work out both sides' streams, evaluate the rules.

The one entry point, :func:`run_lint`, is shared by ``consistency lint`` and the gate. It
never loads weights: checkpoints are known from their safetensors headers, and only the
small ``d2t``/``t2d`` tensors are read.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from consistency import __version__
from consistency.contract import resolve
from consistency.contract.findings import Severity
from consistency.contract.models import Consumer
from consistency.errors import UsageError
from consistency.lint import report as R
from consistency.lint.configs import TargetInfo, read_target, target_from_config
from consistency.lint.swapped import builtin, refuse_dump, swapped_draft, swapped_target
from consistency.lint.context import Context, NotEvaluated
from consistency.lint.draft import read_draft
from consistency.lint.fix_rules import propose
from consistency.lint.kind import LABEL, draft_kind, requested
from consistency.lint.plan import alternatives, arch_key, serving_plan
from consistency.lint.rules import Rule, select
from consistency.lint.rules.base import EAGLE3
from consistency.lint.rules.runtimes import draft_slots
from consistency.lint.serve import adopt_speculators, parse_serve
from consistency.lint.trained import from_draft, parse_trained_with

MISMATCH_RULE = "IDS002"  # ids-stream-mismatch: the rule that judges served against trained streams

RUNTIMES = ("sglang", "vllm")
_CONFIG_RULES = ("IDS", "SHP", "VOC", "NRM")  # findings located in the draft config by default


FAIL_ON = ("error", "warning")  # the severities a run can fail on (the gate's config reads this too)
_TEXT = ("draft", "target", "serve", "runtime", "trained_with")


@dataclass(frozen=True)
class LintRequest:
    """What a lint run is asked to check, validated here and nowhere else: the CLI, the gate and
    the Python API each build one, and a bad field is a usage error naming the field before
    anything is read. Frozen: the engine and ``--fix`` read it, never edit it."""

    draft: str | None = None
    target: str | None = None
    serve: str | None = None
    runtime: str | None = None
    trained_with: str | None = None
    select: tuple[str, ...] = ()
    ignore: tuple[str, ...] = ()
    fail_on: str = "error"  # or "warning"

    def __post_init__(self) -> None:
        for name in _TEXT:
            v = getattr(self, name)
            if isinstance(v, os.PathLike):
                object.__setattr__(self, name, os.fspath(v))
            elif v is not None and not isinstance(v, str):
                raise UsageError(f"lint: {name} must be a string or a path, got {type(v).__name__}")
        for name in ("select", "ignore"):
            v = getattr(self, name)
            v = () if v is None else (v,) if isinstance(v, str) else tuple(v)
            if not all(isinstance(x, str) for x in v):
                raise UsageError(f"lint: {name} must be rule codes (strings), got {v!r}")
            object.__setattr__(self, name, v)
        if self.fail_on not in FAIL_ON:
            raise UsageError(f"fail_on must be 'error' or 'warning', got {self.fail_on!r}")


@dataclass
class _Built:
    ctx: Context
    assumptions: list[str] = field(default_factory=list)


def parse_runtime(spec: str) -> tuple[str, tuple[int, ...] | None, str | None]:
    """``sglang@0.5.12`` -> ('sglang', (0, 5, 12), '0.5.12'); malformed or pre-EAGLE-3 versions are
    a UsageError; a version newer than any known one is kept (the plan states what was assumed)."""
    rs = resolve.parse_runtime(spec, RUNTIMES)
    return rs.name, rs.version, (rs.text or None)


def build(req: LintRequest) -> _Built:
    if not any((req.draft, req.target, req.serve, req.runtime, req.trained_with)):
        raise UsageError("nothing to lint: give --draft, --target, --serve, --runtime or --trained-with")
    ctx = Context()
    notes: list[str] = []
    ctx.serve = parse_serve(req.serve) if req.serve else None
    if req.runtime:
        ctx.runtime, ctx.version, _ = parse_runtime(req.runtime)
        if ctx.serve and ctx.serve.runtime != ctx.runtime:
            raise UsageError(f"--runtime {req.runtime} but --serve starts {ctx.serve.runtime}")
    elif ctx.serve:
        ctx.runtime = ctx.serve.runtime
    if req.draft:
        dp = builtin(req.draft, "--draft") or Path(req.draft)
        refuse_dump(dp, "--draft")
        ctx.draft = read_draft(dp)
        swapped_draft(ctx.draft, req.draft)
    elif ctx.serve and ctx.serve.draft_model and Path(ctx.serve.draft_model).is_dir():
        ctx.draft = read_draft(Path(ctx.serve.draft_model))
        notes.append(f"draft read from the command line's draft path {ctx.serve.draft_model}")
    _served_draft_is_linted(ctx, notes)
    ctx.target = _target(req, ctx, notes)
    ctx.draft_kind = draft_kind(ctx.draft)
    ctx.requested = requested(ctx.serve, ctx.target, ctx.version, ctx.draft)
    if ctx.kind in LAST_HIDDEN:
        notes.append(f"{LABEL[ctx.kind]} setup ({(ctx.draft_kind if ctx.draft_kind.kind else ctx.requested).how}): "
                     "the EAGLE-3 aux-stream rules do not apply")
    ctx.n = ctx.target.num_layers if ctx.target else None
    arch = arch_key(ctx.target.keys) if ctx.target else None
    if req.trained_with:
        stamp = ctx.draft.config.get("transformers_version") if ctx.draft is not None else None
        stamp = stamp if isinstance(stamp, str) else None
        slots = draft_slots(ctx)
        ctx.training = parse_trained_with(req.trained_with, ctx.n, arch, stamp, slots[0] if slots else None)
        m = ctx.training.model
        if m is not None:
            if ctx.target is None:
                ctx.target = TargetInfo(None, m.architecture, [m.architecture] if m.architecture else [], None,
                                        m.num_layers, m.hidden_size, m.vocab_size, m.dtype, None, ctx.training.source)
                ctx.n = m.num_layers
                if ctx.training.streams is None and ctx.n is not None:
                    ctx.training = parse_trained_with(req.trained_with, ctx.n, m.architecture, stamp,
                                                      slots[0] if slots else None)
            elif m.num_layers and ctx.n and m.num_layers != ctx.n:
                notes.append(f"the training side records {m.num_layers} layers but the target config has {ctx.n}")
    elif ctx.draft is not None:
        ctx.training = from_draft(ctx.draft, ctx.n, arch)
    if ctx.training is not None and ctx.training.assumed:
        notes.append(f"training side: {ctx.training.assumed}")
    if ctx.training is not None and ctx.training.appended:
        notes.append(f"training side: {ctx.training.appended}")
    if ctx.target is not None:
        ctx.arch = arch_key(ctx.target.keys)
    quant = (isinstance(ctx.target.config.get("quantization_config"), dict)
             if ctx.target is not None and ctx.target.config else None)  # vLLM 0.22-0.23 keep quantized on V1
    if ctx.runtime:
        moe = ctx.target.is_moe if ctx.target else None
        ctx.plan = serving_plan(ctx.runtime, ctx.version, ctx.draft, ctx.n, ctx.arch, moe, ctx.serve, quantized=quant)
        if ctx.version is None:
            ctx.plan.label = f"{ctx.runtime} (version not pinned)"
        if ctx.plan.runner:
            notes.append(f"vLLM {ctx.plan.runner.upper()} model runner: {ctx.plan.runner_why}")
        notes.extend(ctx.plan.assumptions)
        ctx.alternatives = alternatives(ctx.runtime, ctx.draft, ctx.n, ctx.arch, moe, ctx.serve, ctx.version, quant)
    elif ctx.draft is not None and ctx.draft.config:
        moe = ctx.target.is_moe if ctx.target else None
        # every runtime that can load the draft's format (SGLang has no speculators reader: SRV004)
        rts = [rt for rt in RUNTIMES if not (rt == "sglang" and ctx.draft.format == "speculators")]
        ctx.any_runtime = [a for rt in rts for a in alternatives(rt, ctx.draft, ctx.n, ctx.arch, moe, None, None,
                                                                  quant)]
    if ctx.training is not None and not ctx.training.explicit:
        notes.append(f"training streams {ctx.training.source}")
    return _Built(ctx, notes)


def _served_draft_is_linted(ctx: Context, notes: list[str]) -> None:
    """``vllm serve MODEL`` where MODEL is the speculators draft given to --draft (the same
    directory, or a hub id naming it): vLLM turns EAGLE-3 on by itself, as for a local one."""
    s, d = ctx.serve, ctx.draft
    if s is None or d is None or s.runtime != "vllm" or s.spec_config or not s.target_model or d.format != "speculators":
        return
    folder = d.path if d.path.is_dir() else (d.config_path.parent if d.config_path else d.path)
    model = Path(s.target_model)
    same = (model.exists() and model.resolve() == folder.resolve()) or \
        (not model.exists() and s.target_model.rstrip("/").rsplit("/", 1)[-1] == folder.resolve().name)
    if same:
        adopt_speculators(s, d.config, s.target_model, f"; {s.target_model} taken as the linted draft {d.path} "
                          "(same name)")
        notes.append(f"vllm serve {s.target_model}: the linted speculators draft, which turns EAGLE-3 on by itself")


def _target(req: LintRequest, ctx: Context, notes: list[str]) -> TargetInfo | None:
    if req.target:
        tp = builtin(req.target, "--target") or Path(req.target)
        refuse_dump(tp, "--target")
        swapped_target(tp, req.target)
        return read_target(tp)
    for label, p in (("the command line's model path", ctx.serve.target_model if ctx.serve else None),
                     ("the speculators verifier", ctx.draft.verifier if ctx.draft else None)):
        if p and (Path(p) / "config.json").is_file():
            notes.append(f"target config read from {label} {p}")
            return read_target(Path(p))
    d = ctx.draft
    if d is not None and d.format == "speculators" and isinstance(d.config.get("transformer_layer_config"), dict):
        tlc = d.config["transformer_layer_config"]
        t = target_from_config({"vocab_size": tlc.get("vocab_size"), "architectures": d.verifier_architectures},
                               None, "the speculators config (verifier architecture, target vocab)")
        t.is_moe = None  # the speculators config does not say
        if t.vocab_size or t.architecture:
            notes.append("target known only from the speculators config (architecture, vocabulary); pass --target "
                         "for its layer count and hidden size")
            return t
    return None


# Rules whose row says they concern aux-stream drafts (EAGLE3: aux streams, fc, vocabulary map,
# norm flags): for another kind of draft (MTP, EAGLE-1, Medusa) they are not evaluated, never
# passed (lint/kind.py decides the kind).
LAST_HIDDEN = (Consumer.mtp, Consumer.eagle1, Consumer.medusa)  # drafts that read one last state, no aux ids


def not_applicable(rule: Rule, ctx: Context) -> str | None:
    """Why ``rule`` does not concern this draft at all (not a pass, not a missing input)."""
    if rule.applies_to == EAGLE3 and ctx.kind in LAST_HIDDEN:
        return f"an EAGLE-3 aux-stream rule, and the draft here is {LABEL[ctx.kind]}"
    return None


def _evaluate(rule: Rule, ctx: Context) -> tuple[list[R.LintFinding], str]:
    try:
        hits = list(rule.check(ctx))
    except NotEvaluated as exc:
        f = R.LintFinding(code=rule.code, name=rule.name, severity=Severity.info, message=f"not evaluated: {exc}",
                          source=rule.source, fix=None, doc=rule.doc)
        return [f], "not_evaluated"
    out = []
    for h in hits:
        sev = h.severity or rule.severity
        loc = _location(rule, h, ctx)
        out.append(R.LintFinding(code=rule.code, name=rule.name, severity=sev, message=h.message, source=rule.source,
                                 fix=h.fix or rule.fix, doc=rule.doc, location=loc, evidence=h.evidence,
                                 autofix=propose(rule.code, ctx, h)))
    sevs = {f.severity for f in out}
    status = "fail" if Severity.error in sevs else ("warn" if Severity.warning in sevs else "pass")
    return out, status


def _location(rule: Rule, h: object, ctx: Context) -> R.Location | None:
    file, key = getattr(h, "file", None), getattr(h, "key", None)
    d = ctx.draft
    if file is None and d is not None and (key or rule.code.startswith(_CONFIG_RULES)):
        file = d.config_path or d.path
    if file is None:
        return None
    line = locate(Path(file), key) if key and Path(file).suffix == ".json" else None
    return R.Location(file=str(file), key=key, line=line)


def locate(path: Path, key: str) -> int | None:
    """1-based line of a dotted key in a JSON file (parents first), for SARIF/annotations."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    pos = 0
    for part in key.split("."):
        i = text.find(f'"{part}"', pos)
        if i < 0:
            return None
        pos = i + 1
    return text.count("\n", 0, pos) + 1


def run_lint(req: LintRequest) -> R.LintReport:
    t0 = time.perf_counter()
    b = build(req)
    ctx = b.ctx
    findings: list[R.LintFinding] = []
    results: list[R.RuleResult] = []
    for rule in select(req.select, req.ignore):
        reason = not_applicable(rule, ctx)
        fs, status = ([], "not_applicable") if reason else _evaluate(rule, ctx)
        findings += fs
        results.append(R.RuleResult(code=rule.code, name=rule.name, title=rule.title, severity=rule.severity,
                                    status=status, reason=reason, source=rule.source, fix=rule.fix, doc=rule.doc))
    rank = {Severity.error: 0, Severity.warning: 1, Severity.info: 2}
    findings.sort(key=lambda f: (rank[f.severity], f.code))
    counts = {s.value: sum(f.severity == s for f in findings) for s in Severity}
    failing = {Severity.error} | ({Severity.warning} if req.fail_on == "warning" else set())
    verdict = "fail" if any(f.severity in failing for f in findings) else "pass"
    if verdict == "pass" and all(r.status in ("not_evaluated", "not_applicable") for r in results):
        verdict = "not_evaluated"  # nothing was checked: not a pass (exit 1, docs/lint.md#verdicts)
    aux = ctx.kind not in LAST_HIDDEN  # an MTP/EAGLE-1/Medusa draft has no aux slots to show
    tr = ctx.training.streams if ctx.training and aux else None
    sv = ctx.plan.streams if ctx.plan and aux else None
    rep = R.LintReport(
        version=__version__, verdict=verdict, summary=_summary(verdict, counts, tr, sv, ctx, results), inputs=R.Inputs(
            draft=req.draft or (str(ctx.draft.path) if ctx.draft else None),
            draft_format=ctx.draft.format if ctx.draft else None, target=req.target, serve=req.serve,
            runtime=req.runtime, trained_with=req.trained_with),
        training_streams=list(tr) if tr is not None else None,
        training_source=ctx.training.source if ctx.training else None,
        training_checked=bool(ctx.training and ctx.training.explicit and not ctx.training.ambiguous),
        training_readings=[R.TrainingReading(label=r.label, streams=r.streams,
                                             matches_serving=(r.streams == sv) if sv is not None else None)
                           for r in (ctx.training.readings if ctx.training and aux else [])],
        training_evidence=ctx.training.evidence if ctx.training else None,
        serving_streams=list(sv) if sv is not None else None, serving=_serving(ctx) if aux else None,
        slots=_slots(ctx) if aux else [],
        findings=findings, rules=results, counts=counts, assumptions=b.assumptions)
    from consistency.lint.fix import plan as fix_plan

    rep.fixed_serve = fix_plan(rep, read=False).command
    rep.seconds = time.perf_counter() - t0
    return rep


def _summary(verdict: str, counts: dict[str, int], tr: list[int] | None, sv: list[int] | None, ctx: Context,
             results: list[R.RuleResult]) -> str:
    if verdict == "not_evaluated":
        return (f"nothing was checked: every selected rule lacks an input ({counts['info']} not evaluated); give "
                "--draft, and --serve or --runtime")
    parts = [f"{counts['error']} error{'s' * (counts['error'] != 1)}, {counts['warning']} "
             f"warning{'s' * (counts['warning'] != 1)}"]
    if ctx.kind in LAST_HIDDEN:
        parts.append(f"{LABEL[ctx.kind]} draft ({(ctx.draft_kind if ctx.draft_kind.kind else ctx.requested).how})")
    r = ctx.requested
    if ctx.serve is not None and (r.broken or (sv is not None and r.kind in LAST_HIDDEN)):
        parts.append(f"the command line captures no aux hidden states ({r.how})" + (
            f"; as EAGLE-3, {ctx.runtime_label} would feed streams {sv}" if sv is not None else ""))
    elif sv is not None:
        parts.append(f"{ctx.runtime_label} feeds streams {sv}")
    elif ctx.serve is None and ctx.runtime is None and ctx.kind not in LAST_HIDDEN:
        parts.append("what a server feeds was not checked: no runtime named (--runtime NAME@VERSION or --serve)")
    t = ctx.training
    if t is not None and t.ambiguous and ctx.kind not in LAST_HIDDEN:
        parts.append("the training streams depend on what trained the draft: " + "; ".join(
            f"{r.label}: {r.streams}" + ("" if sv is None else " (equal)" if r.streams == sv else " (differs)")
            for r in t.readings))
    elif tr is not None:
        parts.append(f"training used {tr}" if t is not None and t.explicit else f"the draft config implies {tr}")
        status = next((r.status for r in results if r.code == MISMATCH_RULE), None)
        if sv is not None and list(tr) != list(sv) and status not in ("pass", "fail", "warn"):
            # a line naming two stream lists under PASS must say that nothing judged them
            why = "not run (--select/--ignore)" if status is None else str(status).replace("_", " ")
            parts.append(f"the streams differ, not judged: {MISMATCH_RULE} (ids-stream-mismatch) was {why}")
    elif t is not None and "training unknown" in t.source and ctx.kind not in LAST_HIDDEN:
        parts.append("training unknown: no reading of the draft's ids gives streams inside 0..N (see assumptions)")
    if t is not None and not t.explicit and ctx.kind not in LAST_HIDDEN and (tr is not None or t.ambiguous):
        parts.append("what training really fed the draft was not checked: pass --trained-with (a training dump, "
                     "a contract, or FRAMEWORK@VERSION:IDS), or compare a training dump with `consistency compare`")
    return "; ".join(parts)


def _serving(ctx: Context) -> R.ServingSide | None:
    p = ctx.plan
    if p is None:
        return None
    return R.ServingSide(runtime=p.runtime, version=".".join(map(str, p.version)) if p.version else None,
                         label=p.label, runner=f"{p.runner}: {p.runner_why}" if p.runner else None, key=p.key,
                         ids=p.native_ids, default_used=p.default_used, ignored=p.ignored, convention=p.convention.code,
                         meaning=p.convention.meaning, source=p.source)


def _slots(ctx: Context) -> list[R.SlotRow]:
    tr = ctx.training.streams if ctx.training and ctx.training.streams is not None else []
    p = ctx.plan
    sv = p.streams if p and p.streams is not None else []
    rows = []
    for i in range(max(len(tr), len(sv))):
        t = tr[i] if i < len(tr) else None
        s = sv[i] if i < len(sv) else None
        rows.append(R.SlotRow(slot=i, training_stream=t, serving_stream=s,
                              serving_id=p.slot_ids[i] if p and i < len(p.slot_ids) else None,
                              training_meaning=resolve.describe_streams([t], ctx.n)[0] if t is not None else None,
                              serving_meaning=resolve.describe_streams([s], ctx.n)[0] if s is not None else None,
                              match=(t == s) if tr and sv else None))
    return rows
