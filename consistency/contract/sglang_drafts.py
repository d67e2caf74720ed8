"""Which draft SGLang really runs for ``--speculative-algorithm EAGLE``/``NEXTN``: a table as data.

SGLang turns NEXTN into EAGLE (server_args.py; 0.5.12+ arg_groups/speculative_hook.py
``resolve_speculative_algorithm``), takes ``--speculative-draft-model-path`` or, when it is
absent, the target's own checkpoint (configs/model_config.py ``ModelConfig.from_server_args``:
``model_path or server_args.model_path``; DeepSeek/GLM targets also set it explicitly in
``_handle_speculative_decoding`` / ``_handle_eagle_family``), and then rewrites the draft
config's ``architectures[0]`` (``ModelConfig._config_draft_model``): a GLM-4.6 checkpoint
becomes ``Glm4MoeForCausalLMNextN``, MiMo becomes ``MiMoMTP``. The rewritten class is an
MTP head, whatever the flag was called. Each row below was read in the released wheels
0.4.7-0.5.23 (every release; the first release holding a row starts its range). Releases
before 0.4.7 rewrote DeepSeek-V3 elsewhere (not read here): :data:`CHECKED` says so.
"""

from __future__ import annotations

from dataclasses import dataclass

from consistency.contract.versions import VersionRange

CHECKED = VersionRange((0, 4, 7), None)
SOURCE = "sglang python/sglang/srt/configs/model_config.py ModelConfig._config_draft_model"


@dataclass(frozen=True)
class DraftRewrite:
    arch: str  # the draft (or target) checkpoint's architectures[0]
    served: str  # the class SGLang loads for it as a draft
    versions: VersionRange
    source: str = SOURCE


def _r(arch: str, served: str, lo: tuple[int, ...], hi: tuple[int, ...] | None = None) -> DraftRewrite:
    return DraftRewrite(arch, served, VersionRange(lo, hi), f"{SOURCE} (sglang {VersionRange(lo, hi).label()})")


REWRITES: tuple[DraftRewrite, ...] = (
    _r("DeepseekV3ForCausalLM", "DeepseekV3ForCausalLMNextN", (0, 4, 7)),
    _r("MiMoForCausalLM", "MiMoMTP", (0, 4, 7)),
    _r("Glm4MoeForCausalLM", "Glm4MoeForCausalLMNextN", (0, 4, 10)),
    _r("Ernie4_5_MoeForCausalLM", "Ernie4_5_MoeForCausalLMMTP", (0, 5, 1)),
    _r("LongcatFlashForCausalLM", "LongcatFlashForCausalLMNextN", (0, 5, 2)),
    _r("Qwen3NextForCausalLM", "Qwen3NextForCausalLMMTP", (0, 5, 2)),
    _r("BailingMoeForCausalLM", "BailingMoeForCausalLMNextN", (0, 5, 3)),
    _r("BailingMoeV2ForCausalLM", "BailingMoeForCausalLMNextN", (0, 5, 3)),
    _r("MiMoV2FlashForCausalLM", "MiMoV2MTP", (0, 5, 7)),
    _r("Glm4MoeLiteForCausalLM", "Glm4MoeForCausalLMNextN", (0, 5, 8), (0, 5, 13)),
    _r("Glm4MoeLiteForCausalLM", "Glm4MoeLiteForCausalLMNextN", (0, 5, 13)),
    _r("NemotronHForCausalLM", "NemotronHForCausalLMMTP", (0, 5, 8)),
    _r("GlmMoeDsaForCausalLM", "DeepseekV3ForCausalLMNextN", (0, 5, 9), (0, 5, 16)),
    _r("GlmMoeDsaForCausalLM", "GlmMoeDsaForCausalLMNextN", (0, 5, 16)),
    _r("GlmOcrForConditionalGeneration", "GlmOcrForConditionalGenerationNextN", (0, 5, 9)),
    _r("Step3p5ForCausalLM", "Step3p5MTP", (0, 5, 9)),
    _r("BailingMoeV2_5ForCausalLM", "BailingMoeForCausalLMNextN", (0, 5, 9)),
    _r("Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLMMTP", (0, 5, 9)),
    _r("Qwen3_5MoeForConditionalGeneration", "Qwen3_5ForCausalLMMTP", (0, 5, 9)),
    _r("ExaoneMoEForCausalLM", "ExaoneMoEForCausalLMMTP", (0, 5, 9)),
    _r("MiMoV2ForCausalLM", "MiMoV2MTP", (0, 5, 11)),
    _r("HYV3ForCausalLM", "HYV3ForCausalLMNextN", (0, 5, 11)),
    _r("DeepseekV32ForCausalLM", "DeepseekV3ForCausalLMNextN", (0, 5, 12)),
    # 0.5.16+: DeepseekV4ForCausalLMDSpark instead when the checkpoint bundles a DSpark head and the
    # algorithm is DSPARK; EAGLE/NEXTN keep the NextN class.
    _r("DeepseekV4ForCausalLM", "DeepseekV4ForCausalLMNextN", (0, 5, 12)),
    _r("InternS2PreviewForConditionalGeneration", "Qwen3_5ForCausalLMMTP", (0, 5, 12)),
    _r("Step3p7ForConditionalGeneration", "Step3p5MTP", (0, 5, 13)),
    _r("Qwen3MoeForCausalLM", "Qwen3MoeForCausalLMMTP", (0, 5, 13)),
    _r("NemotronHPuzzleForCausalLM", "NemotronHForCausalLMMTP", (0, 5, 13)),
    _r("InklingForConditionalGeneration", "InklingForConditionalGenerationMTP", (0, 5, 16)),
    _r("Qwen3_5ForCausalLM", "Qwen3_5ForCausalLMMTP", (0, 5, 17)),
    _r("Qwen3_5MoeForCausalLM", "Qwen3_5ForCausalLMMTP", (0, 5, 17)),
    _r("InternS2MobiusForConditionalGeneration", "Qwen3_5ForCausalLMMTP", (0, 5, 18)),
    _r("BailingMoeV3ForCausalLM", "BailingMoeForCausalLMNextN", (0, 5, 19)),
    _r("Glm5NextForConditionalGeneration", "Glm5NextForConditionalGenerationNextN", (0, 5, 20)),
    _r("Qwen4ExpForConditionalGeneration", "Qwen4ExpForCausalLMMTP", (0, 5, 20)),
    _r("NemotronH_Omni_Reasoning_V3", "NemotronHForCausalLMMTP", (0, 5, 20)),
    _r("HYV4ForCausalLM", "HYV4ForCausalLMNextN", (0, 5, 20)),
    _r("GigaChat35ForCausalLM", "GigaChat35ForCausalLMNextN", (0, 5, 21)),
    _r("ExaoneMoeForCausalLM", "ExaoneMoEForCausalLMMTP", (0, 5, 22)),
)
# Algorithms that go through the rewrite as an MTP draft (NEXTN is EAGLE by the time the draft loads).
MTP_ALGORITHMS = frozenset({"EAGLE", "NEXTN"})
