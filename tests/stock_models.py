"""Tiny models shaped as SGLang and Megatron shape theirs, on an HF Llama's weights, for the stock dumpers.

The stock dump tools hook modules by name and by type, so what they write depends on the
module tree: :class:`SGLangLlama` has SGLang's ``LlamaForCausalLM`` tree (``model.embed_tokens``,
``model.layers.{k}.input_layernorm`` as a fused add+RMSNorm returning ``(normed, x + residual)``,
``self_attn.qkv_proj``/``o_proj``, ``mlp.gate_up_proj``/``down_proj``, ``model.norm``,
``logits_processor``) and its call convention (``forward(input_ids, positions, forward_batch)``,
the EAGLE-3 capture loop ``aux.append(hidden_states + residual)``); :class:`MegatronGPT` has
Megatron's GPTModel tree (``decoder.layers.{l}.self_attention.linear_qkv`` a LayerNorm+Linear,
``linear_proj``/``linear_fc2`` row-parallel linears returning ``(out, bias)``, ``[s, b, h]``).
Both keep a KV cache, so a prompt runs as prefill chunks and decode steps, and their streams
equal the HF model's (float32 rounding apart): the tests check that first.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """Causal attention of new queries (positions start..) over cached + new keys; [heads, t, d]."""
    rep = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
    t, total = q.shape[1], k.shape[1]
    mask = torch.ones(t, total, dtype=torch.bool).tril(total - t)
    scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ v


class _Cache:
    def __init__(self) -> None:
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if layer in self.kv:
            k0, v0 = self.kv[layer]
            k, v = torch.cat([k0, k], 1), torch.cat([v0, v], 1)
        self.kv[layer] = (k, v)
        return k, v


# -- SGLang ---------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """SGLang's ``RMSNorm.forward(x, residual=None)``: with a residual, add first and return both."""

    def __init__(self, hf_norm: nn.Module) -> None:
        super().__init__()
        self.hf = [hf_norm]  # not a child: the norm itself is the leaf the hooks see
        self.weight = hf_norm.weight

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        if residual is None:
            return self.hf[0](x)
        s = x + residual
        return self.hf[0](s), s


class RotaryEmbedding(nn.Module):
    def __init__(self, rotary: nn.Module) -> None:
        super().__init__()
        self.rotary = [rotary]

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.rotary[0](q, positions[None])
        return apply_rotary_pos_emb(q, k, cos, sin)


class RadixAttention(nn.Module):
    def __init__(self, layer_id: int, heads: int, kv_heads: int, dim: int) -> None:
        super().__init__()
        self.layer_id, self.heads, self.kv_heads, self.dim = layer_id, heads, kv_heads, dim

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, forward_batch: Any) -> torch.Tensor:
        k, v = forward_batch.cache.extend(self.layer_id, k[0], v[0])
        out = _attend(q[0], k, v, int(forward_batch.positions[0]))
        return out.transpose(0, 1).reshape(q.shape[2], -1)


class SGLangAttention(nn.Module):
    def __init__(self, hf_attn: nn.Module, rotary: nn.Module, layer_id: int, cfg: Any) -> None:
        super().__init__()
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.dim = cfg.hidden_size // self.heads
        w = torch.cat([hf_attn.q_proj.weight, hf_attn.k_proj.weight, hf_attn.v_proj.weight], 0)
        self.qkv_proj = nn.Linear(cfg.hidden_size, w.shape[0], bias=False)
        self.qkv_proj.weight = nn.Parameter(w.detach().clone())
        self.o_proj = hf_attn.o_proj
        self.rotary_emb = RotaryEmbedding(rotary)
        self.attn = RadixAttention(layer_id, self.heads, self.kv_heads, self.dim)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, forward_batch: Any) -> torch.Tensor:
        t = hidden_states.shape[0]
        qkv = self.qkv_proj(hidden_states)
        nq, nk = self.heads * self.dim, self.kv_heads * self.dim
        q = qkv[:, :nq].view(t, self.heads, self.dim).transpose(0, 1)[None]
        k = qkv[:, nq:nq + nk].view(t, self.kv_heads, self.dim).transpose(0, 1)[None]
        v = qkv[:, nq + nk:].view(t, self.kv_heads, self.dim).transpose(0, 1)[None]
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, forward_batch=forward_batch))


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = x.chunk(2, -1)
        return nn.functional.silu(a) * b


class SGLangMLP(nn.Module):
    def __init__(self, hf_mlp: nn.Module) -> None:
        super().__init__()
        w = torch.cat([hf_mlp.gate_proj.weight, hf_mlp.up_proj.weight], 0)
        self.gate_up_proj = nn.Linear(w.shape[1], w.shape[0], bias=False)
        self.gate_up_proj.weight = nn.Parameter(w.detach().clone())
        self.act_fn = SiluAndMul()
        self.down_proj = hf_mlp.down_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class SGLangDecoderLayer(nn.Module):
    def __init__(self, hf_layer: nn.Module, rotary: nn.Module, layer_id: int, cfg: Any) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.self_attn = SGLangAttention(hf_layer.self_attn, rotary, layer_id, cfg)
        self.mlp = SGLangMLP(hf_layer.mlp)
        self.input_layernorm = RMSNorm(hf_layer.input_layernorm)
        self.post_attention_layernorm = RMSNorm(hf_layer.post_attention_layernorm)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, forward_batch: Any,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions=positions, hidden_states=hidden_states, forward_batch=forward_batch)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class SGLangModel(nn.Module):
    def __init__(self, hf: nn.Module, layers_to_capture: Sequence[int], post_norm_last: bool) -> None:
        super().__init__()
        cfg = hf.config
        self.embed_tokens = hf.model.embed_tokens
        rotary = hf.model.rotary_emb
        self.layers = nn.ModuleList(SGLangDecoderLayer(layer, rotary, i, cfg) for i, layer in enumerate(hf.model.layers))
        self.norm = RMSNorm(hf.model.norm)
        self.layers_to_capture = list(layers_to_capture)
        self.post_norm_last = post_norm_last

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: Any) -> Any:
        hidden_states = self.embed_tokens(input_ids)
        residual = None
        aux: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            if i in self.layers_to_capture:  # sglang llama.py <= 0.5.21 (the embedding needs residual None handled)
                aux.append(hidden_states if residual is None else hidden_states + residual)
            hidden_states, residual = layer(positions, hidden_states, forward_batch, residual)
        hidden_states, last = self.norm(hidden_states, residual)
        if len(self.layers) in self.layers_to_capture:  # a model file that also feeds the last state
            aux.append(hidden_states if self.post_norm_last else last)
        return (hidden_states, aux) if aux else hidden_states


@dataclass
class LogitsProcessorOutput:
    next_token_logits: torch.Tensor


class LogitsProcessor(nn.Module):
    def forward(self, input_ids: torch.Tensor, hidden_states: torch.Tensor, lm_head: nn.Module, forward_batch: Any,
                aux_hidden_states: Any = None) -> Any:
        last = forward_batch.seq_lens.cumsum(0) - 1 - (forward_batch.seq_lens.sum() - hidden_states.shape[0])
        return LogitsProcessorOutput(lm_head(hidden_states[last.clamp(min=0)]))


class SGLangLlama(nn.Module):
    """``LlamaForCausalLM`` as SGLang builds it (``model``, ``lm_head``, ``logits_processor``)."""

    def __init__(self, hf: nn.Module, layers_to_capture: Sequence[int] = (), post_norm_last: bool = False) -> None:
        super().__init__()
        self.model = SGLangModel(hf, layers_to_capture, post_norm_last)
        self.lm_head = hf.lm_head
        self.logits_processor = LogitsProcessor()

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: Any) -> Any:
        out = self.model(input_ids, positions, forward_batch)
        hidden, aux = out if isinstance(out, tuple) else (out, None)
        return self.logits_processor(input_ids, hidden, self.lm_head, forward_batch, aux)


class ForwardBatch:
    """The fields of SGLang's ForwardBatch the dump tools read, plus our KV cache."""

    def __init__(self, input_ids: torch.Tensor, positions: torch.Tensor, seq_len: int, cache: _Cache,
                 rid: str = "req-0") -> None:
        self.input_ids, self.positions = input_ids, positions
        self.seq_lens = torch.tensor([seq_len])
        self.req_pool_indices = torch.tensor([0])
        self.rids = [rid]
        self.cache = cache


class PPProxyTensors:
    def __init__(self, tensors: dict) -> None:
        self.tensors = tensors


def run_passes(model: nn.Module, prompt: torch.Tensor, chunks: Sequence[int], decode: int,
               between: Any = None) -> torch.Tensor:
    """Prefill ``prompt`` in chunks of the given sizes, then ``decode`` greedy steps; returns
    every token fed (prompt + generated). ``between()`` runs after each pass (dumper.step())."""
    cache, fed = _Cache(), list(prompt.tolist())
    at, passes = 0, [c for c in chunks]
    for c in passes:
        ids = prompt[at:at + c]
        out = model(ids, torch.arange(at, at + c), ForwardBatch(ids, torch.arange(at, at + c), at + c, cache))
        at += c
        if between:
            between()
    for _ in range(decode):
        nxt = int(out.next_token_logits[-1].argmax())
        fed.append(nxt)
        ids = torch.tensor([nxt])
        out = model(ids, torch.tensor([at]), ForwardBatch(ids, torch.tensor([at]), at + 1, cache))
        at += 1
        if between:
            between()
    return torch.tensor(fed)


def sglang_stubs(extra: dict[str, dict[str, Any]] | None = None) -> dict[str, types.ModuleType]:
    """Minimal stand-ins for the server modules the debug_utils files import."""
    mods: dict[str, dict[str, Any]] = {
        "sglang": {}, "sglang.srt": {}, "sglang.srt.layers": {}, "sglang.srt.model_executor": {},
        "sglang.srt.layers.logits_processor": {"LogitsProcessorOutput": LogitsProcessorOutput},
        "sglang.srt.model_executor.forward_batch_info": {"ForwardBatch": ForwardBatch, "PPProxyTensors": PPProxyTensors},
        "sglang.srt.debug_utils": {},
    }
    mods.update(extra or {})
    out = {}
    for name, attrs in mods.items():
        m = types.ModuleType(name)
        m.__path__ = []  # a package, so submodules import
        for k, v in attrs.items():
            setattr(m, k, v)
        out[name] = m
    return out


@contextmanager
def stubbed(mods: dict[str, types.ModuleType]):
    saved = {k: sys.modules.get(k) for k in mods}
    sys.modules.update(mods)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


def load_upstream(path: Any, modname: str) -> types.ModuleType:
    """Execute a released upstream file as module ``modname`` (call inside :func:`stubbed`:
    its imports resolve to the stand-ins, and it stays registered while the stubs are)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(modname, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[modname] = mod
    spec.loader.exec_module(mod)
    return mod


# -- Megatron -------------------------------------------------------------------------------


class ColumnParallelLinear(nn.Module):
    """megatron.core.tensor_parallel.layers.ColumnParallelLinear: returns ``(output, bias)``."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone())

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return x @ self.weight.t(), None


class RowParallelLinear(ColumnParallelLinear):
    pass


class Router(nn.Module):
    pass


class TELinear(ColumnParallelLinear):
    pass


class TEColumnParallelLinear(ColumnParallelLinear):
    pass


class TERowParallelLinear(ColumnParallelLinear):
    """Under sequence parallelism the output is reduce-scattered: this rank's rows of the sum."""

    def __init__(self, weight: torch.Tensor, shard: Any = None) -> None:
        super().__init__(weight)
        self.shard = [shard]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        out = x @ self.weight.t()
        return (self.shard[0](out) if self.shard[0] is not None else out), None


class TELayerNormColumnParallelLinear(ColumnParallelLinear):
    """LayerNorm fused into the linear (TE spec): its input is the raw residual stream.
    Under sequence parallelism it receives this rank's rows and all-gathers them."""

    def __init__(self, weight: torch.Tensor, norm: nn.Module, gather: Any = None) -> None:
        super().__init__(weight)
        self.norm = [norm]
        self.gather = [gather]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        full = self.gather[0](x) if self.gather[0] is not None else x
        return self.norm[0](full) @ self.weight.t(), None


class _FinalNorm(nn.Module):
    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.norm = [norm]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm[0](x)


class TENorm:
    """``TENorm.__new__`` returns a TE RMSNorm: the object is no TENorm (activation logging's isinstance misses it)."""

    def __new__(cls, norm: nn.Module) -> nn.Module:  # type: ignore[misc]
        return _FinalNorm(norm)


class _Embedding(nn.Module):  # VocabParallelEmbedding is a plain Module, not nn.Embedding
    def __init__(self, emb: nn.Module) -> None:
        super().__init__()
        self.weight = emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight[ids]


class _Wrap(nn.Module):
    def __init__(self, **kids: nn.Module) -> None:
        super().__init__()
        for k, v in kids.items():
            setattr(self, k, v)


class MegatronGPT(nn.Module):
    """Megatron GPTModel's tree and ``[s, b, h]`` layout over HF Llama weights (TE spec).
    ``sp=(rank, size)``: sequence parallel, linear_qkv/linear_fc1 receive this rank's rows."""

    def __init__(self, hf: nn.Module, sp: tuple[int, int] | None = None) -> None:
        super().__init__()
        cfg = hf.config
        self.cfg, self.sp, self.rotary = cfg, sp, [hf.model.rotary_emb]
        self.embedding = _Wrap(word_embeddings=_Embedding(hf.model.embed_tokens))
        layers = []
        for layer in hf.model.layers:
            a, m = layer.self_attn, layer.mlp
            qkv = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight], 0)
            attn = _Wrap(linear_qkv=TELayerNormColumnParallelLinear(qkv, layer.input_layernorm, self._gather),
                         linear_proj=TERowParallelLinear(a.o_proj.weight, self._rows))
            fc1 = torch.cat([m.gate_proj.weight, m.up_proj.weight], 0)
            mlp = _Wrap(linear_fc1=TELayerNormColumnParallelLinear(fc1, layer.post_attention_layernorm, self._gather),
                        linear_fc2=TERowParallelLinear(m.down_proj.weight, self._rows))
            layers.append(_Wrap(self_attention=attn, mlp=mlp))
        self.decoder = _Wrap(layers=nn.ModuleList(layers), final_layernorm=TENorm(hf.model.norm))
        self.output_layer = ColumnParallelLinear(hf.lm_head.weight)
        self._full: torch.Tensor | None = None

    def _gather(self, shard: torch.Tensor) -> torch.Tensor:
        assert self._full is not None
        return self._full  # the all-gather of every rank's rows: the full stream

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        if self.sp is None:
            return x
        r, n = self.sp
        s = x.shape[0] // n
        return x[r * s:(r + 1) * s]

    def _shard(self, x: torch.Tensor) -> torch.Tensor:
        self._full = x
        return self._rows(x)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        heads, kv, dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
        h = self.embedding.word_embeddings(input_ids).transpose(0, 1)  # [s, b, h]
        s = h.shape[0]
        cos, sin = self.rotary[0](h.transpose(0, 1), torch.arange(s)[None])
        for layer in self.decoder.layers:
            qkv, _ = layer.self_attention.linear_qkv(self._shard(h))
            q, k, v = qkv[:, 0].split([heads * dim, kv * dim, kv * dim], -1)
            q = q.view(s, heads, dim).transpose(0, 1)[None]
            k = k.view(s, kv, dim).transpose(0, 1)[None]
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            ctx = _attend(q[0], k[0], v.view(s, kv, dim).transpose(0, 1), 0).transpose(0, 1).reshape(s, 1, -1)
            layer.self_attention.linear_proj(ctx)  # logged: this rank's rows under sequence parallelism
            h = h + ctx @ layer.self_attention.linear_proj.weight.t()
            up, _ = layer.mlp.linear_fc1(self._shard(h))
            a, b = up.chunk(2, -1)
            act = nn.functional.silu(a) * b
            layer.mlp.linear_fc2(act)
            h = h + act @ layer.mlp.linear_fc2.weight.t()
        final = self.decoder.final_layernorm(h)
        self.output_layer(self._shard(final))  # logged: input0 is this rank's rows (gathered inside)
        return final @ self.output_layer.weight.t()


def megatron_stubs(checkpointing_py: Any, tp: int = 0, pp: int = 0, pp_size: int = 1) -> dict[str, types.ModuleType]:
    """Stand-ins for what megatron/training/activation_logging.py imports; ``save_grads`` is the
    released function itself, cut from the wheel's checkpointing.py and run with a stand-in mpu."""
    import ast
    import datetime as _dt
    import os

    text = open(checkpointing_py).read()
    fn = next(n for n in ast.parse(text).body if isinstance(n, ast.FunctionDef) and n.name == "save_grads")
    mpu = types.SimpleNamespace(get_expert_data_parallel_rank=lambda: 0, get_expert_model_parallel_rank=lambda: 0,
                                get_pipeline_model_parallel_rank=lambda: pp, get_tensor_model_parallel_rank=lambda: tp,
                                get_pipeline_model_parallel_world_size=lambda: pp_size,
                                get_expert_model_parallel_world_size=lambda: 1)
    ns: dict[str, Any] = {"mpu": mpu, "print_rank_0": lambda *a: None, "datetime": _dt.datetime, "os": os,
                          "torch": torch}
    exec(compile(ast.Module([fn], []), checkpointing_py, "exec"), ns)  # noqa: S102 - the released function
    te = {"TELinear": TELinear, "TENorm": TENorm, "TEColumnParallelLinear": TEColumnParallelLinear,
          "TERowParallelLinear": TERowParallelLinear, "TELayerNormColumnParallelLinear": TELayerNormColumnParallelLinear}
    mods: dict[str, dict[str, Any]] = {
        "megatron": {}, "megatron.core": {}, "megatron.core.tensor_parallel": {},
        "megatron.core.tensor_parallel.layers": {"ColumnParallelLinear": ColumnParallelLinear,
                                                 "RowParallelLinear": RowParallelLinear},
        "megatron.core.transformer": {}, "megatron.core.transformer.moe": {},
        "megatron.core.transformer.moe.router": {"Router": Router},
        "megatron.core.utils": {"unwrap_model": lambda m: m},
        "megatron.core.extensions": {}, "megatron.core.extensions.transformer_engine": te,
        "megatron.training": {}, "megatron.training.checkpointing": {"save_grads": ns["save_grads"]},
        "megatron.training.activation_logging": {},
    }
    out = {}
    for name, attrs in mods.items():
        m = types.ModuleType(name)
        m.__path__ = []
        m.__dict__.update(attrs)
        out[name] = m
    return out
