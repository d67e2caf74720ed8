"""What each runtime means by "layer id": a registry of conventions as data, and nothing else.

Each entry maps a runtime's native aux-layer ids to stream indices (see
docs/conventions.md). A version-dependent runtime (SGLang changed its rule in PR #25454)
has one entry per version range; :func:`consistency.contract.resolve.resolve` picks the
entry for ``name@version`` and says which rule it assumed when no version was given.
This module holds tables only: every lookup lives in :mod:`consistency.contract.resolve`
(ids to streams) and :mod:`consistency.contract.runtime_model` (what a release serves).

Three smaller tables sit beside the id rules, because a server's behaviour has three
independent parts that change in different releases: *where* it reads the ids
(:data:`ID_SOURCES`), *what* an id means (:data:`REGISTRY`) and *which* streams its model
files can capture at all (:data:`CAPTURE_LIMITS`). vLLM also picks one of two model runners
that read different keys (:data:`VLLM_V2_DEFAULTS`). ``consistency lint`` combines them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from consistency.contract.versions import VersionRange

IdMap = Callable[[int, Sequence[int], int], int]  # (native id, all ids, N) -> stream


def _identity(j: int, ids: Sequence[int], n: int) -> int:
    return j


def _plus_one(j: int, ids: Sequence[int], n: int) -> int:
    return j + 1


def _plus_one_last_is_minus_one(j: int, ids: Sequence[int], n: int) -> int:
    return n if j == -1 else j + 1


def _sglang_25454(j: int, ids: Sequence[int], n: int) -> int:
    # Since sglang PR #25454 the +1 is applied only when the list starts at 1 (the
    # "output of layer j" spelling); lists written as stream ids are used as they are.
    return j + 1 if ids and ids[0] == 1 else j


def _sglang_gpt_oss(j: int, ids: Sequence[int], n: int) -> int:
    # sglang >= 0.5.17 (PR #32334): ids that already include the final boundary (max == N)
    # are stream ids; otherwise the legacy +1.
    return j if ids and max(ids) == n else j + 1


def _default_stream(n: int) -> list[int]:
    return [2, n // 2, n - 3]


def _default_modelopt(n: int) -> list[int]:
    # sorted({1, N//2-1, N-4}) as layer outputs, i.e. streams {2, N//2, N-3}
    return sorted({2, max(1, n // 2), max(1, n - 3)})


@dataclass(frozen=True)
class Convention:
    code: str  # stable identifier, e.g. "sglang-legacy"
    runtime: str  # name a user types: sglang, vllm, ...
    meaning: str  # one line: what an id j means
    source: str  # where the rule lives upstream (path, PR)
    map_id: IdMap = _identity
    default_streams: Callable[[int], list[int]] = _default_stream  # what the runtime feeds when ids are absent
    min_version: tuple[int, ...] | None = None  # inclusive
    max_version: tuple[int, ...] | None = None  # exclusive
    captured: str = "stream"  # what the runtime's capture holds: stream, or 'hidden_states + residual'
    id_location: str = ""  # where the ids are read from
    aliases: tuple[str, ...] = field(default_factory=tuple)
    architectures: frozenset[str] = frozenset()  # empty: every target architecture
    sorts: bool = False  # capture follows the layer loop: slots ascending, duplicates merged

    @property
    def range(self) -> VersionRange:
        return VersionRange(self.min_version, self.max_version)

    def versions(self) -> str:
        return self.range.label()

    def to_streams(self, ids: Sequence[int] | None, num_layers: int | None) -> list[int]:
        """Stream indices of the given native ids (or of the runtime's defaults when None)."""
        if ids is None:
            if num_layers is None:
                raise ValueError(f"{self.runtime}: ids absent and num_layers unknown, cannot apply the default")
            return self.default_streams(num_layers)
        n = num_layers if num_layers is not None else 0
        return [self.map_id(j, list(ids), n) for j in ids]

    def from_streams(self, streams: Sequence[int], num_layers: int | None) -> list[int] | None:
        """Native ids this convention maps onto ``streams`` (the fix a user writes), or None."""
        for shift in (0, 1):
            ids = [s - shift for s in streams]
            if self.to_streams(ids, num_layers) == list(streams):
                return ids
        return None


# Releases that changed SGLang's rule (first release carrying the change; docs/conventions.md).
SGLANG_25454_VERSION = (0, 5, 13)  # PR #25454, merged 2026-05-16: deepseek_v2 / glm4_moe_lite
SGLANG_32334_VERSION = (0, 5, 17)  # PR #32334, merged 2026-07-24: gpt_oss
SGLANG_DEEPSEEK = frozenset({
    "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM", "KimiK25ForConditionalGeneration",
    "KimiK2ForCausalLM", "Glm4MoeLiteForCausalLM", "deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k25", "kimi_k2",
    "glm4_moe_lite",
})
SGLANG_GPT_OSS = frozenset({"GptOssForCausalLM", "gpt_oss"})
_SGLANG_SRC = "sglang python/sglang/srt/models/*.py set_eagle3_layers_to_capture; ids from model_runner"
_SGLANG_IDS = "eagle_config.eagle_aux_hidden_state_layer_ids (nested only)"
_SGLANG_CAPTURED = "hidden_states + residual"

REGISTRY: tuple[Convention, ...] = (
    Convention("stream", "stream", "id j is stream j (the residual stream after j layers, pre-norm)",
               "consistency's canonical unit (conventions.md)", aliases=("streams", "canonical")),
    Convention("hf", "hf", "id j indexes output_hidden_states: stream j, but j = N is post-final-norm",
               "transformers output_hidden_states (checked on 5.19, 5.24)", aliases=("transformers", "huggingface")),
    Convention("eagle", "eagle", "id j is stream j (captured before layer j)",
               "SafeAILab/EAGLE eagle/model/modeling_llama_kv.py (hard-coded)", aliases=("safeailab",)),
    Convention("sglang-internal", "sglang-internal", "layers_to_capture entry j is stream j (appended at the top of loop step j)",
               "sglang python/sglang/srt/models/llama.py LlamaModel.forward", captured=_SGLANG_CAPTURED, sorts=True),
    Convention("sglang-plus1", "sglang", "draft-config id j is the output of layer j: stream j+1 (set_eagle3_layers_to_capture adds 1)",
               _SGLANG_SRC + " (llama, qwen2/3, glm4_moe, minimax_m2, ... every version)", map_id=_plus_one,
               captured=_SGLANG_CAPTURED, id_location=_SGLANG_IDS, sorts=True),
    Convention("sglang-deepseek-legacy", "sglang", "draft-config id j is the output of layer j: stream j+1",
               _SGLANG_SRC + " (deepseek_v2 before PR #25454)", map_id=_plus_one, max_version=SGLANG_25454_VERSION,
               captured=_SGLANG_CAPTURED, id_location=_SGLANG_IDS, architectures=SGLANG_DEEPSEEK, sorts=True),
    Convention("sglang-deepseek", "sglang", "draft-config ids get +1 only when the first id is 1; otherwise id j is stream j",
               "sglang PR #25454 (merged 2026-05-16, first in 0.5.13): deepseek_v2.py, glm4_moe_lite.py",
               map_id=_sglang_25454, min_version=SGLANG_25454_VERSION, captured=_SGLANG_CAPTURED,
               id_location=_SGLANG_IDS, architectures=SGLANG_DEEPSEEK, sorts=True),
    Convention("sglang-gpt-oss-legacy", "sglang", "draft-config id j is the output of layer j: stream j+1",
               _SGLANG_SRC + " (gpt_oss before PR #32334)", map_id=_plus_one, max_version=SGLANG_32334_VERSION,
               captured=_SGLANG_CAPTURED, id_location=_SGLANG_IDS, architectures=SGLANG_GPT_OSS, sorts=True),
    Convention("sglang-gpt-oss", "sglang", "ids are stream ids when the largest equals N; otherwise +1",
               "sglang PR #32334 (merged 2026-07-24, first in 0.5.17): gpt_oss.py", map_id=_sglang_gpt_oss,
               min_version=SGLANG_32334_VERSION, captured=_SGLANG_CAPTURED, id_location=_SGLANG_IDS,
               architectures=SGLANG_GPT_OSS, sorts=True),
    Convention("vllm", "vllm", "eagle_aux_hidden_state_layer_ids entry j is stream j (top level; the V2 runner never reads the nested key)",
               "vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py; interfaces.py EagleModelMixin (PR #36063)",
               captured="hidden_states + residual if residual is not None else hidden_states",
               id_location="eagle_aux_hidden_state_layer_ids (top level), else eagle_config.layer_ids", sorts=True),
    Convention("speculators", "speculators", "id j is stream j (vLLM's meaning); data generation appends N (pre-norm last state)",
               "vllm-project/speculators models/eagle3/config.py, models/utils.py resolve_target_layer_ids",
               id_location="eagle_aux_hidden_state_layer_ids (top level)"),
    Convention("specforge-hf", "specforge-hf", "id j is the output of layer j: stream j+1 (HF backend hooks "
               "layers[j]; SGLang before 0.5.13 adds 1 for every model file)",
               "sgl-project/SpecForge before its SGLang-only runtime (HF backend, sglang 0.5.4-0.5.9); "
               "specforge/algorithms/model_providers.py resolve_eagle_capture_layers", map_id=_plus_one,
               id_location="model.aux_hidden_state_layer_ids, else eagle_config.eagle_aux_hidden_state_layer_ids",
               aliases=("specforge-legacy",)),
    Convention("modelopt", "modelopt", "id j is the output of layer j: stream j+1",
               "NVIDIA/Model-Optimizer modelopt/torch/speculative/plugins/hf_eagle.py", map_id=_plus_one,
               default_streams=_default_modelopt, id_location="eagle_config.eagle_aux_hidden_state_layer_ids", sorts=True),
    Convention("trtllm", "trtllm", "id j is the output of layer j (stream j+1); -1 is the last layer (stream N)",
               "TensorRT-LLM EagleDecodingConfig.eagle3_layers_to_capture", map_id=_plus_one_last_is_minus_one,
               captured=_SGLANG_CAPTURED,
               aliases=("tensorrt-llm", "tensorrt_llm")),
)
LATEST_KNOWN = {"sglang": "0.5.23", "vllm": "0.33.0", "speculators": "0.9.0", "specforge": "0.2.0"}
# The first release of each runtime that serves EAGLE-3 at all: an older version cannot run the draft.
FIRST_EAGLE3 = {"sglang": ((0, 4, 4), "sglang PR #4247 (EAGLE-3, March 2025)"),
                "vllm": ((0, 8, 5), "vllm PR #16937 ([V1][Spec Decode] EAGLE-3 Support, April 2025)")}

# --- where a runtime reads the ids, which streams it can capture, which vLLM runner runs ---

@dataclass(frozen=True)
class IdSource:
    """The config keys a runtime reads the draft's aux ids from, first non-empty one wins."""

    runtime: str
    keys: tuple[str, ...]  # dotted paths into the draft's config.json
    source: str
    runner: str = ""  # vLLM: "v1" or "v2"; empty for runtimes with one code path
    min_version: tuple[int, ...] | None = None
    max_version: tuple[int, ...] | None = None

    @property
    def range(self) -> VersionRange:
        return VersionRange(self.min_version, self.max_version)


TOP_IDS = "eagle_aux_hidden_state_layer_ids"
NESTED_IDS = "eagle_config.eagle_aux_hidden_state_layer_ids"
NESTED_LAYER_IDS = "eagle_config.layer_ids"
VLLM_NESTED_V1 = (0, 22)  # V1 runner falls back to the nested key (absent in 0.21.0)
VLLM_LAYER_IDS_V2 = (0, 28)  # V2 runner reads eagle_config.layer_ids (absent in 0.26.0)
_V1 = "vllm/v1/worker/gpu_model_runner.py (V1 runner)"
_V2 = "vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py (V2 runner)"

ID_SOURCES: tuple[IdSource, ...] = (
    IdSource("sglang", (NESTED_IDS,), "sglang model_executor/model_runner.py (0.5.12), "
             "model_runner_components/spec_aux_hidden_state.py (0.5.23): nested key only"),
    IdSource("vllm", (TOP_IDS,), _V1 + ": top level only", "v1", max_version=VLLM_NESTED_V1),
    IdSource("vllm", (TOP_IDS, NESTED_IDS), _V1 + ": top level, else the nested key", "v1", min_version=VLLM_NESTED_V1),
    IdSource("vllm", (TOP_IDS,), _V2 + ": top level only", "v2", max_version=VLLM_LAYER_IDS_V2),
    IdSource("vllm", (TOP_IDS, NESTED_LAYER_IDS), _V2 + ": top level, else eagle_config.layer_ids", "v2",
             min_version=VLLM_LAYER_IDS_V2),
    IdSource("speculators", (TOP_IDS,), "speculators models/eagle3/config.py"),
    IdSource("specforge", (NESTED_IDS,),
             "SpecForge specforge/algorithms/model_providers.py resolve_eagle_capture_layers"),
    IdSource("modelopt", (NESTED_IDS,), "Model-Optimizer modelopt/torch/export/plugins/hf_spec_configs.py"),
)


@dataclass(frozen=True)
class CaptureLimit:
    """Whether a runtime's model file can capture stream 0 (the embedding) and stream N."""

    runtime: str
    first: str  # "ok", "error" (crashes), "unknown"
    last: str  # "ok", "dropped" (silently not captured), "error" (raises), "unknown"
    source: str
    architectures: frozenset[str] = frozenset()  # empty: every other architecture
    min_version: tuple[int, ...] | None = None
    max_version: tuple[int, ...] | None = None

    @property
    def range(self) -> VersionRange:
        return VersionRange(self.min_version, self.max_version)


CAPTURE_LIMITS: tuple[CaptureLimit, ...] = (
    CaptureLimit("sglang", "error", "dropped", "sglang models/llama.py <= 0.5.21: `hidden_states + residual` with "
                 "residual None at layer 0 (TypeError); the loop captures before each layer, never after the last",
                 max_version=(0, 5, 22)),
    CaptureLimit("sglang", "ok", "dropped", "sglang models/llama.py 0.5.22+: attn_boundary capture (embedding ok); "
                 "final_norm gets no capture", min_version=(0, 5, 22)),
    CaptureLimit("sglang", "error", "dropped", "sglang models/deepseek_v2.py <= 0.5.13: residual None at layer 0",
                 SGLANG_DEEPSEEK, max_version=(0, 5, 14)),
    CaptureLimit("sglang", "ok", "dropped", "sglang deepseek_v2.py 0.5.14-0.5.16: capture in the layer communicator",
                 SGLANG_DEEPSEEK, (0, 5, 14), (0, 5, 17)),
    CaptureLimit("sglang", "ok", "error", "sglang deepseek_v2.py 0.5.17+: AuxHiddenStatePacker.finalize raises "
                 "'captured k of K aux hidden states'", SGLANG_DEEPSEEK, min_version=(0, 5, 17)),
    CaptureLimit("sglang", "unknown", "ok", "sglang gpt_oss.py 0.5.17+ (PR #32334): ids may name the final boundary N",
                 SGLANG_GPT_OSS, min_version=SGLANG_32334_VERSION),
    CaptureLimit("vllm", "error", "dropped", "vllm models/llama.py < 0.18: capture before each layer "
                 "(hidden_states + residual, residual None at 0)", max_version=(0, 18)),
    CaptureLimit("vllm", "ok", "ok", "vllm interfaces.py EagleModelMixin (PR #36063, 0.18+): streams 0..N",
                 min_version=(0, 18)),
    CaptureLimit("vllm", "error", "dropped", "vllm models/deepseek_v2.py < 0.25: capture before each layer",
                 SGLANG_DEEPSEEK, max_version=(0, 25)),
    CaptureLimit("vllm", "error", "ok", "vllm models/deepseek_v2.py 0.25+ (PR #46973 appends stream N; stream 0 "
                 "still adds a None residual)", SGLANG_DEEPSEEK, min_version=(0, 25)),
)


# vLLM's model runner (vllm/config/vllm.py VllmConfig.use_v2_model_runner and
# _is_default_v2_model_runner_model, read in each release's wheel): VLLM_USE_V2_MODEL_RUNNER wins; otherwise
# each release has a rule and a list of architectures (DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES):
#   0.22: listed (Qwen3) and not MoE and not quantized; 0.23: the same over Llama/Mistral/Qwen3;
#   0.24: listed, whatever MoE; 0.25-0.28: not MoE, or listed (PR #44443); 0.29+: every model (PR #53183).
# Before 0.22 no release defaults to V2. A quantized target stays on V1 in 0.22-0.23.
@dataclass(frozen=True)
class V2Default:
    """One release range's rule for vLLM's default model runner."""

    min_version: tuple[int, ...]
    rule: str  # "listed_dense" | "listed" | "dense_or_listed" | "all"
    archs: frozenset[str] = frozenset()
    source: str = ""


VLLM_V2_FIRST = (0, 22)
VLLM_V2_DENSE = (0, 25)
VLLM_V2_ALL = (0, 29)
_V2SRC = "vllm/config/vllm.py DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES, _is_default_v2_model_runner_model"
VLLM_V2_DEFAULTS: tuple[V2Default, ...] = (
    V2Default((0, 22), "listed_dense", frozenset({"Qwen3ForCausalLM"}), f"vllm 0.22.0 {_V2SRC}"),
    V2Default((0, 23), "listed_dense", frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen3ForCausalLM"}),
              f"vllm 0.23.0 {_V2SRC}"),
    V2Default((0, 24), "listed", frozenset({"Qwen3ForCausalLM", "DeepseekV2ForCausalLM", "Qwen2MoeForCausalLM",
                                            "GraniteMoeForCausalLM", "LlamaForCausalLM", "MistralForCausalLM"}),
              f"vllm 0.24.0 {_V2SRC}"),
    V2Default((0, 25), "dense_or_listed", frozenset({"DeepseekV2ForCausalLM", "Qwen2MoeForCausalLM",
                                                     "GraniteMoeForCausalLM"}), f"vllm 0.25.0 {_V2SRC} (PR #44443)"),
    V2Default((0, 26), "dense_or_listed", frozenset({"DeepseekV2ForCausalLM", "Qwen2MoeForCausalLM",
                                                     "GraniteMoeForCausalLM", "InklingForCausalLM",
                                                     "InklingForConditionalGeneration", "LongcatFlashNgramForCausalLM"}),
              f"vllm 0.26.0 {_V2SRC}"),
    V2Default((0, 27), "dense_or_listed", frozenset({"DeepseekV2ForCausalLM", "GraniteMoeForCausalLM",
                                                     "InklingForCausalLM", "InklingForConditionalGeneration",
                                                     "KimiK3ForConditionalGeneration", "LongcatFlashNgramForCausalLM",
                                                     "Qwen2MoeForCausalLM"}), f"vllm 0.27.0 {_V2SRC}"),
    V2Default((0, 28), "dense_or_listed", frozenset({"DeepseekV2ForCausalLM", "DeepseekV4ForCausalLM",
                                                     "GraniteMoeForCausalLM", "InklingForCausalLM",
                                                     "InklingForConditionalGeneration", "KimiK3ForConditionalGeneration",
                                                     "LongcatFlashNgramForCausalLM", "Qwen2MoeForCausalLM"}),
              f"vllm 0.28.0 {_V2SRC}"),
    V2Default(VLLM_V2_ALL, "all", frozenset(), "vllm 0.29.0 vllm/config/vllm.py (PR #53183: V2 for every model)"),
)
