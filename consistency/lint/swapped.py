"""Recognise a draft given as ``--target`` and a target given as ``--draft``.

Swapped inputs would lint "successfully" and say nothing true: a draft config has one
decoder layer and no id lists of a target, a target config has none of the EAGLE-3 fields
(``eagle_config``, ``speculators_config``, an ``*Eagle3*`` architecture) and its checkpoint
has no ``fc.weight``. One line says which it is, before any rule runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from consistency.errors import UsageError
from consistency.lint.configs import config_file, read_json
from consistency.lint.draft import DraftInfo, detect_format
from consistency.lint.kind import draft_kind

_HINT = "did you swap --draft and --target?"


def _draft_markers(cfg: dict[str, Any]) -> list[str]:
    marks = [k for k in ("eagle_config", "speculators_config", "speculators_model_type", "transformer_layer_config",
                         "eagle_aux_hidden_state_layer_ids", "draft_vocab_size", "target_hidden_size") if k in cfg]
    archs = [a for a in (cfg.get("architectures") or []) if isinstance(a, str) and "eagle" in a.lower()]
    return marks + [f"architecture {a}" for a in archs]


def swapped_target(path: Path, given: str) -> None:
    """``--target`` that is an EAGLE-3 draft config: UsageError naming the draft fields it has."""
    cfg_path = config_file(path, "target") if path.exists() else path
    cfg = read_json(cfg_path, "target config")
    marks = _draft_markers(cfg)
    if marks and detect_format(cfg) != "unknown":
        raise UsageError(f"--target {given} is an EAGLE-3 draft config ({', '.join(marks[:3])}), not a target "
                         f"model: {_HINT}")


def swapped_draft(d: DraftInfo, given: str) -> None:
    """``--draft`` that is a target model: no EAGLE-3 field, several decoder layers, no fc weight."""
    if d.format != "unknown" or not d.config or draft_kind(d).kind is not None:
        return  # a draft whose files say what it is (an exported NextN/MTP head keeps the target's layer count)
    layers = d.config.get("num_hidden_layers")
    text = d.config.get("text_config")
    if not isinstance(layers, int) and isinstance(text, dict):
        layers = text.get("num_hidden_layers")
    has_fc = d.checkpoint is not None and d.checkpoint.find("fc.weight") is not None
    if isinstance(layers, int) and not isinstance(layers, bool) and layers > 1 and not has_fc:
        arch = next(iter(d.architectures), "a model")
        raise UsageError(f"--draft {given} looks like a target model ({arch}, {layers} decoder layers, no eagle_config "
                         f"and no fc weight), not an EAGLE-3 draft (one layer plus fc): {_HINT}")


def dump_kind(path: Path) -> str | None:
    """What ``path`` is when it is recorded tensors rather than a model: our dump (.safetensors
    with dump metadata, .npz), a rank-set directory, or a speculators/SpecForge training file.
    Only headers are read (the same sniffers ``compare`` uses); None for anything else."""
    from consistency.dump import formats
    from consistency.dump.reader import META_KEY
    from consistency.dump.safetensors_io import read_header
    from consistency.errors import InputError

    if path.is_dir():
        if (path / "config.json").exists():
            return None
        for make in formats.REGISTRY:  # a stock dump directory (SGLang, Megatron, vLLM)
            fmt = make()
            if fmt.sniff_dir is not None and fmt.sniff_dir(path):
                return f"a directory of recorded tensors ({fmt.name}: {fmt.description.split(':')[0]})"
        inner = sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".npz"))[:4]
        kinds = [k for p in inner if (k := dump_kind(p))]
        return f"a directory of recorded tensors ({kinds[0]}: {inner[0].name})" if kinds else None
    if not path.is_file():
        return None
    try:
        head = formats.checked_head(path)
    except InputError:
        return None
    if head is None:
        return None
    for make in formats.REGISTRY:
        fmt = make()
        if fmt.sniff is not None and fmt.sniff(path, head):
            return f"{fmt.name} training data ({fmt.description.split(':')[0]})"
    kind = formats.content_kind(head)
    if kind == "zip" and path.suffix == ".npz":
        return "a consistency dump (.npz of recorded tensors)"
    if kind == "safetensors":
        try:
            meta = read_header(path).metadata
        except InputError:
            return None
        if META_KEY in meta:
            return "a consistency dump (recorded hidden states)"
    return None


def refuse_dump(path: Path, flag: str) -> None:
    """A dump given where a model belongs: exit 2 naming what the file is and where it goes."""
    from consistency.errors import InputError

    what = dump_kind(path)
    if what:
        want = "an EAGLE-3 draft (directory, config.json or checkpoint)" if flag == "--draft" else \
            "a target model config (directory or config.json)"
        raise InputError(path, f"{flag} is {what}, not {want}: give it to `consistency compare`, or to lint "
                               "--trained-with as the training side")


BUILTIN_TARGETS = Path(__file__).resolve().parents[1] / "record" / "configs"  # package data, read as files
BUILTIN_DRAFTS = Path(__file__).resolve().parents[1] / "replay" / "assets"


def builtin(spec: str, flag: str) -> Path | None:
    """A built-in model name (``tiny-llama``) for --target, or draft name (``tiny-llama-eagle3``) for
    --draft, as ``replay`` and ``gate`` accept them; None when ``spec`` is a path or no such name."""
    if Path(spec).exists() or "/" in spec or spec.startswith("."):
        return None
    p = BUILTIN_TARGETS / f"{spec}.json" if flag == "--target" else BUILTIN_DRAFTS / spec
    return p if p.exists() and p.name not in ("__init__.py", "__pycache__") else None
