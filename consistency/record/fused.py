"""A serving-style (fused-residual) forward over Hugging Face decoder weights.

SGLang and vLLM decoder layers return ``(hidden_states, residual)``: the block's output
delta and the running residual, added inside the next layer's fused add+RMSNorm. This
module reproduces that structure on the *same* weights as an HF model (Llama, Qwen2/3,
Mistral, DeepSeek-V3: any pre-norm layer with ``self_attn``, ``mlp`` and two norms), with
the aux capture loop as upstream writes it, so both recorders can be checked against each
other and the ``.clone()`` bug can be reproduced on purpose. Sandwich norms (Gemma2/3:
``post_attention_layernorm`` on the attention output, the fused add into
``pre_feedforward_layernorm``, ``post_feedforward_layernorm`` on the MLP output, as SGLang's
gemma2.py) and Granite's multipliers (embedding, residual) are followed; an architecture the
loop does not model (parallel blocks: GPT-NeoX, Falcon, Cohere) is refused in one line, and
:func:`check` compares the loop's final norm with the model's own, so a loop that does not
reproduce the forward never writes a dump (values over claims).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any, Literal

import torch

from consistency.record.hf import find_final_norm, find_layers
from consistency.errors import UsageError
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
        cfg = getattr(hf_model, "config", None)
        cfg = getattr(cfg, "text_config", None) or cfg
        self.embed_mult = float(getattr(cfg, "embedding_multiplier", 1.0) or 1.0)  # Granite
        self.resid_mult = float(getattr(cfg, "residual_multiplier", 1.0) or 1.0)
        missing = [a for a in ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
                   if not hasattr(self.layers[0], a)]
        missing += [] if hasattr(self.inner, "embed_tokens") else ["embed_tokens"]
        if missing or self.norm is None:
            arch = type(hf_model).__name__
            raise UsageError(f"serving-style recording follows pre-norm decoder layers (input_layernorm, self_attn, "
                             f"post_attention_layernorm, mlp: Llama, Qwen, Mistral, DeepSeek, Gemma2/3, Granite); "
                             f"{arch} has no "
                             f"{', '.join(missing) or 'final norm'}: record it with --style training")
        self.sandwich = hasattr(self.layers[0], "pre_feedforward_layernorm") and \
            hasattr(self.layers[0], "post_feedforward_layernorm")

    def _capture(self, hidden_states: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        if self.capture_mode == "clone":  # the bug users reproduce: the delta, not the stream
            return hidden_states.clone()
        if self.capture_mode == "add":  # older SGLang llama.py: fails at stream 0
            if residual is None:
                raise TypeError("unsupported operand type(s) for +: 'Tensor' and 'NoneType' (stream 0 in an add-only loop)")
            return hidden_states + residual
        return hidden_states if residual is None else hidden_states + residual

    def _layer_kind(self, i: int) -> str | None:
        """The layer's attention kind when the config names one (Gemma2/3: sliding or full)."""
        cfg = getattr(self.hf, "config", None)
        cfg = getattr(cfg, "text_config", None) or cfg
        types = getattr(cfg, "layer_types", None)
        return types[i] if types and i < len(types) else None

    def _masks(self, t: int, like: torch.Tensor) -> dict[str | None, torch.Tensor]:
        """Causal masks, and a sliding-window one (token i sees j when i - window < j <= i)."""
        cfg = getattr(self.hf, "config", None)
        cfg = getattr(cfg, "text_config", None) or cfg
        i = torch.arange(t, device=like.device)
        keep = i[None, :] <= i[:, None]
        out = {None: keep}
        window = getattr(cfg, "sliding_window", None)
        if window:
            out["sliding_attention"] = keep & (i[:, None] - i[None, :] < int(window))
        neg = torch.tensor(float("-inf"), dtype=like.dtype, device=like.device)
        zero = torch.zeros((), dtype=like.dtype, device=like.device)
        return {k: torch.where(v, zero, neg)[None, None] for k, v in out.items()}

    def _layer(self, layer: torch.nn.Module, positions: torch.Tensor, hidden_states: torch.Tensor,
               residual: torch.Tensor | None, pos_emb: Any, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden_states, residual = _fused_add_norm(layer.input_layernorm, hidden_states, residual)
        attn = layer.self_attn(hidden_states=hidden_states, position_embeddings=pos_emb, attention_mask=mask,
                               position_ids=positions)
        hidden_states = attn[0] if isinstance(attn, tuple) else attn
        if self.sandwich:  # SGLang gemma2.py: the attention output is normed, then added into the MLP's input norm
            hidden_states = layer.post_attention_layernorm(hidden_states)
            hidden_states, residual = _fused_add_norm(layer.pre_feedforward_layernorm, hidden_states, residual)
        else:
            hidden_states, residual = _fused_add_norm(layer.post_attention_layernorm,
                                                      self._scaled(hidden_states), residual)
        mlp = layer.mlp(hidden_states)
        hidden_states = mlp[0] if isinstance(mlp, tuple) else mlp
        if self.sandwich:
            hidden_states = layer.post_feedforward_layernorm(hidden_states)
        return self._scaled(hidden_states), residual

    def _scaled(self, delta: torch.Tensor) -> torch.Tensor:
        """What a block adds to the stream (Granite scales it by residual_multiplier)."""
        return delta if self.resid_mult == 1.0 else delta * self.resid_mult

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
        if self.embed_mult != 1.0:  # Granite: inputs_embeds * embedding_multiplier
            hidden_states = hidden_states * self.embed_mult
        rotary = getattr(self.inner, "rotary_emb", None)
        per_kind = rotary is not None and "layer_type" in inspect.signature(rotary.forward).parameters  # Gemma3
        pos_embs: dict[str | None, Any] = {}
        masks = self._masks(t, hidden_states)
        residual: torch.Tensor | None = None
        aux: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            kind = self._layer_kind(i)
            if kind not in pos_embs:
                pos_embs[kind] = None if rotary is None else \
                    rotary(hidden_states, positions, kind) if per_kind else rotary(hidden_states, positions)
            pos_emb = pos_embs[kind]
            mask = masks.get(kind, masks[None])
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


def check(hf_model: torch.nn.Module, input_ids: torch.Tensor, final: torch.Tensor) -> None:
    """The loop's final norm output must be the model's own (the HF forward, a hook on its
    final norm): a loop that does not reproduce an architecture is refused, never recorded."""
    got: dict[str, torch.Tensor] = {}
    path, _layers = find_layers(hf_model)
    norm = find_final_norm(hf_model, path)
    assert norm is not None
    h = norm.register_forward_hook(lambda _m, _a, o: got.__setitem__("final", o[0] if isinstance(o, tuple) else o))
    try:
        with torch.no_grad():
            hf_model(input_ids=input_ids if input_ids.dim() == 2 else input_ids[None])
    finally:
        h.remove()
    ref, mine = got["final"].double(), final.double()
    err = float((mine - ref).norm() / ref.norm().clamp_min(1e-30)) if ref.shape == mine.shape else float("inf")
    tol = 2e-2 if final.dtype in (torch.bfloat16, torch.float16) else 1e-4
    if not err <= tol:
        raise UsageError(f"serving-style recording: the fused-residual loop does not reproduce "
                         f"{type(hf_model).__name__}'s forward (its final norm output differs by {err:.1e}): "
                         "record it with --style training")

