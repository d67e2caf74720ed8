"""Readers for tensor files other tools write, presented as dumps.

A registry as data: each entry names a format, says how to recognise a file (cheaply,
from its name and first bytes) and how to open it as a :class:`~consistency.dump.reader.Dump`.
``consistency.dump.sets.open_side`` consults it before falling back to the dump reader,
so every command that takes a dump takes these files too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from consistency.dump.reader import Dump


@dataclass(frozen=True)
class Format:
    name: str
    description: str
    source: str  # the upstream writer this reader follows
    sniff: Callable[[Path, bytes], bool]
    open: Callable[[Path, Sequence[int] | None, str | None], Dump]


def _speculators() -> Format:
    from consistency.dump.formats import speculators as m

    return Format(m.NAME, "speculators offline data: hs_{i}.safetensors {hidden_states [T, n, H], token_ids [T]}",
                  "vllm example_hidden_states_connector.py (save_file); speculators train/data.py (reader)",
                  m.sniff, m.open_file)


def _specforge() -> Format:
    from consistency.dump.formats import specforge as m

    return Format(m.NAME, "SpecForge offline data: data_{i}.ckpt[.gz] {aux_hidden_state, hidden_state, input_ids, "
                  "loss_mask} (torch.save; loaded weights_only)",
                  "SpecForge scripts/prepare_hidden_states.py (_save_tensor)", m.sniff, m.open_file)


REGISTRY: tuple[Callable[[], Format], ...] = (_speculators, _specforge)


def detect(path: Path) -> Format | None:
    """The foreign format of ``path``, or None for a dump (or anything else)."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(16)
    except OSError:
        return None
    for make in REGISTRY:
        fmt = make()
        if fmt.sniff(path, head):
            return fmt
    return None


def formats() -> list[Format]:
    return [make() for make in REGISTRY]
