"""How each speculative method consumes the target's hidden states, per runtime: a registry as data.

``contract/conventions.py`` answers "which stream does layer id j mean"; this table answers
the questions that come after it for drafts other than EAGLE-3 (docs/methods.md): which
norm state the draft reads at step 0, what it recycles at steps >= 1, how hidden rows pair
with tokens, whether the position-0 embedding is zeroed and in which order the embedding
and the hidden state are concatenated. One row per (method, runtime, version range, model
family), each with the upstream path or PR it was read from
(../shared/conventions-beyond-eagle3.md gathers them). The lint rules and the contract a
user gets from ``contract_for`` read the same rows, so they cannot disagree.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from consistency.contract.models import (
    AuxContract,
    ConcatOrder,
    Consumer,
    ConsumerSpec,
    ModelInfo,
    NormState,
    Pairing,
    Pos0,
    Recycle,
    SlotSpec,
)
from consistency.contract.versions import VersionRange

_F, _N = NormState.final_norm, NormState.none
_EH, _HE = ConcatOrder.embed_hidden, ConcatOrder.hidden_embed

# Model families a row is restricted to (HF model_type or architecture names).
DEEPSEEK_MTP = frozenset({"deepseek_v3", "deepseek_v32", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM",
                          "deepseek_mtp", "DeepSeekMTPModel", "glm4_moe", "Glm4MoeForCausalLM", "glm4_moe_mtp",
                          "Glm4MoeMTPModel", "glm_moe_dsa", "GlmMoeDsaForCausalLM"})
QWEN3_NEXT_MTP = frozenset({"qwen3_next", "Qwen3NextForCausalLM", "qwen3_next_mtp", "Qwen3NextMTP",
                            "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_5_mtp"})
MIMO_MTP = frozenset({"mimo", "MiMoForCausalLM", "mimo_mtp", "MiMoMTPModel"})

# vllm-project/vllm #45895 made DeepSeek/GLM MTP recycle the post-norm draft state. It was
# merged 2026-06-19 (commit ab66606993), after v0.23.0 was tagged (~2026-06-15) and before
# v0.24.0 shipped (vllm-metal bumped to 0.24.0 on 2026-06-30): 0.24.0 is the first release
# after the merge (docs/rules/MTP003.md; the release branch itself was not read).
VLLM_45895_VERSION = (0, 24, 0)


@dataclass(frozen=True)
class ConsumerRow:
    code: str  # stable id, e.g. "vllm-deepseek-mtp-legacy"
    method: Consumer
    runtime: str  # sglang, vllm, trtllm, megatron, speculators, eagle (SafeAILab), modelopt, medusa
    side: str  # "serving" or "training"
    step0_norm: NormState  # norm state of the last stream N the draft reads at step 0
    recycle: Recycle
    pairing: Pairing
    pos0_embed: Pos0
    concat_order: ConcatOrder
    source: str
    families: frozenset[str] = frozenset()  # empty: every target family
    min_version: tuple[int, ...] | None = None  # inclusive
    max_version: tuple[int, ...] | None = None  # exclusive
    note: str = ""
    confirmed: bool = True  # False: read in a third-party copy or inferred, not in the runtime's own source

    def spec(self, steps: int | None = None) -> ConsumerSpec:
        return ConsumerSpec(kind=self.method, pairing=self.pairing, pos0_embed=self.pos0_embed, recycle=self.recycle,
                            concat_order=self.concat_order, steps=steps, source=self.source)

    def covers(self, version: tuple[int, ...] | None, family: str | None) -> bool:
        if self.families and family is not None and family not in self.families:
            return False
        return VersionRange(self.min_version, self.max_version).covers(version)


def _row(code: str, method: Consumer, runtime: str, side: str, step0: NormState, recycle: Recycle, pairing: Pairing,
         pos0: Pos0, concat: ConcatOrder, source: str, **kw: object) -> ConsumerRow:
    return ConsumerRow(code, method, runtime, side, step0, recycle, pairing, pos0, concat, source, **kw)  # type: ignore[arg-type]


_M, _E1, _MD, _DF, _E3, _PE = Consumer.mtp, Consumer.eagle1, Consumer.medusa, Consumer.dflash, Consumer.eagle3_aux, \
    Consumer.p_eagle
_SH, _NS, _NT = Pairing.shift, Pairing.none, Pairing.no_token
_K, _Z = Pos0.kept, Pos0.zeroed

ROWS: tuple[ConsumerRow, ...] = (
    # --- MTP, serving ---
    _row("sglang-deepseek-nextn", _M, "sglang", "serving", _F, Recycle.d_norm, _SH, _K, _EH,
         "sglang python/sglang/srt/models/deepseek_nextn.py (enorm/hnorm, cat(embed, hidden), shared_head.norm); "
         "speculative/eagle_worker.py forward_draft_extend; layers/logits_processor.py",
         families=DEEPSEEK_MTP, note="--speculative-algorithm NEXTN is rewritten to EAGLE (server_args.py)"),
    _row("vllm-deepseek-mtp-legacy", _M, "vllm", "serving", _F, Recycle.d_raw, _SH, _Z, _EH,
         "vllm vllm/model_executor/models/deepseek_mtp.py (inputs_embeds[positions == 0] = 0; returns "
         "residual + hidden, norm only in compute_logits); glm4_moe_mtp.py; vllm #46075, #47448",
         families=DEEPSEEK_MTP, max_version=VLLM_45895_VERSION,
         note="steps >= 1 recycle the pre-norm draft state until vllm #45895"),
    _row("vllm-deepseek-mtp", _M, "vllm", "serving", _F, Recycle.d_norm, _SH, _Z, _EH,
         "vllm #45895 (recycle the post-shared_head.norm state); llm_base_proposer.py model_returns_tuple",
         families=DEEPSEEK_MTP, min_version=VLLM_45895_VERSION),
    _row("sglang-qwen3-next-mtp", _M, "sglang", "serving", _F, Recycle.d_norm, _SH, _K, _EH,
         "sglang python/sglang/srt/models/qwen3_next_mtp.py (pre_fc_norm_* are GemmaRMSNorm: gain 1+w)",
         families=QWEN3_NEXT_MTP),
    _row("vllm-qwen3-next-mtp", _M, "vllm", "serving", _F, Recycle.d_norm, _SH, _K, _EH,
         "vllm vllm/model_executor/models/qwen3_next_mtp.py (no position-0 masking; returns self.norm(h, res))",
         families=QWEN3_NEXT_MTP),
    _row("sglang-mimo-mtp", _M, "sglang", "serving", _F, Recycle.d_norm, _SH, _Z, _HE,
         "sglang python/sglang/srt/models/mimo_mtp.py (cat(hidden_layernorm(h), token_layernorm(emb)))",
         families=MIMO_MTP),
    _row("vllm-mimo-mtp", _M, "vllm", "serving", _F, Recycle.none, _SH, _Z, _HE,
         "vllm vllm/model_executor/models/mimo_mtp.py (input_proj(cat(h, emb)); assert spec_step_idx == 0)",
         families=MIMO_MTP, note="one draft step only"),
    _row("trtllm-deepseek-mtp", _M, "trtllm", "serving", _F, Recycle.d_norm, _SH, _K, _EH,
         "TensorRT-LLM tensorrt_llm/_torch/models/modeling_deepseekv3.py DeepseekV3MTP; _torch/speculative/mtp.py",
         families=DEEPSEEK_MTP),
    # --- MTP, training ---
    _row("megatron-mtp", _M, "megatron", "training", _F, Recycle.d_norm, _SH, _K, _EH,
         "NVIDIA/Megatron-LM megatron/core/transformer/multi_token_prediction.py; transformer_block.py "
         "has_final_layernorm_in_this_stage; roll_tensor zero-fills the last rolled position"),
    _row("speculators-mtp", _M, "speculators", "training", _N, Recycle.d_norm, _SH, _K, _EH,
         "vllm-project/speculators src/speculators/models/mtp/{core,data}.py: verifier_last_hidden_states is "
         "vLLM's layer-N capture (pre-norm), no verifier_norm on the MTP path; scripts/launch_vllm.py",
         families=QWEN3_NEXT_MTP | frozenset({"qwen3", "Qwen3ForCausalLM"}),
         note="trains on s=N pre-norm while every runtime serves fnorm(s=N)", confirmed=False),
    # --- EAGLE-1/2 ---
    _row("eagle-v1", _E1, "eagle", "training", _F, Recycle.d_raw, _SH, _K, _EH,
         "SafeAILab/EAGLE v1 eagle/ge_data/ge_data_all_vicuna.py (hidden_states[-1]); train/main.py; model/cnets.py"),
    _row("modelopt-eagle1-offline", _E1, "modelopt", "training", _N, Recycle.d_raw, _SH, _K, _EH,
         "NVIDIA/Model-Optimizer plugins/hf_eagle.py: offline vLLM dumps (base_hidden_prenorm) re-normed only for "
         "logits (#1846)", note="offline training from vLLM dumps feeds s=N pre-norm", confirmed=False),
    _row("modelopt-eagle1", _E1, "modelopt", "training", _F, Recycle.d_raw, _SH, _K, _EH,
         "NVIDIA/Model-Optimizer plugins/hf_eagle.py (online: outputs.hidden_states[-1], post-norm)"),
    _row("sglang-eagle1", _E1, "sglang", "serving", _F, Recycle.d_raw, _SH, _K, _EH,
         "sglang python/sglang/srt/models/llama_eagle.py; speculative/eagle_info.py prepare_for_extend"),
    _row("vllm-eagle1", _E1, "vllm", "serving", _F, Recycle.d_raw, _SH, _K, _EH,
         "vllm vllm/model_executor/models/llama_eagle.py; v1/spec_decode/llm_base_proposer.py set_inputs_first_pass"),
    # --- Medusa ---
    _row("medusa", _MD, "medusa", "training", _F, Recycle.none, _NT, _K, _EH,
         "FasterDecoding/Medusa medusa/model/medusa_model.py (outputs[0]); train/train.py (head i -> x_{t+2+i})"),
    _row("vllm-medusa", _MD, "vllm", "serving", _F, Recycle.none, _NT, _K, _EH,
         "vllm vllm/v1/spec_decode/medusa.py propose(target_hidden_states)"),
    # --- EAGLE-3 (for completeness: the aux streams are conventions.py's job) ---
    _row("eagle3", _E3, "any", "serving", _N, Recycle.d_raw, _SH, _K, _EH,
         "conventions.md (EAGLE-3 aux capture); speculators models/eagle3/core.py (norm_output=False)"),
    _row("eagle3.1", _E3, "any", "serving", _N, Recycle.d_norm, _SH, _K, _EH,
         "speculators models/eagle3/config.py norm_output; vllm #42764, #46488", note="norm_output: true"),
    # --- DFlash, P-EAGLE ---
    _row("dflash", _DF, "any", "serving", _N, Recycle.none, _NS, _K, _EH,
         "z-lab/dflash model/dflash.py; vllm llm_base_proposer.py (DFlash does not shift like EAGLE)",
         note="target layer N-1 read through HF's hidden_states[N] is post-norm (sglang #39776)"),
    _row("p-eagle", _PE, "vllm", "serving", _N, Recycle.mask, _SH, _K, _EH,
         "vllm #32887 (parallel_drafting); llm_base_proposer.py parallel_drafting_hidden_state_tensor",
         min_version=(0, 16, 0)),
)


def rows(method: Consumer | str | None = None, runtime: str | None = None) -> list[ConsumerRow]:
    m = Consumer(method) if method is not None else None
    return [r for r in ROWS if (m is None or r.method == m) and (runtime is None or r.runtime == runtime)]


def lookup(method: Consumer | str, runtime: str, version: tuple[int, ...] | None = None,
           family: str | None = None) -> ConsumerRow | None:
    """The row for ``method`` served (or trained) by ``runtime`` at ``version`` on a target of
    ``family``; an unknown version means the newest behaviour, as in conventions.py."""
    cands = [r for r in rows(method) if r.runtime in (runtime, "any")]
    specific = [r for r in cands if r.families and family is not None and family in r.families]
    for pool in (specific, [r for r in cands if not r.families], cands):
        for r in pool:
            if r.covers(version, family):
                return r
    return None


def contract_for(method: Consumer | str, target: ModelInfo, row: ConsumerRow | None = None,
                 aux_streams: Iterable[int] | None = None, steps: int | None = None) -> AuxContract:
    """The contract a draft of ``method`` has with ``target``: which streams (and norm states)
    it reads at step 0, and how it consumes them (``row`` gives the runtime's behaviour;
    without one, the method's majority behaviour across runtimes)."""
    m = Consumer(method)
    if m in (Consumer.eagle3_aux, Consumer.dflash, Consumer.p_eagle):
        ids = list(aux_streams or [])
        if not ids:
            raise ValueError(f"a {m.value} contract needs the aux stream ids")
        slots = [SlotSpec(stream=s, width=target.hidden_size) for s in ids]
    else:
        if target.num_layers is None:
            raise ValueError(f"a {m.value} draft reads the last stream N: the target's num_layers is needed")
        norm = row.step0_norm if row is not None else NormState.final_norm
        slots = [SlotSpec(stream=target.num_layers, width=target.hidden_size, norm=norm)]
    spec = row.spec(steps) if row is not None else _majority(m).spec(steps)
    return AuxContract(target=target, slots=slots, consumer=spec)


def _majority(m: Consumer) -> ConsumerRow:
    serving = [r for r in rows(m) if r.side == "serving" and r.max_version is None] or rows(m)
    return serving[0]
