"""What an EAGLE-3 draft checkpoint says about itself, in one layout-free record.

Two families of ``config.json`` describe the same network:

* speculators (``Eagle3SpeculatorConfig``): the decoder shape sits in
  ``transformer_layer_config``; the flags ``norm_before_residual``, ``norm_before_fc``,
  ``fc_norm``, ``norm_output`` and the aux ids (vLLM meaning: stream j) are top-level
  (speculators ``models/eagle3/config.py``).
* SGLang / SpecForge / ModelOpt (``LlamaForCausalLMEagle3`` and friends): a flat HF config;
  ``norm_before_fc`` may be nested under ``eagle_config`` (nested wins, SGLang 0.5.17+ and vLLM
  ``llama_eagle3.py``), ``fc_norm`` may be spelled ``use_aux_norm``, aux ids live in
  ``eagle_config.eagle_aux_hidden_state_layer_ids`` (layer outputs: stream j+1).

Parsing happens here, without torch, so that the report can describe a draft cheaply; the
tensor shapes settle what the config leaves open (number of aux slots, vocabularies).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from consistency.errors import InputError

MAX_CONFIG_BYTES = 4 * 1024 * 1024
SPECULATORS = "speculators"
SGLANG = "sglang"
FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")


@dataclass
class DraftConfig:
    """The draft's shape and flags; every field has the meaning of speculators' forward."""

    layout: str  # "speculators" or "sglang" (SGLang, SpecForge, ModelOpt exports)
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    layer_config: dict[str, Any]  # HF decoder config dict (rope parameters live here)
    target_vocab_size: int | None
    draft_vocab_size: int | None
    target_hidden_size: int | None
    hidden_act: str = "silu"
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    aux_layer_ids: list[int] | None = None
    aux_ids_meaning: str | None = None  # "stream" (speculators/vLLM) or "layer output" (SGLang nested)
    speculative_tokens: int | None = None  # speculators' proposal_methods[0].speculative_tokens
    verifier: str | None = None
    notes: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        return {"layout": self.layout, "hidden_size": self.hidden_size, "target_hidden_size": self.target_hidden_size,
                "draft_vocab_size": self.draft_vocab_size, "target_vocab_size": self.target_vocab_size,
                **{f: getattr(self, f) for f in FLAGS}, "aux_layer_ids": self.aux_layer_ids,
                "aux_ids_meaning": self.aux_ids_meaning}


def read_json(path: Path) -> dict[str, Any]:
    from consistency.contract.io import read_config_json

    if not path.exists() and not path.is_symlink():
        raise InputError(path, "no such file")
    return read_config_json(path, MAX_CONFIG_BYTES, "config")


def detect_layout(cfg: Mapping[str, Any]) -> str:
    if "speculators_model_type" in cfg or "transformer_layer_config" in cfg or "speculators_config" in cfg:
        return SPECULATORS
    return SGLANG


def _int(path: Path, d: Mapping[str, Any], key: str, default: int | None = None) -> int:
    v = d.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        if v is None:
            raise InputError(path, f"config has no {key!r}")
        raise InputError(path, f"config {key!r} must be a positive integer, got {v!r}")
    return v


def _opt_int(path: Path, d: Mapping[str, Any], key: str) -> int | None:
    return None if d.get(key) is None else _int(path, d, key)


def _flag(path: Path, v: Any, key: str) -> bool:
    if v is None:
        return False
    if not isinstance(v, bool):
        raise InputError(path, f"config {key!r} must be true or false, got {v!r}")
    return v


def _ids(path: Path, v: Any) -> list[int] | None:
    if v is None:
        return None
    if not isinstance(v, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in v):
        raise InputError(path, f"aux layer ids must be a list of integers, got {v!r}")
    return list(v)


def parse(path: Path, cfg: Mapping[str, Any], overrides: Mapping[str, bool] | None = None) -> DraftConfig:
    """A :class:`DraftConfig` from either layout; ``overrides`` force flags (``--set``)."""
    layout = detect_layout(cfg)
    if layout == SPECULATORS:
        tl = cfg.get("transformer_layer_config")
        if not isinstance(tl, dict):
            raise InputError(path, "speculators config without a transformer_layer_config object")
        shape_src: Mapping[str, Any] = tl
        flags = {f: _flag(path, cfg.get(f), f) for f in FLAGS}
        ids, meaning = _ids(path, cfg.get("eagle_aux_hidden_state_layer_ids")), "stream"
        spec = cfg.get("speculators_config") if isinstance(cfg.get("speculators_config"), dict) else {}
        methods = spec.get("proposal_methods") if isinstance(spec.get("proposal_methods"), list) else []
        k = methods[0].get("speculative_tokens") if methods and isinstance(methods[0], dict) else None
        ver = spec.get("verifier") if isinstance(spec.get("verifier"), dict) else {}
        verifier = ver.get("name_or_path")
        draft_vocab = _opt_int(path, cfg, "draft_vocab_size")
        target_hidden = _opt_int(path, cfg, "target_hidden_size")
        notes = []
        if "norm_before_residual" not in cfg:
            notes.append("config omits norm_before_residual: speculators reads False, vLLM's loader True "
                         "(vllm transformers_utils/configs/speculators/algos.py)")
    else:
        shape_src = cfg
        eagle = cfg.get("eagle_config") if isinstance(cfg.get("eagle_config"), dict) else {}
        nbfc = eagle.get("norm_before_fc", cfg.get("norm_before_fc"))
        fcn = cfg.get("fc_norm", cfg.get("use_aux_norm"))
        flags = {"norm_before_residual": _flag(path, cfg.get("norm_before_residual"), "norm_before_residual"),
                 "norm_before_fc": _flag(path, nbfc, "norm_before_fc"), "fc_norm": _flag(path, fcn, "fc_norm"),
                 "norm_output": _flag(path, cfg.get("norm_output"), "norm_output")}
        nested = _ids(path, eagle.get("eagle_aux_hidden_state_layer_ids"))
        top = _ids(path, cfg.get("eagle_aux_hidden_state_layer_ids"))
        ids, meaning = (nested, "layer output") if nested is not None else (top, "stream" if top is not None else None)
        k, verifier = None, None
        draft_vocab = _opt_int(path, cfg, "draft_vocab_size")
        target_hidden = _opt_int(path, cfg, "target_hidden_size")
        notes = []
        if flags["norm_before_residual"]:
            notes.append("norm_before_residual is set; SGLang does not read it (sglang llama_eagle3.py), vLLM does")
        if "norm_output" in cfg:
            notes.append("norm_output follows SGLang/speculators (true: the next step gets the post-norm state); "
                         "SpecForge before PR #879 gave it another meaning")
    for key, value in (overrides or {}).items():
        if key not in FLAGS:
            raise InputError(path, f"unknown flag {key!r}; settable: {', '.join(FLAGS)}")
        flags[key] = bool(value)
    if flags["norm_before_fc"] and flags["fc_norm"]:
        raise InputError(path, "norm_before_fc and fc_norm are mutually exclusive (speculators config validator)")
    hidden = _int(path, shape_src, "hidden_size")
    heads = _int(path, shape_src, "num_attention_heads")
    kv = _int(path, shape_src, "num_key_value_heads", heads)
    head_dim = _int(path, shape_src, "head_dim") if shape_src.get("head_dim") is not None else hidden // heads
    eps = shape_src.get("rms_norm_eps", 1e-6)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1:
        raise InputError(path, f"config 'rms_norm_eps' must be a small positive number, got {eps!r}")
    if heads % kv:
        raise InputError(path, f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}")
    return DraftConfig(
        layout=layout, hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv,
        head_dim=int(head_dim), intermediate_size=_int(path, shape_src, "intermediate_size"),
        rms_norm_eps=float(eps), layer_config=dict(shape_src),
        target_vocab_size=_opt_int(path, shape_src, "vocab_size"), draft_vocab_size=draft_vocab,
        target_hidden_size=target_hidden, hidden_act=str(shape_src.get("hidden_act", "silu")),
        aux_layer_ids=ids, aux_ids_meaning=meaning if ids is not None else None,
        speculative_tokens=k if isinstance(k, int) and k > 0 else None,
        verifier=verifier if isinstance(verifier, str) else None, notes=notes, **flags)


def find_config(draft: Path) -> tuple[Path, Path]:
    """(directory, config.json) of a draft given as a directory or as a weights file."""
    d = draft if draft.is_dir() else draft.parent
    cfg = d / "config.json"
    if not draft.exists():
        raise InputError(draft, "no such draft checkpoint (a directory with config.json and *.safetensors)")
    if not cfg.is_file():
        raise InputError(draft, "no config.json beside the draft weights")
    return d, cfg
