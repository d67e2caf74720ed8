"""vLLM ``extract_hidden_states``: ``{shared_storage_path}/{req_id}.safetensors``.

``--speculative-config '{"method": "extract_hidden_states", ..., "eagle_aux_hidden_state_layer_ids":
[...]}'`` with the ``ExampleHiddenStatesConnector`` (vllm 0.17.0 and later) saves
``{"hidden_states": [T, K, H], "token_ids": [T]}`` per request: the aux states vLLM would
feed an EAGLE-3 draft for the configured ids, in ascending id order, id k being stream k
(``hidden + residual``, pre-final-norm). It is the layout speculators' ``hs_{i}.safetensors``
uses, without speculators' convention that the last slot is the verifier's last state:
every slot is ``aux.{i}``. The two are told apart by the file name: a vLLM request id
(``0-1a2b3c4d.safetensors``, ``cmpl-<uuid>.safetensors``) is this reader's, any other name
speculators'. Version limits come
from the capture-limit table: before 0.18 id 0 fails and id N is never reached.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path

from consistency.contract.ids import split_appended
from consistency.contract.runtime_model import capture_limit
from consistency.contract.versions import parse_version
from consistency.contract.models import DumpMetadata, ModelInfo, RuntimeInfo
from consistency.dump import dtypes, names, safetensors_io
from consistency.dump.formats import speculators
from consistency.dump.formats.base import (Claims, ForeignDump, aux_info, rename, resolve_claims, split_slots,
                                          tensor_meta)
from consistency.dump.reader import META_KEY, TensorView
from consistency.errors import InputError, UsageError

NAME = "vllm-extract-hidden-states"
# what ExampleHiddenStatesConnector names its files: vLLM request ids (offline "0", "1", ...; the
# OpenAI server's cmpl-/chatcmpl-<uuid>), with the "-<8 hex>" suffix the engine appends since 0.11
REQUEST_NAME = re.compile(r"^(?:(?:chat)?cmpl-[0-9A-Za-z-]{1,80}|\d{1,12})(?:-[0-9a-f]{8})?\.safetensors$")


def sniff(path: Path, head: bytes) -> bool:
    """Exactly ``hidden_states`` and ``token_ids`` in a file named as vLLM names request files;
    any other name with these keys is speculators' layout (its ``hs_{i}``, or a renamed copy)."""
    if REQUEST_NAME.match(path.name) is None or head[:2] == b"PK" or len(head) < 8:
        return False
    try:
        hdr = safetensors_io.read_header(path)
    except InputError:
        return False
    return META_KEY not in hdr.metadata and set(hdr.entries) == speculators.KEYS


def sniff_dir(path: Path) -> bool:
    return bool(_requests(path))


def _requests(path: Path) -> list[Path]:
    try:
        files = sorted(p for p in path.iterdir() if p.name.endswith(".safetensors") and p.is_file())
    except OSError:
        return []
    out = []
    for p in files[:4096]:
        try:
            head = safetensors_io.read_head(p)  # never blocks: a FIFO is refused after a non-blocking open
        except (OSError, InputError):
            continue
        if sniff(p, head):
            out.append(p)
    return out


def open_dir(path: Path, layer_ids: Sequence[int] | None = None, convention: str | None = None) -> ForeignDump:
    files = _requests(path)
    if len(files) != 1:
        raise InputError(path, f"holds {len(files)} extract_hidden_states request files "
                         f"({', '.join(p.name for p in files[:3])}{', ...' if len(files) > 3 else ''}): name the one "
                         "whose prompt the reference recorded")
    return open_file(files[0], layer_ids, convention)


def open_file(path: Path, layer_ids: Sequence[int] | None = None, convention: str | None = None,
              num_layers: int | None = None) -> ForeignDump:
    """``num_layers``: the target's N when another input records it; ids ending in N then hold the
    verifier's last state after the aux slots (contract/ids.py split_appended)."""
    fd = safetensors_io.open_regular(path)
    try:
        return _build(path, fd, layer_ids, convention, num_layers)
    except BaseException:
        os.close(fd)
        raise


def _build(path: Path, fd: int, layer_ids: Sequence[int] | None, convention: str | None,
           num_layers: int | None = None) -> ForeignDump:
    hdr = safetensors_io.parse_header(path, fd)
    hs, tok = hdr.entries.get("hidden_states"), hdr.entries.get("token_ids")
    if hs is None or tok is None or len(hs.shape) != 3 or not dtypes.is_float(hs.dtype):
        raise InputError(path, "not an extract_hidden_states file: expected hidden_states [tokens, ids, hidden] (float) "
                         "and token_ids [tokens]")
    t, k, h = hs.shape
    if len(tok.shape) != 1 or tok.shape[0] != t or dtypes.is_float(tok.dtype):
        raise InputError(path, f"token_ids is {tok.dtype}{list(tok.shape)}; expected {t} integer ids")
    notes: list[str] = []
    spec = convention or "vllm"
    claims = resolve_claims(path, layer_ids, spec, "vllm", sorted_slots=True)
    notes += claims.notes
    if claims.streams is not None:
        _check_version(path, spec, claims.streams, k, notes)
    storage = dtypes.BY_NAME[hs.dtype].storage
    flat = TensorView("hidden_states", hs.dtype, (t, k * h), storage, fd, hs.begin, path)  # type: ignore[arg-type]
    tensors: dict[str, TensorView] = {}
    metas = {}
    ids = TensorView(names.INPUT_IDS, tok.dtype, tok.shape, dtypes.BY_NAME[tok.dtype].storage, fd, tok.begin,  # type: ignore[arg-type]
                     path)
    tensors[names.INPUT_IDS], metas[names.INPUT_IDS] = ids, tensor_meta(ids, "vllm token_ids")
    appended = _appended(claims, spec, k, num_layers)
    if appended:
        notes.append(appended)
    for i, v in enumerate(split_slots(flat, k)):
        if appended and i == k - 1 and claims.streams:  # the verifier's last state, not a draft slot
            v = rename(v, names.hidden(claims.streams[-1]))
        tensors[v.name] = v
        metas[v.name] = tensor_meta(v, f"vllm extract_hidden_states hidden_states[:, {i}]"
                                    + (" (the verifier's last state, appended by data generation)"
                                       if appended and i == k - 1 else ""))
    if claims.streams is None:
        notes.append("no --layer-ids: the slots' streams are not claimed; compare identifies them from the values")
    meta = DumpMetadata(side="serving", runtime=RuntimeInfo(name="vllm"), model=ModelInfo(hidden_size=h, dtype=hs.dtype),
                        aux=aux_info(claims, k - 1 if appended else k), tensors=metas,
                        extra={"notes": notes, "source_format": {
                            "tool": NAME, "summary": f"vLLM extract_hidden_states, {t} tokens, {k} slots of {h}"
                            + (f" (streams {claims.streams})" if claims.streams else "")}})
    return ForeignDump(path, NAME, tensors, meta, fds=[fd])


def _appended(claims: Claims, spec: str, k: int, n: int | None) -> str:
    """The verifier's last state appended after the aux ids (contract/ids.py split_appended): the
    last id is N (when N is known), or the file is speculators' data generation (``--convention
    speculators``). Read as ``hidden.N`` like speculators' own hs files, never as a draft slot."""
    if claims.native is None or len(claims.native) != k:
        return ""
    _aux, last, why = split_appended(claims.native, n, spec, slots=k - 1)
    return why if last is not None else ""


def with_target_layers(d: ForeignDump, n: int | None) -> ForeignDump | None:
    """``d`` opened again knowing the target's N (from the other side), when its ids end with N:
    None when nothing changes."""
    aux = d.metadata.aux if d.format == NAME and d.metadata is not None else None
    if n is None or aux is None or not aux.native_ids or aux.native_ids[-1] != n or f"hidden.{n}" in d.tensors:
        return None
    again = open_file(d.path, list(aux.native_ids), aux.convention or "vllm", num_layers=n)
    if f"hidden.{n}" not in again.tensors:
        again.close()
        return None
    return again


def _check_version(path: Path, spec: str, streams: list[int], k: int, notes: list[str]) -> None:
    """Ids a version cannot capture (capture-limit table): 0.17 fails at id 0 and never reaches N."""
    version = None
    if "@" in spec:
        try:
            version = parse_version(spec.split("@", 1)[1])
        except ValueError:
            raise UsageError(f"--convention {spec}: not a version") from None
    limit = capture_limit("vllm", version, None)
    if len(streams) != k:
        raise InputError(path, f"--layer-ids gives {len(streams)} ids but the file has {k} slots")
    if limit is not None and limit.first == "error" and 0 in streams:
        raise InputError(path, f"--layer-ids include 0, which vLLM {spec.split('@')[-1]} cannot capture "
                         f"({limit.source}): the file was not written with these ids")
    if limit is not None and limit.last == "dropped":
        notes.append(f"vLLM {spec.split('@')[-1]} never captures the last layer's output ({limit.source})")
