"""A DeepSeek-V3 style MTP (NextN) module: its forward, and its weights read from a checkpoint.

The forward is the one every runtime serves (conventions-beyond-eagle3.md section 2.1):
``h' = eh_proj(cat(enorm(emb(x[t+1])), hnorm(h[t])))`` (MiMo: ``[hidden, embed]``), one
decoder block of the target's own family, then ``shared_head.norm`` and the shared lm_head.
Sources: vllm ``vllm/model_executor/models/deepseek_mtp.py`` (03356f8,
``DeepSeekMultiTokenPredictorLayer.forward``), sglang ``python/sglang/srt/models/deepseek_nextn.py``
(c28bdc9), speculators ``models/mtp/model_definitions.py`` (``MTPLayerMixin``).

The block is the target family's decoder layer class from transformers, built from the
target's config at layer index N (= ``num_hidden_layers``), so a DeepSeek-V3 MTP block gets
MLA attention and, past ``first_k_dense_replace``, the MoE MLP, exactly as the checkpoint
was trained. transformers' DeepSeek-V3 model skips ``model.layers.{N}.*`` when it loads, so
this module reads those tensors itself, from safetensors only (never a pickle).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from consistency.contract.models import ConcatOrder, Consumer, ConsumerSpec, Pos0, Recycle
from consistency.errors import InputError
from consistency.replay.steps import ATTENTION, EmbeddingDims, KVCache, StepsOutput, StepTensors, run_steps

__all__ = ["MTPDraft", "LoadedMTP", "load_mtp", "run_steps", "StepsOutput", "LAYOUTS"]


@dataclass(frozen=True)
class Layout:
    """Where a checkpoint keeps the MTP module, and what its parts are called there."""

    name: str
    prefix: str  # '{N}' is the MTP layer index
    parts: tuple[tuple[str, str], ...]  # checkpoint name (after prefix) -> ours
    block: str  # prefix of the decoder block's tensors after ``prefix`` ("" = everything else)
    outer: tuple[tuple[str, str], ...] = ()  # full checkpoint names outside the prefix -> ours
    concat: ConcatOrder = ConcatOrder.embed_hidden
    source: str = ""


LAYOUTS: tuple[Layout, ...] = (
    Layout("deepseek", "model.layers.{N}.",
           (("enorm.", "enorm."), ("hnorm.", "hnorm."), ("eh_proj.", "eh_proj."),
            ("shared_head.norm.", "shared_head.norm."), ("shared_head.head.", "shared_head.head."),
            ("embed_tokens.", "embed_tokens.")), "",
           source="deepseek-ai/DeepSeek-V3 README_WEIGHTS.md; vllm deepseek_mtp.py _rewrite_spec_layer_name"),
    Layout("qwen3-next", "mtp.",
           (("pre_fc_norm_embedding.", "enorm."), ("pre_fc_norm_hidden.", "hnorm."), ("fc.", "eh_proj."),
            ("norm.", "shared_head.norm.")),
           "layers.0.", source="vllm qwen3_next_mtp.py; sglang qwen3_next_mtp.py"),
    Layout("speculators", "mtp_layers.0.",
           (("token_layernorm.", "enorm."), ("hidden_layernorm.", "hnorm."), ("input_proj.", "eh_proj."),
            ("final_layernorm.", "shared_head.norm.")), "",
           outer=(("embed_tokens.weight", "embed_tokens.weight"), ("lm_head.weight", "shared_head.head.weight")),
           source="speculators models/mtp/model_definitions.py MTPLayerMixin"),
    Layout("mimo", "model.mtp_layers.{M}.",
           (("token_layernorm.", "enorm."), ("hidden_layernorm.", "hnorm."), ("input_proj.", "eh_proj."),
            ("final_layernorm.", "shared_head.norm.")), "", concat=ConcatOrder.hidden_embed,
           source="sglang mimo_mtp.py; vllm mimo_mtp.py (input_proj(cat(hidden, embed)))"),
)


def _family(target: Any) -> tuple[type, type, type]:
    """(decoder layer class, RMSNorm class, rotary class) of a loaded transformers target."""
    base = getattr(target, "base_model", target)
    try:
        return type(base.layers[0]), type(base.norm), type(base.rotary_emb)
    except (AttributeError, IndexError, TypeError):
        raise InputError(None, f"the target {type(target).__name__} has no layers/norm/rotary_emb to build an MTP "
                               "block from (a transformers decoder-only model is needed)") from None


def block_config(config: Any, layer_idx: int) -> Any:
    """The target's config, eager attention in query blocks (exact masks), long enough to
    hold layer N."""
    cfg = copy.deepcopy(getattr(config, "text_config", None) or config)
    cfg._attn_implementation = ATTENTION
    types = getattr(cfg, "layer_types", None)
    if isinstance(types, list) and len(types) <= layer_idx:
        cfg.layer_types = types + ["full_attention"] * (layer_idx + 1 - len(types))  # MTP blocks attend fully
    if getattr(cfg, "num_hidden_layers", 0) <= layer_idx:
        cfg.num_hidden_layers = layer_idx + 1
    return cfg


class MTPDraft(EmbeddingDims, nn.Module):
    """Parameter names are DeepSeek-V3's inside ``model.layers.{N}.`` (``block.`` = the decoder layer)."""

    def __init__(self, config: Any, layer_cls: type, norm_cls: type, rotary_cls: type, layer_idx: int,
                 concat: ConcatOrder = ConcatOrder.embed_hidden, pos0: Pos0 = Pos0.kept) -> None:
        super().__init__()
        cfg = block_config(config, layer_idx)
        h, eps, v = cfg.hidden_size, cfg.rms_norm_eps, cfg.vocab_size
        self.config, self.layer_idx, self.concat, self.pos0 = cfg, layer_idx, ConcatOrder(concat), Pos0(pos0)
        self.enorm, self.hnorm = norm_cls(h, eps=eps), norm_cls(h, eps=eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.block = layer_cls(cfg, layer_idx)
        self.shared_head = nn.Module()
        self.shared_head.norm = norm_cls(h, eps=eps)
        self.shared_head.head = nn.Linear(h, v, bias=False)
        self.embed_tokens = nn.Embedding(v, h)
        self.rotary = rotary_cls(config=cfg)

    def step(self, hidden: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
             cache: KVCache, at0: torch.Tensor) -> StepTensors:
        emb = self.embed_tokens(ids)
        if self.pos0 == Pos0.zeroed:  # vllm deepseek_mtp.py: inputs_embeds[positions == 0] = 0
            emb = emb.masked_fill(at0[..., None], 0.0)
        e, h = self.enorm(emb), self.hnorm(hidden)
        cat = torch.cat([e, h] if self.concat == ConcatOrder.embed_hidden else [h, e], dim=-1)
        x = self.eh_proj(cat)
        out = self.block(x, attention_mask=mask, position_ids=positions, past_key_values=cache,
                         position_embeddings=self.rotary(x, positions))
        out = out[0] if isinstance(out, tuple) else out  # layers of older transformers return tuples
        norm = self.shared_head.norm(out)
        return StepTensors(emb[0], cat[0], out[0], norm[0], self.shared_head.head(norm)[0])


@dataclass
class LoadedMTP:
    model: MTPDraft
    path: Path
    layout: str
    spec: ConsumerSpec
    sources: dict[str, str]
    notes: list[str] = field(default_factory=list)


def weight_files(d: Path, wanted: str | None = None) -> list[Path]:
    """The safetensors files of a checkpoint directory; with an index, only the shards that
    hold a tensor starting with ``wanted`` (a DeepSeek-V3 checkpoint is 163 shards)."""
    from consistency.replay.config import read_json

    index = d / "model.safetensors.index.json"
    if index.is_file():
        wmap = read_json(index).get("weight_map")
        if not isinstance(wmap, dict):
            raise InputError(index, "has no weight_map object")
        files = sorted({str(f) for k, f in wmap.items() if wanted is None or str(k).startswith(wanted)})
        bad = [f for f in files if "/" in f or "\\" in f or f.startswith(".")]
        if bad:
            raise InputError(index, f"weight_map names a file outside the directory: {bad[0]!r}")
        return [d / f for f in files]
    st = sorted(p for p in d.glob("*.safetensors") if p.is_file())
    if not st:
        raise InputError(d, "no *.safetensors in the checkpoint directory (MTP weights are read from safetensors only)")
    return st


def check_files(d: Path) -> None:
    """Every weights file's safetensors header parses: a corrupt shard is named here, before
    transformers loads the target from the same directory and reports it less precisely."""
    from safetensors import SafetensorError, safe_open

    for f in weight_files(d):
        try:
            with safe_open(str(f), framework="pt", device="cpu"):
                pass
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise InputError(f, f"cannot read safetensors ({' '.join(str(exc).split())})") from None


def read_prefixed(files: list[Path], prefixes: tuple[str, ...], exact: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """Only the tensors whose names start with one of ``prefixes`` (or equal one of ``exact``)."""
    from safetensors import SafetensorError, safe_open

    out: dict[str, torch.Tensor] = {}
    for f in files:
        if not f.is_file():
            raise InputError(f, "no such weights file (named by model.safetensors.index.json)")
        try:
            with safe_open(str(f), framework="pt", device="cpu") as sf:
                for k in sf.keys():
                    if k.startswith(prefixes) or k in exact:
                        out[k] = sf.get_tensor(k)
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise InputError(f, f"cannot read safetensors ({' '.join(str(exc).split())})") from None
    return out


def _mtp_index(path: Path, cfg: dict[str, Any]) -> int:
    n = cfg.get("num_hidden_layers")
    k = cfg.get("num_nextn_predict_layers", cfg.get("mtp_num_hidden_layers"))
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise InputError(path, f"config num_nextn_predict_layers is {k!r}: the checkpoint declares no MTP layer")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise InputError(path, "config has no positive num_hidden_layers "
                               "(the MTP layer is model.layers.{num_hidden_layers})")
    return n


def load_mtp(path: str | Path, target: Any, layer: int = 0, pos0: Pos0 = Pos0.kept,
             spec: ConsumerSpec | None = None) -> LoadedMTP:
    """The MTP module ``layer`` (0 = the first) of a checkpoint directory, on ``target``'s family.

    Layouts (``LAYOUTS``): DeepSeek-V3 / GLM ``model.layers.{N}.*``, Qwen3-Next ``mtp.*``,
    speculators ``mtp_layers.0.*``, MiMo ``model.mtp_layers.{i}.*``. The embedding and the
    head come from the checkpoint's MTP layer when it carries them, else from the target
    (DeepSeek-V3 README_WEIGHTS.md: both are shared with the main model). ``spec`` (a
    contract's ``ConsumerSpec``) overrides the layout's concat order, the position-0 rule and
    the recycle, e.g. to run a checkpoint the way a given runtime serves it."""
    from consistency.replay.config import find_config, read_json

    p = Path(path)
    d, cfg_path = find_config(p)
    cfg = read_json(cfg_path)
    layer_cls, norm_cls, rotary_cls = _family(target)
    tcfg = getattr(target.config, "text_config", None) or target.config
    if cfg.get("speculators_model_type") == "mtp":
        n = int(getattr(tcfg, "num_hidden_layers"))
        layouts = [lo for lo in LAYOUTS if lo.name == "speculators"]
    else:
        n = _mtp_index(cfg_path, cfg) + layer
        layouts = [lo for lo in LAYOUTS if lo.name != "speculators"]
    prefixes = tuple(lo.prefix.format(N=n, M=layer) for lo in layouts)
    outer = tuple(o for lo in layouts for o, _ in lo.outer)
    files = [p] if p.is_file() else weight_files(d, None if len(prefixes) > 1 else prefixes[0])
    raw = read_prefixed(files, prefixes, outer)
    found = [(lo, pre) for lo, pre in zip(layouts, prefixes) if any(k.startswith(pre) for k in raw)]
    if not found:
        looked = ", ".join(pre + "*" for pre in prefixes)
        raise InputError(p, f"has no MTP layer: no tensor named {prefixes[0]}* (looked for {looked})")
    lo, pre = found[0]
    w, notes = _rename(lo, pre, raw)
    if spec is None:
        spec = ConsumerSpec(kind=Consumer.mtp, recycle=Recycle.d_norm, concat_order=lo.concat, pos0_embed=pos0,
                            source=lo.source)
    model = MTPDraft(tcfg, layer_cls, norm_cls, rotary_cls, n, spec.concat_order, spec.pos0_embed)
    sources = _fill(p, model, w, target, notes)
    model.eval()
    return LoadedMTP(model, p, lo.name, spec, sources, notes)


def _rename(lo: Layout, pre: str, raw: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[str]]:
    out: dict[str, torch.Tensor] = {}
    unknown: list[str] = []
    outer = dict(lo.outer)
    for k, t in raw.items():
        if k in outer:
            out[outer[k]] = t
            continue
        if not k.startswith(pre):
            continue
        rest = k[len(pre):]
        for theirs, ours in lo.parts:
            if rest.startswith(theirs):
                out[ours + rest[len(theirs):]] = t
                break
        else:
            if rest.startswith(lo.block):
                out["block." + rest[len(lo.block):]] = t
            else:
                unknown.append(k)
    shown = ", ".join(sorted(unknown)[:4])
    notes = [f"ignored {len(unknown)} tensors of the MTP layer the forward does not use: {shown}"] if unknown else []
    return out, notes


def _fill(p: Path, model: MTPDraft, w: dict[str, torch.Tensor], target: Any, notes: list[str]) -> dict[str, str]:
    """Copy the checkpoint's tensors into ``model``; borrow the embedding/head from the target."""
    expected = {k: v for k, v in model.state_dict().items() if not k.startswith("rotary.")}
    sources = {"embed_tokens": "draft", "lm_head": "draft"}
    borrowed = {"embed_tokens.weight": ("embed_tokens", target.get_input_embeddings()),
                "shared_head.head.weight": ("lm_head", target.get_output_embeddings())}
    for name, (label, mod) in borrowed.items():
        if name not in w:
            if mod is None:
                raise InputError(p, f"the MTP layer carries no {label} and the target has none to share")
            w[name] = mod.weight.detach()
            sources[label] = "target"
    missing = [k for k in expected if k not in w and not k.endswith("e_score_correction_bias")]
    if missing:
        raise InputError(p, f"the MTP layer lacks {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''} "
                            "(names as in DeepSeek-V3 README_WEIGHTS.md, inside model.layers.{N}.)")
    extra = [k for k in w if k not in expected]
    if extra:
        shown = ", ".join(sorted(extra)[:4])
        notes.append(f"ignored {len(extra)} tensors the MTP block of this config does not have: {shown}")
    with torch.no_grad():
        for name, ref in expected.items():
            if name not in w:
                continue
            t = w[name]
            if tuple(t.shape) != tuple(ref.shape):
                raise InputError(p, f"MTP tensor {name!r} has shape {list(t.shape)}, expected {list(ref.shape)}")
            if t.is_floating_point() and not torch.isfinite(t.float()).all():
                raise InputError(p, f"MTP tensor {name!r} holds NaN or Inf values")
            mod_name, _, attr = name.rpartition(".")
            cur = getattr(model.get_submodule(mod_name) if mod_name else model, attr)
            cur.data.copy_(t.to(cur.dtype))
    return sources
