"""Read one side of a replay: its tokens, its aux slots (as the draft gets them), its labels.

Aux slots are found the way ``consistency compare`` finds them
(:func:`consistency.compare.sides.describe`: ``aux.{i}`` tensors, or one concatenated
``aux`` split by the claimed stream count or the hidden size), concatenated in slot order
on the last dim: the ``cat(aux, -1)`` a runtime hands the draft's ``fc``.

Labels are the target's own next tokens: the argmax of the dump's ``logits`` when it has
them, else of a forward of the target on the dump's ``input_ids`` (in the serving dtype for a
bf16/fp16 capture). Without either nothing says what a server would accept: an error naming
the file, never the recorded next tokens (the target's own only if someone checked).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from consistency.compare.sides import describe
from consistency.contract.models import DumpMetadata
from consistency.dump import names
from consistency.dump.reader import Dump, TensorView
from consistency.dump.sets import open_side
from consistency.dump.stitch import stitch
from consistency.errors import InputError, UsageError
from consistency.replay.checks import check_model, check_streams

CHUNK_ROWS = 4096
LOSS_MASK = "loss_mask"  # SpecForge's name (dump.formats.specforge), and speculators' beside its files


@dataclass
class Side:
    path: Path
    ids: torch.Tensor  # [T] int64
    aux: torch.Tensor  # [T, n*H] float32
    slots: list[str]
    claimed: list[int] | None
    aux_dtype: str
    labels: torch.Tensor  # [T] target's next token after ids[:p+1]
    label_source: str
    greedy_agreement: float | None
    meta: DumpMetadata | None = None
    drafted: torch.Tensor | None = None  # [T] bool: tokens a server generated (a loss mask, decode/verify rows)
    drafted_source: str = "all"  # "loss_mask", "response" or "all"
    segments: list[tuple[int, int]] | None = None  # each request's [start, stop) when the dump holds several
    label_dtype: str | None = None  # the dtype of the target forward behind the labels (None: logits)
    label_changed: int | None = None  # labels whose serving-dtype argmax differs from float32's


def _rows(view: TensorView) -> torch.Tensor:
    parts = [view.rows_float(s, min(view.rows, s + CHUNK_ROWS)) for s in range(0, view.rows, CHUNK_ROWS)]
    arr = np.concatenate(parts) if parts else np.zeros((0, view.cols), np.float32)
    return torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32))


def token_ids(d: Dump) -> torch.Tensor:
    if names.INPUT_IDS not in d:
        raise InputError(d.path, "has no 'input_ids': replay needs the tokens the aux states were computed on")
    v = d[names.INPUT_IDS]
    if v.is_float:
        raise InputError(d.path, f"'input_ids' is {v.dtype}, expected an integer tensor")
    shape = v.shape
    if len(shape) == 2 and shape[0] == 1:
        shape = shape[1:]
    if len(shape) != 1:
        raise InputError(d.path, f"'input_ids' has shape {list(v.shape)}; replay reads one sequence per dump")
    ids = np.asarray(v.read_all()).reshape(-1).astype(np.int64)
    if len(ids) < 2:
        raise InputError(d.path, "needs at least 2 tokens to replay")
    return torch.from_numpy(ids)


def read_side(path: str | Path, num_aux: int, width: int, target: Any | None, labels: str = "auto",
              cache: dict[bytes, torch.Tensor] | None = None, layer_ids: Sequence[int] | None = None,
              convention: str | None = None, target_name: str | None = None, reading: str | None = None) -> Side:
    """``num_aux`` slots of ``width`` are what the draft's ``fc`` takes (n x H_target);
    ``cache`` shares target labels between dumps of the same tokens (one forward, not two).
    ``layer_ids``/``convention`` describe a training file that does not record its streams,
    exactly as ``compare --layer-ids --convention`` reads it (open_side). ``reading="mtp"``: a
    training file two drafts read differently is read as an MTP trainer reads it (speculators:
    the last slot). Where the server drafts comes with the side: a ``loss_mask`` the file holds
    (SpecForge writes one; speculators keeps one beside its files), else the decode and verify
    rows its stitched passes show."""
    p = Path(path)
    with ExitStack() as stack:  # dumps, rank sets, speculators hs_*.safetensors, SpecForge .ckpt
        raw = stack.enter_context(open_side(p, layer_ids, convention))
        if reading == "mtp":
            from consistency.dump.formats.speculators import as_mtp

            mtp = as_mtp(raw)
            if mtp is not raw:
                stack.callback(mtp.close)
                raw = mtp
        d, layout = stitch(raw)  # chunked prefill + decode steps, verify passes: one token axis, as compare reads them
        ids = token_ids(d)
        check_model(p, d.metadata, target, target_name)
        bounds = layout.bounds() if len(layout.segments) > 1 else None
        check_streams(p, d, ids[:bounds[0][1]] if bounds else ids, target, target_name)  # one request: the target's context
        info = describe(d, width, num_aux, "reference")
        if list(info.slots) != list(range(len(info.slots))):
            raise InputError(p, f"holds aux slots {sorted(info.slots)}: slots are numbered 0..n-1 with none missing")
        slots = list(info.slots.values())
        if not slots:
            raise InputError(p, "has no aux slots ('aux.{i}' or a concatenated 'aux') to feed the draft")
        widths = {v.cols for v in slots}
        if len(slots) != num_aux or widths != {width}:
            raise InputError(p, f"holds {len(slots)} aux slot(s) of width {sorted(widths)}; the draft's fc takes "
                                f"{num_aux} of {width} (cat(aux) {num_aux * width} wide)")
        t = len(ids)
        for v in slots:
            if v.rows != t:
                raise InputError(p, f"{v.name!r} has {v.rows} rows but 'input_ids' has {t} tokens")
        aux = torch.cat([_rows(v) for v in slots], dim=-1)
        if not torch.isfinite(aux).all():
            raise InputError(p, "aux slots hold NaN or Inf values")
        dtype = slots[0].dtype
        meta = d.metadata
        y, source, (label_dtype, changed) = _labels(d, ids, target, labels, cache if cache is not None else {}, bounds,
                                                    dtype)
        drafted, drafted_source = _drafted(d, layout.response(), len(ids))
    agree = None if source == "input_ids" else float((ids[1:] == y[:-1]).float().mean())
    return Side(p, ids, aux, [v.name for v in slots], info.claimed_streams, dtype, y, source, agree, meta, drafted,
                drafted_source, bounds, label_dtype=label_dtype, label_changed=changed)


def _drafted(d: Dump, response: np.ndarray | None, t: int) -> tuple[torch.Tensor | None, str]:
    """The tokens a server generated: the file's loss mask, else its decode/verify rows."""
    v = d.tensors.get(LOSS_MASK)
    if v is not None and not v.is_float and v.numel == t:
        return torch.from_numpy(np.asarray(v.read_all()).reshape(-1) != 0), "loss_mask"
    if response is not None and len(response) == t:
        return torch.from_numpy(np.asarray(response, bool)), "response"
    return None, "all"


SERVING_DTYPES = ("bfloat16", "float16")  # a server running the target in these verifies with their argmax


def _labels(d: Dump, ids: torch.Tensor, target: Any | None, mode: str, cache: dict[bytes, torch.Tensor],
            bounds: list[tuple[int, int]] | None = None,
            dtype: str | None = None) -> tuple[torch.Tensor, str, tuple[str | None, int | None]]:
    """``bounds``: the requests of a dump holding several; the target reads each on its own.
    ``dtype``: the aux states' dtype. A bf16/fp16 capture comes from a server running the
    target in that dtype, whose verify accepts its own argmax: the labels are computed in it
    (a float32 target's argmax differs on a few percent of positions); returned with the
    labels' dtype and how many differ from float32's."""
    t = len(ids)
    if mode in ("auto", "logits") and names.LOGITS in d:
        v = d[names.LOGITS]
        if v.rows != t:
            raise InputError(d.path, f"'logits' has {v.rows} rows but 'input_ids' has {t} tokens")
        out = [torch.from_numpy(v.rows_float(s, min(t, s + 512))).argmax(-1) for s in range(0, t, 512)]
        return torch.cat(out), "logits", (None, None)
    if mode == "logits":
        raise InputError(d.path, "has no 'logits' (--labels logits)")
    if mode in ("auto", "target") and target is not None:
        serving = dtype if dtype in SERVING_DTYPES else None
        y = _target_labels(target, ids, bounds, cache, None)
        if serving is None:
            return y, "target", ("float32", None)
        ys = _target_labels(target, ids, bounds, cache, serving)
        return ys, "target", (serving, int((ys != y).sum()))
    if mode == "target":
        raise InputError(d.path, "--labels target needs --target")
    if mode == "input_ids":
        raise UsageError("--labels input_ids: the recorded next tokens are not the target's own next tokens, so they "
                         "score no serving acceptance; give --target (or dumps with 'logits')")
    raise InputError(d.path, "acceptance could not be scored: the dump has no 'logits' and no --target was given, so "
                             "nothing says which next token the target would verify (the recorded next tokens are not "
                             "the target's own); give --target")


def _target_labels(target: Any, ids: torch.Tensor, bounds: list[tuple[int, int]] | None,
                   cache: dict[bytes, torch.Tensor], dtype: str | None) -> torch.Tensor:
    parts, model = [], None
    for a, b in bounds or [(0, len(ids))]:
        key = (dtype or "float32").encode() + b":" + ids[a:b].numpy().tobytes()
        if key not in cache:
            if model is None:  # a copy, cast once: casting the caller's model would change its other uses
                import copy

                model = target if dtype is None else copy.deepcopy(target).to(getattr(torch, dtype))
            cache[key] = target_next_tokens(model, ids[a:b])
        parts.append(cache[key])
    return torch.cat(parts)


@torch.no_grad()
def target_next_tokens(target: Any, ids: torch.Tensor) -> torch.Tensor:
    """The target's greedy next token at every position (one forward, in the model's dtype)."""
    vocab = int(getattr(getattr(target.config, "text_config", None) or target.config, "vocab_size", 0) or 0)
    if vocab and int(ids.max()) >= vocab:
        raise InputError(None, f"token id {int(ids.max())} is outside the target's vocabulary of {vocab}")
    out = target(input_ids=ids[None])
    return out.logits[0].float().argmax(-1)


def truncate(side: Side, n: int, start: int = 0) -> Side:
    """Tokens [start, start + n) of a side (the run both dumps share)."""
    if start == 0 and n >= len(side.ids):
        return side
    sl = slice(start, start + n)
    segs = None
    if side.segments is not None:  # each request's bounds on the kept tokens
        segs = [(max(a - start, 0), min(b - start, n)) for a, b in side.segments if min(b - start, n) > max(a - start, 0)]
    return replace(side, ids=side.ids[sl], aux=side.aux[sl], labels=side.labels[sl],
                   drafted=side.drafted[sl] if side.drafted is not None else None, segments=segs)
