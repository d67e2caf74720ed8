"""Readers for tensor files other tools write, presented as dumps.

A registry as data: each entry names a format, says how to recognise a file (cheaply,
from its name and first bytes) or a directory (from its entries' names), and how to open
it as a :class:`~consistency.dump.reader.Dump`. ``consistency.dump.sets.open_side``
consults it before falling back to the dump reader, so every command that takes a dump
takes these files too. :func:`looks_like` names what an unreadable file's bytes are, so a
refusal says what the file is and what we read instead of calling it a corrupt header.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from consistency.dump.reader import Dump
from consistency.dump.sniff import MAGIC, MAX_HEADER, content_kind, looks_like, read_names  # noqa: F401 - re-exported
from consistency.errors import InputError


@dataclass(frozen=True)
class Format:
    name: str
    description: str
    source: str  # the upstream writer this reader follows
    sniff: Callable[[Path, bytes], bool] | None  # a file: its name and first 16 bytes
    open: Callable[[Path, Sequence[int] | None, str | None], Dump] | None
    sniff_dir: Callable[[Path], bool] | None = None  # a directory: its entries' names
    open_dir: Callable[[Path, Sequence[int] | None, str | None], Dump] | None = None


def _speculators() -> Format:
    from consistency.dump.formats import speculators as m

    return Format(m.NAME, "speculators offline data: hs_{i}.safetensors {hidden_states [T, n, H], token_ids [T]}",
                  "vllm example_hidden_states_connector.py (save_file); speculators train/data.py (reader)",
                  m.sniff, m.open_file)


def _specforge() -> Format:
    from consistency.dump.formats import specforge as m

    return Format(m.NAME, "SpecForge offline data: data_{i}.ckpt[.gz] {aux_hidden_state, hidden_state, input_ids, "
                  "loss_mask} (torch.save; read by the restricted reader, without torch)",
                  "SpecForge scripts/prepare_hidden_states.py (_save_tensor)", m.sniff, m.open_file)


def _vllm() -> Format:
    from consistency.dump.formats import vllm_hidden as m

    return Format(m.NAME, "vLLM extract_hidden_states: {req_id}.safetensors {hidden_states [T, K, H], token_ids [T]} "
                  "(every slot an aux state, ids from --layer-ids)",
                  "vllm distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py (0.17.0+)",
                  m.sniff, m.open_file, m.sniff_dir, m.open_dir)


def _sglang_tensor_dump() -> Format:
    from consistency.dump.formats import sglang_tensor_dump as m

    return Format(m.NAME, "SGLang --debug-tensor-dump-output-folder: [target/]TP*_PP*_Rank*_pid*/Pass*.pt (leaf "
                  "module outputs per forward pass)", "sglang srt/debug_utils/tensor_dump_forward_hook.py (0.5.5-0.5.23)",
                  None, None, m.sniff_dir, m.open_dir)


def _sglang_dumper() -> Format:
    from consistency.dump.formats import sglang_dumper as m

    return Format(m.NAME, "SGLang dumper: step=S___rank=R___...___name=N.pt ({value, meta}; forward_pass_id= up to 0.5.9)",
                  "sglang srt/debug_utils/dumper.py (0.5.5-0.5.23; DUMPER_NON_INTRUSIVE_MODE=all from 0.5.10)",
                  None, None, m.sniff_dir, m.open_dir)


def _megatron() -> Format:
    from consistency.dump.formats import megatron as m

    return Format(m.NAME, "Megatron --save-activations-interval: activations/iter_*/mp_rank_*.pth "
                  "({model_chunk0: {module/input0: [s, b, h]}})",
                  "megatron-core 0.18.0 megatron/training/activation_logging.py (save_grads)",
                  m.sniff, m.open_file, m.sniff_dir, m.open_dir)


# order matters where two formats accept the same content: vLLM's request files carry
# speculators' keys, told apart by name (speculators writes hs_{i}.safetensors); Megatron's
# mp_rank_*.pth and SpecForge's .ckpt are torch archives read before the generic one
def _torch_archive() -> Format:
    from consistency.dump.formats import torch_archive as m

    return Format(m.NAME, "a torch.save .pt/.pth/.bin zip archive of named tensors (nested dicts/lists flattened "
                  "with dots), read without torch", "torch serialization.py (zip format, torch >= 1.6)",
                  m.sniff, m.open_file)


REGISTRY: tuple[Callable[[], Format], ...] = (_vllm, _speculators, _megatron, _torch_archive, _specforge,
                                              _sglang_tensor_dump, _sglang_dumper)


# the content a name promises: a mismatch is refused before any loader sees the file
EXPECTED = {".safetensors": "safetensors", ".npz": "zip"}


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
    from consistency.dump.safetensors_io import read_head

    try:
        head = read_head(path)  # non-blocking open, then fstat: a FIFO swapped in cannot hang the sniff
    except (OSError, InputError):
        return None  # the reader that opens it says what is wrong
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
        if fmt.sniff is not None and fmt.sniff(path, head):
            return fmt
    return None


def detect_dir(path: Path) -> Format | None:
    """The foreign format of a directory (stock debug dumps are directories), or None."""
    for make in REGISTRY:
        fmt = make()
        if fmt.sniff_dir is not None and fmt.sniff_dir(path):
            return fmt
    return None
