"""SpecForge offline training data: ``data_{i}.ckpt`` / ``data_{i}.ckpt.gz``.

Written by SpecForge ``scripts/prepare_hidden_states.py`` (sgl-project/SpecForge @ a6b6b02,
``_save_tensor``): ``torch.save(record, f)`` inside ``gzip.open(path, "wb",
compresslevel=6)`` with ``--compress``, else ``torch.save(record, path)``. The eagle3
record (``specforge/algorithms/eagle3/providers.py`` OfflineCaptureLayout) is a plain dict:
``input_ids`` [T], ``loss_mask`` [T], ``aux_hidden_state`` [1, T, n*H] (SGLang's aux
states concatenated on the last dim, in capture order) and ``hidden_state`` [1, T, H]
(the state SGLang hands its logits processor: post final norm). Older SpecForge saved the
same keys through ``dataclasses.asdict(DataPoint)``.

The file is a pickle. SpecForge itself loads it with ``weights_only=False``; we load it
with ``torch.load(weights_only=True)`` only, so a file that needs anything beyond tensors
and plain containers is refused, and nothing in it ever runs.
"""

from __future__ import annotations

import gzip
import io
import os
import pickle
import re
import warnings
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from consistency.contract.models import DumpMetadata, ModelInfo, NormState, RuntimeInfo
from consistency.dump import dtypes, names
from consistency.dump.formats.base import ForeignDump, aux_info, memory_view, resolve_claims, split_slots, tensor_meta
from consistency.dump.reader import TensorView
from consistency.dump.safetensors_io import open_regular
from consistency.errors import InputError, UsageError, need

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
    """``torch.load(weights_only=True)`` of a .ckpt or .ckpt.gz; every failure is one InputError line."""
    torch = need("torch", "torch", f"reading the SpecForge file {path}")
    fd = open_regular(path)  # refuses directories, devices and FIFOs
    os.close(fd)
    with open(path, "rb") as fh:
        head = fh.read(4)
    try:
        with warnings.catch_warnings():  # torch warns about pickle protocols on stderr: the error says it all
            warnings.simplefilter("ignore")
            if head[:2] == GZIP_MAGIC:
                obj = torch.load(io.BytesIO(_gunzip(path)), weights_only=True, map_location="cpu")
            elif head[:2] == b"PK":
                obj = torch.load(str(path), weights_only=True, map_location="cpu", mmap=True)
            else:
                obj = torch.load(str(path), weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as exc:
        raise InputError(path, f"refused: loading it needs more than tensors and plain containers "
                         f"({_why(exc)}); consistency loads .ckpt files with torch.load(weights_only=True) only"
                         ) from None
    except InputError:
        raise
    except (RuntimeError, EOFError, ValueError, OSError, zipfile.BadZipFile, KeyError, TypeError,
            AttributeError, IndexError) as exc:
        raise InputError(path, f"not a readable torch file ({type(exc).__name__}: {_why(exc)})") from None
    if not isinstance(obj, Mapping) or not all(isinstance(k, str) for k in obj):
        raise InputError(path, f"holds a {type(obj).__name__}; a SpecForge record is a dict of named tensors")
    return dict(obj)


def _limit() -> int:
    text = os.environ.get(ENV_MAX_GUNZIP)
    if not text:
        return MAX_GUNZIP_BYTES
    try:
        return int(text)
    except ValueError:
        raise UsageError(f"{ENV_MAX_GUNZIP}={text!r}: expected a number of bytes") from None


def _gunzip(path: Path) -> bytes:
    out = io.BytesIO()
    limit = _limit()
    try:
        with gzip.open(path, "rb") as g:
            while chunk := g.read(16 * 1024 * 1024):
                out.write(chunk)
                if out.tell() > limit:
                    raise InputError(path, f"decompresses to more than {limit} bytes (limit: {ENV_MAX_GUNZIP}); "
                                     "refused")
    except (OSError, EOFError, gzip.BadGzipFile) as exc:
        raise InputError(path, f"corrupt or truncated gzip stream ({_why(exc)})") from None
    return out.getvalue()


def _why(exc: BaseException) -> str:
    """The informative line of torch's multi-line weights_only message."""
    text = str(exc)
    m = re.search(r"Unsupported global: GLOBAL (\S+)", text)
    if m:
        return f"pickle global {m.group(1)}"
    m = re.search(r"Unsupported operand \S+", text)
    if m:
        return f"pickle opcode: {m.group(0)}"
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[0][:200] if lines else type(exc).__name__


def to_storage(path: Path, key: str, t: Any) -> tuple[np.ndarray, str]:
    """(numpy storage sharing the tensor's memory where possible, canonical dtype name)."""
    import torch

    name = str(t.dtype).removeprefix("torch.")
    if name not in dtypes.BY_NAME:
        raise InputError(path, f"{key} has dtype {name}, which consistency cannot store")
    x = t.detach().cpu().contiguous()
    if name == "bfloat16":
        return x.view(torch.int16).numpy().view(np.uint16), name
    if name.startswith("float8"):
        return x.view(torch.uint8).numpy(), name
    return x.numpy(), name


def _rows_2d(path: Path, key: str, arr: np.ndarray) -> np.ndarray:
    """[1, T, W] (SpecForge's unsqueeze(0)) -> [T, W]; [T, W] as is."""
    while arr.ndim > 2 and arr.shape[0] == 1:
        arr = arr[0]
    if arr.ndim != 2:
        raise InputError(path, f"{key} has shape {list(arr.shape)}; expected [1, tokens, width]")
    return arr


def _build(path: Path, record: dict[str, Any], layer_ids: Sequence[int] | None, convention: str | None) -> ForeignDump:
    import torch

    if not torch.is_tensor(record.get("aux_hidden_state")):
        keys = ", ".join(sorted(record)) or "none"
        raise InputError(path, f"not a SpecForge EAGLE-3 hidden-state record: no aux_hidden_state tensor (keys: {keys})")
    arrays: dict[str, tuple[np.ndarray, str]] = {}
    notes: list[str] = []
    for key, value in record.items():
        if value is None:
            continue
        if not torch.is_tensor(value):
            notes.append(f"{key!r} ({type(value).__name__}) is not a tensor: skipped")
            continue
        arrays[key] = to_storage(path, key, value)
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
    return ForeignDump(path, NAME, tensors, meta, keep=[record])


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
