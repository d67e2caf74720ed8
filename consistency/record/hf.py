"""Record every stream of a Hugging Face decoder model with forward hooks.

``output_hidden_states`` is not enough: its last element is post-norm, so stream N is only
reachable with a hook on the last decoder layer. Hooks give ``hidden.0..N`` (pre-norm),
each block's delta (``attn_out.k``, ``mlp_out.k``), ``final_norm`` and ``logits``, and
the additive identity ``hidden.{k+1} = hidden.k + attn_out.k + mlp_out.k`` is checked so
a post-norm architecture never gets mislabelled deltas.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from consistency.dump import names

_ATTN = ("self_attn", "attn", "self_attention", "attention")
_MLP = ("mlp", "feed_forward", "block_sparse_moe", "ffn")
_FINAL_NORM = ("norm", "ln_f", "final_layernorm", "norm_f", "final_norm")


def find_layers(model: torch.nn.Module) -> tuple[str, torch.nn.ModuleList]:
    """The decoder-layer list: the longest ModuleList of identical blocks (N of them)."""
    cfg = getattr(model, "config", None)
    cfg = getattr(cfg, "text_config", None) or cfg
    n = getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer", None)
    best: tuple[str, torch.nn.ModuleList] | None = None
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.ModuleList) and len(mod) and len({type(m) for m in mod}) == 1:
            if n is not None and len(mod) == n:
                return name, mod
            if best is None or len(mod) > len(best[1]):
                best = (name, mod)
    if best is None:
        raise ValueError("no decoder layer list found in the model")
    return best


def find_final_norm(model: torch.nn.Module, layers_path: str) -> torch.nn.Module | None:
    parent = model.get_submodule(layers_path.rsplit(".", 1)[0]) if "." in layers_path else model
    for attr in _FINAL_NORM:
        mod = getattr(parent, attr, None)
        if isinstance(mod, torch.nn.Module):
            return mod
    return None


def _child(layer: torch.nn.Module, attrs: Sequence[str]) -> torch.nn.Module | None:
    for a in attrs:
        mod = getattr(layer, a, None)
        if isinstance(mod, torch.nn.Module):
            return mod
    return None


def _first(x: Any) -> torch.Tensor:
    return x[0] if isinstance(x, (tuple, list)) else x


def capture_streams(model: torch.nn.Module, input_ids: torch.Tensor, components: bool = True,
                    logits: bool = False, **forward_kw: Any) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Run ``model`` once; return named CPU tensors (batch dim kept) and notes."""
    path, layers = find_layers(model)
    out: dict[str, torch.Tensor] = {}
    notes: list[str] = []
    handles = []

    def keep(name: str, t: torch.Tensor) -> None:
        out[name] = t.detach().to("cpu", copy=True)

    def pre0(_m: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        h = args[0] if args else kwargs.get("hidden_states")
        keep(names.hidden(0), h)

    handles.append(layers[0].register_forward_pre_hook(pre0, with_kwargs=True))
    for k, layer in enumerate(layers):
        handles.append(layer.register_forward_hook(lambda _m, _a, o, k=k: keep(names.hidden(k + 1), _first(o))))
        if components:
            attn, mlp = _child(layer, _ATTN), _child(layer, _MLP)
            if attn is not None:
                handles.append(attn.register_forward_hook(lambda _m, _a, o, k=k: keep(names.attn_out(k), _first(o))))
            if mlp is not None:
                handles.append(mlp.register_forward_hook(lambda _m, _a, o, k=k: keep(names.mlp_out(k), _first(o))))
    norm = find_final_norm(model, path)
    if norm is not None:
        handles.append(norm.register_forward_hook(lambda _m, _a, o: keep(names.FINAL_NORM, _first(o))))
    try:
        with torch.no_grad():
            result = model(input_ids=input_ids, **forward_kw)
    finally:
        for h in handles:
            h.remove()
    if logits and getattr(result, "logits", None) is not None:
        keep(names.LOGITS, result.logits)
    if components:
        _check_components(out, len(layers), notes)
    return out, notes


def _check_components(out: dict[str, torch.Tensor], n: int, notes: list[str]) -> None:
    """Drop deltas that do not add up to the next stream (post-norm blocks, parallel blocks)."""
    for k in range(n):
        a, m = out.get(names.attn_out(k)), out.get(names.mlp_out(k))
        h0, h1 = out.get(names.hidden(k)), out.get(names.hidden(k + 1))
        if a is None or m is None or h0 is None or h1 is None or a.shape != h0.shape or m.shape != h0.shape:
            out.pop(names.attn_out(k), None)
            out.pop(names.mlp_out(k), None)
            continue
        s = h0.double() + a.double() + m.double()
        err = float((s - h1.double()).norm() / h1.double().norm().clamp_min(1e-30))
        tol = 2e-2 if h1.dtype in (torch.bfloat16, torch.float16) else 1e-4
        if err > tol:
            out.pop(names.attn_out(k))
            out.pop(names.mlp_out(k))
            notes.append(f"layer {k}: attention/MLP outputs do not add up to the next stream "
                         f"(relative error {err:.1e}); components not recorded")

def _max_stream(streams: dict[str, torch.Tensor]) -> int:
    return max((names.stream_of(n) or 0) for n in streams)


def record_pass(model: torch.nn.Module, input_ids: Any, rec: Any, aux_streams: Sequence[int] = (), *,
                cache: Any = None, streams: bool = False, request_ids: Sequence[int] | None = None) -> Any:
    """Record one forward pass the way a serving runtime runs it: a prefill chunk or a decode
    step on top of ``cache`` (a transformers ``Cache``, updated in place), with this pass's
    ``input_ids``, ``positions`` (cache length + 0..T-1) and, for a batch, ``request_ids``
    written as the next ``#k`` capture, so :mod:`consistency.dump.stitch` can join the passes.

    ``input_ids`` is ``[T]`` or ``[B, T]`` (B requests of equal length, flattened request
    by request). Returns the cache, for the next pass.
    """
    from transformers import DynamicCache

    ids = torch.as_tensor(input_ids, dtype=torch.long)
    ids = ids[None] if ids.dim() == 1 else ids
    b, t = ids.shape
    cache = DynamicCache() if cache is None else cache
    past = cache.get_seq_length()
    pos = torch.arange(past, past + t, dtype=torch.long)
    got, _notes = capture_streams(model, ids, components=False, past_key_values=cache, use_cache=True,
                                  position_ids=pos[None].expand(b, t))
    flat_pos = pos.repeat(b)
    rec.capture(names.INPUT_IDS, ids.reshape(-1), producer="input_ids", positions=flat_pos)
    if b > 1 or request_ids is not None:
        req = torch.as_tensor(list(request_ids) if request_ids is not None else range(b), dtype=torch.long)
        rec.capture("request_ids", req.repeat_interleave(t), producer="request_ids")
    if streams:
        for name in sorted(got, key=names.sort_key):
            rec.capture(name, got[name].reshape(b * t, -1), producer="hook")
    for i, s in enumerate(aux_streams):
        rec.capture(names.aux(i), got[names.hidden(s)].reshape(b * t, -1), producer="hook")
    return cache
