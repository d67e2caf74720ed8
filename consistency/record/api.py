"""Record a training-side (reference) or serving-side (candidate) dump in one call.

Training side: every stream, each block's delta, the final norm and the aux slots the
draft was trained on (HF hooks). Serving side: the aux slots exactly as a fused-residual
runtime builds them, with the capture mode that runtime uses ('add', 'guarded', or the
'clone' bug), and what the runtime claims about them in metadata.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from consistency.contract.resolve import check_spec, streams_of
from consistency.contract.models import DumpMetadata, NormState, Residual, RuntimeInfo
from consistency.dump import names
from consistency.errors import UsageError
from consistency.record.recorder import Recorder, aux_info, model_info


def num_layers(model: Any) -> int:
    info = model_info(model.config, model)
    if info.num_layers is None:
        raise UsageError("the model config does not say how many layers it has")
    return info.num_layers


def resolve_streams(model: Any, ids: Sequence[int] | None, convention: str) -> tuple[list[int], str | None]:
    """Stream indices of ``ids`` under ``convention`` (runtime@version), plus any assumption made."""
    arch = model_info(model.config, model).architecture
    check_spec(convention, "--convention", arch)
    n = num_layers(model)
    res = streams_of(ids, convention, n, arch)
    streams = res.streams or []
    bad = [s for s in streams if not 0 <= s <= n]
    if bad:
        raise UsageError(f"ids {list(ids or [])} under {convention} give streams {streams}; valid streams are 0..{n}")
    return streams, res.assumed


def out_of_vocab(input_ids: Any, model: Any, name: str = "the model") -> str | None:
    """Why ``model`` cannot embed ``input_ids``, or None: an id past the vocabulary is an
    IndexError deep inside the embedding otherwise (and a negative one wraps around)."""
    ids = np.asarray(input_ids).reshape(-1)
    get = getattr(model, "get_input_embeddings", None)
    emb = get() if callable(get) else None
    vocab = getattr(emb, "num_embeddings", None) or getattr(getattr(model, "config", None), "vocab_size", None)
    if not isinstance(vocab, int) or ids.size == 0:
        return None
    bad = np.flatnonzero((ids < 0) | (ids >= vocab))
    if bad.size == 0:
        return None
    i = int(bad[0])
    more = f"; {bad.size} ids are outside it" if bad.size > 1 else ""
    return (f"token id {int(ids[i])} at position {i} is outside the vocabulary of {name}: ids run 0..{vocab - 1} "
            f"(vocab_size {vocab}){more}")


def _torch_ids(input_ids: Any, model: Any = None) -> Any:
    import torch

    if model is not None and (problem := out_of_vocab(input_ids, model)):
        raise UsageError(problem)
    t = torch.as_tensor(np.asarray(input_ids, dtype=np.int64))
    return t[None] if t.dim() == 1 else t


def record_reference(model: Any, input_ids: Any, path: str | Path, aux_streams: Sequence[int] | None = None,
                     *, native_ids: Sequence[int] | None = None, convention: str = "stream",
                     components: bool = True, logits: bool = False, side: str = "training",
                     force: bool = False, post_norm_last: bool = False,
                     draft: Callable[[Recorder, Mapping[str, Any]], None] | None = None) -> Path:
    """All streams plus the aux slots of ``aux_streams``; ``post_norm_last`` feeds HF's
    post-norm last hidden state for stream N (what ``output_hidden_states[-1]`` gives).
    ``draft(rec, streams)`` runs an MTP / EAGLE-1 draft on the recorded streams and records
    its steps into the same dump (consistency.record.draft.capture_draft_step)."""
    from consistency.record.hf import capture_streams

    ids = _torch_ids(input_ids, model)
    streams, notes = capture_streams(model, ids, components=components, logits=logits)
    n = num_layers(model)
    meta = DumpMetadata(side=side, runtime=RuntimeInfo(name="transformers", version=_tf_version()),  # type: ignore[arg-type]
                        model=model_info(model.config, model))
    rec = Recorder(path, meta, force=force, strict=True)  # our own captures: a refusal is a bug, said
    rec.capture(names.INPUT_IDS, ids[0] if ids.shape[0] == 1 else ids)
    for name in sorted(streams, key=names.sort_key):
        rec.capture(name, _squeeze(streams[name]), producer="hook")
    if aux_streams is not None:
        for i, s in enumerate(aux_streams):
            if not 0 <= s <= n:
                raise UsageError(f"stream {s} out of range 0..{n}")
            post = post_norm_last and s == n
            src = streams[names.FINAL_NORM] if post else streams[names.hidden(s)]
            extra = {"norm": NormState.final_norm} if post else {}
            rec.capture(names.aux(i), _squeeze(src), producer="hook", **extra)
        rec.metadata.aux = aux_info(list(aux_streams), list(native_ids) if native_ids is not None else None, convention)
    if notes:
        rec.metadata.extra["notes"] = notes
    if draft is not None:
        draft(rec, {k: _squeeze(v) for k, v in streams.items()})
    out = rec.save()
    assert out is not None
    return out


def record_serving(model: Any, input_ids: Any, path: str | Path, streams: Sequence[int], *,
                   capture_mode: str = "guarded", native_ids: Sequence[int] | None = None,
                   convention: str | None = None, runtime: str = "sglang", components: bool = False,
                   dtype: str | None = None, side: str = "serving", force: bool = False) -> Path:
    """The aux slots a fused-residual runtime would feed the draft, captured its way."""
    import torch

    from consistency.record.fused import FusedDecoder, check

    if dtype is not None:
        model = model.to(getattr(torch, dtype))
    ids = _torch_ids(input_ids, model)
    order = sorted(set(streams))  # the capture loop appends in layer order, once per layer
    name, _, version = runtime.partition("@")
    meta = DumpMetadata(side=side, runtime=RuntimeInfo(name=name, version=version or None),  # type: ignore[arg-type]
                        model=model_info(model.config, model))
    meta.aux = aux_info(order, list(native_ids) if native_ids is not None else None, convention,
                        residual=Residual.delta.value if capture_mode == "clone" else Residual.stream.value)
    loop = FusedDecoder(model, order, capture_mode=capture_mode, record_components=components)
    with Recorder(path, meta, force=force, strict=True) as rec:
        rec.capture(names.INPUT_IDS, ids[0] if ids.shape[0] == 1 else ids)
        final, _aux = loop(ids)  # type: ignore[arg-type]
        check(model, ids, final)  # before the file is written: a wrong loop leaves nothing behind
    assert rec.written is not None
    return rec.written


def _squeeze(t: Any) -> Any:
    return t[0] if t.dim() >= 3 and t.shape[0] == 1 else t


def _tf_version() -> str | None:
    try:
        import transformers

        return transformers.__version__
    except ImportError:  # pragma: no cover
        return None
