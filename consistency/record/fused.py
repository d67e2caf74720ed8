"""A serving-style (fused-residual) forward over Hugging Face decoder weights.

SGLang and vLLM decoder layers return ``(hidden_states, residual)``: the block's output
delta and the running residual, added inside the next layer's fused add+RMSNorm. This
module reproduces that structure on the *same* weights as an HF model (Llama, Qwen2/3,
Mistral, DeepSeek-V3: any pre-norm layer with ``self_attn``, ``mlp`` and two norms), with
the aux capture loop as upstream writes it, so both recorders can be checked against each
other and the ``.clone()`` bug can be reproduced on purpose.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch

from consistency.record.hf import find_final_norm, find_layers
from consistency.record.recorder import capture

CaptureMode = Literal["add", "guarded", "clone"]


def _fused_add_norm(norm: torch.nn.Module, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang's ``RMSNorm.forward(x, residual)``: add, then normalise; return both."""
    if residual is None:
        return norm(x), x
    s = x + residual
    return norm(s), s


class FusedDecoder(torch.nn.Module):
    """Wrap an HF causal LM; ``forward`` returns (final hidden, aux list) like SGLang's LlamaModel."""

    def __init__(self, hf_model: torch.nn.Module, layers_to_capture: Sequence[int] = (),
                 capture_mode: CaptureMode = "guarded", record_components: bool = False) -> None:
        super().__init__()
        self.hf = hf_model
        path, self.layers = find_layers(hf_model)
        self.inner = hf_model.get_submodule(path.rsplit(".", 1)[0])
        self.norm = find_final_norm(hf_model, path)
        self.layers_to_capture = list(layers_to_capture)
        self.capture_mode = capture_mode
        self.record_components = record_components

    def _capture(self, hidden_states: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        if self.capture_mode == "clone":  # the bug users reproduce: the delta, not the stream
            return hidden_states.clone()
        if self.capture_mode == "add":  # older SGLang llama.py: fails at stream 0
            if residual is None:
                raise TypeError("unsupported operand type(s) for +: 'Tensor' and 'NoneType' (stream 0 in an add-only loop)")
            return hidden_states + residual
        return hidden_states if residual is None else hidden_states + residual

    def _layer(self, layer: torch.nn.Module, positions: torch.Tensor, hidden_states: torch.Tensor,
               residual: torch.Tensor | None, pos_emb: Any, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden_states, residual = _fused_add_norm(layer.input_layernorm, hidden_states, residual)
        attn = layer.self_attn(hidden_states=hidden_states, position_embeddings=pos_emb, attention_mask=mask,
                               position_ids=positions)
        hidden_states = attn[0] if isinstance(attn, tuple) else attn
        hidden_states, residual = _fused_add_norm(layer.post_attention_layernorm, hidden_states, residual)
        mlp = layer.mlp(hidden_states)
        hidden_states = mlp[0] if isinstance(mlp, tuple) else mlp
        return hidden_states, residual

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        t = input_ids.shape[-1]
        positions = torch.arange(t, device=input_ids.device)[None]
        hidden_states = self.inner.embed_tokens(input_ids)
        scale = getattr(self.inner, "embed_scale", None)
        if scale is not None:
            hidden_states = hidden_states * scale
        pos_emb = self.inner.rotary_emb(hidden_states, positions) if hasattr(self.inner, "rotary_emb") else None
        mask = torch.full((t, t), float("-inf"), dtype=hidden_states.dtype, device=hidden_states.device).triu(1)[None, None]
        residual: torch.Tensor | None = None
        aux: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            if i in self.layers_to_capture:
                value = self._capture(hidden_states, residual)
                aux.append(value)
                capture(f"aux.{len(aux) - 1}", value, producer=self.capture_mode)
                if self.record_components:
                    capture(f"aux.{len(aux) - 1}.hidden_states", hidden_states, producer="component")
                    if residual is not None:
                        capture(f"aux.{len(aux) - 1}.residual", residual, producer="component")
            hidden_states, residual = self._layer(layer, positions, hidden_states, residual, pos_emb, mask)
        n = len(self.layers)
        if n in self.layers_to_capture:  # vLLM EagleModelMixin: stream N, pre-norm
            value = self._capture(hidden_states, residual)
            aux.append(value)
            capture(f"aux.{len(aux) - 1}", value, producer=self.capture_mode)
        assert self.norm is not None
        final, _ = _fused_add_norm(self.norm, hidden_states, residual)
        return final, aux
