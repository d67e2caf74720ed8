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
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from consistency import __version__
from consistency.contract.models import AuxInfo, DumpMetadata, ModelInfo, RuntimeInfo, TensorMeta
from consistency.dump.writer import dump_name_problem, write_dump
from consistency.record.tensors import layout, to_numpy

ENV_PATH = "CONSISTENCY_RECORD"
ENV_RANK0 = "CONSISTENCY_RECORD_RANK0_ONLY"
ENV_FORCE = "CONSISTENCY_FORCE"  # "1": the environment recorder may overwrite an existing file

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
        # the environment recorder: ``path`` stays the requested name (patches identify it by
        # that); ``redirect`` is where it will really write when that name cannot be used
        self.from_env = False
        self.redirect: Path | None = None

    def capture(self, name: str, tensor: Any, producer: str | None = None, positions: Any = None, **meta: Any) -> None:
        """Copy ``tensor`` to the host under ``name``; a repeated name gets ``name#2``, ... .

        ``positions`` (this forward pass's token positions) is written once per pass as
        ``positions``/``positions#k``, beside the k-th capture, so captures can be stitched.
        """
        if not self.enabled:
            return
        if positions is not None:
            self.capture_positions(name, positions)
        n = self.counts.get(name, 0) + 1
        self.counts[name] = n
        key = name if n == 1 else f"{name}#{n}"
        tm = layout(tensor, producer) if hasattr(tensor, "stride") else TensorMeta(producer=producer)
        if "shard" in meta:  # 'h[tp]', 't[tp]', 'tp:partial', 'tp:replicated' or a ShardSpec
            from consistency.dump.ranks import parse_shard

            meta["shard"] = parse_shard(meta["shard"], self.rank or 0, self.world or 1,
                                        self.metadata.extra.get("parallel"))  # a declared layout's TP/DP rank
        for k, v in meta.items():
            setattr(tm, k, v)
        self.tensors[key] = to_numpy(tensor)
        self.metadata.tensors[key] = tm

    def capture_positions(self, name: str, positions: Any) -> None:
        """Record ``positions`` for the pass that ``name``'s next capture belongs to, once."""
        k = self.counts.get(name, 0) + 1
        if self.counts.get("positions", 0) == k - 1:
            self.capture("positions", positions, producer="positions")

    def save(self) -> Path | None:
        """Write the dump. The environment recorder never raises here and never loses the
        recording (:func:`_save_safely`); a recorder opened in code raises as usual."""
        if not self.enabled or not self.tensors:
            return None
        if self.from_env:
            return _save_safely(self)
        return self._write(self.path, self.force)

    def _write(self, path: Path, force: bool) -> Path:
        now = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
        self.metadata.created = self.metadata.created or now
        self.metadata.tool_version = __version__
        self.written = write_dump(path, self.tensors, self.metadata, force=force)
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
            _active = Recorder(path, meta, force=os.environ.get(ENV_FORCE) == "1",
                               rank0_only=os.environ.get(ENV_RANK0) == "1")
            _active.from_env = True
            _preflight(_active)
            atexit.register(flush)
    return _active


def _say(msg: str) -> None:
    """One line on stderr (the server's log): where the recording goes and why."""
    from consistency.report.escape import term

    try:
        sys.stderr.write(f"consistency: {ENV_PATH}: {term(msg)}\n")
        sys.stderr.flush()
    except (OSError, ValueError):  # stderr closed at exit: nothing more we can do
        pass


def sibling(path: Path) -> Path:
    """A fresh name next to ``path``: ``out.safetensors`` -> ``out.20261130T081500-4242.safetensors``
    (time and pid, so a re-run and a second process never pick the same name)."""
    suffix = path.suffix or ".safetensors"
    stem = path.name[: len(path.name) - len(path.suffix)] if path.suffix else path.name
    stamp = _dt.datetime.now().strftime("%Y%m%dT%H%M%S")
    for k in range(1000):
        cand = path.with_name(f"{stem}.{stamp}-{os.getpid()}{'' if k == 0 else f'-{k}'}{suffix}")
        if not cand.exists() and not cand.is_symlink():
            return cand
    return path.with_name(f"{stem}.{stamp}-{os.getpid()}-{os.urandom(4).hex()}{suffix}")


def _preflight(rec: Recorder) -> None:
    """At the first capture, not at exit: say now if the output cannot be written as named.

    A server may run for hours before it exits; learning then that the path existed or its
    directory was missing would lose the whole run. The recording is never dropped for
    these reasons: an existing file keeps its content and the recording gets a sibling
    name; a missing directory is created at exit; an unwritable one falls back to the
    temporary directory. ``CONSISTENCY_FORCE=1`` overwrites an existing file instead.
    """
    if not rec.enabled:
        return
    p = rec.path
    problem = dump_name_problem(p)
    if problem:  # x.pt would be refused at exit: keep the name, add the suffix that says what it holds
        p = rec.redirect = p.with_name(p.name + ".safetensors")
        _say(f"{rec.path}: {problem.split(';')[0]}; the recording will be written to {p}")
    if (p.exists() or p.is_symlink()) and not rec.force:
        if p.is_dir() or (p.exists() and not p.is_file()):
            rec.redirect = sibling(p.parent / (p.name + ".safetensors")) if p.is_dir() else sibling(p)
            _say(f"{p} is not a regular file; the recording will be written to {rec.redirect}")
        else:
            rec.redirect = sibling(p)
            _say(f"{p} exists (kept); the recording will be written to {rec.redirect} "
                 f"(set {ENV_FORCE}=1 to overwrite instead)")
    parent = (rec.redirect or p).parent
    if not parent.exists():
        _say(f"directory {parent} does not exist; it will be created when the recording is written")
    elif not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        rec.redirect = sibling(Path(tempfile.gettempdir()) / p.name)
        _say(f"{parent} is not a writable directory; the recording will be written to {rec.redirect} instead")


def _save_safely(rec: Recorder) -> Path | None:
    """Write the environment-activated recording, never losing it to a name clash, a missing
    directory or a full disk: try the path, then a sibling name, then the temporary
    directory; say where it went (or why nowhere) in one line, never a traceback."""
    from consistency.errors import ConsistencyError, OutputExistsError

    wanted = rec.redirect or rec.path
    tried: list[str] = []
    candidates = [wanted, sibling(wanted), sibling(Path(tempfile.gettempdir()) / wanted.name)]
    force = rec.force and rec.redirect is None
    for i, cand in enumerate(candidates):
        try:
            if i < 2 and not cand.parent.exists():
                cand.parent.mkdir(parents=True, exist_ok=True)
            out = rec._write(cand, force and i == 0)  # a sibling is never an overwrite
        except OutputExistsError:
            tried.append(f"{cand}: exists")
            continue
        except (ConsistencyError, OSError) as exc:
            tried.append(str(exc) if isinstance(exc, ConsistencyError) else f"{cand}: {exc.strerror or exc}")
            continue
        if cand != wanted:
            _say(f"recording written to {out} (not {wanted}: {'; '.join(tried)})")
        return out
    n = len(rec.tensors)
    mb = sum(getattr(a[0] if isinstance(a, tuple) else a, "nbytes", 0) for a in rec.tensors.values()) / 1e6
    _say(f"could not write the recording ({n} tensors, {mb:.1f} MB) anywhere: {'; '.join(tried)}")
    return None


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

    Never raises: at interpreter exit a traceback would be the only trace of a lost
    recording. Where it went is said on stderr when it is not the requested path."""
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
