"""Open one side of a comparison.

Today: one dump file. Formats other tools write (speculators ``hs_*.safetensors``,
SpecForge ``.ckpt``) and tensor-parallel rank sets are recognised here, so every command
that takes a dump takes them too. ``layer_ids``/``convention`` describe inputs whose files
do not record which streams they hold.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from consistency.dump.reader import Dump
from consistency.errors import InputError


def open_side(spec: str | Path, layer_ids: Sequence[int] | None = None, convention: str | None = None) -> Dump:
    p = Path(spec)
    if p.is_dir():
        raise InputError(p, "is a directory, expected a dump file (.safetensors or .npz)")
    return Dump(p)
