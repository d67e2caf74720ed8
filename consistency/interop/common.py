"""Write named streams from another tool as a dump, with aux slots and claims like ``record``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from consistency.contract.resolve import check_spec, streams_of
from consistency.contract.models import DumpMetadata, ModelInfo, RuntimeInfo
from consistency.dump import names
from consistency.errors import UsageError
from consistency.record.recorder import Recorder, aux_info


def squeeze_batch(t: Any) -> Any:
    """[1, T, H] -> [T, H], as every other recorder stores a single prompt."""
    shape = getattr(t, "shape", ())
    return t[0] if len(shape) >= 3 and shape[0] == 1 else t


def num_layers(named: Mapping[str, Any]) -> int | None:
    streams = [names.stream_of(n) for n in named]
    found = [s for s in streams if s is not None]
    return max(found) if found else None


def write_streams(named: Mapping[str, Any], path: str | Path, *, input_ids: Any = None,
                  aux_layers: Sequence[int] | None = None, convention: str = "stream", runtime: str = "",
                  version: str | None = None, side: str = "training", notes: Sequence[str] = (),
                  force: bool = False) -> Path:
    """A dump of ``named`` (our names -> tensors); ``aux_layers`` (ids under ``convention``)
    adds the aux slots a draft trained on those streams would be fed, as ``record`` does."""
    n = num_layers(named)
    meta = DumpMetadata(side=side, runtime=RuntimeInfo(name=runtime or None, version=version),  # type: ignore[arg-type]
                        model=ModelInfo(num_layers=n, hidden_size=_width(named)))
    rec = Recorder(path, meta, force=force)
    if input_ids is not None:
        ids = input_ids[0] if len(getattr(input_ids, "shape", ())) == 2 and input_ids.shape[0] == 1 else input_ids
        rec.capture(names.INPUT_IDS, ids)
    for name in sorted(named, key=names.sort_key):
        rec.capture(name, squeeze_batch(named[name]), producer=runtime or None)
    if aux_layers is not None:
        check_spec(convention, "convention")
        streams = streams_of(list(aux_layers), convention, n).streams or []
        for i, s in enumerate(streams):
            if names.hidden(s) not in named:
                raise UsageError(f"aux layer {aux_layers[i]} ({convention}) is stream {s}, which the cache does not hold")
            rec.capture(names.aux(i), squeeze_batch(named[names.hidden(s)]), producer=runtime or None)
        rec.metadata.aux = aux_info(streams, list(aux_layers), convention)
    if notes:
        rec.metadata.extra["notes"] = list(notes)
    out = rec.save()
    if out is None:
        raise UsageError("nothing to write: the cache holds no tensor this tool maps")
    return out


def _width(named: Mapping[str, Any]) -> int | None:
    for n, t in named.items():
        if names.stream_of(n) is not None and getattr(t, "shape", None):
            return int(t.shape[-1])
    return None
