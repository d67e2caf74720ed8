"""What a gate config needs installed, read the way the gate reads it.

The GitHub Action installs torch only when a check needs it (lint and compare do not; a
CUDA build is gigabytes). It used to decide with a regex over the config text, which
``[["replay"]]`` (valid TOML for ``[[replay]]``) slipped past: torch was not installed and
the replay was skipped. The decision is now made from the config as
:func:`consistency.gate.config.load` parses and validates it — the same TOML loader and
the same model the gate runs — by ``consistency gate --plan`` in the job's environment.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from consistency.errors import COMMAND_EXTRAS, EXTRAS
from consistency.gate.config import Check, GateConfig

# what each kind of check imports beyond the core install (replay runs the draft in torch)
NEEDS: dict[str, tuple[str, ...]] = {"lint": (), "compare": (), "replay": ("torch", "transformers")}


def needs(check: Check) -> list[str]:
    return list(NEEDS[check.kind])


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def plan(cfg: GateConfig) -> dict[str, Any]:
    """Per check its needs; overall the modules, the pip extras and what is missing here."""
    checks = [{"kind": c.kind, "name": c.name, "optional": c.options.get("optional") is True, "needs": needs(c)}
              for c in cfg.checks]
    mods = sorted({m for c in checks for m in c["needs"]})
    extras = sorted({COMMAND_EXTRAS.get(c["kind"], EXTRAS.get(m, m)) for c in checks for m in c["needs"]})
    return {"tool": "consistency", "kind": "gate-plan", "config": str(cfg.path), "checks": checks, "needs": mods,
            "extras": extras, "torch": "torch" in mods, "missing": [m for m in mods if not _installed(m)]}
