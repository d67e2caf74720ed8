"""Reading config files safely, and the target model's config.

Config files come from anywhere (a hub download, a colleague's edit), so every read is
bounded and every field is type-checked before a rule sees it: a malformed file ends the
run with one ``path: problem`` line rather than a traceback or a silently skipped rule.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from consistency.errors import InputError

MAX_CONFIG_BYTES = 16 * 1024 * 1024
MAX_IDS = 1024  # aux layer ids in one list: a model has fewer layers (lint was quadratic in them)
MOE_KEYS = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts", "num_experts_per_tok")


def read_json(path: Path, what: str = "config") -> dict[str, Any]:
    """A JSON object from ``path`` (bounded size and nesting), or InputError naming the file."""
    from consistency.contract.io import read_config_json

    if not path.exists() and not path.is_symlink():
        raise InputError(path, f"no such {what} file")
    _refuse_non_json(path, what)
    return read_config_json(path, MAX_CONFIG_BYTES, what)


def _refuse_non_json(path: Path, what: str) -> None:
    """A file that is plainly not JSON (an .npy, a GGUF, a pickle, a checkpoint) is named for what
    its first bytes say it is, not reported as "not UTF-8 text (byte 0)". Only regular files are
    peeked at (a FIFO is refused by the bounded reader, never opened here)."""
    from consistency.dump.sniff import content_kind, looks_like

    if not path.is_file():
        return
    try:
        with open(path, "rb") as fh:
            head = fh.read(16)
    except OSError:
        return  # the bounded reader says why
    body = head.removeprefix(b"\xef\xbb\xbf").lstrip()
    if body[:1] in (b"{", b"["):
        return  # JSON-shaped: the parser decides
    kind = "a safetensors file (tensors, not a config)" if content_kind(head) == "safetensors" else looks_like(head)
    if kind.startswith("text") and head:
        return  # text: the parser's message says where it breaks
    whose = "draft" if "draft" in what else "model"
    raise InputError(path, f"is {kind}, not a JSON {what} (give the {whose}'s directory or its config.json)")


def config_file(path: Path, what: str) -> Path:
    """``DIR`` -> ``DIR/config.json``; a file is taken as it is."""
    if path.is_dir():
        cfg = path / "config.json"
        if not cfg.is_file():
            raise InputError(path, f"directory has no config.json ({what})")
        return cfg
    return path


def dig(obj: dict[str, Any] | None, dotted: str) -> Any:
    """``dig(cfg, "eagle_config.eagle_aux_hidden_state_layer_ids")`` -> value or None."""
    cur: Any = obj
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return None
        cur = cur[part]
    return cur


def has(obj: dict[str, Any] | None, dotted: str) -> bool:
    cur: Any = obj
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return False
        cur = cur[part]
    return True


def ids_at(obj: dict[str, Any] | None, dotted: str, path: Path | None) -> list[int] | None:
    """An id list (None when absent or null; InputError when it is not a list of integers)."""
    v = dig(obj, dotted)
    if v is None:
        return None
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        raise InputError(path, f"{dotted} must be a list of integers, got {json.dumps(v)[:80]}")
    if len(v) > MAX_IDS:  # no model has that many layers; every rule over the ids stays cheap
        raise InputError(path, f"{dotted} lists {len(v)} ids; at most {MAX_IDS} (a layer id per layer at most)")
    return list(v)


def int_at(obj: dict[str, Any] | None, dotted: str, path: Path | None) -> int | None:
    v = dig(obj, dotted)
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise InputError(path, f"{dotted} must be a non-negative integer, got {json.dumps(v)[:80]}")
    return v


def bool_at(obj: dict[str, Any] | None, dotted: str, path: Path | None) -> bool | None:
    v = dig(obj, dotted)
    if v is None:
        return None
    if not isinstance(v, bool):
        raise InputError(path, f"{dotted} must be true or false, got {json.dumps(v)[:80]}")
    return v


def str_at(obj: dict[str, Any] | None, dotted: str) -> str | None:
    v = dig(obj, dotted)
    return v if isinstance(v, str) else None


def dtype_of(cfg: dict[str, Any] | None) -> str | None:
    """``torch_dtype`` (transformers 4) or ``dtype`` (transformers 5), canonical name."""
    from consistency.dump.dtypes import lookup

    for key in ("torch_dtype", "dtype"):
        v = str_at(cfg, key)
        if v and v != "auto":
            try:
                return lookup(v).name
            except KeyError:
                return v
    return None


@dataclass
class TargetInfo:
    """What a rule needs to know about the target (verifier) model."""

    path: Path | None
    architecture: str | None = None
    architectures: list[str] = field(default_factory=list)
    model_type: str | None = None
    num_layers: int | None = None
    hidden_size: int | None = None
    vocab_size: int | None = None
    dtype: str | None = None
    is_moe: bool | None = None
    source: str = "target config"
    config: dict[str, Any] = field(default_factory=dict, repr=False)  # the raw config (MTP layer counts)

    @property
    def keys(self) -> list[str]:
        """Names a per-architecture rule may be registered under (architectures, model types)."""
        return [k for k in (*self.architectures, self.model_type) if k]


def read_target(path: Path) -> TargetInfo:
    cfg_path = config_file(path, "target")
    cfg = read_json(cfg_path, "target config")
    return target_from_config(cfg, cfg_path)


def target_from_config(cfg: dict[str, Any], cfg_path: Path | None, source: str = "target config") -> TargetInfo:
    """Multimodal targets (Kimi-K2.5, Qwen-VL) keep the language model in ``text_config``."""
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else None
    archs = [a for a in (cfg.get("architectures") or []) if isinstance(a, str)]
    if text:
        archs += [a for a in (text.get("architectures") or []) if isinstance(a, str) and a not in archs]

    def pick(key: str) -> int | None:
        v = int_at(cfg, key, cfg_path)
        return v if v is not None else int_at(text, key, cfg_path)

    moe = any(dig(cfg, k) or dig(text, k) for k in MOE_KEYS)
    return TargetInfo(
        path=cfg_path, architecture=archs[0] if archs else None, architectures=archs,
        model_type=str_at(text, "model_type") or str_at(cfg, "model_type"),
        num_layers=pick("num_hidden_layers") or pick("n_layer") or pick("num_layers"),
        hidden_size=pick("hidden_size") or pick("n_embd"), vocab_size=pick("vocab_size"),
        dtype=dtype_of(cfg) or dtype_of(text), is_moe=moe, source=source, config=cfg,
    )
