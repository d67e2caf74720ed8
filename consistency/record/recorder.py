"""The recorder: a drop-in ``capture(name, tensor)`` that is inert unless switched on.

A runtime patch is one import and one call per captured point::

    from consistency.record import capture
    capture("aux.0", hidden_states + residual)

``capture`` costs one global read when recording is off. It switches on when a
:class:`Recorder` is active (context manager) or when ``CONSISTENCY_RECORD`` names an
output path (the recorder is then created lazily and written at interpreter exit, or on
:func:`flush`). Under torch.distributed each rank writes its own file, atomically.
"""

from __future__ import annotations

import atexit
import datetime as _dt
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from consistency import __version__
from consistency.contract.models import AuxInfo, DumpMetadata, ModelInfo, RuntimeInfo, TensorMeta
from consistency.dump.writer import write_dump
from consistency.record.tensors import layout, to_numpy

ENV_PATH = "CONSISTENCY_RECORD"
ENV_RANK0 = "CONSISTENCY_RECORD_RANK0_ONLY"

_active: Recorder | None = None
_lock = threading.Lock()


def dist_info() -> tuple[int | None, int | None]:
    """(rank, world_size) when torch.distributed is initialised, else (None, None)."""
    try:
        import torch.distributed as dist
    except ImportError:
        return None, None
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return None, None


def rank_path(path: str | Path, rank: int | None, world: int | None) -> Path:
    """``out.safetensors`` -> ``out.rank1-of4.safetensors`` under torch.distributed; a
    ``{rank}`` placeholder in the path is filled instead when present."""
    p = str(path)
    if rank is None or world is None:
        return Path(p.replace("{rank}", "0"))
    if "{rank}" in p:
        return Path(p.replace("{rank}", str(rank)))
    q = Path(p)
    suffix = "".join(q.suffixes[-1:]) or ".safetensors"
    return q.with_name(f"{q.name[: len(q.name) - len(suffix)]}.rank{rank}-of{world}{suffix}")


class Recorder:
    """Collects host copies of captured tensors and writes one dump."""

    def __init__(self, path: str | Path, metadata: DumpMetadata | None = None, force: bool = False,
                 rank0_only: bool = False) -> None:
        self.rank, self.world = dist_info()
        self.path = rank_path(path, self.rank, self.world)
        self.metadata = metadata.model_copy(deep=True) if metadata else DumpMetadata()
        self.metadata.rank, self.metadata.world_size = self.rank, self.world
        self.force = force
        self.enabled = not (rank0_only and self.rank not in (None, 0))
        self.tensors: dict[str, tuple[Any, str]] = {}
        self.counts: dict[str, int] = {}
        self.written: Path | None = None

    def capture(self, name: str, tensor: Any, producer: str | None = None, **meta: Any) -> None:
        """Copy ``tensor`` to the host under ``name``; a repeated name gets ``name#2``, ... ."""
        if not self.enabled:
            return
        n = self.counts.get(name, 0) + 1
        self.counts[name] = n
        key = name if n == 1 else f"{name}#{n}"
        tm = layout(tensor, producer) if hasattr(tensor, "stride") else TensorMeta(producer=producer)
        if "shard" in meta:  # 'h[tp]', 't[tp]', 'tp:partial', 'tp:replicated' or a ShardSpec
            from consistency.dump.ranks import parse_shard

            meta["shard"] = parse_shard(meta["shard"], self.rank or 0, self.world or 1)
        for k, v in meta.items():
            setattr(tm, k, v)
        self.tensors[key] = to_numpy(tensor)
        self.metadata.tensors[key] = tm

    def save(self) -> Path | None:
        if not self.enabled or not self.tensors:
            return None
        self.metadata.created = self.metadata.created or _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
        self.metadata.tool_version = __version__
        self.written = write_dump(self.path, self.tensors, self.metadata, force=self.force)
        return self.written

    def __enter__(self) -> Recorder:
        global _active
        with _lock:
            self._previous = _active
            _active = self
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self._deactivate()
        if exc_type is None:
            self.save()

    def _deactivate(self) -> None:
        global _active
        with _lock:
            if _active is self:
                _active = getattr(self, "_previous", None)

    def discard(self) -> None:
        """Stop recording without writing anything (an aborted run, a benchmark)."""
        self._deactivate()
        self.tensors.clear()


def _from_env() -> Recorder | None:
    global _active
    path = os.environ.get(ENV_PATH)
    if not path:
        return None
    with _lock:
        if _active is None:
            side = os.environ.get("CONSISTENCY_SIDE")
            runtime = os.environ.get("CONSISTENCY_RUNTIME")
            meta = DumpMetadata(side=side if side in ("training", "serving") else None,
                                runtime=RuntimeInfo(name=runtime) if runtime else None)
            _active = Recorder(path, meta, force=os.environ.get("CONSISTENCY_FORCE") == "1",
                               rank0_only=os.environ.get(ENV_RANK0) == "1")
            atexit.register(flush)
    return _active


def capture(name: str, tensor: Any, producer: str | None = None, **meta: Any) -> None:
    """Record ``tensor`` as ``name`` if recording is on; otherwise do nothing, cheaply."""
    rec = _active
    if rec is None:
        if ENV_PATH not in os.environ:
            return
        rec = _from_env()
        if rec is None:
            return
    rec.capture(name, tensor, producer, **meta)


def active() -> Recorder | None:
    return _active


def flush() -> Path | None:
    """Write the environment-activated recorder now (also runs at interpreter exit)."""
    rec = _active
    if rec is None or not rec.tensors or rec.written is not None:
        return None
    return rec.save()


@contextmanager
def recording(path: str | Path, **kw: Any) -> Iterator[Recorder]:
    with Recorder(path, **kw) as rec:
        yield rec


def model_info(config: Any) -> ModelInfo:
    """ModelInfo from a transformers config (text config of multimodal models)."""
    cfg = getattr(config, "text_config", None) or config
    arch = (getattr(config, "architectures", None) or [None])[0]
    return ModelInfo(name=getattr(config, "_name_or_path", None) or None, architecture=arch,
                     num_layers=getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer", None),
                     hidden_size=getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd", None),
                     vocab_size=getattr(cfg, "vocab_size", None))


def aux_info(stream_ids: list[int] | None, native: list[int] | None = None, convention: str | None = None,
             residual: str = "stream") -> AuxInfo:
    return AuxInfo(stream_ids=stream_ids, native_ids=native, convention=convention, residual=residual)  # type: ignore[arg-type]
