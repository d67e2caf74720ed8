"""IDS: aux layer ids — which stream each slot holds on the server versus in training."""

from __future__ import annotations

from collections.abc import Iterator

from consistency.contract import conventions as cv
from consistency.contract.resolve import streams_of
from consistency.contract.runtime_model import id_source
from consistency.lint.context import Context, NotEvaluated
from consistency.lint.plan import ID_KEYS
from consistency.lint.rules.base import EAGLE3, E, W, Hit, fmt_streams, rule
from consistency.lint.trained import from_draft


@rule("IDS001", "ids-default-fallback", W, "no aux ids where the serving runtime reads them: it uses its default",
      "sglang spec_aux_hidden_state.py _resolve_eagle_aux_hidden_state (nested key only); vllm eagle3_utils.py "
      "(V2: top level only); vLLM PR #50170 (fallback gave 1.2% acceptance instead of 58.9%)",
      "write the ids the draft was trained on under the key the runtime reads, in its convention", applies_to=EAGLE3)
def default_fallback(ctx: Context) -> Iterator[Hit]:
    plan = ctx.need_plan()
    ctx.need_config()  # the rule needs the draft config (its absence is "not evaluated")
    if not plan.default_used:
        return
    src = id_source(plan.runtime, plan.version, plan.runner)
    where = " or ".join(src.keys) if src else "its id key"
    why = (f"ids are present only under {', '.join(f'{k} = {v}' for k, v in plan.ignored.items())}, which "
           f"{plan.label} does not read ({plan.source})") if plan.ignored else "the draft config has no aux layer ids"
    tr = ctx.training.streams if ctx.training else None
    sev = E if tr is not None and plan.streams is not None and tr != plan.streams else W
    tail = "" if sev is E else (" — right only because the defaults happen to agree" if tr == plan.streams and tr
                                else "")
    yield Hit(f"{why}: {plan.label} finds nothing under {where} and falls back to its default, streams "
              f"{fmt_streams(plan.streams, ctx.n)}{tail}", sev, key=next(iter(plan.ignored), None))


@rule("IDS002", "ids-stream-mismatch", E, "the server feeds other streams than training used, slot by slot",
      "seed story (trained on streams [0, 3, 31], served [3, 31, 59]); sglang PR #25454; vllm PR #43671",
      "write the training streams in the serving runtime's convention (the finding names the ids), or retrain",
      applies_to=EAGLE3)
def stream_mismatch(ctx: Context) -> Iterator[Hit]:
    plan = ctx.need_plan()
    if plan.unknown:
        yield Hit(f"{plan.unknown}: which streams {plan.label} feeds the draft cannot be known, so nothing says "
                  "they match training; lint the draft's files (--draft DIR)", W)
        return
    tr = ctx.need_training()
    if plan.streams is None or tr.streams is None:
        raise NotEvaluated("serving or training streams unknown (the default ids need the target's layer count: "
                           "--target)")
    if tr.ambiguous:
        yield from _readings_mismatch(ctx, plan.streams)
        return
    if plan.streams == tr.streams:
        return
    n = ctx.n
    rows = []
    for i in range(max(len(plan.streams), len(tr.streams))):
        s = plan.streams[i] if i < len(plan.streams) else None
        t = tr.streams[i] if i < len(tr.streams) else None
        if s != t:
            rows.append(f"slot {i}: {'-' if s is None else s} instead of {'-' if t is None else t}")
    yield Hit(f"{plan.label} feeds streams {fmt_streams(plan.streams, n)}; training used "
              f"{fmt_streams(tr.streams, n)} ({'; '.join(rows)})", key=plan.key,
              fix=_fix(ctx, tr.streams), evidence={"serving": plan.streams, "training": tr.streams})


def _readings_mismatch(ctx: Context, served: list[int]) -> Iterator[Hit]:
    """The training streams depend on a version lint cannot see: an error as soon as one
    plausible reading differs from what the server feeds, every reading listed."""
    tr, plan = ctx.training, ctx.plan
    assert tr is not None and plan is not None
    bad = [r for r in tr.readings if r.streams != served]
    if not bad:
        return
    said = "; ".join(f"{r.label}: {fmt_streams(r.streams, ctx.n)} — "
                     + ("equal" if r.streams == served else "differs from what the server feeds") for r in tr.readings)
    yield Hit(f"{plan.label} feeds streams {fmt_streams(served, ctx.n)}; what training used depends on which "
              f"SpecForge trained the draft, which nothing here says: {said}"
              + (f" ({tr.evidence})" if tr.evidence else ""), key=plan.key, fix=_fix(ctx, bad[0].streams or [])
              + "; or pass --trained-with specforge@sglang-VER:IDS (the SGLang your training ran) to settle it",
              evidence={"serving": served, "readings": {r.label: r.streams for r in tr.readings}})


def _fix(ctx: Context, streams: list[int]) -> str:
    plan = ctx.plan
    assert plan is not None
    src = id_source(plan.runtime, plan.version, plan.runner)
    key = src.keys[0] if src else cv.TOP_IDS
    ids = plan.convention.from_streams(sorted(streams), ctx.n)
    blocked = _uncapturable(ctx, streams)
    out = (f"write {key}: {ids} (read by {plan.label} as streams {sorted(streams)})" if ids is not None
           else f"no id list makes {plan.label} feed streams {sorted(streams)}")
    if sorted(streams) != list(streams):
        out += f"; training's slot order {list(streams)} is not ascending, which no server reproduces"
    if blocked:
        out += f"; but {blocked} — upgrade the runtime or retrain on streams it can feed"
    return out


def _uncapturable(ctx: Context, streams: list[int]) -> str:
    lim = ctx.plan.limit if ctx.plan else None
    if lim is None:
        return ""
    bad = []
    if 0 in streams and lim.first == "error":
        bad.append("stream 0 (the embedding)")
    if ctx.n is not None and ctx.n in streams and lim.last != "ok":
        bad.append(f"stream {ctx.n} (the last layer)")
    return f"{ctx.runtime_label} cannot capture {' or '.join(bad)} ({lim.source})" if bad else ""


@rule("IDS003", "ids-out-of-range", E, "an id gives a stream outside 0..N, or one the runtime version cannot capture",
      "sglang models/llama.py (residual None at layer 0; no capture after the last layer), deepseek_v2.py "
      "AuxHiddenStatePacker (0.5.17+); vllm EagleModelMixin (PR #36063), deepseek_v2.py (PR #46973)",
      "use ids whose streams lie in 0..N and that the runtime version captures; upgrade the runtime for stream 0/N",
      applies_to=EAGLE3)
def out_of_range(ctx: Context) -> Iterator[Hit]:
    if ctx.runtime is None and ctx.draft is not None and ctx.draft.config:
        yield from _out_of_range_any(ctx, ctx.need_n())
        return
    plan, n = ctx.need_plan(), ctx.need_n()
    if plan.config_order is None:
        raise NotEvaluated("serving streams unknown")
    bad = [(j, s) for j, s in zip(plan.native_ids or plan.config_order, plan.config_order) if not 0 <= s <= n]
    for j, s in bad:
        yield Hit(f"id {j} is stream {s} on {plan.label}, outside 0..{n} for a {n}-layer target: that slot is "
                  "never filled", key=plan.key)
    lim = plan.limit
    if lim is None:
        return
    if 0 in plan.config_order and lim.first != "ok":
        yield Hit(f"stream 0 (the embedding) is requested but {plan.label} "
                  f"{'crashes capturing it' if lim.first == 'error' else 'may not capture it (not verified)'}: "
                  f"{lim.source}", E if lim.first == "error" else W, key=plan.key)
    if n in plan.config_order and lim.last != "ok":
        what = ("never captures it: the draft gets one slot fewer" if lim.last == "dropped"
                else "raises at the first step")
        yield Hit(f"stream {n} (the last layer's output) is requested but {plan.label} {what} ({lim.source})",
                  key=plan.key)


def _out_of_range_any(ctx: Context, n: int) -> Iterator[Hit]:
    """No runtime named: an id j is stream j or j + 1 under every runtime's reading, so j < 0 or
    j > N lies outside 0..N whichever runtime serves the draft."""
    for key, ids in _present(ctx):
        bad = [j for j in ids if j < 0 or j > n]
        if bad:
            yield Hit(f"{key} = {ids}: {bad} lie outside 0..{n} for a {n}-layer target under every runtime's "
                      "reading (id j is stream j or j + 1): that slot is never filled", key=key)


def _present(ctx: Context) -> list[tuple[str, list[int]]]:
    d = ctx.need_config()
    return [(k, v) for k in ID_KEYS if (v := d.ids(k))]


@rule("IDS004", "ids-duplicate", E, "an id list repeats an id: capture merges it, the draft gets fewer slots",
      "sglang models/*.py (`if i in layers_to_capture`); vllm interfaces.py (`tuple(sorted(set(layers)))`); "
      "speculators models/utils.py resolve_target_layer_ids (rejects duplicates)",
      "list each layer once; the fc width must equal (number of distinct ids) x target hidden size", applies_to=EAGLE3)
def duplicate(ctx: Context) -> Iterator[Hit]:
    for key, ids in _present(ctx):
        dup = sorted({j for j in ids if ids.count(j) > 1})
        if dup:
            yield Hit(f"{key} = {ids} repeats {dup}: servers capture each layer once, so the draft gets "
                      f"{len(set(ids))} slots, not {len(ids)}", key=key)


@rule("IDS005", "ids-unsorted", W, "ids are not ascending: servers fill slots in layer order, not list order",
      "sglang models/llama.py (capture inside the layer loop); vllm interfaces.py EagleModelMixin (sorted ids)",
      "list ids in ascending order, and train with the slots in that order", applies_to=EAGLE3)
def unsorted(ctx: Context) -> Iterator[Hit]:
    for key, ids in _present(ctx):
        if list(ids) != sorted(ids):
            yield Hit(f"{key} = {ids} is not ascending: the server's slots are {sorted(set(ids))} in layer order, "
                      "so a draft trained on the listed order gets its slots permuted", key=key)


@rule("IDS006", "ids-conflict", W, "the config carries two id lists that mean different streams",
      "sglang reads eagle_config.eagle_aux_hidden_state_layer_ids only; vllm reads the top-level key first",
      "keep one list, or make both spell the same streams in their runtime's convention", applies_to=EAGLE3)
def conflict(ctx: Context) -> Iterator[Hit]:
    d = ctx.need_config()
    top, nested = d.ids(cv.TOP_IDS), d.ids(cv.NESTED_IDS)
    if not top or not nested:
        return
    spec = f"sglang@{'.'.join(map(str, ctx.version))}" if ctx.runtime == "sglang" and ctx.version else "sglang"
    s_top, s_nested = sorted(set(top)), sorted(set(streams_of(nested, spec, ctx.n or 0, ctx.arch).streams or []))
    if s_top != s_nested:
        yield Hit(f"top-level ids {top} (vLLM: streams {s_top}) and eagle_config ids {nested} (SGLang: streams "
                  f"{s_nested}) disagree: the same draft is fed different streams on each runtime", key=cv.TOP_IDS)


@rule("IDS007", "ids-version-dependent", W, "the streams fed depend on a runtime version or target not pinned",
      "sglang PR #25454 (0.5.13, deepseek_v2/glm4_moe_lite), PR #32334 (0.5.17, gpt_oss); vllm runners V1/V2 "
      "(PR #44443, #53183)",
      "pin --runtime NAME@VERSION (and pass --target) so the linter checks the rule your server applies",
      applies_to=EAGLE3)
def version_dependent(ctx: Context) -> Iterator[Hit]:
    ctx.need_plan()
    ctx.need_config()
    if len(ctx.alternatives) > 1:
        parts = "; ".join(f"{a.label} -> {a.streams}" for a in ctx.alternatives)
        yield Hit(f"the streams depend on what is not pinned: {parts}")


@rule("IDS008", "ids-foreign-spelling", W, "the server feeds the default streams shifted by one layer: ids were "
      "written in another runtime's convention", "speculators convert/eagle/eagle3_converter.py (copies ids "
      "verbatim); SpecForge/ModelOpt write layer outputs [1, N//2-1, N-4]; vllm PR #43671",
      "rewrite the ids in the serving runtime's convention (stream ids for vLLM/speculators, layer outputs for SGLang)",
      applies_to=EAGLE3)
def foreign_spelling(ctx: Context) -> Iterator[Hit]:
    plan, n = ctx.need_plan(), ctx.need_n()
    if plan.native_ids is None or plan.config_order is None:
        return
    dflt = plan.convention.default_streams(n)
    got = sorted(set(plan.config_order))
    for shift, how in ((-1, "layer-output ids (SpecForge/ModelOpt/SGLang style) read as stream ids"),
                       (1, "stream ids (vLLM/speculators style) read as layer outputs (+1)")):
        confirmed = ctx.training is not None and ctx.training.explicit and ctx.training.streams == got
        if got == [s + shift for s in dflt] and not confirmed:
            yield Hit(f"{plan.key} = {plan.native_ids} gives streams {got} on {plan.label}: the default streams "
                      f"{dflt} moved by {shift:+d} layer, the signature of {how}", key=plan.key)


@rule("IDS009", "ids-capture-disabled", E, "eagle_config.use_aux_hidden_state is false: no aux states are captured",
      "sglang model_runner.py (eagle_use_aux_hidden_state); vllm models/llama_eagle3.py use_aux_hidden_state",
      "remove use_aux_hidden_state: false from an EAGLE-3 draft's eagle_config", applies_to=EAGLE3)
def capture_disabled(ctx: Context) -> Iterator[Hit]:
    d = ctx.need_config()
    if d.use_aux_hidden_state is False and d.is_eagle3 is not False:
        yield Hit("eagle_config.use_aux_hidden_state is false: the server feeds only the last hidden state, "
                  "not the concatenated aux states the fc was trained on", key="eagle_config.use_aux_hidden_state")


@rule("IDS010", "ids-config-vs-training", W, "the draft config's own ids do not mean the streams training used",
      "speculators scripts/launch_vllm.py vs --target-layer-ids (not cross-checked); SpecForge run-config "
      "model.aux_hidden_state_layer_ids overrides the draft config",
      "write into the draft config the ids training used, in the training framework's convention", applies_to=EAGLE3)
def config_vs_training(ctx: Context) -> Iterator[Hit]:
    d, tr = ctx.need_config(), ctx.need_training()
    if not tr.explicit:
        raise NotEvaluated("training streams were assumed from the draft config itself (--trained-with not given)")
    own = from_draft(d, ctx.n, ctx.arch)
    if own is None or own.streams is None or tr.streams is None:
        raise NotEvaluated("the draft config's format has no training convention, or the layer count is unknown")
    readings = {f"{own.convention} convention": own.streams}
    readings.update({r.label: r.streams for r in own.readings if r.streams is not None})
    if d.format in ("sglang", "modelopt") and ctx.n is not None:
        # an SGLang-layout config may be written for SGLang's own (version-dependent) reading instead
        spec = f"sglang@{'.'.join(map(str, ctx.version))}" if ctx.runtime == "sglang" and ctx.version else "sglang"
        readings[f"{spec} reading"] = streams_of(own.native_ids, spec, ctx.n, ctx.arch).streams or []
    if all(sorted(s) != sorted(tr.streams) for s in readings.values()):
        uniq: dict[str, list[str]] = {}
        for k, v in readings.items():
            uniq.setdefault(str(v), []).append(k)
        said = " or ".join(f"{v} ({', '.join(ks)})" for v, ks in uniq.items())
        yield Hit(f"the draft config's ids {own.native_ids} mean streams {said} but training used {tr.streams} "
                  f"({tr.source})", key=cv.TOP_IDS if own.convention == "speculators" else cv.NESTED_IDS)


@rule("IDS011", "ids-training-version-dependent", W, "the streams training used depend on a version the draft does "
      "not record (SpecForge ids mean what its SGLang made of them)",
      "SpecForge pyproject.toml (sglang pins 0.5.6, 0.5.9, 0.5.14); sglang PR #25454 (0.5.13: DeepSeek/Kimi ids "
      "used as they are unless the first is 1); sglang wheels' METADATA (transformers pin per release)",
      "pass --trained-with specforge@sglang-VER:IDS with the SGLang release your training ran, or record a training "
      "dump and pass it", applies_to=EAGLE3)
def training_version_dependent(ctx: Context) -> Iterator[Hit]:
    tr = ctx.need_training()
    if not tr.ambiguous:
        if tr.explicit and tr.convention != "specforge":
            raise NotEvaluated(f"the training streams are given explicitly ({tr.source})")
        ctx.need_config()
        return
    served = ctx.plan.streams if ctx.plan is not None else None
    parts = "; ".join(f"{r.label}: {fmt_streams(r.streams, ctx.n)}" + (
        "" if served is None else " (equal to what the server feeds)" if r.streams == served else " (differs)")
        for r in tr.readings)
    yield Hit(f"the draft's ids mean different streams depending on the SGLang release SpecForge captured with: "
              f"{parts}" + (f"; {tr.evidence}" if tr.evidence else "; nothing in the draft narrows it"),
              key=cv.NESTED_IDS, evidence={r.label: r.streams for r in tr.readings})


RULES = (default_fallback, stream_mismatch, out_of_range, duplicate, unsorted, conflict, version_dependent,
         foreign_spelling, capture_disabled, config_vs_training, training_version_dependent)
