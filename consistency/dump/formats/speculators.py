"""speculators offline training data: ``hs_{i}.safetensors``.

Written by vLLM's ``ExampleHiddenStatesConnector`` during ``speculators
generate_offline_data`` (vllm ``distributed/kv_transfer/kv_connector/v1/
example_hidden_states_connector.py``: ``save_file({"hidden_states": ..., "token_ids":
...}, filename)``), or by hs_connectors' ``FP8HiddenStatesConnector`` (same keys,
``float8_e4m3fn`` values plus ``hidden_states_scales`` [T, 1, 1]).

``hidden_states`` is ``[T, n, H]``: ``torch.stack(aux_hidden_states, dim=1)`` of the
target's aux states, in vLLM's capture order (ascending stream; ``EagleModelMixin``
sorts the ids). speculators' trainer (``speculators/train/data.py``) feeds the draft the
first n-1 slots (``hidden_states[:, :-1].flatten(1)``) and uses the last one as the
verifier's last hidden state (``scripts/launch_vllm.py`` appends id N, pre-norm). We map
them the same way: ``aux.0 .. aux.{n-2}``, and the last slot as ``hidden.{s}`` when the
ids say which stream it is, else ``verifier_last_hidden_states``.

speculators' MTP trainer reads the same files another way (``models/mtp/data.py``
``shift_batch_mtp``: ``hidden_states = batch["verifier_last_hidden_states"]``; ``core.py``:
``target_layer_ids = [num_hidden_layers]``): its draft is fed the *last* slot only, pre-norm.
A file holding one slot can only be MTP data (the EAGLE-3 trainer would feed nothing from
it), so it is read as such: ``aux.0`` is that slot, and the file claims speculators' MTP
consumer. A file of several slots serves both trainers; it reads as EAGLE-3 unless the user
declares an MTP draft (``--consumer mtp``, a contract's consumer, replay of an MTP draft),
which reads it with :func:`open_mtp`: ``aux.0`` is the last slot, the others ``hidden.{s}``.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from consistency.contract import consumers
from consistency.contract.models import Consumer, DumpMetadata, ModelInfo, RuntimeInfo
from consistency.dump import dtypes, names, safetensors_io
from consistency.dump.formats.base import (
    Claims,
    ForeignDump,
    ScaledView,
    aux_info,
    rename,
    resolve_claims,
    split_slots,
    tensor_meta,
)
from consistency.dump.reader import META_KEY, Dump, TensorView
from consistency.errors import InputError

NAME = "speculators"
MAX_ARROW = 4 << 30  # a dataset shard larger than this is not read for a loss mask
LOSS_MASK = "loss_mask"
KEYS = frozenset({"hidden_states", "token_ids"})
SCALES = "hidden_states_scales"
LAST = "verifier_last_hidden_states"  # speculators' own name for the split-off last slot


def sniff(path: Path, head: bytes) -> bool:
    """A safetensors file holding exactly speculators' keys and no dump metadata."""
    if head[:2] == b"PK" or len(head) < 8:
        return False
    try:
        hdr = safetensors_io.read_header(path)
    except InputError:
        return False
    keys = set(hdr.entries)
    return META_KEY not in hdr.metadata and (keys == KEYS or keys == KEYS | {SCALES})


def open_file(path: Path, layer_ids: Sequence[int] | None = None, convention: str | None = None) -> ForeignDump:
    return _open(path, layer_ids, convention, mtp=False)


def open_mtp(path: Path, layer_ids: Sequence[int] | None = None, convention: str | None = None) -> ForeignDump:
    """The file as speculators' MTP trainer reads it: the last slot is the draft's input."""
    return _open(path, layer_ids, convention, mtp=True)


def as_mtp(d: Dump) -> Dump:
    """``d`` read the MTP way when it is a speculators file read the EAGLE-3 way (else ``d``;
    the caller closes both)."""
    if not isinstance(d, ForeignDump) or d.format != NAME or getattr(d, "mtp_reading", False):
        return d
    return open_mtp(d.path, *getattr(d, "opened_with", (None, None)))


def _open(path: Path, layer_ids: Sequence[int] | None, convention: str | None, mtp: bool) -> ForeignDump:
    fd = safetensors_io.open_regular(path)
    try:
        out = _build(path, fd, layer_ids, convention, mtp)
    except BaseException:
        os.close(fd)
        raise
    out.opened_with = (layer_ids, convention)
    return out


def _build(path: Path, fd: int, layer_ids: Sequence[int] | None, convention: str | None,
           mtp: bool = False) -> ForeignDump:
    hdr = safetensors_io.parse_header(path, fd)
    missing = KEYS - set(hdr.entries)
    if missing:
        raise InputError(path, f"not a speculators hidden-state file: no {', '.join(sorted(missing))} tensor")
    hs, tok = hdr.entries["hidden_states"], hdr.entries["token_ids"]
    if len(hs.shape) != 3:
        raise InputError(path, f"hidden_states has shape {list(hs.shape)}; speculators writes [tokens, layers, hidden]")
    t, n, h = hs.shape
    if not hs.dtype.startswith(("float", "bfloat")):
        raise InputError(path, f"hidden_states is {hs.dtype}; expected a float dtype")
    if len(tok.shape) != 1 or not tok.dtype.startswith(("int", "uint")):
        raise InputError(path, f"token_ids is {tok.dtype}{list(tok.shape)}; expected a 1-D integer tensor")
    if tok.shape[0] != t:
        raise InputError(path, f"token_ids has {tok.shape[0]} tokens but hidden_states has {t}")
    if n < 1 or h < 1:
        raise InputError(path, f"hidden_states has shape {list(hs.shape)}: no slots to read")
    storage = np.dtype(dtypes.BY_NAME[hs.dtype].storage)
    flat = TensorView("hidden_states", hs.dtype, (t, n * h), storage, fd, hs.begin, path)
    notes: list[str] = []
    if SCALES in hdr.entries:
        flat = ScaledView.wrap(flat, _scales(path, fd, hdr.entries[SCALES], t))
        notes.append("FP8 hidden states (hs_connectors FP8HiddenStatesConnector): values are dequantized with "
                     "their per-token scale and carry FP8 rounding (~6%)")
    slots = split_slots(flat, n, "slot")
    claims = _claims(path, layer_ids, convention, n)
    notes += claims.notes
    tensors: dict[str, TensorView] = {}
    metas = {}
    ids_view = TensorView(names.INPUT_IDS, tok.dtype, tok.shape, np.dtype(dtypes.BY_NAME[tok.dtype].storage), fd,
                          tok.begin, path)
    tensors[names.INPUT_IDS] = ids_view
    metas[names.INPUT_IDS] = tensor_meta(ids_view, "speculators token_ids")
    last_stream = claims.streams[-1] if claims.streams is not None and len(claims.streams) == n else None
    extra: dict = {}
    if mtp or n == 1:  # speculators' MTP trainer: the last slot is the draft's input, pre-norm
        tensors[names.aux(0)] = rename(slots[-1], names.aux(0))
        metas[names.aux(0)] = tensor_meta(tensors[names.aux(0)], f"speculators hidden_states[:, {n - 1}] (the MTP "
                                          "trainer's verifier_last_hidden_states, shift_batch_mtp)")
        for i, v in enumerate(slots[:-1]):  # the other slots: streams to identify with, when the ids name them
            if claims.streams is not None and len(claims.streams) == n:
                nm = names.hidden(claims.streams[i])
                tensors[nm] = rename(v, nm)
                metas[nm] = tensor_meta(tensors[nm], f"speculators hidden_states[:, {i}]")
        aux = aux_info(Claims([last_stream], claims.native[-1:] if claims.native else None, claims.convention),
                       1) if last_stream is not None else None
        extra["consumer"] = next(r for r in consumers.rows(Consumer.mtp) if r.code == "speculators-mtp").spec().model_dump(
            mode="json")
        notes.append(("one slot: " if n == 1 else f"read as MTP training data ({n} slots): ") +
                     "speculators' MTP trainer feeds the draft the last slot (verifier_last_hidden_states, pre-norm; "
                     "models/mtp/data.py shift_batch_mtp)" + ("" if last_stream is not None else
                                                              "; pass --layer-ids N to name its stream"))
    else:
        for i, v in enumerate(slots[:-1]):
            tensors[names.aux(i)] = rename(v, names.aux(i))
            metas[names.aux(i)] = tensor_meta(tensors[names.aux(i)], f"speculators hidden_states[:, {i}]")
        last_name = names.hidden(last_stream) if last_stream is not None else LAST
        tensors[last_name] = rename(slots[-1], last_name)
        metas[last_name] = tensor_meta(tensors[last_name], f"speculators hidden_states[:, {n - 1}] "
                                       "(the trainer's verifier_last_hidden_states)")
        if last_stream is None and claims.streams is not None:
            notes.append(f"the last slot is the verifier's last hidden state (launch_vllm.py appends N); pass its id "
                         f"too (--layer-ids {','.join(map(str, claims.native or []))},N) to name it hidden.N")
        aux = aux_info(claims, n - 1)
    mask, why = loss_mask_beside(path, np.asarray(ids_view.read_all()).reshape(-1).astype(np.int64))
    if why:
        notes.append(why)
    if mask is not None:
        from consistency.dump.rows import array_view

        tensors[LOSS_MASK] = array_view(LOSS_MASK, mask, path, "int64")
        metas[LOSS_MASK] = tensor_meta(tensors[LOSS_MASK], "speculators dataset loss_mask (beside the hs files)")
    if notes:
        extra["notes"] = notes
    meta = DumpMetadata(side="training", runtime=RuntimeInfo(name=NAME), model=ModelInfo(hidden_size=h, dtype=hs.dtype),
                        aux=aux, tensors=metas, extra=extra)
    out = ForeignDump(path, NAME, tensors, meta, fds=[fd])
    out.mtp_reading = mtp or n == 1
    return out


def loss_mask_beside(path: Path, token_ids: np.ndarray) -> tuple[np.ndarray | None, str | None]:
    """The loss mask speculators keeps beside its files: ``hs_{i}`` is row i of the
    preprocessed dataset (``train/data.py`` ArrowDataset: ``transfer = FileTransfer(datapath /
    "hidden_states")``, the row's ``loss_mask``) saved with ``save_to_disk`` in the parent
    directory. Read with pyarrow (Arrow IPC, no code runs) when it is installed; the row is
    used only when its ``input_ids`` are the file's token ids, as speculators checks."""
    m = re.fullmatch(r"hs_(\d{1,12})\.safetensors", path.name)
    root = path.parent.parent
    state = root / "state.json"
    if m is None or path.parent.name != "hidden_states" or not state.is_file():
        return None, None
    try:
        import pyarrow.ipc as ipc  # noqa: PLC0415 - optional: present wherever speculators is
    except ImportError:
        return None, f"{root.name}/ holds speculators' dataset, but pyarrow is not installed: its loss mask was not read"
    row = int(m.group(1))
    try:
        from consistency.contract.io import read_small_file  # non-blocking open, fstat: never a FIFO's hang

        files = [f["filename"] for f in json.loads(read_small_file(state, 1 << 20, "state.json"))["_data_files"]]
        for f in files:
            fp = (root / f).resolve()
            if fp.parent != root.resolve():
                raise ValueError("a data file outside the dataset")
            with ipc.open_stream(read_small_file(fp, MAX_ARROW, "dataset file")) as reader:
                table = reader.read_all()
            if row < table.num_rows:
                ids = np.asarray(table.column("input_ids")[row].as_py(), np.int64)
                mask = np.asarray(table.column("loss_mask")[row].as_py(), np.int64)
                break
            row -= table.num_rows
        else:
            return None, f"{root.name}/'s dataset has no row {m.group(1)}: its loss mask was not read"
    except (OSError, ValueError, KeyError, TypeError, IndexError, InputError) as exc:
        return None, f"{root.name}/'s dataset could not be read ({type(exc).__name__}): its loss mask was not read"
    except Exception as exc:  # noqa: BLE001 - pyarrow's own errors (ArrowInvalid, ...) on a damaged file
        return None, f"{root.name}/'s dataset could not be read ({type(exc).__name__}): its loss mask was not read"
    t = len(token_ids)
    if len(mask) != t or not np.array_equal(ids, token_ids):
        return None, f"{root.name}/'s row {m.group(1)} is not this file's tokens ({len(ids)} vs {t}): its loss mask " \
                     "was not used"
    return mask, f"loss mask read from {root.name}/ (speculators' dataset row {m.group(1)}: {int((mask != 0).sum())} " \
                 f"of {t} tokens supervised)"


def _claims(path: Path, layer_ids: Sequence[int] | None, convention: str | None, n: int) -> Claims:
    """Ids for all n slots, or for the n-1 aux slots (the trainer's --target-layer-ids)."""
    claims = resolve_claims(path, layer_ids, convention, NAME, sorted_slots=True)
    if claims.streams is None:
        return claims
    k = len(claims.streams)
    if k not in (n, n - 1) or k == 0:
        raise InputError(path, f"--layer-ids gives {k} ids but the file has {n} slots "
                         f"({n - 1} aux slots and the verifier's last hidden state)")
    return claims


def _scales(path: Path, fd: int, e: safetensors_io.Entry, t: int) -> np.ndarray:
    if e.dtype not in ("float32", "float16", "bfloat16", "float64") or len(e.shape) < 1 or e.shape[0] != t \
            or int(np.prod(e.shape)) != t:
        raise InputError(path, f"{SCALES} is {e.dtype}{list(e.shape)}; expected one float scale per token [{t}, 1, 1]")
    raw = np.frombuffer(os.pread(fd, e.nbytes, e.begin), dtype=np.dtype(dtypes.BY_NAME[e.dtype].storage))
    if raw.nbytes != e.nbytes:
        raise InputError(path, f"truncated while reading {SCALES}")
    scale = dtypes.to_float(raw.copy(), e.dtype, np.float64)
    if not np.isfinite(scale).all():
        raise InputError(path, f"{SCALES} holds non-finite values")
    return scale
