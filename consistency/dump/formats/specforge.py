"""SpecForge offline training data: ``data_{i}.ckpt`` / ``data_{i}.ckpt.gz``.

Written by SpecForge ``scripts/prepare_hidden_states.py`` (sgl-project/SpecForge @ a6b6b02,
``_save_tensor``): ``torch.save(record, f)`` inside ``gzip.open(path, "wb",
compresslevel=6)`` with ``--compress``, else ``torch.save(record, path)``. The eagle3
record (``specforge/algorithms/eagle3/providers.py`` OfflineCaptureLayout) is a plain dict:
``input_ids`` [T], ``loss_mask`` [T], ``aux_hidden_state`` [1, T, n*H] (SGLang's aux
states concatenated on the last dim, in capture order) and ``hidden_state`` [1, T, H]
(the state SGLang hands its logits processor: post final norm). Older SpecForge saved the
same keys through ``dataclasses.asdict(DataPoint)``.

The file is a pickle. SpecForge itself loads it with ``weights_only=False``; we read it with
the restricted ``torch.save`` reader (:mod:`consistency.dump.ptzip`, the same bounds as a
``.pt``), without torch: a file that needs anything beyond tensors and plain containers is
refused, and nothing in it ever runs. A ``.ckpt.gz`` is gunzipped (bounded) into a temporary
file first, since the reader maps storages from a file.
"""

from __future__ import annotations

import gzip
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from consistency.contract.models import DumpMetadata, ModelInfo, NormState, RuntimeInfo
from consistency.dump import dtypes, names
from consistency.dump.formats.base import ForeignDump, aux_info, memory_view, resolve_claims, split_slots, tensor_meta
from consistency.dump.reader import TensorView
from consistency.dump.safetensors_io import open_regular
from consistency.errors import InputError, UsageError

NAME = "specforge"
SUFFIXES = (".ckpt", ".ckpt.gz")  # .pt/.pth zips come through the torch-archive reader
GZIP_MAGIC = b"\x1f\x8b"
ENV_MAX_GUNZIP = "CONSISTENCY_MAX_GUNZIP_BYTES"
MAX_GUNZIP_BYTES = 16 * 1024**3  # a gzip bomb stops here (SpecForge samples are ~0.5 GB)
RENAMES = {"aux_hidden_state": None, "hidden_state": names.FINAL_NORM, "input_ids": names.INPUT_IDS,
           "loss_mask": "loss_mask"}


def sniff(path: Path, head: bytes) -> bool:
    """By name (what SpecForge writes) or by gzip magic; content is checked on load."""
    name = path.name.lower()
    if name.endswith((".safetensors", ".npz", ".json", ".yaml", ".yml", ".toml")):
        return False  # a name that promises another format is never routed to torch by content
    return name.endswith(SUFFIXES) or head[:2] == GZIP_MAGIC


def open_file(path: Path, layer_ids: Sequence[int] | None = None, convention: str | None = None) -> ForeignDump:
    record = load_record(path)
    return _build(path, record, layer_ids, convention)


def load_record(path: Path) -> dict[str, Any]:
    """The record of a .ckpt or .ckpt.gz, read by the restricted ``torch.save`` reader
    (:mod:`consistency.dump.ptzip`, the bounds of a ``.pt``) without torch: tensors become
    ``(storage array, dtype name)``; every failure is one InputError line."""
    fd = open_regular(path)  # refuses directories, devices and FIFOs
    try:
        head = os.pread(fd, 4, 0)
        if head[:2] == GZIP_MAGIC:  # gunzipped from the descriptor checked, never reopened by name (a FIFO swap)
            with _gunzipped(path, fd) as tmp:
                return _read(path, tmp)
    finally:
        os.close(fd)
    if head[:2] != b"PK":  # legacy torch.save or a bare pickle: only pickle could read it
        raise InputError(path, "refused: not a torch.save zip archive (a raw or legacy pickle stream); consistency "
                               "reads .ckpt files with its restricted torch.save reader only, which runs no pickle; "
                               "re-save it with torch.save's default format")
    return _read(path, path)


def _read(path: Path, source: Path) -> dict[str, Any]:
    from consistency.dump import ptzip

    try:
        a = ptzip.open_archive(source)
    except InputError as exc:  # a gunzipped temporary file: the user's file is named, not ours
        raise InputError(path, exc.problem) from None
    try:
        obj = a.obj
        if not isinstance(obj, Mapping) or not all(isinstance(k, str) for k in obj):
            raise InputError(path, f"holds a {type(obj).__name__}; a SpecForge record is a dict of named tensors")
        out: dict[str, Any] = {}
        for key, value in obj.items():
            if isinstance(value, ptzip.PtTensor):
                value.path = path
                out[key] = (value.read(a.fd), value.dtype)
            else:
                out[key] = value
        return out
    finally:
        a.close()


class _gunzipped:  # noqa: N801 - a context manager read as a phrase
    """The decompressed stream in a temporary file (unlinked on exit), at most the gunzip bound."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self.fd = fd

    def __enter__(self) -> Path:
        import tempfile

        limit = _limit(os.fstat(self.fd).st_size)
        fd, name = tempfile.mkstemp(prefix="consistency-ckpt-", suffix=".pt")
        self.tmp = Path(name)
        try:
            with os.fdopen(fd, "wb") as out, os.fdopen(os.dup(self.fd), "rb") as raw, \
                    gzip.GzipFile(fileobj=raw, mode="rb") as g:
                n = 0
                while chunk := g.read(16 * 1024 * 1024):
                    n += len(chunk)
                    if n > limit:
                        raise InputError(self.path, f"decompresses to more than {limit} bytes (limit: "
                                                    f"{ENV_MAX_GUNZIP}); refused")
                    out.write(chunk)
        except (OSError, EOFError, gzip.BadGzipFile) as exc:
            self.tmp.unlink(missing_ok=True)
            raise InputError(self.path, f"corrupt or truncated gzip stream ({_why(exc)})") from None
        except BaseException:
            self.tmp.unlink(missing_ok=True)
            raise
        return self.tmp

    def __exit__(self, *exc: object) -> None:
        self.tmp.unlink(missing_ok=True)


def _limit(size: int) -> int:
    """What a .ckpt.gz of ``size`` bytes may inflate to: hidden states compress about 1.1-2x, so
    64x its size (at least 256 MiB, at most the 16 GiB cap) bounds an honest file with room to
    spare and keeps a small gzip bomb from filling the disk; the variable, when set, decides."""
    text = os.environ.get(ENV_MAX_GUNZIP)
    if not text:
        return min(MAX_GUNZIP_BYTES, max(256 * 1024**2, 64 * size))
    try:
        return int(text)
    except ValueError:
        raise UsageError(f"{ENV_MAX_GUNZIP}={text!r}: expected a number of bytes") from None


def _why(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return lines[0][:200] if lines else type(exc).__name__


def _rows_2d(path: Path, key: str, arr: np.ndarray) -> np.ndarray:
    """[1, T, W] (SpecForge's unsqueeze(0)) -> [T, W]; [T, W] as is."""
    while arr.ndim > 2 and arr.shape[0] == 1:
        arr = arr[0]
    if arr.ndim != 2:
        raise InputError(path, f"{key} has shape {list(arr.shape)}; expected [1, tokens, width]")
    return arr


def _build(path: Path, record: dict[str, Any], layer_ids: Sequence[int] | None, convention: str | None) -> ForeignDump:
    if not isinstance(record.get("aux_hidden_state"), tuple):
        keys = ", ".join(sorted(record)) or "none"
        raise InputError(path, f"not a SpecForge EAGLE-3 hidden-state record: no aux_hidden_state tensor (keys: {keys})")
    arrays: dict[str, tuple[np.ndarray, str]] = {}
    notes: list[str] = []
    for key, value in record.items():
        if value is None:
            continue
        if not isinstance(value, tuple):
            notes.append(f"{key!r} ({type(value).__name__}) is not a tensor: skipped")
            continue
        arrays[key] = value
    aux, aux_dt = arrays.pop("aux_hidden_state")
    aux = _rows_2d(path, "aux_hidden_state", aux)
    if not dtypes.is_float(aux_dt):
        raise InputError(path, f"aux_hidden_state is {aux_dt}; expected a float dtype")
    t, width = aux.shape
    hidden = arrays.get("hidden_state")
    h = _rows_2d(path, "hidden_state", hidden[0]).shape[1] if hidden is not None else None
    claims = resolve_claims(path, layer_ids, convention, NAME, sorted_slots=True)
    notes = claims.notes + notes
    n = _num_slots(path, width, h, claims.streams)
    tensors: dict[str, TensorView] = {}
    metas = {}
    base = memory_view("aux_hidden_state", aux, aux_dt, path)
    for v in split_slots(base, n):
        tensors[v.name] = v
        metas[v.name] = tensor_meta(v, f"specforge aux_hidden_state[..., {v.name}]")
    for key, (arr, dt) in arrays.items():
        target = RENAMES.get(key, key)
        if key in ("input_ids", "loss_mask"):
            arr = arr.reshape(-1)
            if arr.shape[0] != t:
                raise InputError(path, f"{key} has {arr.shape[0]} tokens but aux_hidden_state has {t}")
        elif arr.ndim >= 2:
            arr = _rows_2d(path, key, arr)
            if arr.shape[0] != t:
                raise InputError(path, f"{key} has {arr.shape[0]} rows but aux_hidden_state has {t}")
        if key not in RENAMES:
            notes.append(f"extra tensor {key!r} kept under its own name")
        view = memory_view(str(target), arr, dt, path)
        tensors[view.name] = view
        extra = {"norm": NormState.final_norm} if target == names.FINAL_NORM else {}
        metas[view.name] = tensor_meta(view, f"specforge {key}", **extra)
    if h is not None:
        notes.append("hidden_state is SGLang's last hidden state after the final norm: mapped to final_norm")
    meta = DumpMetadata(side="training", runtime=RuntimeInfo(name=NAME),
                        model=ModelInfo(hidden_size=width // n, dtype=aux_dt), aux=aux_info(claims, n),
                        tensors=metas, extra={"notes": notes} if notes else {})
    return ForeignDump(path, NAME, tensors, meta)


def _num_slots(path: Path, width: int, h: int | None, streams: list[int] | None) -> int:
    if streams is not None:
        if width % len(streams) or (h is not None and width != len(streams) * h):
            raise InputError(path, f"aux_hidden_state is {width} wide: {len(streams)} ids do not split it into "
                             f"slots of the hidden size {h or '?'}")
        return len(streams)
    if h is not None:
        if width % h:
            raise InputError(path, f"aux_hidden_state is {width} wide, not a multiple of hidden_state's {h}")
        return width // h
    if width % 3:
        raise InputError(path, f"aux_hidden_state is {width} wide and there is no hidden_state to size its slots; "
                         "pass --layer-ids")
    return 3  # SpecForge requires exactly three ids (resolve_eagle_capture_layers)
