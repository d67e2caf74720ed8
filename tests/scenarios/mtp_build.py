"""Tiny targets and our own MTP / EAGLE-1 drafts, written from the published formulas only.

Nothing here imports the engine (``consistency.compare``/``diagnose``/``replay``): the target
is a seeded transformers model built in memory, its streams come from
``output_hidden_states`` (HF's last entry is **post**-norm, so ``s=N`` pre-norm comes from a
hook on the last decoder layer), and the draft is a few lines of torch:

- MTP (DeepSeek-V3 ``README_WEIGHTS.md``; sglang ``deepseek_nextn.py``, vllm ``deepseek_mtp.py``):
  ``eh_proj(cat(enorm(emb), hnorm(h)))`` -> one pre-norm decoder block -> ``d_raw``;
  ``shared_head.norm(d_raw)`` = ``d_norm``. MiMo (vllm/sglang ``mimo_mtp.py``) concatenates
  ``[hidden, embed]``: an order of the same module here.
- EAGLE-1 (SafeAILab/EAGLE v1 ``model/cnets.py``): ``fc(cat(emb, h))`` with a bias, the block's
  first ``input_layernorm`` skipped, output ``d_raw`` (no norm on the inputs). Our EAGLE-1 has an
  output norm used only for logits (vLLM's HASS reading), so ``draft_norm`` exists and a
  recycle of it where ``d_raw`` is recycled is a constructible fault.

Step k (k = 0..K-1) of a teacher-forced run pairs hidden row r with token r+1+k (``shift``)
and keeps T-1-k rows: the tensors a reference dump holds under ``draft_*.k``/``recycle.k``
(docs/format.md, /work/notes/design19.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from functools import lru_cache
from typing import Any

import numpy as np

N_LAYERS = 4
T_MAX = 48
HIDDEN = 64
HEADS = 4

_COMMON = dict(hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=N_LAYERS, num_attention_heads=HEADS,
               num_key_value_heads=2, vocab_size=256, max_position_embeddings=512, tie_word_embeddings=False,
               initializer_range=0.05)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "deepseek_v3": ("DeepseekV3Config", {"num_key_value_heads": 4, "kv_lora_rank": 16, "q_lora_rank": None,
                                         "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 16,
                                         "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                         "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1}),
    "qwen3": ("Qwen3Config", {"head_dim": 16}),
    "llama": ("LlamaConfig", {}),
}
_SEEDS = {"deepseek_v3": 191, "qwen3": 192, "llama": 193}


@dataclass(frozen=True)
class Target:
    """One family's recording (float32 torch tensors): streams s=0..N pre-norm and fnorm(s=N)."""

    family: str
    n: int
    hidden_size: int
    ids: Any  # [T] int64
    hidden: tuple[Any, ...]  # s = 0..N, each [T, H]; hidden[N] is the last layer's output pre-norm
    final_norm: Any  # fnorm(s=N): what lm_head reads, HF's hidden_states[-1]
    embed: Any  # [V, H] the target's embedding table (MTP shares it)
    hf_last: Any  # HF's output_hidden_states[-1], kept to prove it is the post-norm tensor


def _rms(x: Any, w: Any, eps: float = 1e-6) -> Any:
    import torch

    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


@lru_cache(maxsize=None)
def target(family: str) -> Target:
    import torch
    import transformers

    cls_name, extra = FAMILIES[family]
    cfg = getattr(transformers, cls_name)(**{**_COMMON, **extra})
    torch.manual_seed(_SEEDS[family])
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():  # a learned-looking final-norm gain: with gain 1, hnorm(fnorm(x)) == hnorm(x)
        model.model.norm.weight.copy_(1.0 + 0.5 * torch.randn(HIDDEN))
    ids = torch.from_numpy(np.random.default_rng(_SEEDS[family]).integers(2, cfg.vocab_size, T_MAX)).long()
    grabbed: dict[str, Any] = {}

    def hook(_m: Any, _i: Any, out: Any) -> None:
        grabbed["pre"] = (out[0] if isinstance(out, tuple) else out).detach()

    h = model.model.layers[-1].register_forward_hook(hook)
    try:
        with torch.no_grad():
            out = model(ids[None], output_hidden_states=True)
    finally:
        h.remove()
    hs = [x[0].float() for x in out.hidden_states]
    pre = grabbed["pre"][0].float()
    with torch.no_grad():
        fnorm = model.model.norm(pre[None])[0].float()
    return Target(family, N_LAYERS, HIDDEN, ids, tuple(hs[:N_LAYERS]) + (pre,), fnorm,
                  model.model.embed_tokens.weight.detach().float().clone(), hs[N_LAYERS])


@dataclass(frozen=True)
class DraftWeights:
    kind: str  # "mtp" | "eagle1"
    enorm: Any
    hnorm: Any
    proj: Any  # [H, 2H] eh_proj / fc
    bias: Any  # fc bias (EAGLE-1) or None
    block: dict[str, Any]
    head_norm: Any  # shared_head.norm (MTP) / the logits norm (our EAGLE-1)


@lru_cache(maxsize=None)
def draft_weights(family: str, kind: str) -> DraftWeights:
    import torch

    g = torch.Generator().manual_seed(_SEEDS[family] * 10 + (kind == "eagle1"))
    H = HIDDEN

    def lin(o: int, i: int) -> Any:
        return torch.randn(o, i, generator=g) / i ** 0.5

    def gain() -> Any:
        return 1.0 + 0.3 * torch.randn(H, generator=g)

    block = {"ln1": gain(), "wq": lin(H, H), "wk": lin(H, H), "wv": lin(H, H), "wo": lin(H, H), "ln2": gain(),
             "wg": lin(2 * H, H), "wu": lin(2 * H, H), "wd": lin(H, 2 * H)}
    return DraftWeights(kind, gain(), gain(), lin(H, 2 * H), 0.1 * torch.randn(H, generator=g) if kind == "eagle1"
                        else None, block, gain())


def _block(x: Any, p: dict[str, Any], skip_input_norm: bool) -> Any:
    """One pre-norm decoder block (causal multi-head attention, SwiGLU MLP); returns hidden + residual."""
    import torch

    t, h = x.shape
    hd = h // HEADS
    a = x if skip_input_norm else _rms(x, p["ln1"])
    q, k, v = (torch.nn.functional.linear(a, p[w]).view(t, HEADS, hd).transpose(0, 1) for w in ("wq", "wk", "wv"))
    att = (q @ k.transpose(1, 2)) / hd ** 0.5
    att = att.masked_fill(torch.triu(torch.ones(t, t, dtype=torch.bool), 1), float("-inf")).softmax(-1)
    x = x + torch.nn.functional.linear((att @ v).transpose(0, 1).reshape(t, h), p["wo"])
    m = _rms(x, p["ln2"])
    f = torch.nn.functional
    return x + f.linear(f.silu(f.linear(m, p["wg"])) * f.linear(m, p["wu"]), p["wd"])


@dataclass(frozen=True)
class SideSpec:
    """How one side (training or serving) feeds the draft: the contract fields plus the faults."""

    step0: str = "final_norm"  # "final_norm": fnorm(s=N); "none": s=N pre-norm (a vLLM layer-N capture)
    recycle: str = "d_norm"  # d_norm | d_raw | target | target_same (target rows not advanced) | stale
    pos0: str = "kept"  # kept | zeroed
    order: str = "embed,hidden"  # or "hidden,embed"
    shift: bool = True  # draft_ids.k = ids[1+k:] (False: ids[k:-1], the unshifted pairing)
    drop: frozenset[int] = field(default_factory=frozenset)  # recycle.k this side does not record
    dtype: str = "float32"  # the draft's forward dtype ("bfloat16": a serving forward, rounding at every op)
    aux_rows: str = "step"  # aux.0 as recorded: "step" = step 0's T-1 rows (consistency.record.draft); "all" = T


@lru_cache(maxsize=256)
def run_cached(family: str, kind: str, spec: SideSpec, steps: int, tokens: int) -> dict[str, np.ndarray]:
    """``run_draft`` as numpy copies, cached: many scenarios share a side (treat as read-only)."""
    out = run_draft(target(family), draft_weights(family, kind), spec, steps, tokens)
    for a in (out := {k: v.numpy().copy() for k, v in out.items()}).values():
        a.flags.writeable = False
    return out


def run_draft(t: Target, w: DraftWeights, spec: SideSpec, steps: int, tokens: int) -> dict[str, Any]:
    """K teacher-forced steps; every per-step tensor under its dump name (float32 torch / int64)."""
    import torch

    ids = t.ids[:tokens]
    aux0 = (t.final_norm if spec.step0 == "final_norm" else t.hidden[t.n])[:tokens]
    if spec.dtype != "float32":
        out32 = run_draft(_cast(t, spec.dtype), _cast(w, spec.dtype), replace(spec, dtype="float32"), steps, tokens)
        return {k: v.float() if v.is_floating_point() else v for k, v in out32.items()}
    out: dict[str, Any] = {"aux.0": aux0[:tokens - 1] if spec.aux_rows == "step" else aux0}  # T-1: the last row has no token
    prev: dict[str, Any] = {}
    first: dict[str, Any] = {}
    with torch.no_grad():
        for k in range(steps):
            rows = tokens - 1 - k
            ids_k = ids[1 + k:tokens] if spec.shift else ids[k:tokens - 1]
            emb = t.embed[ids_k].clone()
            if spec.pos0 == "zeroed":  # vLLM: inputs_embeds[positions == 0] = 0 (row 0 is position 0)
                emb[0] = 0
            if k == 0:
                h = aux0[:rows]
            else:
                h = {"d_norm": prev.get("norm"), "d_raw": prev.get("raw"), "target": aux0[k:k + rows],
                     "target_same": aux0[:rows], "stale": first.get("norm")}[spec.recycle]
                h = h[:rows]
                if k not in spec.drop:
                    out[f"recycle.{k}"] = h
            a, b = (_rms(emb, w.enorm), _rms(h, w.hnorm)) if w.kind == "mtp" else (emb, h)
            cat = torch.cat([a, b] if spec.order == "embed,hidden" else [b, a], dim=-1)
            x = torch.nn.functional.linear(cat, w.proj, w.bias)
            raw = _block(x, w.block, skip_input_norm=w.kind == "eagle1")
            norm = _rms(raw, w.head_norm)
            out |= {f"draft_ids.{k}": ids_k.clone(), f"draft_embed.{k}": emb, f"draft_cat.{k}": cat,
                    f"draft_out.{k}": raw, f"draft_norm.{k}": norm}
            prev = {"raw": raw, "norm": norm}
            first = first or prev  # "stale": every step fed step 0's state (a buffer not refreshed)
    return out


def _cast(obj: Any, dtype: str) -> Any:
    """A Target / DraftWeights with every float tensor in ``dtype`` (ids and gains' meaning kept)."""
    import torch

    dt = getattr(torch, dtype)

    def c(v: Any) -> Any:
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return v.to(dt)
        if isinstance(v, dict):
            return {k: c(x) for k, x in v.items()}
        if isinstance(v, tuple):
            return tuple(c(x) for x in v)
        return v

    return replace(obj, **{f.name: c(getattr(obj, f.name)) for f in fields(obj)})


def target_tensors(t: Target, tokens: int) -> dict[str, Any]:
    """What a full reference records of the target: ``hidden.0..N``, ``final_norm``, ``input_ids``."""
    out = {f"hidden.{s}": x[:tokens] for s, x in enumerate(t.hidden)}
    return out | {"final_norm": t.final_norm[:tokens], "input_ids": t.ids[:tokens]}


def trd(x: Any, y: Any) -> float:
    """Mean token relative difference sum((x-y)^2) / (sum x^2 + sum y^2), 0 for equal tensors."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    if x.shape != y.shape:
        return float("inf")
    if x.dtype.kind in "iu" or x.ndim == 1:
        return float(np.mean(x != y))
    den = (x * x).sum(-1) + (y * y).sum(-1)
    return float(np.mean(((x - y) ** 2).sum(-1) / np.where(den > 0, den, 1.0)))
