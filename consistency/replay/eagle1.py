"""The EAGLE-1/2 draft (and HASS): its forward, and its weights read from a checkpoint.

SafeAILab/EAGLE v1 ``eagle/model/cnets.py`` and vllm ``vllm/model_executor/models/llama_eagle.py``
(00da923): ``x = fc(cat(embed(x[t+1]), h[t]))`` with no norm on either input (HASS,
``add_para_norm``: ``embedding_layernorm`` / ``hidden_states_layernorm`` first), Llama decoder
layers whose first one skips ``input_layernorm`` (cnets: ``if self.index != 0``; vLLM
``disable_input_layernorm``), **no final norm**: the output is ``d_raw`` (hidden + residual),
trained to regress the target's ``fnorm(s=N)``, read by the target's own lm_head and
recycled as is into the next step (conventions-beyond-eagle3.md section 3).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from consistency.contract.models import Consumer, ConsumerSpec, Recycle
from consistency.errors import InputError
from consistency.replay.steps import ATTENTION, EmbeddingDims, KVCache, StepTensors

# speculators' EAGLE-1 names, as vLLM's llama_eagle.py remaps them (SPECULATORS_WEIGHT_MAP)
RENAMES = {"fusion_fc.weight": "fc.weight", "fusion_fc.bias": "fc.bias",
           "pre_lm_head_layernorm.weight": "hidden_states_layernorm.weight"}


class Eagle1Draft(EmbeddingDims, nn.Module):
    def __init__(self, config: Any, num_layers: int, fc_bias: bool, para_norm: bool) -> None:
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

        cfg = config
        h = cfg.hidden_size
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h)
        self.fc = nn.Linear(2 * h, h, bias=fc_bias)
        self.embedding_layernorm = LlamaRMSNorm(h, eps=cfg.rms_norm_eps) if para_norm else None
        self.hidden_states_layernorm = LlamaRMSNorm(h, eps=cfg.rms_norm_eps) if para_norm else None
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(num_layers))
        self.layers[0].input_layernorm = nn.Identity()  # cnets.py: `if self.index != 0`
        self.lm_head = nn.Linear(h, cfg.vocab_size, bias=False)
        self.rotary = LlamaRotaryEmbedding(config=cfg)

    def step(self, hidden: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
             cache: KVCache, at0: torch.Tensor) -> StepTensors:
        emb = self.embed_tokens(ids)
        e, h = emb, hidden
        if self.embedding_layernorm is not None and self.hidden_states_layernorm is not None:  # HASS
            e, h = self.embedding_layernorm(e), self.hidden_states_layernorm(h)
        cat = torch.cat([e, h], dim=-1)
        x = self.fc(cat)
        pe = self.rotary(x, positions)
        for layer in self.layers:
            x = layer(x, attention_mask=mask, position_ids=positions, past_key_values=cache, position_embeddings=pe)
            x = x[0] if isinstance(x, tuple) else x
        return StepTensors(emb[0], cat[0], x[0], None, self.lm_head(x)[0])


@dataclass
class LoadedEagle1:
    model: Eagle1Draft
    path: Path
    layout: str
    spec: ConsumerSpec
    sources: dict[str, str]
    notes: list[str] = field(default_factory=list)


def layer_config(cfg: dict[str, Any], path: Path) -> Any:
    """A LlamaConfig of the draft's shape, eager attention in query blocks (exact masks)."""
    from transformers import LlamaConfig

    shape = cfg.get("transformer_layer_config") if isinstance(cfg.get("transformer_layer_config"), dict) else cfg
    keep = {k: v for k, v in shape.items() if k in (
        "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
        "rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings", "hidden_act", "vocab_size",
        "attention_bias", "mlp_bias")}
    for key in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size"):
        v = keep.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise InputError(path, f"config {key!r} must be a positive integer, got {v!r}")
    try:
        lc = LlamaConfig(**keep)
    except (TypeError, ValueError) as exc:
        raise InputError(path, f"not a Llama-shaped EAGLE-1 config ({' '.join(str(exc).split())})") from None
    lc._attn_implementation = ATTENTION
    return lc


def load_eagle1(path: str | Path, target: Any | None) -> LoadedEagle1:
    """A SafeAILab (``fc``, ``layers.*``, ``embed_tokens``), vLLM (``model.`` prefix) or
    speculators (``fusion_fc``) EAGLE-1/HASS checkpoint. Embedding and lm_head come from the
    target when the draft lacks them (vLLM shares the target's embedding; the head is always
    the target's in cnets.py and vLLM)."""
    from consistency.replay import weights as W
    from consistency.replay.config import find_config, read_json

    p = Path(path)
    d, cfg_path = find_config(p)
    cfg = read_json(cfg_path)
    lc = layer_config(cfg, cfg_path)
    files = [p] if p.is_file() else W.weight_files(d)
    raw = W.read_tensors(files)
    w: dict[str, torch.Tensor] = {}
    for k, t in raw.items():
        name = k[len("model."):] if k.startswith("model.") else k
        w[RENAMES.get(name, name)] = t
    if "fc.weight" not in w:
        raise InputError(p, "EAGLE-1 checkpoint has no 'fc.weight'")
    n_layers = W.num_layers(w)
    if n_layers == 0:
        raise InputError(p, "EAGLE-1 checkpoint has no decoder layer (layers.0.*)")
    para = "embedding_layernorm.weight" in w or bool(cfg.get("add_para_norm"))
    model = Eagle1Draft(lc, n_layers, "fc.bias" in w, para)
    notes: list[str] = []
    sources = {"embed_tokens": "draft", "lm_head": "draft"}
    for name, label, get in (("embed_tokens.weight", "embed_tokens", "get_input_embeddings"),
                             ("lm_head.weight", "lm_head", "get_output_embeddings")):
        if name not in w:
            mod = getattr(target, get)() if target is not None else None
            if mod is None:
                raise InputError(p, f"the draft carries no {label}; give the target (--target) to borrow its {label}")
            w[name] = mod.weight.detach()
            sources[label] = "target"
    expected = {k: v for k, v in model.state_dict().items() if not k.startswith("rotary.")}
    missing = [k for k in expected if k not in w]
    if missing:
        raise InputError(p, f"EAGLE-1 checkpoint lacks {', '.join(missing[:3])}")
    extra = sorted(k for k in w if k not in expected and not k.endswith("rotary_emb.inv_freq"))
    if extra:
        notes.append(f"ignored {len(extra)} tensors the EAGLE-1 forward does not use: {', '.join(extra[:4])}")
    with torch.no_grad():
        for name, ref in expected.items():
            t = w[name]
            if tuple(t.shape) != tuple(ref.shape):
                raise InputError(p, f"{name!r} has shape {list(t.shape)}, expected {list(ref.shape)}")
            if t.is_floating_point() and not torch.isfinite(t.float()).all():
                raise InputError(p, f"{name!r} holds NaN or Inf values")
            mod_name, _, attr = name.rpartition(".")
            getattr(model.get_submodule(mod_name), attr).data.copy_(t.to(ref.dtype))
    model.eval()
    spec = ConsumerSpec(kind=Consumer.eagle1, recycle=Recycle.d_raw,
                        source="SafeAILab/EAGLE v1 eagle/model/cnets.py; vllm llama_eagle.py")
    return LoadedEagle1(model, p, "hass" if para else "eagle1", spec, sources, notes)


def is_eagle1(shapes: dict[str, tuple[int, ...]]) -> bool:
    """EAGLE-1 by its tensors: ``fc`` takes 2H (embedding + one hidden state) and layer 0's
    attention reads H (EAGLE-3's first layer reads 2H: ``cat(embeds, h)``)."""
    s = {(k[len("model."):] if k.startswith("model.") else k): v for k, v in shapes.items()}
    s = {RENAMES.get(k, k): v for k, v in s.items()}
    fc, q = s.get("fc.weight"), s.get("layers.0.self_attn.q_proj.weight")
    return fc is not None and q is not None and len(fc) == 2 and fc[1] == 2 * fc[0] and q[1] == fc[0]
