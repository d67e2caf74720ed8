"""Record every stream of a Hugging Face decoder model with forward hooks.

``output_hidden_states`` is not enough: its last element is post-norm, so stream N is only
reachable with a hook on the last decoder layer. Hooks give ``hidden.0..N`` (pre-norm),
each block's delta (``attn_out.k``, ``mlp_out.k``: what the block *adds* to the stream),
``final_norm`` and ``logits``, and the additive identity
``hidden.{k+1} = hidden.k + attn_out.k + mlp_out.k`` is checked so no architecture gets
mislabelled deltas.

What a block adds is not always its module's output: sandwich norms (Gemma2/3, OLMo2) add
``post_attention_layernorm(attn(x))`` and ``post_feedforward_layernorm(mlp(x))``; Granite adds
``residual_multiplier * block(x)``. The recorder hooks those norms too and keeps, per layer,
the first reading under which the identity holds (plain outputs first), so the deltas are
what the stream really receives. Parallel blocks (GPT-NeoX, Cohere, Falcon:
``x + attn(ln(x)) + mlp(ln(x))``) satisfy the identity with the plain outputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from consistency.dump import names

_ATTN = ("self_attn", "attn", "self_attention", "attention")
_MLP = ("mlp", "feed_forward", "block_sparse_moe", "ffn")
_FINAL_NORM = ("norm", "ln_f", "final_layernorm", "final_layer_norm", "norm_f", "final_norm")  # GPT-NeoX: final_layer_norm
# norms applied to a block's output before it is added (sandwich norms: Gemma2/3, OLMo2). Llama's
# post_attention_layernorm is the MLP's *input* norm: the identity check tells the two apart.
_POST_ATTN = ("post_attention_layernorm", "post_attn_norm", "post_self_attn_layernorm")
_POST_MLP = ("post_feedforward_layernorm", "post_mlp_layernorm", "post_ffw_norm")


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
    parts: dict[tuple[int, str], torch.Tensor] = {}  # (layer, role) -> a candidate reading of a block's delta

    def part(k: int, role: str, t: torch.Tensor) -> None:
        parts[(k, role)] = t.detach().to("cpu", copy=True)  # a copy: Falcon adds to its MLP output in place

    for k, layer in enumerate(layers):
        handles.append(layer.register_forward_hook(lambda _m, _a, o, k=k: keep(names.hidden(k + 1), _first(o))))
        if components:
            for role, attrs in (("attn", _ATTN), ("mlp", _MLP), ("post_attn", _POST_ATTN), ("post_mlp", _POST_MLP)):
                mod = _child(layer, attrs)
                if mod is not None:
                    handles.append(mod.register_forward_hook(lambda _m, _a, o, k=k, r=role: part(k, r, _first(o))))
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
        _components(out, parts, len(layers), _residual_scale(model), notes)
    return out, notes


def _residual_scale(model: torch.nn.Module) -> float | None:
    """Granite's ``residual_multiplier`` (each block's output is scaled before the add)."""
    cfg = getattr(model, "config", None)
    cfg = getattr(cfg, "text_config", None) or cfg
    c = getattr(cfg, "residual_multiplier", None)
    return float(c) if isinstance(c, (int, float)) and c not in (0, 1) else None


def _components(out: dict[str, torch.Tensor], parts: dict[tuple[int, str], torch.Tensor], n: int,
                scale: float | None, notes: list[str]) -> None:
    """Per layer, the deltas the stream really receives: the first reading (plain block
    outputs, then post-block norms, each times 1 or the residual multiplier) under which
    ``hidden.k + attn + mlp == hidden.{k+1}``; none (with a note) when no reading adds up."""
    used: set[str] = set()
    for k in range(n):
        h0, h1 = out.get(names.hidden(k)), out.get(names.hidden(k + 1))
        found = None
        if h0 is not None and h1 is not None:
            tol = 2e-2 if h1.dtype in (torch.bfloat16, torch.float16) else 1e-4
            err = float("inf")
            for a_role, m_role, c in _readings(scale):
                a, m = parts.get((k, a_role)), parts.get((k, m_role))
                if a is None or m is None or a.shape != h0.shape or m.shape != h0.shape:
                    continue
                s = h0.double() + c * (a.double() + m.double())
                e = float((s - h1.double()).norm() / h1.double().norm().clamp_min(1e-30))
                err = min(err, e)
                if e <= tol:
                    found = (a, m, c, f"{a_role}/{m_role}" + (f" x {c:g}" if c != 1 else ""))
                    break
        if found is None:
            if (k, "attn") in parts or (k, "mlp") in parts:
                notes.append(f"layer {k}: attention/MLP outputs do not add up to the next stream "
                             f"(relative error {err:.1e}); components not recorded")
            continue
        a, m, c, how = found
        out[names.attn_out(k)] = a if c == 1 else (a.double() * c).to(a.dtype)
        out[names.mlp_out(k)] = m if c == 1 else (m.double() * c).to(m.dtype)
        used.add(how)
    if used - {"attn/mlp"}:
        notes.append("block deltas read as " + ", ".join(sorted(used)) + " (what each block adds to the stream: "
                     "post-block norms and residual multipliers included)")


def _readings(scale: float | None) -> list[tuple[str, str, float]]:
    pairs = [("attn", "mlp"), ("post_attn", "post_mlp"), ("attn", "post_mlp"), ("post_attn", "mlp")]
    return [(a, m, c) for c in ((1.0, scale) if scale else (1.0,)) for a, m in pairs]

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
