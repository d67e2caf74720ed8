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
from consistency.errors import InputError


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


# first bytes -> what the content is; a name never overrides them
MAGIC: tuple[tuple[bytes, str], ...] = (
    (b"\x1f\x8b", "gzip"), (b"PK\x03\x04", "zip"), (b"PK\x05\x06", "zip"), (b"\x80", "pickle"),
    (b"BZh", "bzip2"), (b"\xfd7zXZ\x00", "xz"), (b"\x28\xb5\x2f\xfd", "zstd"),
)
# the content a name promises: a mismatch is refused before any loader sees the file
EXPECTED = {".safetensors": "safetensors", ".npz": "zip"}


MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit on the JSON header


def content_kind(head: bytes) -> str:
    """What the first bytes say the file is: gzip, zip, pickle, ..., safetensors, or unknown.

    The safetensors shape is tested first: its first 8 bytes are a little-endian header
    length, and one valid file in 32 has a length whose low byte is 0x80 (pickle's magic).
    No gzip, zip or pickle stream has '{' at byte 8 after a plausible length."""
    if len(head) >= 9 and head[8:9] == b"{" and 2 <= int.from_bytes(head[:8], "little") <= MAX_HEADER:
        return "safetensors"
    for magic, kind in MAGIC:
        if head.startswith(magic):
            return kind
    return "unknown"


def check_content(path: Path, head: bytes) -> None:
    """Refuse a file whose content contradicts its name (a gzip stream or a pickle named
    ``.safetensors``), before any pickle-capable or decompressing loader sees it.

    A ``.safetensors`` name is a promise of a header and raw bytes that our strict reader
    parses; a file that breaks it is hostile or mislabelled either way, and routing it by
    content to torch (as a SpecForge ``.ckpt.gz``) would inflate and unpickle it.
    """
    want = next((kind for suffix, kind in EXPECTED.items() if path.name.lower().endswith(suffix)), None)
    have = content_kind(head)
    if want is None or have == want or have == "unknown":
        return
    raise InputError(path, f"named {path.suffix} but its content is {have} data, not a {want} header; refused "
                           "(files are read by what their name promises and never decompressed or unpickled on a "
                           "guess)")


def checked_head(path: Path) -> bytes | None:
    """The first 16 bytes of ``path`` (None when it cannot be read), after the content check
    that refuses a file whose content contradicts its name (:func:`check_content`)."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(16)
    except OSError:
        return None
    check_content(path, head)
    return head


def detect(path: Path) -> Format | None:
    """The foreign format of ``path``, or None for a dump (or anything else); a file whose
    content contradicts its name is refused here (:func:`check_content`)."""
    head = checked_head(path)
    if head is None:
        return None
    for make in REGISTRY:
        fmt = make()
        if fmt.sniff(path, head):
            return fmt
    return None


def formats() -> list[Format]:
    return [make() for make in REGISTRY]
