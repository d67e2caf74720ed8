"""A user's own ``torch.save({name: tensor, ...})`` archive, read as a dump without torch.

The restricted reader (:mod:`consistency.dump.ptzip`) rebuilds the tensors without running
the pickle; nested dicts and lists are flattened with dots (``{"aux": [a, b]}`` ->
``aux.0``, ``aux.1``), so a file whose keys are our names (``hidden.3``, ``aux.0``,
``input_ids``) compares as a dump. A SpecForge record (``aux_hidden_state``) goes to the
SpecForge reader. Anything that is not a tensor is skipped, with a note.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from consistency.contract.models import DumpMetadata, RuntimeInfo
from consistency.dump import names, ptzip
from consistency.dump.formats.base import ForeignDump, tensor_meta
from consistency.dump.reader import Dump, TensorView
from consistency.errors import InputError

NAME = "torch-archive"
SUFFIXES = (".pt", ".pth", ".bin")
MAX_NAMES = 100_000


def sniff(path: Path, head: bytes) -> bool:
    return path.name.lower().endswith(SUFFIXES) and ptzip.is_torch_zip(path, head)


def open_file(path: Path, layer_ids: Sequence[int] | None = None, convention: str | None = None) -> Dump:
    a = ptzip.open_archive(path)
    try:
        if isinstance(a.obj, dict) and "aux_hidden_state" in a.obj:
            a.close()
            from consistency.dump.formats import specforge

            return specforge.open_file(path, layer_ids, convention)
        flat: dict[str, ptzip.PtTensor] = {}
        skipped: list[str] = []
        _flatten(path, "", a.obj, flat, skipped)
        names.refuse_twins(path, flat)  # {"aux": {"0": x, "00": y}}: which one is slot 0 is not ours to pick
        if not flat:
            raise InputError(path, f"a torch.save archive of a {type(a.obj).__name__} holding no tensors")
        tensors: dict[str, TensorView] = {k: t.view(k, a.fd) for k, t in flat.items()}
        notes = [f"{len(skipped)} non-tensor value(s) skipped: {', '.join(skipped[:5])}"] if skipped else []
        if layer_ids is not None:
            notes.append("--layer-ids ignored: a plain torch archive names its own tensors")
        meta = DumpMetadata(runtime=RuntimeInfo(name="torch.save"),
                            tensors={k: tensor_meta(v, "torch.save") for k, v in tensors.items()},
                            extra={"notes": notes, "source_format": {
                                "tool": NAME, "summary": f"torch.save archive, {len(tensors)} tensors (read without "
                                "torch; nothing unpickled)"}})
        return ForeignDump(path, NAME, tensors, meta, fds=[a.fd])
    except BaseException:
        a.close()
        raise


def _flatten(path: Path, prefix: str, obj: Any, out: dict[str, ptzip.PtTensor], skipped: list[str]) -> None:
    if len(out) > MAX_NAMES:
        raise InputError(path, f"holds more than {MAX_NAMES} tensors")
    if isinstance(obj, ptzip.PtTensor):
        name = prefix or "tensor"
        if name in out:  # {"a.b": x, "a": {"b": y}}: two tensors, one name
            raise InputError(path, f"two tensors flatten to the name {name!r} (a key with a dot beside a nested "
                             "one): refused rather than keep one of them")
        out[name] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _flatten(path, f"{prefix}.{k}" if prefix else str(k), v, out, skipped)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _flatten(path, f"{prefix}.{i}" if prefix else str(i), v, out, skipped)
    elif obj is not None:
        skipped.append(prefix or type(obj).__name__)
