"""Pipeline stages (and DP-attention ranks) merged into one logical dump, with findings.

A pipeline stage runs layers [start, end) and records its own streams under *global* ids:
its input stream ``hidden.{start}`` (received from the previous stage), its outputs up to
``hidden.{end}``, its layers' components. The merger groups rank files by stage, unshards
each stage's tensor-parallel group (:func:`consistency.dump.ranks.tp_combine`) and, under
DP attention, puts its data-parallel ranks' tokens back in order
(:mod:`consistency.dump.tokens`), then takes the union of the stages. A stream recorded on
both sides of a boundary is checked as a replica: the transfer between stages is a copy,
so two different values mean one stage's name is wrong.

What the merge finds is not a tensor difference, so it is kept as facts about the dump
(``layout_facts``: data, worded by ``consistency.diagnose.layout``), each naming the stage: a stage with no file (the capture guarded by
``is_first_rank``, vLLM PR #45985), layer ranges that overlap or leave a gap, a stream
outside the stage's range (a local layer index: ``enumerate(islice(layers, start, end))``
counting from 0, vLLM PR #36731), a stream two stages hold with different values, and a
token held by no DP rank or by two.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from consistency.contract.models import DumpMetadata
from consistency.dump import layout as lay
from consistency.dump import names
from consistency.dump.formats.base import ForeignDump
from consistency.dump.layout import LayoutFact
from consistency.dump.ranks import (RankDump, _ranges, _replica_spread, _set_name, _spec, check_rank, check_set,
                                    full_shapes, tp_combine)
from consistency.dump.reader import Dump, TensorView
from consistency.dump.tokens import TokenView, duplicate_spread, merge_ownership
from consistency.errors import InputError

CONFLICT_FLOOR = {2: 1e-4, 1: 1e-2}  # token rel_diff allowed between stage copies, by item size; else 1e-8
MERGED_KEY = "parallel_merged"
ALL = 100_000  # the layer range of a set without pipeline stages: everything


def open_rank_set(paths: Sequence[Path]) -> Dump:
    """A plain tensor-parallel :class:`RankDump`, or a :class:`StagedDump` when the files
    declare pipeline stages or data-parallel token ownership."""
    world, by_rank = check_set(paths, allow_missing=True)
    dumps: dict[int, Dump] = {}
    try:
        for r in sorted(by_rank):
            dumps[r] = Dump(by_rank[r])
            check_rank(dumps[r], r, world)
        layouts = {r: lay.of(d.metadata, d.path) for r, d in dumps.items()}
        if not any(x is not None and x.staged for x in layouts.values()):
            for d in dumps.values():
                d.close()
            return RankDump(paths)
        return StagedDump(world, dumps, layouts)  # type: ignore[arg-type]
    except BaseException:
        for d in dumps.values():
            d.close()
        raise


def _where(name: str, aux_streams: Sequence[int] | None) -> tuple[str, int] | None:
    """('stream', s) or ('layer', k) that ``name`` belongs to, if its name says."""
    n = names.parse(name)
    if n.index is None:
        return None
    if n.kind == names.HIDDEN:
        return ("stream", n.index)
    if n.kind in (names.ATTN_OUT, names.MLP_OUT, names.RESID_MID):
        return ("layer", n.index)
    if n.kind == names.AUX and aux_streams is not None and n.index < len(aux_streams):
        return ("stream", aux_streams[n.index])
    return None


def _in_range(w: tuple[str, int] | None, lo: int, hi: int, shift: int = 0) -> bool:
    if w is None:
        return True
    kind, i = w
    return lo <= i + shift <= hi if kind == "stream" else lo <= i + shift < hi


class StagedDump(ForeignDump):
    """Rank files of a pipeline-parallel and/or DP-attention layout as one logical dump."""

    def __init__(self, world: int, dumps: dict[int, Dump], layouts: dict[int, lay.Layout]) -> None:
        self.all_dumps = list(dumps.values())
        self.world = world
        self.layout_facts: list[LayoutFact] = []
        self.token_keys: list[tuple[Any, ...]] | None = None  # DP: each merged row's (row,) or (request, position)
        self.replica_checks: dict[str, tuple[float, int]] = {}
        first = dumps[min(dumps)]
        for r, x in layouts.items():
            if x is None or not x.staged:
                raise InputError(dumps[r].path, f"declares no pipeline/data-parallel layout, while "
                                 f"{first.path.name} does: every rank of a set must")
        self.pp = self._one(dumps, {r: x.pp.size if x.pp else 1 for r, x in layouts.items()}, "pipeline size")
        self.dp = self._one(dumps, {r: x.dp.size if x.dp else 1 for r, x in layouts.items()}, "data-parallel size")
        tps = {x.tp.size if x.tp else 1 for x in layouts.values()}
        if len(tps) == 1 and self.pp * self.dp * min(tps) != world:  # the layout must fill the set its names say
            raise InputError(first.path, f"the files declare {self.pp} pipeline stage(s) x dp {self.dp} x tp "
                             f"{min(tps)} = {self.pp * self.dp * min(tps)} ranks, but their names say {world} "
                             f"(rank{{r}}-of{world}): the files come from another layout than their names")
        cells = self._cells(dumps, layouts)
        self.ranges = {s: self._range(dumps, layouts, ranks) for s, ranks in cells.items()}
        self.nodes = sorted({x.node for x in layouts.values() if x.node})
        self.stage_tp: dict[int, list[Dump]] = {}
        missing = sorted(set(range(world)) - set(dumps))
        meta = (first.metadata or DumpMetadata()).model_copy(deep=True)
        self.num_layers = meta.model.num_layers if meta.model else None
        self.boundary: dict[str, tuple[list[int], float]] = {}  # name -> (stages holding it, spread): checked replicas
        self._check_cells(dumps, layouts, cells, missing)
        aux = meta.aux.stream_ids if meta.aux else None
        stage_tensors = {s: self._stage(s, cells[s], dumps, layouts) for s in sorted(cells)}
        tensors, owner = self._union(stage_tensors, aux)
        self._range_facts(self.num_layers)
        for d in self.all_dumps:
            for k, tm in (d.metadata.tensors.items() if d.metadata else ()):
                meta.tensors.setdefault(k, tm.model_copy(deep=True))
        meta.tensors = {k: v for k, v in meta.tensors.items() if k in tensors}
        full_shapes(meta, tensors)
        meta.rank, meta.world_size = None, world
        meta.extra.pop(lay.KEY, None)
        meta.extra[MERGED_KEY] = {"pp": self.pp, "dp": self.dp, "nodes": self.nodes[:64],
                                  "stages": {str(s): list(r) for s, r in sorted(self.ranges.items())}}
        self.owner = owner
        super().__init__(first.path.parent / _set_name(first.path),
                         f"{first.format} x{world} ranks ({self._shape()})", tensors, meta)

    def _shape(self) -> str:
        parts = ([f"{self.pp} pipeline stages"] if self.pp > 1 else []) + ([f"dp {self.dp}"] if self.dp > 1 else [])
        return ", ".join(parts) or "staged"

    # -- grouping -------------------------------------------------------------------------
    @staticmethod
    def _one(dumps: dict[int, Dump], sizes: dict[int, int], what: str) -> int:
        vals = sorted(set(sizes.values()))
        if len(vals) != 1:
            r = next(r for r, v in sizes.items() if v != sizes[min(sizes)])
            raise InputError(dumps[r].path, f"rank files disagree on the {what}: {vals}")
        return vals[0]

    @staticmethod
    def _cells(dumps: dict[int, Dump], layouts: dict[int, lay.Layout]) -> dict[int, dict[int, dict[int, int]]]:
        """stage -> dp rank -> tp rank -> global rank."""
        cells: dict[int, dict[int, dict[int, int]]] = {}
        for r in sorted(layouts):
            x = layouts[r]
            s, d, t = (x.pp.rank if x.pp else 0), (x.dp.rank if x.dp else 0), (x.tp.rank if x.tp else 0)
            cell = cells.setdefault(s, {}).setdefault(d, {})
            if t in cell:
                raise InputError(dumps[r].path, f"rank {r} and rank {cell[t]} both claim stage {s}, dp rank {d}, "
                                 f"tp rank {t}")
            cell[t] = r
        return cells

    @staticmethod
    def _range(dumps: dict[int, Dump], layouts: dict[int, lay.Layout], cell: dict[int, dict[int, int]]) -> tuple[int, int]:
        got = {r: (layouts[r].pp.layers if layouts[r].pp else (0, ALL)) for g in cell.values() for r in g.values()}
        if len(set(got.values())) > 1:
            r = max(got, key=lambda k: got[k] != got[min(got)])
            raise InputError(dumps[r].path, f"ranks of one pipeline stage disagree on its layers: "
                             f"{sorted(set(got.values()))}")
        return next(iter(got.values()))

    def _check_cells(self, dumps: dict[int, Dump], layouts: dict[int, lay.Layout],
                     cells: dict[int, dict[int, dict[int, int]]], missing: list[int]) -> None:
        for s, cell in cells.items():
            r0 = next(iter(next(iter(cell.values())).values()))
            tp = layouts[r0].tp.size if layouts[r0].tp else 1
            holes = [(d, t) for d in range(self.dp) for t in range(tp) if t not in cell.get(d, {})]
            if holes:
                raise InputError(dumps[r0].path, f"pipeline stage {s} is incomplete: (dp rank, tp rank) "
                                 f"{holes[:8]} have no file (global ranks {_ranges(missing)} of {self.world} "
                                 f"missing{self._from_nodes()})")
        gone = [s for s in range(self.pp) if s not in cells]
        if missing and not gone:
            raise InputError(dumps[min(dumps)].path, f"rank files for ranks {_ranges(missing)} of {self.world} "
                             f"are missing{self._from_nodes()}")
        for s in gone:
            lo, hi = self._gap_for(s)
            self.layout_facts.append(LayoutFact.of(
                "STAGE_MISSING", stage=s, pp=self.pp, world=self.world, missing_ranks=missing[:256],
                n_missing=len(missing), nodes=self.nodes[:8], layers=[lo, hi]))

    def _from_nodes(self) -> str:
        return f"; files came from nodes {', '.join(repr(n) for n in self.nodes[:8])}" if self.nodes else ""

    def _gap_for(self, s: int) -> tuple[int | None, int | None]:
        """The layers a missing stage should have run: between its neighbours' ranges."""
        before = [r[1] for t, r in self.ranges.items() if t < s]
        after = [r[0] for t, r in self.ranges.items() if t > s]
        return (max(before) if before else 0), (min(after) if after else self.num_layers)

    # -- one stage ------------------------------------------------------------------------
    def _stage(self, s: int, cell: dict[int, dict[int, int]], dumps: dict[int, Dump],
               layouts: dict[int, lay.Layout]) -> dict[str, TensorView]:
        per_dp: list[dict[str, TensorView]] = []
        for d in range(self.dp):
            ranks = [cell[d][t] for t in sorted(cell[d])]
            tensors, reps = tp_combine([dumps[r] for r in ranks], ranks)
            for k, v in reps.items():
                if v[0] >= self.replica_checks.get(k, (-1.0, 0))[0]:
                    self.replica_checks[k] = v
            per_dp.append(tensors)
            if self.dp == 1:
                self.stage_tp[s] = [dumps[r] for r in ranks]
        if self.dp == 1:
            return per_dp[0]
        heads = [dumps[cell[d][min(cell[d])]] for d in range(self.dp)]
        toks = []
        for h in heads:
            t = lay.of(h.metadata, h.path)
            if t is None or t.dp is None:
                raise InputError(h.path, "declares no token ownership (parallel.dp) in a data-parallel set")
            if toks and (t.dp.rows is None) != (toks[0].rows is None):
                raise InputError(h.path, "declares its tokens by request while another rank declares rows "
                                 "(or the reverse): one scheme per set")
            toks.append(t.dp)
        own = merge_ownership(toks)
        self.token_keys = list(own.keys)  # the stitcher reads positions (and requests) from them
        rows_of = [{k: j for j, k in enumerate(t.keys())} for t in toks]
        out: dict[str, TensorView] = {}
        worst = 0.0
        for name in per_dp[0]:
            parts = [p.get(name) for p in per_dp]
            if any(v is None for v in parts):
                bad = heads[[v is None for v in parts].index(True)]
                raise InputError(bad.path, f"data-parallel rank file lacks tensor {name!r}")
            spec = _spec(heads[0], name)
            if spec is not None and spec.kind == "split" and spec.group == "dp":
                for h, v, t in zip(heads, parts, toks):
                    if v.rows != len(t.keys()):  # type: ignore[union-attr]
                        raise InputError(h.path, f"{name}: {v.rows} token rows but the layout declares "  # type: ignore[union-attr]
                                         f"{len(t.keys())} tokens")
                out[name] = TokenView.of(name, parts, own)  # type: ignore[arg-type]
                if own.duplicated and parts[0].is_float:  # type: ignore[union-attr]
                    worst = max(worst, duplicate_spread(parts, own.duplicated, rows_of))  # type: ignore[arg-type]
            else:
                out[name] = parts[0]  # type: ignore[assignment]
                if parts[0].is_float and all(p.shape == parts[0].shape for p in parts):  # type: ignore[union-attr]
                    spread, at = _replica_spread(parts)  # type: ignore[arg-type]
                    self.replica_checks[name] = (spread, cell[at][min(cell[at])])
        self._token_findings(s, own, worst)
        return out

    def _token_findings(self, s: int, own: Any, worst: float) -> None:
        stage = s if self.pp > 1 else None
        if own.unowned:
            self.layout_facts.append(LayoutFact.of("TOKEN_UNOWNED", stage=stage, tokens=len(own.unowned),
                                                   keys=list(own.unowned)[:4096]))
        if own.duplicated:
            by_pair: dict[tuple[int, ...], list[Any]] = {}
            for k, rs in own.duplicated.items():
                by_pair.setdefault(tuple(rs), []).append(k)
            self.layout_facts.append(LayoutFact.of(
                "TOKEN_DUPLICATE", stage=stage, tokens=len(own.duplicated), worst=float(worst),
                pairs=[[list(p), list(ks)[:4096]] for p, ks in list(by_pair.items())[:4]],
                kept=min(min(p) for p in by_pair)))

    # -- the union of stages --------------------------------------------------------------
    def _union(self, stage_tensors: dict[int, dict[str, TensorView]],
               aux: Sequence[int] | None) -> tuple[dict[str, TensorView], dict[str, int]]:
        merged: dict[str, TensorView] = {}
        owner: dict[str, int] = {}
        conflicts: dict[tuple[int, int], list[tuple[str, float]]] = {}
        for s, tensors in stage_tensors.items():
            lo, hi = self.ranges[s]
            outside = [n for n in tensors if not _in_range(_where(n, aux), lo, hi)]
            for name, v in tensors.items():
                if name not in merged:
                    merged[name], owner[name] = v, s
                    continue
                prev = owner[name]
                spread = _spread(merged[name], v)
                floor = CONFLICT_FLOOR.get(min(v._storage.itemsize, merged[name]._storage.itemsize), 1e-8)
                held = self.boundary.setdefault(name, ([prev], 0.0))
                self.boundary[name] = (held[0] + [s], max(held[1], spread))
                if spread > floor:
                    conflicts.setdefault((prev, s), []).append((name, spread))
                if name in outside:
                    continue
                if not _in_range(_where(name, aux), *self.ranges[prev]):
                    merged[name], owner[name] = v, s  # keep the copy of the stage the name belongs to
            if outside:
                self._outside(s, outside, aux)
        for (a, b), items in conflicts.items():
            self.layout_facts.append(LayoutFact.of("STAGE_CONFLICT", tensor=items[0][0], stages=[a, b],
                                                   count=len(items), items=[[n, float(d)] for n, d in items[:64]]))
        return merged, owner

    def _outside(self, s: int, outside: list[str], aux: Sequence[int] | None) -> None:
        lo, hi = self.ranges[s]
        ws = [w for n in outside if names.parse(n).kind != names.AUX and (w := _where(n, aux)) is not None]
        local = lo > 0 and bool(ws) and all(_in_range(w, lo, hi, shift=lo) for w in ws)
        self.layout_facts.append(LayoutFact.of("STAGE_OUT_OF_RANGE", tensor=outside[0], stage=s, layers=[lo, hi],
                                               names=outside[:64], count=len(outside), local_index=local))

    def _range_facts(self, num_layers: int | None) -> None:
        if self.pp == 1:
            return
        order = sorted(self.ranges.items(), key=lambda kv: kv[0])
        for (a, (alo, ahi)), (b, (blo, bhi)) in zip(order, order[1:]):
            if ahi > blo:
                self.layout_facts.append(LayoutFact.of("STAGE_RANGES", what="overlap", stages=[a, b],
                                                       ranges=[[alo, ahi], [blo, bhi]]))
            elif ahi < blo and b == a + 1:
                self.layout_facts.append(LayoutFact.of("STAGE_RANGES", what="gap", stages=[a, b],
                                                       ranges=[[alo, ahi], [blo, bhi]]))
        if order and order[0][0] == 0 and order[0][1][0] > 0:
            self.layout_facts.append(LayoutFact.of("STAGE_RANGES", what="late_start", stages=[0],
                                                   ranges=[list(order[0][1])]))
        if order and num_layers and order[-1][0] == self.pp - 1 and order[-1][1][1] != num_layers:
            s, (lo, hi) = order[-1]
            self.layout_facts.append(LayoutFact.of("STAGE_RANGES", what="short_end", stages=[s], ranges=[[lo, hi]],
                                                   num_layers=num_layers))

    # -- Dump API extras ------------------------------------------------------------------
    def rank_views(self, name: str) -> list[TensorView] | None:
        """The tensor-parallel ranks' own copies of ``name`` in the stage that holds it."""
        group = self.stage_tp.get(self.owner.get(name, -1))
        if not group or len(group) < 2:
            return None
        views = [d.tensors.get(name) for d in group]
        return None if any(v is None for v in views) else views  # type: ignore[return-value]

    def close(self) -> None:
        for d in getattr(self, "all_dumps", []):
            d.close()
        super().close()


def _spread(a: TensorView, b: TensorView) -> float:
    if a.shape != b.shape:
        return float("inf")
    if a.rows == 0:
        return 0.0
    if not (a.is_float and b.is_float):
        same = all((a.read_rows(i, i + 4096) == b.read_rows(i, i + 4096)).all() for i in range(0, a.rows, 4096))
        return 0.0 if same else float("inf")
    return _replica_spread([a, b])[0]


def layout_facts(d: Dump) -> list[LayoutFact]:
    """The facts a merged rank set carries, looking through view wrappers (``.base``)."""
    seen: Any = d
    for _ in range(8):
        found = getattr(seen, "layout_facts", None)
        if found:
            return list(found)
        seen = getattr(seen, "base", None)
        if seen is None:
            break
    return []
