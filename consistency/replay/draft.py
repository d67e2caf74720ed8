"""The EAGLE-3 draft forward in plain torch, with the runtimes' chained-step attention.

The math is speculators' ``Eagle3DraftModel`` (and SGLang's / vLLM's ``llama_eagle3.py``):

1. ``input_norm`` over the whole concat (``norm_before_fc``) or a per-slot ``fc_norm``,
   then ``fc``: n·H_target -> H.
2. First layer: ``embeds = input_layernorm(embed(ids))``, ``h = hidden_norm(x)``; the residual
   is the pre-norm ``x`` (``h`` with ``norm_before_residual``); attention over
   ``cat([embeds, h])`` (embedding first, 2H-wide q/k/v), fused add, MLP, add.
3. Later layers (multi-layer drafts) are plain pre-norm decoder layers.
4. ``logits = lm_head(norm(x))``; the next chained step is fed ``x`` itself (pre-norm), or
   ``norm(x)`` with ``norm_output`` (EAGLE 3.1), and never goes through ``fc`` again.

Module and parameter names are speculators' checkpoint names, so ``state_dict()`` is a
speculators-layout checkpoint. Attention for chained steps is :mod:`consistency.replay.chain`'s
business; a layer only asks an ``attend(q, k, v)`` callable for the mixing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from consistency.replay.config import DraftConfig

Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu, "swish": F.silu, "gelu": F.gelu, "relu": F.relu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


class RMSNorm(nn.Module):
    """HF's RMSNorm: statistics in fp32, weight applied in the input dtype."""

    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dt = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dt)


class Attention(nn.Module):
    def __init__(self, cfg: DraftConfig, in_width: int, bias: bool = False, qk_norm: bool = False) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(in_width, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(in_width, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(in_width, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: int, attend: Attend) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:  # Qwen3 layers
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        out = attend(layer, q, k, v)  # [b, heads, t, head_dim]
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        if cfg.hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {cfg.hidden_act!r}")
        self.act = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    """Layer 0 is EAGLE-3's first layer (``hidden_norm``, 2H-wide q/k/v); others are plain."""

    def __init__(self, cfg: DraftConfig, first: bool, bias: bool = False, qk_norm: bool = False) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.first = first
        self.norm_before_residual = cfg.norm_before_residual
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps) if first else None
        self.self_attn = Attention(cfg, 2 * h if first else h, bias, qk_norm)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, embeds: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                index: int, attend: Attend) -> torch.Tensor:
        if self.first:
            assert self.hidden_norm is not None and embeds is not None
            h = self.hidden_norm(x)
            residual = h if self.norm_before_residual else x
            a_in = torch.cat([self.input_layernorm(embeds), h], dim=-1)
        else:
            residual, a_in = x, self.input_layernorm(x)
        x = residual + self.self_attn(a_in, cos, sin, index, attend)
        return x + self.mlp(self.post_attention_layernorm(x))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's ``apply_rotary_pos_emb`` (rotate-half), cos/sin [t, head_dim] or [b, t, head_dim]."""
    if cos.dim() == 2:
        cos, sin = cos[None], sin[None]
    cos, sin = cos[:, None], sin[:, None]
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin


class Rotary(nn.Module):
    """cos/sin for positions, from transformers' RoPE initialisers (every rope_type HF knows)."""

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        keep = {k: v for k, v in cfg.layer_config.items()
                if k in ("rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings", "partial_rotary_factor")}
        lc = LlamaConfig(hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
                         head_dim=cfg.head_dim, **keep)
        self.impl = LlamaRotaryEmbedding(lc)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        pos = positions if positions.dim() == 2 else positions[None]
        probe = torch.empty(0, dtype=dtype, device=positions.device)
        cos, sin = self.impl(probe, pos)
        return (cos[0], sin[0]) if positions.dim() == 1 else (cos, sin)


class Eagle3Draft(nn.Module):
    """Parameters named as in a speculators checkpoint; embed/lm_head may come from the target."""

    def __init__(self, cfg: DraftConfig, num_aux: int, target_hidden: int, num_layers: int, target_vocab: int,
                 draft_vocab: int, fc_bias: bool = False, attn_bias: bool = False, qk_norm: bool = False) -> None:
        super().__init__()
        self.cfg = cfg
        self.num_aux, self.target_hidden = num_aux, target_hidden
        h = cfg.hidden_size
        self.input_norm = RMSNorm(num_aux * target_hidden, cfg.rms_norm_eps) if cfg.norm_before_fc else None
        self.fc_norm = (nn.ModuleList(RMSNorm(target_hidden, cfg.rms_norm_eps) for _ in range(num_aux))
                        if cfg.fc_norm else None)
        self.fc = nn.Linear(num_aux * target_hidden, h, bias=fc_bias)
        self.layers = nn.ModuleList(Layer(cfg, i == 0, attn_bias, qk_norm) for i in range(num_layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, draft_vocab, bias=False)
        self.embed_tokens = nn.Embedding(target_vocab, h)
        self.embed_tokens.weight.requires_grad_(False)
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))
        self.rotary = Rotary(cfg)
        lc = cfg.layer_config
        types = lc.get("layer_types") or []
        w = lc.get("sliding_window")
        self.windows = {i: int(w) for i, kind in enumerate(types[:num_layers]) if kind == "sliding_attention" and w}

    @property
    def draft_vocab(self) -> int:
        return self.lm_head.weight.shape[0]

    @property
    def target_vocab(self) -> int:
        return self.embed_tokens.weight.shape[0]

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's aux states (``cat(aux, -1)``, n·H_target wide) -> the first step's hidden."""
        if self.input_norm is not None:
            aux = self.input_norm(aux)
        if self.fc_norm is not None:
            aux = torch.cat([n(c) for n, c in zip(self.fc_norm, aux.chunk(self.num_aux, dim=-1))], dim=-1)
        return self.fc(aux)

    def step(self, hidden: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor,
             attend: Attend) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step for every row: (logits over the draft vocab, hidden for the next step)."""
        embeds = self.embed_tokens(token_ids)
        cos, sin = self.rotary(positions, hidden.dtype)
        x = hidden
        for i, layer in enumerate(self.layers):
            x = layer(x, embeds if i == 0 else None, cos, sin, i, attend)
        if self.cfg.norm_output:
            x = self.norm(x)
            return self.lm_head(x), x
        return self.lm_head(self.norm(x)), x

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocab ids -> target ids by the offset rule: target = i + d2t[i]."""
        return draft_ids + self.d2t[draft_ids]

    def export_state(self) -> dict[str, Any]:
        """Checkpoint tensors in speculators' names (rotary buffers left out)."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith("rotary.")}
