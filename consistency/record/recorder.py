"""The recorder: a drop-in ``capture(name, tensor)`` that is inert unless switched on.

A runtime patch is one import and one call per captured point::

    from consistency.record import capture
    capture("aux.0", hidden_states + residual)

``capture`` costs one global read when recording is off. It switches on when a
:class:`Recorder` is active (context manager) or when ``CONSISTENCY_RECORD`` names an
output path (the recorder is then created lazily and written at interpreter exit, or on
:func:`flush`). Under torch.distributed each rank writes its own file, atomically.
The environment recorder never loses a recording: an existing output is kept and the
recording goes to a sibling name (``CONSISTENCY_FORCE=1`` overwrites), said in one line
on stderr at the first capture (docs/commands.md#in-your-own-code-the-drop-in-capture).
"""

from __future__ import annotations

import atexit
import datetime as _dt
import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from consistency import __version__
from consistency.contract.models import AuxInfo, DumpMetadata, ModelInfo, RuntimeInfo
from consistency.dump import names
from consistency.dump.writer import max_tensors, write_dump
from consistency.errors import UsageError
from consistency.record import guard
from consistency.record.fallback import ENV_FORCE, ENV_PATH, preflight, save_safely, say, sibling  # noqa: F401
from consistency.record.graph_plan import resolve
from consistency.record.guard import Refused, check_name

ENV_RANK0 = "CONSISTENCY_RECORD_RANK0_ONLY"

_active: Recorder | None = None
_lock = threading.Lock()
# graph-safe mode (consistency/record/graphs.py) sets this: (recorder, name, tensor, producer, meta) -> taken
graph_hook: Callable[[Recorder, str, Any, str | None, dict[str, Any]], bool] | None = None


def dist_info() -> tuple[int | None, int | None]:
    """(rank, world_size) when torch.distributed is initialised, else (None, None).

    A process group exists only once ``torch.distributed`` was imported, so a process that
    never imported it (numpy-only capture) is not made to pay torch's import here."""
    if "torch.distributed" not in sys.modules:
        return None, None
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
    """Collects host copies of captured tensors and writes one dump.

    ``capture`` never raises into the caller (a server's forward pass): a capture the dump
    could not hold is refused alone, said in one stderr line and counted in the dump's
    metadata (record/guard.py); ``strict=True`` raises instead (tests, our own recorders).
    Captures, ``save`` and ``flush`` may come from several threads.
    """

    def __init__(self, path: str | Path, metadata: DumpMetadata | None = None, force: bool = False,
                 rank0_only: bool = False, strict: bool = False) -> None:
        self.rank, self.world = dist_info()
        alone = rank0_only and (self.world or 1) > 1  # one file for the whole run: named as complete, not rank 0 of w
        self.path = rank_path(path, None if alone else self.rank, None if alone else self.world)
        self.metadata = metadata.model_copy(deep=True) if metadata else DumpMetadata()
        self.metadata.rank, self.metadata.world_size = self.rank, self.world
        if alone:  # compare reads it as one dump, not a rank set missing ranks 1..w-1
            self.metadata.extra["rank0_only"] = True
        self.force = force
        self.strict = strict
        self.enabled = not (rank0_only and self.rank not in (None, 0))
        self.tensors: dict[str, tuple[Any, str]] = {}
        self.counts: dict[str, int] = {}
        self.refused: dict[str, dict[str, Any]] = {}  # name -> {"count", "reason"}: in extra.refused_captures
        self._spellings: dict[str, str] = {}  # names.spelling(name) -> the first name captured of that spelling
        self.written: Path | None = None
        self.dirty = False  # captures since the last write
        self._written_id: tuple[int, ...] | None = None
        self._meta_chars = 0
        self._said = 0
        self._guard = threading.RLock()
        # the environment recorder: ``path`` stays the requested name (patches identify it by
        # that); ``redirect`` is where it will really write when that name cannot be used
        self.from_env = False
        self.redirect: Path | None = None

    def capture(self, name: str, tensor: Any, producer: str | None = None, positions: Any = None, **meta: Any) -> None:
        """Copy ``tensor`` to the host under ``name``; a repeated name gets ``name#2``, ... .

        ``positions`` (this forward pass's token positions) is written once per pass as
        ``positions``/``positions#k``, beside the k-th capture, so captures can be stitched.
        A capture the dump could not hold is refused with one line on stderr, never raised.
        """
        if not self.enabled:
            return
        try:
            with self._guard:
                self._capture(name, tensor, producer, positions, meta)
        except Refused as exc:
            self._refuse(name, exc.reason)
        except Exception as exc:  # noqa: BLE001 - nothing the recorder does may raise into the host
            if self.strict:
                raise
            self._refuse(name, f"{type(exc).__name__}: {' '.join(str(exc).split())[:160]}")

    def parse_meta(self, meta: dict[str, Any]) -> dict[str, Any]:
        """Keywords as the metadata model takes them (a shard annotation resolved for this rank)."""
        if "shard" in meta:  # 'h[tp]', 't[tp]', 'tp:partial', 'tp:replicated' or a ShardSpec
            from consistency.dump.ranks import parse_shard

            meta["shard"] = parse_shard(meta["shard"], self.rank or 0, self.world or 1,
                                        self.metadata.extra.get("parallel"))  # a declared layout's TP/DP rank
        return meta

    def _capture(self, name: str, tensor: Any, producer: str | None, positions: Any, meta: dict[str, Any]) -> None:
        check_name(name)
        self.check_spelling(name)
        tm = guard.tensor_meta(tensor, producer, self.parse_meta(resolve(meta)))
        host = guard.host_copy(tensor)  # everything checked before anything is kept
        if len(self.tensors) >= max_tensors(self.path):
            raise Refused(f"the recording holds {len(self.tensors)} tensors, what a {self.path.suffix} dump can hold")
        if positions is not None:  # only for a capture that is kept, so positions#k stays beside it
            self.capture_positions(name, positions)
        n = self.counts.get(name, 0) + 1
        key = name if n == 1 else f"{name}#{n}"
        while key in self.tensors:  # never over an earlier capture
            n += 1
            key = f"{name}#{n}"
        size = guard.meta_chars(key, tm)
        if self._meta_chars + size > guard.meta_budget():
            raise Refused(f"the recording's metadata would pass the readers' {guard.MAX_META_TEXT}-character bound")
        self.counts[name] = n
        self._spellings.setdefault(names.spelling(name), name)  # kept: later captures are held to its spelling
        self._meta_chars += size
        self.tensors[key] = host
        self.metadata.tensors[key] = tm
        self.dirty = True

    def has_captures(self) -> bool:
        """Whether anything was kept (an asynchronous recorder's captures may still be on the way)."""
        return bool(self.tensors)

    def check_spelling(self, name: str) -> None:
        """Refuse ``aux.00`` after ``aux.0`` was kept (or ``layers.03`` after ``layers.3``):
        the file would hold two spellings of one name, which every reader refuses, so the
        whole recording would be unreadable; the earlier spelling stays, this one is said."""
        first = self._spellings.get(names.spelling(name), name)
        if first != name:
            raise Refused(f"its name is another spelling of {first[:80]!r}, captured before (a file holding both is "
                          "refused by every reader); capture it under one spelling")

    def _refuse(self, name: Any, reason: str) -> None:
        if self.strict:
            raise UsageError(f"capture {str(name)[:80]!r} refused: {reason}")
        from consistency.contract.io import writable

        shown = (name if len(name) <= 200 else f"{name[:200]}...") if isinstance(name, str) else repr(name)[:200]
        shown, reason = writable(shown), writable(reason)  # they go into the metadata: escaped there too
        with self._guard:
            entry = self.refused.setdefault(shown, {"count": 0, "reason": reason})
            entry["count"] += 1
            said, self._said = self._said, self._said + 1
        guard.say(name, reason, said)

    def capture_positions(self, name: str, positions: Any) -> None:
        """Record ``positions`` for the pass that ``name``'s next capture belongs to, once."""
        k = self.counts.get(name, 0) + 1
        if self.counts.get("positions", 0) == k - 1:
            self.capture("positions", positions, producer="positions")

    def save(self) -> Path | None:
        """Write the dump: everything captured so far (a later save rewrites it with what
        came since). The environment recorder never raises here and never loses the
        recording (record/fallback.py); a recorder opened in code raises as usual."""
        if not self.enabled or not self.tensors:
            return None
        if self.from_env:
            return save_safely(self)
        return self._write(self.path, self.force)

    def _snapshot(self) -> tuple[dict[str, Any], DumpMetadata]:
        with self._guard:
            meta = self.metadata.model_copy(deep=True)
            if self.refused:
                meta.extra["refused_captures"] = {k: dict(v) for k, v in self.refused.items()}
            self.dirty = False
            return dict(self.tensors), meta

    def _write(self, path: Path, force: bool) -> Path:
        tensors, meta = self._snapshot()
        now = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
        meta.created = meta.created or now
        meta.tool_version = __version__
        force = force or self.is_ours(path)  # our own earlier flush: rewritten, never a sibling
        try:
            self.written = write_dump(path, tensors, meta, force=force)
        except UsageError as exc:
            if "metadata" not in str(exc):
                raise
            # metadata set by the caller that cannot be written: keep the tensors, say why
            keep = DumpMetadata(side=meta.side, runtime=meta.runtime, model=meta.model, aux=meta.aux, rank=meta.rank,
                                world_size=meta.world_size, tensors=meta.tensors, created=meta.created,
                                tool_version=meta.tool_version,
                                extra={"metadata_dropped": " ".join(str(exc).split())[:300]})
            self.written = write_dump(path, tensors, keep, force=force)
        with self._guard:
            try:
                st = os.stat(self.written)
                self._written_id = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
            except OSError:
                self._written_id = None
        return self.written

    def is_ours(self, path: Path) -> bool:
        """``path`` is the file this recorder last wrote, untouched since (same inode, size, mtime)."""
        if self.written is None or self._written_id is None or Path(path) != self.written:
            return False
        try:
            st = os.stat(path)
        except OSError:
            return False
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) == self._written_id

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
            _active = Recorder(path, meta, force=os.environ.get(ENV_FORCE) == "1",
                               rank0_only=os.environ.get(ENV_RANK0) == "1")
            _active.from_env = True
            preflight(_active)
            atexit.register(flush)
    return _active


def capture(name: str, tensor: Any, producer: str | None = None, positions: Any = None, **meta: Any) -> None:
    """Record ``tensor`` as ``name`` if recording is on; otherwise do nothing, cheaply.

    ``positions``: the token positions of this forward pass (``forward_batch.positions``
    in SGLang, ``positions`` in vLLM), written once per pass so captures can be stitched.
    """
    rec = _active
    if rec is None:
        if ENV_PATH not in os.environ:
            return
        rec = _from_env()
        if rec is None:
            return
    if positions is not None:
        meta["positions"] = positions
    if graph_hook is not None and graph_hook(rec, name, tensor, producer, meta):
        return  # inside a CUDA-graph capture: buffered, drained after each replay
    rec.capture(name, tensor, producer, **meta)


def active() -> Recorder | None:
    return _active


def flush() -> Path | None:
    """Write the environment-activated recorder now (also runs at interpreter exit).

    Everything captured so far is written; captures made after a flush are written by the
    next flush (or at exit), which rewrites the same file with the whole recording. Never
    raises: at interpreter exit a traceback would be the only trace of a lost recording.
    Where it went is said on stderr when it is not the requested path."""
    rec = _active
    if rec is None:
        return None
    if not rec.has_captures() or not rec.dirty:
        return rec.written
    try:
        return rec.save()
    except Exception as exc:  # noqa: BLE001 - a recorder opened in code raises; the environment's never does
        if not rec.from_env:
            raise
        say(f"could not write the recording: {type(exc).__name__}: {exc}")
        return None


@contextmanager
def recording(path: str | Path, **kw: Any) -> Iterator[Recorder]:
    with Recorder(path, **kw) as rec:
        yield rec


def model_info(config: Any, model: Any = None) -> ModelInfo:
    """ModelInfo from a transformers config (text config of multimodal models). A config
    loaded from a GGUF file names no ``architectures``; the loaded model's class does
    (``LlamaForCausalLM``), and the runtimes' layer-id rules depend on it."""
    cfg = getattr(config, "text_config", None) or config
    arch = (getattr(config, "architectures", None) or [None])[0]
    if arch is None and model is not None and getattr(model, "config", None) is config:
        arch = type(model).__name__
    return ModelInfo(name=getattr(config, "_name_or_path", None) or None, architecture=arch,
                     num_layers=getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer", None),
                     hidden_size=getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd", None),
                     vocab_size=getattr(cfg, "vocab_size", None))


def aux_info(stream_ids: list[int] | None, native: list[int] | None = None, convention: str | None = None,
             residual: str = "stream") -> AuxInfo:
    return AuxInfo(stream_ids=stream_ids, native_ids=native, convention=convention, residual=residual)  # type: ignore[arg-type]
