"""Rules that hold whatever runtime serves the draft: the slot count, every runtime's reading
of the ids when none is named, and whether a release accepts the method at all.

Without ``--runtime``/``--serve`` the linter does not guess one: it reads the draft's ids as
every runtime and release it knows would (lint/plan.py ``alternatives``). A mismatch under
every reading is an error; one that depends on the reading is a warning naming which
readings differ. The slot count needs no runtime: an fc built for three slots cannot take
two training streams on any server.
"""

from __future__ import annotations

from collections.abc import Iterator

from consistency.contract import conventions as cv
from consistency.contract import methods as M
from consistency.contract.ids import APPENDING
from consistency.contract.models import Consumer
from consistency.lint.context import Context, NotEvaluated
from consistency.lint.plan import ID_KEYS
from consistency.lint.rules.base import EAGLE3, E, W, Hit, fmt_streams, rule

_KIND_METHOD = {Consumer.mtp: M.MTP, Consumer.eagle1: M.EAGLE, Consumer.eagle3_aux: M.EAGLE3,
                Consumer.medusa: M.MEDUSA, Consumer.dflash: M.DFLASH, Consumer.p_eagle: M.PEAGLE}
_VLLM_METHOD = {"eagle": M.EAGLE, "eagle3": M.EAGLE3, "medusa": M.MEDUSA, "mlp_speculator": M.MLP,
                "dflash": M.DFLASH, "ngram": M.NGRAM, "ngram_gpu": M.NGRAM}
_SGLANG_METHOD = {"EAGLE3": M.EAGLE3, "MEDUSA": M.MEDUSA, "NGRAM": M.NGRAM, "DFLASH": M.DFLASH}
MLP_ARCHS = ("MLPSpeculatorPreTrainedModel", "MLPSpeculator")


def draft_slots(ctx: Context) -> tuple[int, str] | None:
    """How many aux slots the draft's fc reads, and how that is known (checkpoint, config, default)."""
    d = ctx.draft
    if d is None:
        return None
    h = ctx.target_hidden or d.target_hidden_size
    fc = d.checkpoint.find("fc.weight") if d.checkpoint is not None else None
    if fc is not None and len(fc.shape) == 2 and h and fc.shape[1] % h == 0:
        return fc.shape[1] // h, f"fc.weight takes {fc.shape[1]} = {fc.shape[1] // h} x {h} inputs"
    if not d.config:
        return None
    if d.num_aux_hidden_states is not None:
        return d.num_aux_hidden_states, f"num_aux_hidden_states = {d.num_aux_hidden_states}"
    lists = [(k, v) for k in ID_KEYS if (v := d.ids(k))]
    counts = {len(set(v)) for _k, v in lists}
    if len(counts) == 1:
        k, v = lists[0]
        return counts.pop(), f"{k} = {v}"
    if not lists and d.is_eagle3:
        return 3, "no ids in the config: every runtime's default is three ids"
    return None


@rule("IDS012", "ids-slot-count", E, "training fed another number of aux streams than the draft has slots",
      "EAGLE-3 fc: Linear(n * H_target, H_draft) in sglang llama_eagle3.py, vllm llama_eagle3.py, speculators "
      "models/eagle3/core.py (n = len(eagle_aux_hidden_state_layer_ids)); speculators train/data.py drops the "
      "appended verifier state (hidden_states[:, :-1])",
      "give --trained-with the ids training really used (one per slot), or fix the draft's ids / fc to that count",
      applies_to=EAGLE3)
def slot_count(ctx: Context) -> Iterator[Hit]:
    tr = ctx.need_training()
    if not tr.explicit:
        raise NotEvaluated("training streams were assumed from the draft config itself (--trained-with not given)")
    slots = draft_slots(ctx)
    if slots is None:
        raise NotEvaluated("the draft's slot count is unknown (no fc.weight with a known target hidden size, no ids)")
    counts = {len(r.streams) for r in tr.readings if r.streams is not None} or (
        {len(tr.streams)} if tr.streams is not None else set())
    if not counts:
        raise NotEvaluated("the training streams are unknown")
    k, how = slots
    if k not in counts:
        got = tr.streams if tr.streams is not None else []
        hint = ""
        if k + 1 in counts and (tr.convention or "").split("@")[0] in APPENDING and got:
            hint = (f"; a data-generation list ends with N, the verifier's last state, but {got[-1]} is not N "
                    f"({ctx.n if ctx.n is not None else 'unknown: pass --target'})")
        yield Hit(f"training fed {sorted(counts)[0]} aux stream(s) {list(got)} but the draft has {k} slot(s) ({how}): "
                  f"no runtime and no version can make these agree{hint}", evidence={"training": got, "slots": k})


@rule("IDS013", "ids-mismatch-every-runtime", E, "no runtime named: the training streams differ from what every "
      "(or some) runtime and release would feed",
      "the id tables of contract/conventions.py (every runtime, release and model-file family); seed story "
      "(trained on streams [0, 3, 31], served [3, 31, 59])",
      "write the training streams in the convention of the runtime you serve with, and pin it with --runtime",
      applies_to=EAGLE3)
def every_runtime(ctx: Context) -> Iterator[Hit]:
    if ctx.runtime is not None:
        return  # IDS002 compares against the named runtime
    tr = ctx.need_training()
    d = ctx.need_config()
    if tr.streams is None:
        raise NotEvaluated("the training streams are unknown (the default ids need the target's layer count)")
    if not ctx.any_runtime:
        raise NotEvaluated("no runtime's reading of the draft's ids is known (the default ids need the target's "
                           "layer count: --target)")
    if not any(d.ids(k) for k in ID_KEYS) and not d.is_eagle3:
        raise NotEvaluated("the draft config names no aux ids and is not recognised as EAGLE-3")
    wanted = [r.streams for r in tr.readings] if tr.ambiguous else [tr.streams]
    rows = [(a.label, a.streams) for a in ctx.any_runtime if a.streams is not None]
    if not rows:
        raise NotEvaluated("no runtime's serving streams are known for this draft")
    unknown = [a.label for a in ctx.any_runtime if a.streams is None]
    if unknown and not any(_default_can_be(w) for w in wanted):
        unknown = []  # those readings are a runtime default, and no layer count makes a default equal training
    pairs = [(lab, s, w) for lab, s in rows for w in wanted]
    n = ctx.n
    said = "; ".join(f"{lab}: {fmt_streams(s, n)}" for lab, s in rows)
    train = " or ".join(str(w) for w in wanted) + (" (depending on what trained the draft)" if len(wanted) > 1 else "")
    ev = {"training": wanted, "readings": {lab: s for lab, s in rows}, "unknown": unknown}
    if all(s == w for _lab, s, w in pairs):
        if unknown:
            yield Hit(f"training used {train}, equal on {said}; what {'; '.join(unknown)} feeds is not known (the "
                      "default ids need the target's layer count: --target), so it was not checked", W, evidence=ev)
        return
    if all(s != w for _lab, s, w in pairs) and not unknown:
        yield Hit(f"training used {train}, and no runtime or release reads the draft's ids as that: {said}",
                  E, key=cv.NESTED_IDS if d.ids(cv.NESTED_IDS) else cv.TOP_IDS, evidence=ev)
    else:
        yield Hit(f"training used {train}; whether the server feeds that depends on the runtime and release, "
                  f"none named: {said}" + (f"; {'; '.join(unknown)}: not known (--target)" if unknown else "")
                  + " — name it (--runtime NAME@VERSION) to settle it", W, evidence=ev)


def _default_can_be(streams: list[int] | None) -> bool:
    """Whether some layer count N makes a runtime's default ids (contract/conventions.py) give ``streams``."""
    if not streams:
        return False
    fns = {c.default_streams for c in cv.REGISTRY}
    return any(f(n) == list(streams) for f in fns for n in range(max(streams), max(streams) + 8))


def methods(ctx: Context) -> dict[str, str]:
    """Speculative methods this run is about -> how each was known (the flags, the draft files)."""
    out: dict[str, str] = {}
    s = ctx.serve
    if s is not None and s.algorithm:
        if s.runtime == "vllm":
            m = _VLLM_METHOD.get(s.algorithm.lower()) or (M.MTP if ctx.requested.kind is Consumer.mtp else None)
            if m == M.EAGLE3 and s.parallel_drafting:
                m = M.PEAGLE
        else:
            m = _SGLANG_METHOD.get(s.algorithm.upper()) or _KIND_METHOD.get(ctx.requested.kind)  # type: ignore[arg-type]
        if m:
            out[m] = ctx.requested.how if ctx.requested.kind is not None else f"the method {s.algorithm!r}"
    d = ctx.draft
    if d is not None and (any(a in MLP_ARCHS for a in d.architectures) or d.config.get("model_type") == M.MLP):
        out.setdefault(M.MLP, "the draft config (MLPSpeculatorPreTrainedModel)")
    k = ctx.draft_kind.kind
    if k in _KIND_METHOD:
        out.setdefault(_KIND_METHOD[k], f"the draft files ({ctx.draft_kind.how})")
    return out


@rule("MTH001", "method-unsupported-release", E, "the runtime release does not accept the speculative method "
      "(removed, or never had it)",
      "contract/methods.py: vllm/config/speculative.py SpeculativeMethod and models/registry.py in each wheel "
      "0.18.0-0.33.0 (Medusa removed in 0.33.0; MLPSpeculator registry entry commented out); sglang "
      "speculative/spec_info.py SpeculativeAlgorithm in each wheel 0.5.5-0.5.23 (no MEDUSA, no P-EAGLE; DFLASH "
      "from 0.5.12)",
      "serve the draft on a release that accepts its method (the finding names the range), or train another kind")
def method_release(ctx: Context) -> Iterator[Hit]:
    found = methods(ctx)
    if not found:
        raise NotEvaluated("no speculative method is known (no serving command, and the draft files name none)")
    for m, how in found.items():
        if ctx.runtime is None:
            if M.accepted_anywhere(m) is False:
                yield Hit(f"{M.LABEL[m]} ({how}): no release of any runtime read here accepts it: "
                          + "; ".join(M.support(rt, m, None).why for rt in ("vllm", "sglang")))
            continue
        if ctx.runtime == "sglang" and m == M.MEDUSA:
            continue  # MDS001 says it, with the SGLang flags
        sup = M.support(ctx.runtime, m, ctx.version)
        if sup.accepted is False:
            older = sup.row is not None and sup.row.accepted is not None
            sev = W if ctx.version is None and older else E
            tail = " (version not pinned: an older release may be what you serve)" if sev is W else ""
            yield Hit(f"{M.LABEL[m]} ({how}): {sup.why}{tail}", sev)


@rule("MTH002", "draft-config-names-nothing", E, "the draft config names no architecture and no method: no runtime "
      "can load it", "vllm transformers_utils/configs/speculators and model_executor/models/registry.py (the "
      "architecture picks the class); sglang ModelConfig._config_draft_model (hf_config.architectures[0])",
      "write the draft's architectures (e.g. LlamaForCausalLMEagle3) or a speculators_model_type into its config")
def names_nothing(ctx: Context) -> Iterator[Hit]:
    d = ctx.need_draft()
    if d.config_path is None:
        raise NotEvaluated("the draft has no config.json (only a checkpoint was given)")
    if d.architectures or isinstance(d.config.get("speculators_model_type"), str) or ctx.draft_kind.kind is not None:
        return
    what = "is empty" if not d.config else f"has only {sorted(d.config)[:6]}"
    yield Hit(f"the draft config {what}: no architectures, no speculators_model_type, no method; nothing about it "
              "can be checked and no server can load it", file=d.config_path)


RULES = (slot_count, every_runtime, method_release, names_nothing)
