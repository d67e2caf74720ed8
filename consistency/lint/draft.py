"""Read an EAGLE-3 draft: its config (any format in use) and its checkpoint's headers.

Formats (docs/lint.md#draft-formats): SGLang/SpecForge ``LlamaForCausalLMEagle3`` (ids in
``eagle_config``, ``fc_norm``, ``norm_output``), speculators ``Eagle3SpeculatorConfig``
(top-level ids, ``norm_before_residual``, ``transformer_layer_config``,
``speculators_config.verifier``) and NVIDIA ModelOpt exports (SGLang layout plus ModelOpt's
``eagle_config`` keys). Tensors are known from safetensors headers only: a multi-GB
checkpoint costs a few kilobytes of reads. Only ``d2t``/``t2d`` values are ever read, and
only when they are small (:data:`MAX_MAP_ELEMENTS`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from consistency.dump.safetensors_io import read_header
from consistency.errors import InputError
from consistency.lint.configs import bool_at, config_file, dig, dtype_of, has, ids_at, int_at, read_json, str_at

MAX_MAP_ELEMENTS = 16 * 1024 * 1024  # d2t/t2d beyond this are not read (128 MiB of int64)
MODELOPT_KEYS = ("use_input_layernorm_in_first_layer", "use_last_layernorm", "use_mtp_layernorm",
                 "next_layer_regular", "parallel_draft_step")
NORM_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "use_aux_norm", "norm_output")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    file: Path


@dataclass
class Checkpoint:
    """Tensor names, dtypes and shapes of a draft checkpoint (one file or shards)."""

    files: list[Path]
    tensors: dict[str, TensorInfo]
    _cache: dict[str, np.ndarray] = field(default_factory=dict, repr=False)

    def find(self, name: str) -> TensorInfo | None:
        """SGLang loads ``name`` or ``model.{name}``; SpecForge's ``midlayer.`` is ``layers.0.``."""
        cands = [name, f"model.{name}"]
        if name.startswith("layers.0."):
            rest = name[len("layers.0."):]
            cands += [f"midlayer.{rest}", f"model.midlayer.{rest}"]
        for c in cands:
            if c in self.tensors:
                return self.tensors[c]
        return None

    def with_prefix(self, prefix: str) -> list[TensorInfo]:
        return [t for n, t in sorted(self.tensors.items()) if n.startswith(prefix) or n.startswith(f"model.{prefix}")]

    def float_dtypes(self) -> dict[str, int]:
        """Bytes per floating dtype: the draft's storage dtype is the one holding most bytes."""
        from consistency.dump import dtypes

        out: dict[str, int] = {}
        for t in self.tensors.values():
            if dtypes.is_float(t.dtype):
                n = 1
                for d in t.shape:
                    n *= d
                out[t.dtype] = out.get(t.dtype, 0) + n * dtypes.BY_NAME[t.dtype].bits // 8
        return out

    def read_small(self, name: str) -> np.ndarray | None:
        """Values of a small tensor (d2t, t2d), read through the bounded dump reader."""
        from consistency.dump.reader import open_dump

        t = self.find(name)
        if t is None:
            return None
        n = 1
        for d in t.shape:
            n *= d
        if n > MAX_MAP_ELEMENTS:
            return None
        if t.name not in self._cache:  # several rules look at d2t: read it once
            with open_dump(t.file) as d:
                self._cache[t.name] = d[t.name].read_all()
        return self._cache[t.name]


@dataclass
class DraftInfo:
    path: Path
    config_path: Path | None
    config: dict[str, Any] = field(default_factory=dict)
    format: str = "unknown"  # speculators, sglang (SGLang/SpecForge), modelopt, unknown
    architectures: list[str] = field(default_factory=list)
    hidden_size: int | None = None
    target_hidden_size: int | None = None
    vocab_size: int | None = None  # the target vocab the draft was built for
    draft_vocab_size: int | None = None
    ids_top: list[int] | None = None
    ids_nested: list[int] | None = None
    ids_layer_ids: list[int] | None = None
    use_aux_hidden_state: bool | None = None
    num_aux_hidden_states: int | None = None
    dtype: str | None = None
    layer_model_type: str | None = None  # speculators transformer_layer_config.model_type
    verifier: str | None = None
    verifier_architectures: list[str] = field(default_factory=list)
    speculative_tokens: int | None = None
    checkpoint: Checkpoint | None = None
    checkpoint_note: str | None = None  # why no checkpoint was read

    def flag(self, name: str) -> tuple[bool | None, str | None]:
        """(value, where) of a norm flag: top level first, then ``eagle_config``."""
        for key in (name, f"eagle_config.{name}"):
            v = bool_at(self.config, key, self.config_path)
            if v is not None:
                return v, key
        return None, None

    def ids(self, key: str) -> list[int] | None:
        return ids_at(self.config, key, self.config_path) if self.config else None

    @property
    def is_eagle3(self) -> bool | None:
        if self.format in ("speculators",):
            return str_at(self.config, "speculators_model_type") in ("eagle3", "peagle")
        if any("eagle3" in a.lower() for a in self.architectures):
            return True
        if self.ids_top is not None or self.ids_nested is not None:
            return True
        fc = self.checkpoint.find("fc.weight") if self.checkpoint else None
        if fc is not None and len(fc.shape) == 2 and self.hidden_size and fc.shape[1] >= 2 * self.hidden_size:
            return True
        return None


def detect_format(cfg: dict[str, Any]) -> str:
    if "speculators_config" in cfg or "speculators_model_type" in cfg or "transformer_layer_config" in cfg:
        return "speculators"
    ec = cfg.get("eagle_config")
    if isinstance(ec, dict) and any(k in ec for k in MODELOPT_KEYS):
        return "modelopt"
    archs = cfg.get("architectures") or []
    if any(isinstance(a, str) and "eagle" in a.lower() for a in archs) or isinstance(ec, dict):
        return "sglang"
    return "unknown"


def read_draft(path: Path) -> DraftInfo:
    """A draft directory, its config.json, or a bare .safetensors checkpoint."""
    if not path.exists():
        raise InputError(path, "no such draft directory or file")
    if path.is_file() and path.suffix == ".safetensors":
        ck = read_checkpoint([path], path)
        return DraftInfo(path=path, config_path=None, checkpoint=ck)
    cfg_path = config_file(path, "draft")
    cfg = read_json(cfg_path, "draft config")
    info = from_config(cfg, cfg_path, path)
    folder = path if path.is_dir() else (cfg_path.parent if cfg_path.name == "config.json" else None)
    if folder is None:
        info.checkpoint_note = "a bare config file was given (pass the draft directory to check its tensors)"
    else:
        info.checkpoint, info.checkpoint_note = find_checkpoint(folder)
    return info


def from_config(cfg: dict[str, Any], cfg_path: Path | None, path: Path) -> DraftInfo:
    fmt = detect_format(cfg)
    tlc = cfg.get("transformer_layer_config") if isinstance(cfg.get("transformer_layer_config"), dict) else None
    layer = tlc if fmt == "speculators" and tlc is not None else cfg
    info = DraftInfo(path=path, config_path=cfg_path, config=cfg, format=fmt)
    info.architectures = [a for a in (cfg.get("architectures") or []) if isinstance(a, str)]
    info.hidden_size = int_at(layer, "hidden_size", cfg_path)
    info.target_hidden_size = int_at(cfg, "target_hidden_size", cfg_path)
    info.vocab_size = int_at(layer, "vocab_size", cfg_path)
    info.draft_vocab_size = int_at(cfg, "draft_vocab_size", cfg_path)
    info.ids_top = ids_at(cfg, "eagle_aux_hidden_state_layer_ids", cfg_path)
    info.ids_nested = ids_at(cfg, "eagle_config.eagle_aux_hidden_state_layer_ids", cfg_path)
    info.ids_layer_ids = ids_at(cfg, "eagle_config.layer_ids", cfg_path)
    info.use_aux_hidden_state = bool_at(cfg, "eagle_config.use_aux_hidden_state", cfg_path)
    info.num_aux_hidden_states = int_at(cfg, "num_aux_hidden_states", cfg_path)
    info.dtype = dtype_of(cfg) or dtype_of(layer)
    info.layer_model_type = str_at(tlc, "model_type")
    info.verifier = str_at(cfg, "speculators_config.verifier.name_or_path")
    va = dig(cfg, "speculators_config.verifier.architectures")
    info.verifier_architectures = [a for a in va if isinstance(a, str)] if isinstance(va, list) else []
    methods = dig(cfg, "speculators_config.proposal_methods")
    if isinstance(methods, list) and methods and isinstance(methods[0], dict):
        st = methods[0].get("speculative_tokens")
        info.speculative_tokens = st if isinstance(st, int) and not isinstance(st, bool) else None
    for name in NORM_FLAGS:  # validate types early: a string "true" is a bug worth one line
        info.flag(name)
    if has(cfg, "embed_requires_grad"):
        bool_at(cfg, "embed_requires_grad", cfg_path)
    return info


def find_checkpoint(folder: Path) -> tuple[Checkpoint | None, str | None]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        wm = read_json(index, "safetensors index").get("weight_map")
        if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
            raise InputError(index, "weight_map must map tensor names to shard file names")
        shards = []
        for name in sorted(set(wm.values())):
            shard = (folder / name).resolve()
            if folder.resolve() not in shard.parents:
                raise InputError(index, f"shard {name!r} lies outside the checkpoint directory")
            shards.append(shard)
        ck = read_checkpoint(shards, index)
        missing = sorted(n for n, f in wm.items() if n not in ck.tensors)
        if missing:
            raise InputError(index, f"weight_map names {len(missing)} tensors the shards lack (first: {missing[0]!r})")
        return ck, None
    main = folder / "model.safetensors"
    files = [main] if main.is_file() else sorted(folder.glob("*.safetensors"))
    if files:
        return read_checkpoint(files, folder), None
    pickled = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
    if pickled:
        return None, f"only pickle-based weights ({pickled[0]}); they are never unpickled, so tensor rules cannot run"
    return None, "no *.safetensors file in the draft directory"


def read_checkpoint(files: list[Path], where: Path) -> Checkpoint:
    tensors: dict[str, TensorInfo] = {}
    for f in files:
        hdr = read_header(f)  # header only: the data region is never read here
        for name, e in hdr.entries.items():
            if name in tensors:
                raise InputError(where, f"tensor {name!r} appears in two shards ({tensors[name].file.name}, {f.name})")
            tensors[name] = TensorInfo(name, e.dtype, e.shape, f)
    return Checkpoint(files=list(files), tensors=tensors)
