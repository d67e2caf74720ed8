"""Built-in fixture drafts shipped with the package (no download, like the built-in targets).

``tiny-llama-eagle3``: an EAGLE-3 draft (speculators layout) for the built-in ``tiny-llama``
(seed 0), trained on aux streams [0, 3, 7] by ``fixtures/train_draft.py --target tiny-llama
--preset long`` (see docs/replay.md). Its ``config.json`` records the target's weight
fingerprint so a draft is never silently used with another target.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

BUILTIN = ("tiny-llama-eagle3",)


def builtin_dir(name: str) -> Path:
    return Path(str(resources.files("consistency.replay.assets").joinpath(name)))


def resolve_draft(spec: str) -> str:
    """A built-in draft name -> its directory; anything else is returned as given."""
    if spec in BUILTIN and not Path(spec).exists():
        return str(builtin_dir(spec))
    return spec
