"""Tensor-parallel rank files: unshard them into one dump before comparing.

Each rank writes its own file (``out.rank{r}-of{w}.safetensors``), with each tensor's
relation to the full tensor in its metadata (SGLang's comparator annotates ``h[tp]`` and
``tp:partial``; we store a :class:`ShardSpec`): ``split`` along a dimension is undone by
concatenation, ``partial`` (awaiting an all-reduce) by a sum, and ``replicated`` copies
are checked to really agree -- rank 0's copy is used, and disagreement is reported, since
a replicated tensor that differs across ranks is exactly what a missing all-reduce makes.
The combined views read rows from every rank lazily, so memory stays per chunk.
"""

from __future__ import annotations

import glob
import itertools
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from consistency.contract.models import DumpMetadata, ShardSpec
from consistency.dump import dtypes
from consistency.dump.formats.base import ForeignDump
from consistency.dump.layout import shard_group
from consistency.dump.reader import Dump, TensorView
from consistency.errors import InputError

RANK_RE = re.compile(r"^(?P<stem>.+)\.rank(?P<rank>\d+)-of(?P<world>\d+)(?P<suffix>\.[A-Za-z0-9]+)$")
MAX_WORLD = 1 << 20  # ranks a set's names may claim: stage sets list the missing ones (a finding, up to this many)
REPLICA_ROWS = 256  # rows compared across ranks per replicated tensor (sampled, evenly spaced)


def parse_shard(spec: str | ShardSpec | None, rank: int, world: int, layout: object = None) -> ShardSpec | None:
    """``'h[tp]'`` (split along the last dim), ``'t[tp]'`` (along tokens), ``'t[dp]'`` (tokens
    owned by data-parallel ranks), ``'tp:partial'``/``'ep:partial'`` (awaiting an all-reduce),
    ``'tp:replicated'``/``'ep:replicated'``, or ``'dim=N'``. Rank and size come from the group
    in ``layout`` (the recorder's declared parallel layout) when it names one, else from
    (``rank``, ``world``): under pipeline stages the TP rank is not the global rank."""
    if spec is None or isinstance(spec, ShardSpec):
        return spec
    s = spec.strip().lower()

    def made(group: str, kind: str, dim: int | None = None) -> ShardSpec:
        r, w = shard_group(layout, group) or (rank, world)  # type: ignore[arg-type]
        return ShardSpec(kind=kind, dim=dim, rank=r, world_size=w, group=group)  # type: ignore[arg-type]

    m = re.fullmatch(r"(?:(tp|ep|dp):)?(partial|replicated)?", s)
    if m:
        return made(m.group(1) or "tp", m.group(2) or "replicated")
    m = re.fullmatch(r"(h|hidden|d|t|tokens)\[(tp|dp|ep)\]", s)
    if m:
        return made(m.group(2), "split", -1 if m.group(1) in ("h", "hidden", "d") else -2)
    m = re.fullmatch(r"dim=(-?\d+)", s)
    if m:
        return made("tp", "split", int(m.group(1)))
    raise ValueError(f"unknown shard annotation {spec!r}: use h[tp], t[tp], t[dp], dim=N, tp:partial, "
                     f"ep:partial or tp:replicated")


def rank_files(spec: str | Path) -> list[Path] | None:
    """The rank files a spec names: a glob (its directory part may hold wildcards too, so
    ``nodes/*/out.rank*-of16.safetensors`` gathers every node's files), a directory of rank
    files or of per-node directories of them, or the un-ranked name."""
    p = Path(spec)
    if any(ch in str(spec) for ch in "*?["):
        found = sorted(Path(x) for x in glob.glob(str(spec)))
    elif p.is_dir():
        found = sorted(x for x in p.iterdir() if RANK_RE.match(x.name))
        if not found:  # a directory per node: one level down
            found = sorted(x for sub in p.iterdir() if sub.is_dir() for x in sub.iterdir() if RANK_RE.match(x.name))
    elif not p.exists():
        stem, suffix = p.name[: len(p.name) - len(p.suffix)], p.suffix
        found = sorted(p.parent.glob(f"{stem}.rank*-of*{suffix}")) if suffix else []
    else:
        return None
    return [x for x in found if RANK_RE.match(x.name) and x.is_file()] or None


class RankDump(ForeignDump):
    """Several rank files presented as one dump of full (unsharded) tensors."""

    def __init__(self, paths: Sequence[Path]) -> None:
        world, by_rank = check_set(paths)
        self.rank_dumps: list[Dump] = []
        try:
            for r in range(world):
                self.rank_dumps.append(Dump(by_rank[r]))
                check_rank(self.rank_dumps[-1], r, world)
            tensors, replicas = tp_combine(self.rank_dumps)
        except BaseException:
            for d in self.rank_dumps:
                d.close()
            raise
        meta = (self.rank_dumps[0].metadata or DumpMetadata()).model_copy(deep=True)
        meta.rank, meta.world_size = None, world
        full_shapes(meta, tensors)
        super().__init__(by_rank[0].parent / _set_name(by_rank[0]), f"{self.rank_dumps[0].format} x{world} ranks",
                         tensors, meta)
        self.world = world
        self.replica_checks = replicas  # name -> (worst token rel_diff across ranks, first rank that differs)
        self.layout_facts: list = []  # facts about the set itself (none for plain tensor parallel)

    def rank_views(self, name: str) -> list[TensorView] | None:
        """Every rank's own copy of ``name`` (for explanations such as a missing all-reduce)."""
        views = [d.tensors.get(name) for d in self.rank_dumps]
        return None if any(v is None for v in views) else views  # type: ignore[return-value]

    def close(self) -> None:
        for d in getattr(self, "rank_dumps", []):
            d.close()
        super().close()


def full_shapes(meta: DumpMetadata, tensors: dict[str, TensorView]) -> None:
    """Metadata of a combined dump describes the full tensors, not any rank's shard."""
    for name, v in tensors.items():
        tm = meta.tensors.get(name)
        if tm is not None:
            tm.shape, tm.dtype, tm.shard = list(v.shape), v.dtype, None


def tp_combine(dumps: Sequence[Dump], ranks: Sequence[int] | None = None,
               groups: tuple[str, ...] = ("tp", "ep")) -> tuple[dict[str, TensorView], dict[str, tuple[float, int]]]:
    """Unshard one tensor-parallel group (``dumps`` in TP-rank order). Tensors split or
    partial in another group (``t[dp]``) pass through as rank 0's view for the caller
    to merge; replicated ones are checked across the group (ranks named by ``ranks``)."""
    first = dumps[0]
    labels = list(ranks) if ranks is not None else list(range(len(dumps)))
    out: dict[str, TensorView] = {}
    replicas: dict[str, tuple[float, int]] = {}
    for name in first.names:
        views = [d.tensors.get(name) for d in dumps]
        if any(v is None for v in views):
            missing = [i for i, v in enumerate(views) if v is None]
            raise InputError(dumps[missing[0]].path, f"rank file lacks tensor {name!r} that rank {labels[0]} has")
        spec = _spec(first, name)
        if spec is not None and spec.kind != "replicated" and spec.group not in groups:
            out[name] = views[0]  # type: ignore[assignment]
            continue
        if spec is None or spec.kind == "replicated" or len(dumps) == 1:
            out[name] = views[0]  # type: ignore[assignment]
            if views[0].is_float and len(views) > 1:  # type: ignore[union-attr]
                spread, at = _replica_spread(views)  # type: ignore[arg-type]
                replicas[name] = (spread, labels[at])
            continue
        out[name] = CombinedView.of(name, views, spec)  # type: ignore[arg-type]
    return out, replicas


def _set_name(p: Path) -> str:
    m = RANK_RE.match(p.name)
    return f"{m.group('stem')}.rank*-of{m.group('world')}{m.group('suffix')}" if m else p.name


def check_set(paths: Sequence[Path], allow_missing: bool = False) -> tuple[int, dict[int, Path]]:
    """World size and rank -> file of a rank set; a rank given twice (two nodes' copies),
    mixed world sizes or (unless ``allow_missing``) a missing rank is a one-line error that
    names the ranks and the directories searched."""
    by_rank: dict[int, Path] = {}
    worlds = set()
    for p in paths:
        m = RANK_RE.match(p.name)
        if m is None:
            raise InputError(p, "not a rank file (expected NAME.rank{r}-of{w}.EXT)")
        r, w = int(m.group("rank")), int(m.group("world"))
        worlds.add(w)
        if r in by_rank:
            raise InputError(p, f"rank {r} given twice (also {by_rank[r]}): pass one copy per rank")
        by_rank[r] = p
    if len(worlds) != 1:
        raise InputError(paths[0], f"rank files disagree on the world size: {sorted(worlds)}")
    world = worlds.pop()
    # the world size is the names' claim: checked against the files present before anything is built to its size
    if world > MAX_WORLD:
        raise InputError(paths[0], f"its name claims a world of {world} ranks, over the {MAX_WORLD} bound "
                         f"({len(by_rank)} rank file(s) present)")
    outside = sorted(r for r in by_rank if r >= world)
    if outside:
        raise InputError(by_rank[outside[0]], f"rank {outside[0]} of a world of {world}: no such rank")
    if len(by_rank) < world and not allow_missing:
        first = list(itertools.islice((r for r in range(world) if r not in by_rank), 64))  # found within len + 64 steps
        more = world - len(by_rank) - len(first)
        dirs = sorted({str(p.parent) for p in paths})
        where = f" (found {len(by_rank)} in {', '.join(dirs[:4])}{', ...' if len(dirs) > 4 else ''})"
        raise InputError(paths[0], f"rank files for ranks {_ranges(first)}{f' and {more} more' if more else ''} of "
                         f"{world} are missing{where}")
    return world, by_rank


def check_rank(d: Dump, rank: int, world: int) -> None:
    """A rank file's own metadata must agree with its name (``rank{r}-of{w}``): its
    ``rank``/``world_size`` and every tensor's shard spec. The name decides how the set is
    merged, so a file that says otherwise is refused rather than merged on either word."""
    meta = d.metadata
    if meta is None:
        return
    if meta.world_size is not None and meta.world_size != world:
        raise InputError(d.path, f"its name says rank {rank} of {world} but its metadata says world_size "
                                 f"{meta.world_size}: the files come from another layout than their names")
    if meta.rank is not None and meta.rank != rank:
        raise InputError(d.path, f"its name says rank {rank} of {world} but its metadata says rank {meta.rank}")
    for name, tm in meta.tensors.items():
        sh = tm.shard
        if sh is not None and sh.group == "tp" and (sh.world_size > world or sh.rank >= sh.world_size):
            raise InputError(d.path, f"tensor {name!r} declares tp rank {sh.rank} of {sh.world_size}, which does "
                                     f"not fit a set of {world} rank files")


def _ranges(xs: Sequence[int]) -> str:
    """[1, 2, 3, 7] -> '[1, 2, 3, 7]' for short lists, '[1..3, 7]'-style when long."""
    if len(xs) <= 8:
        return str(list(xs))
    parts, i = [], 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        parts.append(str(xs[i]) if i == j else f"{xs[i]}..{xs[j]}")
        i = j + 1
    return "[" + ", ".join(parts) + "]"


def _spec(d: Dump, name: str) -> ShardSpec | None:
    tm = d.metadata.tensors.get(name) if d.metadata else None
    return tm.shard if tm is not None else None


def _replica_spread(views: list[TensorView]) -> tuple[float, int]:
    """Worst token rel_diff of any rank's copy against rank 0's, on sampled rows."""
    rows = views[0].rows
    if any(v.shape != views[0].shape for v in views):
        return float("inf"), next(i for i, v in enumerate(views) if v.shape != views[0].shape)
    if rows == 0:
        return 0.0, 0
    idx = np.unique(np.linspace(0, max(rows - 1, 0), min(rows, REPLICA_ROWS)).round().astype(np.int64))
    base = views[0].take_rows(idx, np.float64)
    worst, at = 0.0, 0
    for r, v in enumerate(views[1:], start=1):
        x = v.take_rows(idx, np.float64)
        d = x - base
        den = (x * x).sum(1) + (base * base).sum(1)
        rd = np.divide((d * d).sum(1), den, out=np.zeros(len(den)), where=den > 0).mean()
        if rd > worst:
            worst, at = float(rd), r
    return worst, at


class CombinedView(TensorView):
    """The full tensor behind rank shards: concatenated (split) or summed (partial)."""

    parts: list[TensorView]
    spec: ShardSpec
    axis: int  # normalised: -1 (columns) or -2 (rows)

    @classmethod
    def of(cls, name: str, parts: list[TensorView], spec: ShardSpec) -> CombinedView:
        base = parts[0]
        nd = len(base.shape)
        dim = spec.dim if spec.dim is not None else -1
        if spec.kind == "split" and dim not in (-1, nd - 1, -2, nd - 2):
            raise InputError(base.path, f"{name}: split along dim {dim} is not supported (only tokens or hidden)")
        axis = -1 if spec.kind != "split" or dim in (-1, nd - 1) else -2
        shape = list(base.shape)
        if spec.kind == "split":
            shape[axis] = sum(p.shape[axis] for p in parts)
        elif any(p.shape != base.shape for p in parts):
            raise InputError(base.path, f"{name}: partial sums of different shapes across ranks")
        out = cls.__new__(cls)
        out.__dict__.update(base.__dict__)
        out.name, out.parts, out.spec, out.axis = name, parts, spec, axis
        out.shape = tuple(shape)
        if spec.kind == "partial":  # sums are formed in fp32
            out.dtype = "float32" if base.is_float else base.dtype
            out._storage = np.dtype(np.float32) if base.is_float else base._storage
        out._cols = None
        return out

    def read_rows(self, start: int, stop: int) -> np.ndarray:
        start, stop = max(0, start), min(self.rows, stop)
        if self.spec.kind == "partial":
            acc = None
            for p in self.parts:
                x = p.rows_float(start, stop) if p.is_float else p.read_rows(start, stop)
                acc = x.copy() if acc is None else acc + x
            return acc  # type: ignore[return-value]
        if self.axis == -1:
            return np.concatenate([p.read_rows(start, stop) for p in self.parts], axis=1)
        out, offset = [], 0
        for p in self.parts:  # token-split: rank r holds a contiguous block of rows
            a, b = max(start - offset, 0), min(stop - offset, p.rows)
            if a < b:
                out.append(p.read_rows(a, b))
            offset += p.rows
        return np.concatenate(out, axis=0) if out else np.zeros((0, self.cols), self._storage)

    def rows_float(self, start: int, stop: int, out_dtype: type = np.float32) -> np.ndarray:
        raw = self.read_rows(start, stop)
        if self.spec.kind == "partial":
            return raw.astype(out_dtype, copy=False)
        return dtypes.to_float(raw, self.dtype, out_dtype)

    def column_view(self, c0: int, c1: int, name: str) -> TensorView:
        return _Columns.of(self, c0, c1, name)


class _Columns(TensorView):
    """Columns [c0, c1) of any view (a slot of a concatenated ``aux`` that was unsharded)."""

    src: TensorView

    @classmethod
    def of(cls, src: TensorView, c0: int, c1: int, name: str) -> _Columns:
        out = cls.__new__(cls)
        out.__dict__.update(src.__dict__)
        out.src, out.name, out.c0, out.c1 = src, name, c0, c1
        out.shape = (*src.shape[:-1], c1 - c0)
        return out

    def read_rows(self, start: int, stop: int) -> np.ndarray:
        return self.src.read_rows(start, stop)[:, self.c0:self.c1]

    def rows_float(self, start: int, stop: int, out_dtype: type = np.float32) -> np.ndarray:
        return self.src.rows_float(start, stop, out_dtype)[:, self.c0:self.c1]

    def column_view(self, c0: int, c1: int, name: str) -> TensorView:
        return _Columns.of(self.src, self.c0 + c0, self.c0 + c1, name)
