"""SRV and DTY: the serving command line against the draft (algorithm, budget, format, dtype)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from consistency.contract.models import Consumer
from consistency.lint.context import Context, NotEvaluated
from consistency.lint.kind import VLLM_MTP_METHODS
from consistency.lint.rules.base import EAGLE3, E, I, W, Hit, rule

_EAGLE_FAMILY = ("EAGLE", "EAGLE3", "STANDALONE")
# vLLM methods that need no "model" (vllm config/speculative.py SpeculativeConfig.__post_init__, model None with
# num_speculative_tokens): MTP runs the target's own layers (kind.VLLM_MTP_METHODS), these use a sentinel.
VLLM_NO_MODEL = frozenset({"ngram", "[ngram]", "ngram_gpu", "ngram_dsc", "suffix", "extract_hidden_states", "dspark"})
_SGLANG_ARGS = "sglang server_args.py _handle_speculative_decoding (0.5.12), arg_groups/speculative_hook.py (0.5.23)"


def vllm_method(ctx: Context) -> tuple[str | None, str]:
    """vLLM's method: given, from a speculators config, or guessed from the path (speculative.py)."""
    s = ctx.need_serve()
    if s.algorithm:
        return s.algorithm, s.method_note or "method given in --speculative-config"
    d = ctx.draft
    if d is not None and d.format == "speculators":
        mt = d.config.get("speculators_model_type")
        return (str(mt) if mt else None), "taken from the speculators config"
    path = (s.draft_model or "").lower()
    if not path:
        return None, "no draft model"
    if "eagle3" in path:
        return "eagle3", "inferred from 'eagle3' in the draft path"
    if "eagle-" in path:
        return "eagle", "inferred from 'eagle-' in the draft path"
    return "draft_model", "inferred: the draft path names neither eagle3 nor eagle-"


@rule("SRV001", "draft-token-cap", W, "SGLang speculative budget flags override each other (topk 1: draft tokens = "
      "num_steps + 1)", _SGLANG_ARGS + "; seed story (--speculative-num-steps 1 capped 6 draft tokens at 2)",
      "with --speculative-eagle-topk 1 set --speculative-num-draft-tokens to --speculative-num-steps + 1, i.e. raise "
      "num-steps to get more draft tokens")
def draft_token_cap(ctx: Context) -> Iterator[Hit]:
    s = ctx.need_serve()
    if s.runtime != "sglang" or s.algorithm not in _EAGLE_FAMILY:
        return
    if s.num_steps is None and s.topk is None and s.num_draft_tokens is None:
        arch = ctx.target.architecture if ctx.target else None
        auto = (5, 4, 8) if arch in ("LlamaForCausalLM", "Grok1ForCausalLM", "Grok1VForCausalLM") else (3, 1, 4)
        yield Hit(f"no budget flags: SGLang picks (num_steps, topk, draft tokens) = {auto} for "
                  f"{arch or 'this target (architecture unknown: Llama gets (5, 4, 8))'}", I)
    elif s.topk == 1 and s.num_steps is not None and s.num_draft_tokens is not None \
            and s.num_draft_tokens != s.num_steps + 1:
        yield Hit(f"--speculative-eagle-topk 1 with --speculative-num-steps {s.num_steps}: SGLang sets "
                  f"--speculative-num-draft-tokens {s.num_draft_tokens} to {s.num_steps + 1} (num_steps + 1)"
                  + (", capping the draft" if s.num_draft_tokens > s.num_steps + 1 else ""),
                  evidence={"requested": s.num_draft_tokens, "effective": s.num_steps + 1})


@rule("SRV002", "spec-args-invalid", E, "the server rejects this speculative configuration at start-up",
      _SGLANG_ARGS + "; vllm engine/arg_utils.py, config/speculative.py (num_speculative_tokens required unless "
      "the draft config has n_predict; a model required unless the method is MTP or model-free)",
      "fix the flags the finding names")
def spec_args(ctx: Context) -> Iterator[Hit]:
    s = ctx.need_serve()
    for p in s.problems:
        yield Hit(p)
    if s.runtime == "vllm" and s.spec_config and s.num_speculative_tokens is None \
            and not any(str(x).startswith("num_speculative_tokens") for x in s.spec_config):
        d = ctx.draft
        has_n = d is not None and (d.speculative_tokens is not None or "n_predict" in d.config)
        if not has_n:
            yield Hit("--speculative-config sets no num_speculative_tokens and the draft config has no n_predict "
                      "(nor a speculators proposal): vLLM refuses to start")
    m = s.algorithm
    if s.runtime == "vllm" and s.spec_config and s.draft_model is None and s.num_speculative_tokens is not None \
            and not (m is not None and (m in VLLM_NO_MODEL or m in VLLM_MTP_METHODS)):
        yield Hit(f"--speculative-config sets num_speculative_tokens but no \"model\" for method "
                  f"{m or '(none given)'!r}: vLLM refuses to start (\"num_speculative_tokens was provided but "
                  "without speculative model.\"); name the draft with \"model\"")


@rule("SRV003", "algorithm-mismatch", E, "the serving algorithm/method does not run an EAGLE-3 draft as EAGLE-3",
      "sglang model_runner.py (aux capture only when spec_algorithm.is_eagle3()); vllm config/speculative.py "
      "(method inferred from the path when omitted: 'eagle3', 'eagle-', else draft_model); vllm "
      "transformers_utils/config.py maybe_override_with_speculators (a speculators dir as the model turns EAGLE-3 on)",
      "SGLang: --speculative-algorithm EAGLE3; vLLM: \"method\": \"eagle3\" in --speculative-config", applies_to=EAGLE3)
def algorithm(ctx: Context) -> Iterator[Hit]:
    s, r = ctx.need_serve(), ctx.requested
    if r.broken:  # the flags run no kind of draft on these files: never a pass, with or without --draft
        yield Hit(f"{r.how}: neither an MTP head nor an EAGLE-3 draft with aux hidden states is served")
        return
    if r.undecided and ctx.draft_kind.kind is None:  # cannot tell what runs: say so, never pass silently
        yield Hit(f"which draft the server runs is not known: {r.how}", W)
        return
    d = ctx.need_draft()
    eagle3 = d.is_eagle3
    if eagle3 is None:
        raise NotEvaluated("cannot tell whether the draft is an EAGLE-3 draft")
    if s.runtime == "sglang":
        algo, how = s.algorithm, "--speculative-algorithm"
        if algo is None:
            yield Hit("no --speculative-algorithm: speculative decoding is off")
            return
        right = "EAGLE3"
    else:
        if not s.spec_config:
            local = s.target_model is not None and (Path(s.target_model) / "config.json").is_file()
            if local or not s.target_model:
                yield Hit("no --speculative-config: speculative decoding is off")
            else:  # a hub id: it may be the speculators draft itself, which turns EAGLE-3 on (a warning, not an error)
                yield Hit(f"no --speculative-config: speculative decoding is off unless {s.target_model} is a "
                          "speculators draft, which turns EAGLE-3 on by itself; it is not a local directory, so lint "
                          "cannot tell (pass the downloaded directory to --serve, or lint it with --draft)", W)
            return
        algo, how = vllm_method(ctx)
        right = "eagle3"
    if eagle3 and algo != right:
        yield Hit(f"the draft is an EAGLE-3 draft but the method is {algo!r} ({how}): the server neither captures "
                  "aux hidden states for it nor runs its fc")
    elif eagle3 is False and algo == right:
        yield Hit(f"{how} selects {right} but the draft is not an EAGLE-3 draft")


@rule("SRV004", "draft-format-unsupported", E, "the serving runtime cannot read this draft's config format",
      "sglang llama_eagle3.py (no speculators format: no speculators_model_type / transformer_layer_config), "
      "models/registry.py (no class for a speculators architecture: Eagle3Speculator, MTPDraftModel); vllm "
      "speculators/algos.py update_eagle3 (transformer_layer_config.model_type llama or qwen3, else ValueError)",
      "convert the draft to the runtime's format (SGLang: LlamaForCausalLMEagle3 with eagle_config ids) or serve "
      "it on vLLM")
def draft_format(ctx: Context) -> Iterator[Hit]:
    d, runtime = ctx.need_config(), ctx.need_runtime()
    if runtime == "sglang" and d.format == "speculators":  # whatever the kind: SGLang has no speculators reader
        arch = f" ({d.architectures[0]})" if d.architectures else ""
        yield Hit(f"a speculators draft{arch}: SGLang reads neither speculators_model_type nor "
                  "transformer_layer_config, nor the top-level ids", key="speculators_model_type")
    elif ctx.kind in (Consumer.mtp, Consumer.eagle1, Consumer.medusa):
        return  # vLLM's speculators adapter check below is update_eagle3's (EAGLE-3 drafts)
    elif runtime == "vllm" and d.format == "speculators" and d.layer_model_type not in ("llama", "qwen3"):
        yield Hit(f"transformer_layer_config.model_type {d.layer_model_type!r}: vLLM's speculators adapter "
                  "supports llama and qwen3 only", key="transformer_layer_config.model_type")


@rule("SRV005", "embed-replaced", W, "a trained draft embedding is replaced by the target's on SGLang",
      "sglang speculative/eagle_worker_v2.py init_lm_head (set_embed unless target_hidden_size != hidden_size); "
      "speculators embed_requires_grad",
      "serve on vLLM (keeps the draft's embed_tokens), or train with a frozen embedding (embed_requires_grad false)",
      applies_to=EAGLE3)
def embed_replaced(ctx: Context) -> Iterator[Hit]:
    d, runtime = ctx.need_config(), ctx.need_runtime()
    if runtime != "sglang" or d.config.get("embed_requires_grad") is not True:
        return
    if d.target_hidden_size and d.hidden_size and d.target_hidden_size != d.hidden_size:
        return
    yield Hit("embed_requires_grad is true (the embedding was trained) but SGLang replaces the draft's "
              "embed_tokens with the target's", key="embed_requires_grad")


@rule("SRV006", "draft-path", W, "the command line serves another draft than the one linted",
      "consistency: a lint of the wrong directory proves nothing about the served draft",
      "lint the directory the server loads (--speculative-draft-model-path / speculative-config model)")
def draft_path(ctx: Context) -> Iterator[Hit]:
    s, d = ctx.need_serve(), ctx.need_draft()
    if not s.draft_model:
        raise NotEvaluated("the command line names no draft model")
    served = Path(s.draft_model)
    linted = d.path if d.path.is_dir() or d.config_path is None else d.config_path.parent
    if not served.exists():
        raise NotEvaluated(f"the command line's draft {s.draft_model} is not a local path (a hub id?): cannot "
                           "confirm it is the linted draft")
    if served.resolve() != linted.resolve():
        yield Hit(f"the command line serves {s.draft_model} but the linted draft is {d.path}")


@rule("DTY001", "dtype-mismatch", W, "the draft's weights are stored in another dtype than the server runs it in",
      "sglang configs/model_config.py from_server_args (draft dtype = server --dtype); vllm config/speculative.py "
      "(draft dtype = target dtype)", "store (and validate) the draft in the dtype the server runs, or set --dtype")
def dtype(ctx: Context) -> Iterator[Hit]:
    d = ctx.need_draft()
    by_bytes = d.checkpoint.float_dtypes() if d.checkpoint else {}
    stored = max(by_bytes, key=by_bytes.__getitem__) if by_bytes else d.dtype
    what = "draft weights are" if by_bytes else "the draft config says its weights are"
    served = (ctx.serve.dtype if ctx.serve else None) or (ctx.target.dtype if ctx.target else None)
    if stored is None or served is None:
        raise NotEvaluated("needs the draft's dtype (checkpoint or config) and the server's (--serve --dtype or "
                           "the target config)")
    if stored != served:
        risk = " (fp16 overflows where bf16 does not)" if served == "float16" else ""
        yield Hit(f"{what} {stored} but the server runs the draft in {served}{risk}",
                  key="torch_dtype" if "torch_dtype" in d.config else "dtype")


RULES = (draft_token_cap, spec_args, algorithm, draft_format, embed_replaced, draft_path, dtype)
