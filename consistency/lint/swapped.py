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
    if d.format != "unknown" or not d.config:
        return
    layers = d.config.get("num_hidden_layers")
    text = d.config.get("text_config")
    if not isinstance(layers, int) and isinstance(text, dict):
        layers = text.get("num_hidden_layers")
    has_fc = d.checkpoint is not None and d.checkpoint.find("fc.weight") is not None
    if isinstance(layers, int) and not isinstance(layers, bool) and layers > 1 and not has_fc:
        arch = next(iter(d.architectures), "a model")
        raise UsageError(f"--draft {given} looks like a target model ({arch}, {layers} decoder layers, no eagle_config "
                         f"and no fc weight), not an EAGLE-3 draft (one layer plus fc): {_HINT}")
