"""What the server will feed the draft, slot by slot.

Three facts decide it, each from its own table in :mod:`consistency.contract.conventions`:
which config key the runtime (and, for vLLM, its model runner) reads the ids from, what an
id means for the target's model file at that version, and the capture order (ascending by
layer, duplicates merged). When no version is pinned every known version range is
evaluated, so a rule can say exactly which releases feed which streams.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from consistency.contract import conventions as cv
from consistency.contract.resolve import streams_of
from consistency.contract.runtime_model import (capture_limit, id_source, range_label, served_streams, version_points,
                                                vllm_runner)
from consistency.contract.versions import vtext
from consistency.lint.draft import DraftInfo
from consistency.lint.serve import ServeInfo

ID_KEYS = (cv.TOP_IDS, cv.NESTED_IDS, cv.NESTED_LAYER_IDS)
ARCH_FAMILIES = {"Llama-family model files": None, "DeepSeek/Kimi/GLM-4-MoE-Lite": "DeepseekV3ForCausalLM",
                 "gpt-oss": "GptOssForCausalLM"}


@dataclass
class StreamPlan:
    runtime: str
    version: tuple[int, ...] | None
    label: str  # "sglang@0.5.12", or "sglang (no version: newest rules)"
    convention: cv.Convention
    runner: str = ""
    runner_why: str = ""
    key: str | None = None  # the config key the ids were read from; None: the runtime default
    source: str = ""
    native_ids: list[int] | None = None
    ignored: dict[str, list[int]] = field(default_factory=dict)  # id lists present but not read
    streams: list[int] | None = None  # capture order = slot order
    config_order: list[int] | None = None  # streams in the order the config lists the ids
    slot_ids: list[int | None] = field(default_factory=list)
    capture_disabled: bool = False
    limit: cv.CaptureLimit | None = None
    assumptions: list[str] = field(default_factory=list)
    arch: str | None = None  # the target architecture the convention was resolved for
    unknown: str = ""  # why the streams cannot be known (no draft config read), '' when they can

    @property
    def default_used(self) -> bool:
        return self.key is None and not self.capture_disabled


@dataclass
class Alternative:
    label: str
    streams: list[int] | None
    key: str | None
    lo: tuple[int, ...] | None = None
    hi: tuple[int, ...] | None = None
    family: str = ""


def arch_key(keys: list[str]) -> str | None:
    """The name a per-architecture rule is registered under (SGLang's model file choice)."""
    known = cv.SGLANG_DEEPSEEK | cv.SGLANG_GPT_OSS
    for k in keys:
        if k in known:
            return k
    return keys[0] if keys else None


def spec_of(plan: StreamPlan) -> str:
    return f"{plan.runtime}@{vtext(plan.version)}" if plan.version else plan.runtime


def serving_plan(runtime: str, version: tuple[int, ...] | None, draft: DraftInfo | None, n: int | None,
                 arch: str | None, is_moe: bool | None, serve: ServeInfo | None,
                 label: str | None = None, quantized: bool | None = None) -> StreamPlan:
    spec = f"{runtime}@{vtext(version)}" if version else runtime
    res = streams_of(None, spec, None, arch)  # the convention (and what was assumed); streams come in _finish
    plan = StreamPlan(runtime, version, label or spec, res.convention, arch=arch)
    if res.assumed:
        plan.assumptions.append(res.assumed)
    if runtime == "vllm":
        env = serve.env.get("VLLM_USE_V2_MODEL_RUNNER") if serve else None
        v1_only = None
        if serve and serve.parallel_drafting:
            v1_only = "parallel drafting"
        elif serve and (serve.pp or 1) > 1:
            v1_only = "EAGLE3 with pipeline parallelism"
        plan.runner, plan.runner_why = vllm_runner(version, arch, is_moe, env, v1_only, quantized)
    src = id_source(runtime, version, plan.runner)
    if draft is None or not draft.config:
        # no draft config was read (a hub id, a bare checkpoint): its ids, and so the streams, cannot be known;
        # the runtime's defaults apply only to a config that has no ids, never to one nobody read
        plan.source = src.source if src else ""
        plan.unknown = ("no draft config was read" + (f" ({serve.draft_model} is not a directory here: a hub id?)"
                                                      if serve is not None and serve.draft_model else ""))
        plan.assumptions.append(f"{plan.unknown}: the streams {plan.label} feeds cannot be known")
        return plan
    if src is None:
        plan.source = ""
        return _finish(plan, None, n)
    plan.source = src.source
    for key in src.keys:
        ids = draft.ids(key)
        if ids is not None and (ids or runtime == "sglang"):  # vLLM skips an empty list (`if not layer_ids`)
            plan.key, plan.native_ids = key, ids
            break
    plan.ignored = {k: v for k in ID_KEYS if k != plan.key and (v := draft.ids(k))}
    plan.capture_disabled = draft.use_aux_hidden_state is False
    plan.limit = capture_limit(runtime, version, arch)
    _finish(plan, plan.native_ids, n)
    if plan.capture_disabled:
        plan.streams, plan.slot_ids = [], []
        plan.assumptions.append("eagle_config.use_aux_hidden_state is false: no aux streams are captured")
    elif plan.streams is not None and n is not None:
        # what the layer loop really captures (the runtime model the demo's server shares):
        # ids beyond 0..N never match a layer; a model file capturing before each layer never reaches N
        missing = served_streams(spec, plan.native_ids, n, arch).missing
        keep = [i for i, s in enumerate(plan.streams) if s not in missing]
        if len(keep) != len(plan.streams):
            gone = [plan.streams[i] for i in range(len(plan.streams)) if i not in keep]
            plan.assumptions.append(f"streams {gone} are never captured by {plan.label} (see IDS003)")
            plan.streams = [plan.streams[i] for i in keep]
            plan.slot_ids = [plan.slot_ids[i] for i in keep]
    return plan


def _finish(plan: StreamPlan, ids: list[int] | None, n: int | None) -> StreamPlan:
    conv = plan.convention
    if ids is None and n is None:
        plan.assumptions.append("the target's layer count is unknown (pass --target): the default ids cannot be "
                                "turned into streams")
        return plan
    raw = streams_of(ids, spec_of(plan), n, plan.arch).streams or []
    plan.config_order = raw
    order = sorted(set(raw)) if conv.sorts else list(raw)
    plan.streams = order
    native = ids if ids is not None else raw
    plan.slot_ids = [next((native[i] for i, s in enumerate(raw) if s == st), None) for st in order]
    if ids is None:
        plan.slot_ids = [None] * len(order)
    return plan


def alternatives(runtime: str, draft: DraftInfo | None, n: int | None, arch: str | None, is_moe: bool | None,
                 serve: ServeInfo | None, version: tuple[int, ...] | None,
                 quantized: bool | None = None) -> list[Alternative]:
    """Streams under every known version range (when ``version`` is None, i.e. unpinned) and
    every architecture family (when the target is unknown); adjacent ranges that agree are
    merged, so one entry per distinct outcome remains."""
    pinned = [(None, None, version)] if version is not None else version_points(runtime)
    archs = {"": arch} if arch is not None else ARCH_FAMILIES
    out: list[Alternative] = []
    for fam, a in archs.items():
        for lo, hi, rep in pinned:
            p = serving_plan(runtime, rep, draft, n, a, is_moe, serve, quantized=quantized)
            prev = out[-1] if out else None
            if prev and prev.family == fam and prev.streams == p.streams and prev.key == p.key and prev.hi == lo:
                prev.hi = hi
                continue
            out.append(Alternative("", p.streams, p.key, lo, hi, fam))
    for alt in out:
        ver = f"@{vtext(version)}" if version is not None else (
            "" if alt.lo is None and alt.hi is None else range_label(alt.lo, alt.hi))
        alt.label = f"{runtime}{ver}" + (f" ({alt.family})" if alt.family else "")
    distinct: list[Alternative] = []
    for alt in out:
        same = next((m for m in distinct if m.streams == alt.streams and m.key == alt.key), None)
        if same:
            same.label += f"; {alt.label}"
        else:
            distinct.append(alt)
    return distinct
