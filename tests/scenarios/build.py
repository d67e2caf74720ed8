"""Record every stream of small seeded transformers models once, so scenarios are numpy only.

The construction is deliberately independent of the engine: we build the HF configs here
(not the project's built-in JSON), run one fp32 forward pass with hooks
(``consistency.record.hf.capture_streams``) and keep ``hidden.0..N`` (pre-norm), each
block's delta, and ``final_norm``. A causal model's rows for a prefix of the prompt equal
a run on that prefix, so one long recording serves every token count.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

N_LAYERS = 12  # the seed story needs stream 10: training [0, 3, 7], serving [3, 7, 10]
T_MAX = 1200  # "2 zeroed tokens out of 1,200" (issue 13)
T_SMOL = 320
T_BF16 = 256  # bf16 matmuls are slow on CPU: the bf16 forward records a prefix

# family -> (transformers config class name, extra kwargs). Sizes are ours, not the built-ins.
_COMMON = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=N_LAYERS, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=384, max_position_embeddings=2048, tie_word_embeddings=False,
               initializer_range=0.05)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 16}),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "deepseek_v3": ("DeepseekV3Config", {"num_key_value_heads": 4, "kv_lora_rank": 16, "q_lora_rank": None,
                                         "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 16,
                                         "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                         "first_k_dense_replace": 2, "n_group": 1, "topk_group": 1}),
}
# Architectures beyond Llama-style pre-norm (tests/scenarios/arch_faults.py runs them): parallel
# attention + MLP (x + attn(ln(x)) + mlp(ln(x))), sandwich norms with Gemma's sqrt(H) embedding
# normalizer, Granite's embedding and residual multipliers. Kept apart from FAMILIES so the
# Llama-style tables do not grow with them (CI time).
_NO_KV = {k: v for k, v in _COMMON.items() if k != "num_key_value_heads"}
ARCH_FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "gpt_neox": ("GPTNeoXConfig", {**_NO_KV, "use_parallel_residual": True, "rotary_pct": 0.5}),
    "cohere": ("CohereConfig", {**_COMMON, "logit_scale": 0.5}),
    "falcon": ("FalconConfig", {**_NO_KV, "new_decoder_architecture": False, "parallel_attn": True,
                                "multi_query": False, "alibi": False, "bias": False, "ffn_hidden_size": 160}),
    "gemma2": ("Gemma2Config", {**_COMMON, "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 32,
                                "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0}),
    "gemma3": ("Gemma3TextConfig", {**_COMMON, "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 32}),
    # Granite-3's multipliers; a wider init so that 12 layers scaled by 0.22 still move the stream
    # (adjacent streams 4e-2 apart, ~1,000x the bf16 noise; at 0.05 they are 3e-4 apart)
    "granite": ("GraniteConfig", {**_COMMON, "embedding_multiplier": 12.0, "residual_multiplier": 0.22,
                                  "logits_scaling": 8.0, "attention_multiplier": 0.25, "initializer_range": 0.3}),
}
PARALLEL = ("gpt_neox", "cohere", "falcon")  # one residual add per layer: the layer's delta is attn + mlp
SANDWICH = ("gemma2", "gemma3")  # post-block norms: what a block adds is already a norm's output
SMOL = "smollm2"
_SEEDS = {"llama": 11, "qwen2": 12, "qwen3": 13, "mistral": 14, "deepseek_v3": 15,
          "gpt_neox": 16, "cohere": 17, "falcon": 18, "gemma2": 19, "gemma3": 20, "granite": 21}


@dataclass(frozen=True)
class Streams:
    """One architecture's recording: float32 [T, H] arrays, stream index s in 0..N."""

    arch: str
    n: int
    hidden_size: int
    ids: np.ndarray
    hidden: tuple[np.ndarray, ...]
    attn_out: tuple[np.ndarray, ...]
    mlp_out: tuple[np.ndarray, ...]
    final_norm: np.ndarray
    pretrained: bool = False
    bf16: Streams | None = None  # the same model and prompt run in bfloat16 (a real serving forward)
    dtype: str = "float32"  # the dtype the forward ran in
    in_norm: tuple[np.ndarray, ...] = ()  # layer k's input norm output (tests/scenarios/taps.py)
    mlp_part: tuple[np.ndarray, ...] = ()  # rank 0's share of layer k's MLP before the all-reduce / MoE combine

    @property
    def tokens(self) -> int:
        return int(self.ids.shape[0])

    def named(self) -> dict[str, np.ndarray]:
        """Every recorded tensor under its dump name (docs/format.md)."""
        out = {f"hidden.{s}": x for s, x in enumerate(self.hidden)}
        out |= {f"attn_out.{k}": x for k, x in enumerate(self.attn_out)}
        out |= {f"mlp_out.{k}": x for k, x in enumerate(self.mlp_out)}
        out["final_norm"] = self.final_norm
        return out


def smollm2_dir() -> Path | None:
    """The offline SmolLM2 package's directory, when installed (one locator: fixtures/smollm2.py)."""
    from fixtures.smollm2 import package_dir

    return package_dir()


def archs(pretrained: bool = True) -> list[str]:
    out = list(FAMILIES)
    if pretrained and smollm2_dir() is not None:
        out.append(SMOL)
    return out


def _tiny_model(arch: str) -> Any:
    import torch
    import transformers

    cls_name, kw = (FAMILIES[arch][0], {**_COMMON, **FAMILIES[arch][1]}) if arch in FAMILIES else ARCH_FAMILIES[arch]
    cfg = getattr(transformers, cls_name)(**kw)
    torch.manual_seed(_SEEDS[arch])
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    if arch in ARCH_FAMILIES:
        _learned_norms(model)
    return model.float().eval()


def _learned_norms(model: Any) -> None:
    """Norm gains (and LayerNorm biases) away from their init, as a trained model has them:
    a post-norm capture must then be found through a fitted weight, not a unit one."""
    import torch

    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for mod in model.modules():
            if "norm" not in type(mod).__name__.lower():
                continue
            w, b = getattr(mod, "weight", None), getattr(mod, "bias", None)
            if isinstance(w, torch.nn.Parameter):
                w.add_(0.3 * torch.randn(w.shape, generator=g))
            if isinstance(b, torch.nn.Parameter):
                b.add_(0.05 * torch.randn(b.shape, generator=g))


def _smol_model() -> Any:
    from fixtures.smollm2 import load_model  # the GGUF de-quantized once per machine, then ~1 s

    assert smollm2_dir() is not None
    return load_model()


@lru_cache(maxsize=None)
def record(arch: str) -> Streams:
    """An fp32 and a bf16 forward pass of ``arch`` (cached per process: the session-scoped recording)."""
    import copy

    import torch

    model = _smol_model() if arch == SMOL else _tiny_model(arch)
    low = copy.deepcopy(model).to(torch.bfloat16)
    st = _record(arch, model)
    low_st = _record(arch, low, T_BF16)
    return Streams(**{**st.__dict__, "bf16": Streams(**{**low_st.__dict__, "dtype": "bfloat16"})})


def _record(arch: str, model: Any, t_max: int | None = None) -> Streams:
    import torch

    from consistency.record.hf import capture_streams

    cfg = model.config
    n, h = int(cfg.num_hidden_layers), int(cfg.hidden_size)
    t = T_SMOL if arch == SMOL else T_MAX
    rng = np.random.default_rng(1000 + len(arch))
    ids = rng.integers(2, int(cfg.vocab_size), size=t).astype(np.int64)[:t_max]
    if arch == SMOL:
        ids[0] = 1  # a BOS-like first token: the attention sink row real models have
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    from consistency.record.hf import find_layers
    from tests.scenarios import taps

    parts: dict[tuple[str, int], Any] = {}
    handles = taps.install(find_layers(model)[1], parts)
    try:
        out, _notes = capture_streams(model, torch.from_numpy(ids)[None], components=True)
    finally:
        for hd in handles:
            hd.remove()

    def get(name: str) -> np.ndarray:
        return out[name][0].float().numpy().astype(np.float32)

    hidden = tuple(get(f"hidden.{s}") for s in range(n + 1))
    attn = tuple(get(f"attn_out.{k}") for k in range(n) if f"attn_out.{k}" in out)
    mlp = tuple(get(f"mlp_out.{k}") for k in range(n) if f"mlp_out.{k}" in out)
    if len(attn) != n or len(mlp) != n:
        raise RuntimeError(f"{arch}: block deltas were not recorded for every layer")
    tap = lambda kind: tuple(parts[(kind, k)][0].numpy().astype(np.float32) for k in range(n)  # noqa: E731
                             if (kind, k) in parts)
    return Streams(arch, n, h, ids, hidden, attn, mlp, get("final_norm"), pretrained=arch == SMOL,
                   in_norm=tap("in_norm"), mlp_part=tap("mlp_part"))
