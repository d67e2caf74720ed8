"""MTP: multi-token-prediction drafts (DeepSeek-V3/R1 NextN, GLM, Qwen3-Next/3.5, MiMo) and their flags.

Each rule reads the serving side from the command line (lint/kind.py) and the behaviour of
the runtime version from the one consumer table, ``contract/consumers.py``, so a lint
finding and a contract from ``contract_for`` cannot disagree. Facts and sources:
docs/rules/MTP00x.md (each page says what was read, at which commit).
"""

from __future__ import annotations

from collections.abc import Iterator

from consistency.contract import consumers as C
from consistency.contract.models import Consumer, NormState, Recycle
from consistency.lint import kind as K
from consistency.lint.context import Context, NotEvaluated
from consistency.lint.rules.base import E, I, W, Hit, rule

VLLM_46994 = "2026-09-11"  # merge date of vllm #46994 (commit 6fe67cbbf3); first release with it not verified


def _steps(k: int) -> str:
    """'draft step 1' or 'draft steps 1..3': the steps >= 1 of k that read a recycled state."""
    return "draft step 1" if k == 2 else f"draft steps 1..{k - 1}"


def _mtp_served(ctx: Context) -> bool:
    """True when the command line runs an MTP draft; NotEvaluated without a command line."""
    if ctx.serve is None:
        raise NotEvaluated("no serving command line (--serve \"COMMAND\"): cannot tell whether MTP is served")
    if ctx.requested.undecided:
        raise NotEvaluated(f"cannot tell whether MTP is served: {ctx.requested.how}")
    return ctx.requested.kind is Consumer.mtp


def _need_family(ctx: Context) -> str:
    fam = K.family(ctx.target)
    if fam is None:
        raise NotEvaluated("the target's architecture is unknown (--target CONFIG)")
    return fam


def _vtext(v: tuple[int, ...] | None) -> str:
    return ".".join(map(str, v)) if v else ""


@rule("MTP001", "mtp-layers-missing", E, "MTP is served but the model it comes from declares no MTP layers",
      "vllm vllm/model_executor/models/deepseek_mtp.py (03356f8: one layer per num_nextn_predict_layers, from "
      "layer index num_hidden_layers); Kimi-K2 config num_nextn_predict_layers 0 (NVIDIA/Model-Optimizer "
      "default_kimik2_eagle_config)", "serve an EAGLE-3 draft for this target (e.g. Kimi-K2: lightseekorg "
      "kimi-k2.5-eagle3), or a checkpoint that ships its MTP layers")
def layers_missing(ctx: Context) -> Iterator[Hit]:
    if not _mtp_served(ctx):
        return
    d = ctx.draft
    if d is not None and ctx.draft_kind.kind is Consumer.mtp:  # a separate MTP draft (speculators, converted)
        cfg, what, path = d.config, f"the draft {d.path}", d.config_path
    else:
        t = ctx.need_target()
        cfg, what, path = t.config, "the target config", t.path
    n, key = K.mtp_layers(cfg, path)
    if n == 0:
        yield Hit(f"{ctx.requested.how} runs the target's MTP layers, but {what} has {key} = 0: there is no MTP layer "
                  "to draft with (Kimi-K2/K2.5 ship none; serve an EAGLE-3 draft instead)", key=key, file=path)
    elif n is None:
        yield Hit(f"{ctx.requested.how} runs MTP layers, but {what} declares none ({' / '.join(K.MTP_LAYER_KEYS)} "
                  "absent): the runtime falls back to its config class default and loads weights that may not exist",
                  W, file=path)


@rule("MTP002", "mtp-trained-prenorm", W, "an MTP draft trained on the pre-final-norm last state is served "
      "the post-norm one (unconfirmed in the field)",
      "vllm-project/speculators 0.9.0 src/speculators/models/mtp/{core,data}.py (target_layer_ids = "
      "[num_hidden_layers]; hidden_states = verifier_last_hidden_states, no verifier_norm); train/data.py "
      "(last captured layer); speculators #313 (vLLM captures layer N before the final norm)",
      "train on the target's post-final-norm state (apply the verifier's final norm to verifier_last_hidden_states, "
      "as the EAGLE-3 and DFlash paths do), or measure both with `consistency compare`")
def trained_prenorm(ctx: Context) -> Iterator[Hit]:
    d = ctx.need_draft()
    if ctx.draft_kind.kind is not Consumer.mtp:
        return
    if d.format != "speculators":
        raise NotEvaluated("the MTP draft's training pipeline is unknown (only speculators MTP configs say it)")
    train = next(r for r in C.ROWS if r.code == "speculators-mtp")
    fam = K.family(ctx.target) or (d.verifier_architectures[0] if d.verifier_architectures else None)
    if ctx.runtime is not None:
        row = C.lookup(Consumer.mtp, ctx.runtime, ctx.version, fam)
        rows = [row] if row is not None else []
        label = ctx.runtime_label
    else:
        rows = [r for r in C.rows(Consumer.mtp) if r.side == "serving" and r.covers(None, fam)]
        label = "every runtime in the consumer table"
    if not rows:  # an unknown family is "not evaluated", never a silent pass
        where = ctx.runtime_label if ctx.runtime is not None else "any runtime"
        raise NotEvaluated(f"the consumer table (contract/consumers.py) has no MTP serving row for {where} on a "
                           f"{fam or 'target of unknown family'} target: which norm state the server feeds the MTP "
                           "head is not known here (measure it with `consistency compare`)")
    served = {r.step0_norm for r in rows}
    if train.step0_norm is NormState.none and NormState.final_norm in served:
        yield Hit(f"speculators MTP trains on verifier_last_hidden_states = the layer-N capture, s=N before the "
                  f"final norm; {label} feeds the MTP head fnorm(s=N), the tensor lm_head reads (probable mismatch, "
                  "not yet confirmed by a measurement)", key="speculators_model_type",
                  evidence={"training": train.code, "serving": [r.code for r in rows]})


@rule("MTP003", "mtp-recycle-prenorm", W, "vLLM DeepSeek/GLM MTP with more than one draft step recycles the "
      "pre-norm draft state (before vllm #45895)",
      "vllm vllm/model_executor/models/deepseek_mtp.py (03356f8: forward returns residual + hidden, shared_head.norm "
      "only in compute_logits); vllm #45895 (merged 2026-06-19, after v0.23.0), #46075, #47448; ROCm/ATOM #1764",
      "upgrade vLLM to a release with #45895 (0.24.0 or later), or serve num_speculative_tokens 1")
def recycle_prenorm(ctx: Context) -> Iterator[Hit]:
    if not _mtp_served(ctx) or ctx.need_serve().runtime != "vllm":
        return
    fam = _need_family(ctx)
    if not K.in_family(fam, C.DEEPSEEK_MTP):
        return
    k = K.steps(ctx.serve)
    if k is None:
        raise NotEvaluated("num_speculative_tokens is not given")
    if k <= 1:
        return
    train = next(r for r in C.ROWS if r.code == "megatron-mtp")
    if ctx.version is None:
        legacy = C.lookup(Consumer.mtp, "vllm", (0, 0, 0), fam)
        if legacy is not None and legacy.recycle is not train.recycle:
            yield Hit(f"num_speculative_tokens {k} on an unpinned vLLM: releases before "
                      f"{_vtext(C.VLLM_45895_VERSION)} feed {_steps(k)} the pre-norm state "
                      f"({legacy.recycle.value}) where the MTP layer was trained on {train.recycle.value}; pin "
                      "--runtime vllm@VERSION", evidence={"row": legacy.code})
        return
    row = C.lookup(Consumer.mtp, "vllm", ctx.version, fam)
    if row is not None and row.recycle is Recycle.d_raw and train.recycle is Recycle.d_norm:
        yield Hit(f"{ctx.runtime_label} with num_speculative_tokens {k}: {_steps(k)} recycle{'s' if k == 2 else ''} the MTP "
                  "layer's output before shared_head.norm (d_raw); the layer was trained on its normed output "
                  "(d_norm), so acceptance drops at later positions (GLM-5 position 2 ~10%, vllm #46075)",
                  evidence={"row": row.code, "training": train.code})


@rule("MTP004", "mimo-mtp-multistep", E, "vLLM mimo_mtp with more than one speculative token asserts at the "
      "second draft step", "vllm vllm/model_executor/models/mimo_mtp.py (0bb55d6: MiMoMTP.forward "
      "`assert spec_step_idx == 0, \"mimo_mtp only support predict one token now\"`)",
      "set num_speculative_tokens to 1 for MiMo MTP on vLLM")
def mimo_multistep(ctx: Context) -> Iterator[Hit]:
    if not _mtp_served(ctx) or ctx.need_serve().runtime != "vllm":
        return
    s = ctx.need_serve()
    mimo = s.algorithm == "mimo_mtp"
    if not mimo:
        if s.algorithm not in ("mtp",):
            return
        mimo = K.in_family(_need_family(ctx), C.MIMO_MTP)
    if not mimo:
        return
    k = K.steps(s)
    if k is None:
        raise NotEvaluated("num_speculative_tokens is not given")
    if k > 1:
        yield Hit(f"{ctx.requested.how} with num_speculative_tokens {k}: vLLM's MiMo MTP asserts spec_step_idx == 0, "
                  "so the second draft step fails", evidence={"num_speculative_tokens": k})


@rule("MTP005", "mtp-pipeline-parallel", W, "vLLM MTP under pipeline parallelism before vllm #46994 (V2 runner: "
      "no SupportsPP; Qwen3.5/3.6 head skips its fc)",
      f"vllm #46994 (merged {VLLM_46994}: SupportsPP for DeepSeekMTP and Qwen3_5MTP; Qwen3.5 MTP head branched "
      "on is_first_rank, ~1% acceptance); v0.28.0 qwen3_5_mtp.py still lacks SupportsPP (syv-ai/qwen38-27b-rtx3090 "
      "#160)", "serve MTP without --pipeline-parallel-size, or on a vLLM that contains #46994 (check its changelog)")
def pipeline_parallel(ctx: Context) -> Iterator[Hit]:
    if not _mtp_served(ctx) or ctx.need_serve().runtime != "vllm":
        return
    s = ctx.need_serve()
    if (s.pp or 1) <= 1:
        return
    fam = _need_family(ctx)
    qwen = K.in_family(fam, C.QWEN3_NEXT_MTP)
    if ctx.version is not None and ctx.version < (0, 29, 0):
        sev, when = W, f"{ctx.runtime_label} predates #46994"
    else:
        sev, when = I, (f"{ctx.runtime_label}: whether it contains #46994 (merged {VLLM_46994}) is not known here")
    what = ("the Qwen3.5/3.6 MTP head runs without its fc on the last stage (~1% acceptance) or the draft is "
            "refused" if qwen else "the MTP draft model does not implement SupportsPP on the V2 runner: start-up fails")
    yield Hit(f"--pipeline-parallel-size {s.pp} with MTP; {when}: {what}", sev, evidence={"pp": s.pp, "family": fam})


@rule("MTP006", "mtp-method-mismatch", E, "an MTP draft is served by a method that does not run it as MTP",
      "sglang configs/model_config.py ModelConfig._config_draft_model (NEXTN/EAGLE load the MTP class) vs "
      "models/llama_eagle3.py (EAGLE3 builds an fc over aux states); vllm config/speculative.py (method eagle3/eagle/"
      "medusa build EAGLE or Medusa heads; MTPModelTypes and 'mtp' run the MTP layers)",
      "SGLang: --speculative-algorithm NEXTN (or EAGLE) with the MTP draft; vLLM: \"method\": \"mtp\"")
def mtp_method(ctx: Context) -> Iterator[Hit]:
    s, d = ctx.need_serve(), ctx.need_draft()
    if ctx.draft_kind.kind is None:
        raise NotEvaluated(f"cannot tell whether the draft is an MTP draft ({ctx.draft_kind.how})")
    if ctx.draft_kind.kind is not Consumer.mtp:
        return
    r = ctx.requested
    if r.undecided:
        raise NotEvaluated(f"cannot tell which draft the server runs: {r.how}")
    if r.kind is Consumer.mtp:
        return
    if r.kind is None and s.algorithm is None:
        yield Hit("the command line selects no speculative method: the MTP draft is not used")
        return
    runs = f"runs {K.LABEL.get(r.kind, r.kind.value)}" if r.kind is not None else "runs no MTP head"
    yield Hit(f"the draft {d.path} is an MTP draft ({ctx.draft_kind.how}) but {r.how} {runs}: the server builds "
              "another model class around its weights, or refuses them",
              key="architectures" if d.architectures else None)


RULES = (layers_missing, trained_prenorm, recycle_prenorm, mimo_multistep, pipeline_parallel, mtp_method)
