"""Load a real EAGLE-3 draft checkpoint (speculators or SGLang/SpecForge layout) for replay.

What the checkpoint leaves out is taken where the runtimes take it: the embedding and the
lm_head from the target (SGLang ``eagle_worker_v2.py::init_lm_head``, vLLM
``_maybe_share_embeddings``; the lm_head restricted to the draft vocabulary through ``d2t``),
the vocabulary map is the identity when ``d2t`` is absent (what both runtimes do; NeMo
Automodel PR #2447 shows what that costs a draft trained with a reduced vocabulary).
Everything that cannot line up raises :class:`InputError` naming the checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from consistency.errors import InputError
from consistency.replay import config as dcfg
from consistency.replay import weights as W
from consistency.replay.draft import Eagle3Draft

LAYER_REQUIRED = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
                  "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                  "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")


@dataclass
class TargetParts:
    """What a draft may borrow from its target."""

    embed: torch.Tensor | None = None  # [V_target, H]
    lm_head: torch.Tensor | None = None  # [V_target, H]
    hidden_size: int | None = None
    vocab_size: int | None = None
    name: str | None = None

    @classmethod
    def from_model(cls, model: Any, name: str | None = None) -> TargetParts:
        emb = model.get_input_embeddings()
        head = model.get_output_embeddings()
        cfg = getattr(model.config, "text_config", None) or model.config
        return cls(emb.weight.detach().float() if emb is not None else None,
                   head.weight.detach().float() if head is not None else None,
                   getattr(cfg, "hidden_size", None), getattr(cfg, "vocab_size", None), name)


@dataclass
class LoadedDraft:
    model: Eagle3Draft
    config: dcfg.DraftConfig
    path: Path
    sources: dict[str, str]  # embed_tokens / lm_head / d2t -> "draft" | "target" | "identity"
    notes: list[str] = field(default_factory=list)


def load_draft(path: str | Path, target: TargetParts | None = None,
               overrides: Mapping[str, bool] | None = None) -> LoadedDraft:
    p = Path(path)
    d, cfg_path = dcfg.find_config(p)
    cfg = dcfg.parse(cfg_path, dcfg.read_json(cfg_path), overrides)
    files = [p] if p.is_file() else W.weight_files(d)
    w, dropped = W.normalize(p, W.read_tensors(files))
    notes = list(cfg.notes)
    if dropped:
        notes.append(f"ignored {len(dropped)} tensors the EAGLE-3 forward does not use: {', '.join(sorted(dropped)[:6])}"
                     + (" ..." if len(dropped) > 6 else ""))
    return build(p, cfg, w, target, notes)


def _need(p: Path, w: Mapping[str, torch.Tensor], name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    if name not in w:
        raise InputError(p, f"draft checkpoint has no {name!r}")
    t = w[name]
    if shape is not None and tuple(t.shape) != shape:
        raise InputError(p, f"{name!r} has shape {list(t.shape)}, expected {list(shape)}")
    if t.is_floating_point() and not torch.isfinite(t.float()).all():
        raise InputError(p, f"{name!r} holds NaN or Inf values")
    return t


def build(p: Path, cfg: dcfg.DraftConfig, w: dict[str, torch.Tensor], target: TargetParts | None,
          notes: list[str]) -> LoadedDraft:
    h = cfg.hidden_size
    fc = _need(p, w, "fc.weight")
    if fc.dim() != 2 or fc.shape[0] != h:
        raise InputError(p, f"'fc.weight' has shape {list(fc.shape)}; expected [{h}, n x target hidden]")
    ht = cfg.target_hidden_size or (target.hidden_size if target and target.hidden_size else None) or h
    if fc.shape[1] % ht:
        raise InputError(p, f"'fc.weight' input width {fc.shape[1]} is not a multiple of the target hidden size {ht}")
    n_aux = fc.shape[1] // ht
    n_layers = W.num_layers(w)
    if n_layers == 0:
        raise InputError(p, "draft checkpoint has no decoder layer (midlayer.* or layers.0.*)")
    sources: dict[str, str] = {}
    embed = w.get("embed_tokens.weight")
    sources["embed_tokens"] = "draft"
    if embed is None:
        if target is None or target.embed is None:
            raise InputError(p, "the draft carries no embed_tokens; give the target (--target) to borrow its embedding")
        embed, sources["embed_tokens"] = target.embed, "target"
    if embed.dim() != 2 or embed.shape[1] != h:
        raise InputError(p, f"embedding width {embed.shape[-1]} differs from the draft hidden size {h}")
    vt = embed.shape[0]
    if target is not None and target.vocab_size and target.vocab_size != vt:
        raise InputError(p, f"the draft's embedding has {vt} rows but the target vocabulary has {target.vocab_size}")
    d2t = w.get("d2t")
    head = w.get("lm_head.weight")
    vd = head.shape[0] if head is not None else (d2t.shape[0] if d2t is not None else cfg.draft_vocab_size or vt)
    if cfg.draft_vocab_size is not None and cfg.draft_vocab_size != vd:
        raise InputError(p, f"config draft_vocab_size {cfg.draft_vocab_size} but the checkpoint's vocabulary has {vd} rows")
    if d2t is None:
        offsets = torch.zeros(vd, dtype=torch.long)
        sources["d2t"] = "identity"
        if vd < vt:
            notes.append(f"no d2t in a draft with a reduced vocabulary ({vd} < {vt}): draft ids are taken as target ids, "
                         "as SGLang and vLLM do (NeMo Automodel PR #2447)")
    else:
        offsets = _offsets(p, d2t, vd, vt)
        sources["d2t"] = "draft"
    if head is None:
        if target is None or target.lm_head is None:
            raise InputError(p, "the draft carries no lm_head; give the target (--target) to borrow its lm_head")
        head = target.lm_head[torch.arange(vd) + offsets]
        sources["lm_head"] = "target"
    else:
        sources["lm_head"] = "draft"
    if vd > vt:
        raise InputError(p, f"the draft vocabulary ({vd}) is larger than the target's ({vt})")
    # the config's shape must match the tensors before anything is allocated from it
    hd, heads, kv, inter = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
    _need(p, w, "layers.0.self_attn.q_proj.weight", (heads * hd, 2 * h))
    _need(p, w, "layers.0.self_attn.k_proj.weight", (kv * hd, 2 * h))
    _need(p, w, "layers.0.mlp.gate_proj.weight", (inter, h))
    lay = {k[len("layers.0."):]: v for k, v in w.items() if k.startswith("layers.0.")}
    attn_bias = "self_attn.q_proj.bias" in lay
    qk_norm = "self_attn.q_norm.weight" in lay
    model = Eagle3Draft(cfg, n_aux, ht, n_layers, vt, vd, fc_bias="fc.bias" in w, attn_bias=attn_bias, qk_norm=qk_norm)
    state = {k: v for k, v in w.items() if k not in ("t2d", "d2t", "embed_tokens.weight", "lm_head.weight")}
    state.update({"embed_tokens.weight": embed, "lm_head.weight": head, "d2t": offsets})
    expected = model.state_dict()
    for i in range(n_layers):
        for name in LAYER_REQUIRED + (("hidden_norm.weight",) if i == 0 else ()):
            _need(p, w, f"layers.{i}.{name}", tuple(expected[f"layers.{i}.{name}"].shape))
    _need(p, w, "norm.weight", (h,))
    for name, t in state.items():
        if name not in expected:
            notes.append(f"{name!r} is not used by this draft's configuration (flags: "
                         f"norm_before_fc={cfg.norm_before_fc}, fc_norm={cfg.fc_norm})")
            continue
        if tuple(t.shape) != tuple(expected[name].shape):
            raise InputError(p, f"{name!r} has shape {list(t.shape)}, expected {list(expected[name].shape)}")
    missing = [n for n in expected if n not in state and not n.startswith("rotary.")]
    if missing:
        raise InputError(p, f"the configuration needs {', '.join(missing[:4])} but the checkpoint lacks it")
    with torch.no_grad():
        for name, t in state.items():
            if name in expected:
                _assign(model, name, t)
    model.eval()
    return LoadedDraft(model, cfg, p, sources, notes)


def _assign(model: torch.nn.Module, name: str, t: torch.Tensor) -> None:
    mod_name, _, attr = name.rpartition(".")
    mod = model.get_submodule(mod_name) if mod_name else model
    cur = getattr(mod, attr)
    if isinstance(cur, torch.nn.Parameter):
        cur.data.copy_(t.to(cur.dtype))
    else:
        setattr(mod, attr, t.to(cur.dtype).clone())


def _offsets(p: Path, d2t: torch.Tensor, vd: int, vt: int) -> torch.Tensor:
    if d2t.dim() != 1 or d2t.shape[0] != vd or d2t.is_floating_point() or d2t.dtype == torch.bool:
        raise InputError(p, f"'d2t' must be an integer vector of {vd} offsets, got {d2t.dtype} {list(d2t.shape)}")
    off = d2t.long()
    ids = torch.arange(vd) + off
    if ids.min() < 0 or ids.max() >= vt:
        hint = (" -- it looks like absolute target ids; d2t holds offsets, target id = i + d2t[i] (verl-SpeCo PR #67)"
                if bool((off >= 0).all()) and int(off.max()) < vt else "")
        raise InputError(p, f"'d2t' maps draft ids outside the target vocabulary 0..{vt - 1}{hint}")
    if len(torch.unique(ids)) != vd:
        raise InputError(p, "'d2t' maps two draft ids to the same target id")
    return off
