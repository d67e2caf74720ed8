"""What a serving bug would have captured instead, tapped from the same forward pass.

The scenarios build candidates from real values, not from formulas: the output of each
layer's input norm (what a fused add+norm hands the next layer: a post-norm capture with the
model's own norm and weights), and rank 0's share of each layer's MLP before the tensor- or
expert-parallel reduction (a capture placed before the all-reduce / MoE combine).

Rank 0 of 2, as the runtimes shard them:

* a dense MLP's down projection is row-parallel: rank 0 holds the first half of the
  intermediate features, so its pre-all-reduce output is ``W[:, :F/2] @ a[:F/2]``
  (vLLM/SGLang ``RowParallelLinear``; the bias is added once, after the reduce);
* a routed MoE is expert-parallel: rank 0 holds experts ``[0, E/2)`` and sums only the
  tokens' picks among them; shared experts are computed on every rank and added after the
  combine (SGLang ``DeepseekV2MoE`` with EP), so rank 0's value is its local experts plus the
  shared ones, and rank 1's is the rest.

These hooks are test-side code (independent of ``consistency.record``) and never change
the forward: the recorded streams stay the model's own.
"""

from __future__ import annotations

from typing import Any

_IN_NORM = ("input_layernorm", "ln_1", "ln_attn")


def install(layers: Any, parts: dict[tuple[str, int], Any]) -> list[Any]:
    """Hooks filling ``parts[("in_norm", k)]`` and ``parts[("mlp_part", k)]`` for every layer k."""
    import torch

    handles = []

    def keep(kind: str, k: int, t: torch.Tensor) -> None:
        parts[(kind, k)] = t.detach().float().clone()

    for k, layer in enumerate(layers):
        norm = next((getattr(layer, a) for a in _IN_NORM if isinstance(getattr(layer, a, None), torch.nn.Module)), None)
        if norm is not None:
            handles.append(norm.register_forward_hook(lambda _m, _a, o, k=k: keep("in_norm", k, o)))
        mlp = getattr(layer, "mlp", None)
        if mlp is None:
            continue
        experts = getattr(mlp, "experts", None)
        if experts is not None and hasattr(experts, "num_experts"):
            handles += _expert_parallel(mlp, experts, k, keep)
        elif isinstance(getattr(mlp, "down_proj", None), torch.nn.Linear):
            handles.append(mlp.down_proj.register_forward_hook(
                lambda m, a, _o, k=k: keep("mlp_part", k, _row_parallel(m, a[0]))))
    return handles


def _row_parallel(lin: Any, a: Any) -> Any:
    """Rank 0's partial sum of a row-parallel linear (the first half of the input features)."""
    import torch

    f = a.shape[-1] // 2
    return torch.nn.functional.linear(a[..., :f], lin.weight[:, :f])


def _expert_parallel(mlp: Any, experts: Any, k: int, keep: Any) -> list[Any]:
    """Rank 0's MoE output before the combine: its own experts' picks plus the shared experts."""
    import torch

    got: dict[str, torch.Tensor] = {}

    def routed(m: Any, args: tuple, kwargs: dict, _out: Any) -> None:
        hs, idx, w = (list(args) + [kwargs.get(n) for n in ("hidden_states", "top_k_index", "top_k_weights")])[:3]
        e = m.num_experts
        mine = idx < e // 2
        # e is the "no expert" sentinel (transformers' EP convention): its weight must be zero too,
        # since the grouped kernels leave the sentinel rows unwritten and rely on the weight
        got["routed"] = m.forward(hs, torch.where(mine, idx, torch.full_like(idx, e)), torch.where(mine, w, 0))

    def shared(_m: Any, _a: Any, out: Any) -> None:
        got["shared"] = out

    def whole(_m: Any, _a: Any, out: Any) -> None:
        r = got.pop("routed", None)
        s = got.pop("shared", None)
        if r is not None:
            keep("mlp_part", k, r.view(out.shape) + (s if s is not None else 0))

    hs = [experts.register_forward_hook(routed, with_kwargs=True), mlp.register_forward_hook(whole)]
    if isinstance(getattr(mlp, "shared_experts", None), torch.nn.Module):
        hs.append(mlp.shared_experts.register_forward_hook(shared))
    return hs
