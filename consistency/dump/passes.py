"""Forward passes of a dump whose recorder left some captures out, paired by their graph tags.

Stitching needs every name in every forward pass: capture ``#k`` of each name is pass k. A
recorder that could not record some captures (a graph-buffer budget that fits two graphs
of four, a full host ring) says so in its metadata (``cuda_graphs.not_recorded``,
``dropped_captures``) and numbers each name's captures by what it did record, so a short
name's ``#k`` is no longer pass k. This module pairs each capture of a short name with the
pass it belongs to -- by its graph tag (``TensorMeta.graph``: graph, batch size, replay),
an untagged (eager) capture with the next eager pass, always with the pass's token count --
and keeps the passes every name holds, numbered again from 1, so the stitcher sees a
complete dump. What it left out is returned in words-free numbers (``LeftOut``) for
CAPTURES_DROPPED to say; a name whose captures pair with no pass is left out whole. Only a
dump whose metadata declares drops is treated so: for any other a short name is still the
one-line refusal (a file we did not write that way is not guessed at).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

from consistency.dump.reader import Dump, TensorView

Tag = tuple[str | None, int | None, int | None] | None  # (graph label, batch size, replay); None: eager
MAX_SKIP = 64  # passes of the right tag but another token count skipped before a capture fits none


@dataclass
class LeftOut:
    """What pairing by graph tags could not compare: passes some name lacks (each with its
    graph, None for eager), and names whose captures fit no pass."""

    passes: int = 0
    total: int = 0
    graphs: dict[str, int] = field(default_factory=dict)  # "label bs=N" (or "eager") -> passes left out
    lacking: dict[str, int] = field(default_factory=dict)  # name -> passes it lacks
    names: list[str] = field(default_factory=list)  # names left out whole

    def as_dict(self) -> dict[str, Any]:
        return {"passes": self.passes, "of": self.total, "graphs": dict(sorted(self.graphs.items())[:16]),
                "lacking": dict(sorted(self.lacking.items())[:32]), "names": self.names[:32]}


def declared(d: Dump) -> set[str]:
    """Names the dump's own metadata says were not recorded (read defensively: untrusted)."""
    meta = getattr(d, "metadata", None)
    extra = meta.extra if meta is not None and isinstance(meta.extra, dict) else {}
    out: set[str] = set()
    flat = extra.get("dropped_captures")
    graph = extra.get("cuda_graphs", {}).get("not_recorded") if isinstance(extra.get("cuda_graphs"), dict) else None
    for source in ([flat] if isinstance(flat, dict) else []) + (list(graph.values()) if isinstance(graph, dict) else []):
        if isinstance(source, dict):
            out |= {str(n) for n, c in source.items() if isinstance(c, int) and not isinstance(c, bool) and c > 0}
    return out


def _tag(d: Dump, key: str) -> Tag:
    tm = d.metadata.tensors.get(key) if d.metadata is not None else None
    g = getattr(tm, "graph", None)
    if g is None:
        return None
    return (g.label, g.batch_size, g.replay)


def _index(sigs: list[list[Tag]]) -> dict[Any, list[int]]:
    """Passes by exact tag, by (batch size, replay) and eager (None), each in order: one
    lookup per capture (a dump of many captures never scans every pass per capture)."""
    out: dict[Any, list[int]] = {}
    for i, tags in enumerate(sigs):
        for t in tags:
            keys = [("eager",)] if t is None else [("tag", t), ("step", t[1], t[2])]
            for key in keys:
                got = out.setdefault(key, [])
                if not got or got[-1] != i:
                    got.append(i)
    return out


def _assign(caps: list[tuple[int, TensorView]], tags: list[Tag], index: dict[Any, list[int]],
            rows: list[int]) -> list[int] | None:
    """The pass of each capture, in order: the next pass whose full names carry the same
    tag (the same graph and replay), else the same batch size and replay (another graph of
    the same step: a draft's graph beside the target's), eager with eager; the token count
    must be the pass's. None: some capture fits no pass."""
    out: list[int] = []
    at = 0
    for (_k, v), t in zip(caps, tags, strict=True):
        hit = None
        for key in ([("eager",)] if t is None else [("tag", t), ("step", t[1], t[2])]):
            cands = index.get(key, [])
            j0 = bisect.bisect_left(cands, at)
            hit = next((cands[j] for j in range(j0, min(len(cands), j0 + MAX_SKIP)) if rows[cands[j]] == v.rows), None)
            if hit is not None:
                break
        if hit is None:
            return None
        out.append(hit)
        at = hit + 1
    return out


def complete(d: Dump, groups: dict[str, list[tuple[int, TensorView]]],
             anchor: str) -> tuple[dict[str, list[tuple[int, TensorView]]], LeftOut] | None:
    """Groups renumbered to the passes every name holds, and what was left out; None when
    nothing needs it (every name complete) or the dump declares no drops. ``anchor`` (the
    token ids, else the positions) numbers the passes and gives each its token count."""
    drops = declared(d)
    if not drops or not groups:
        return None
    k = max(len(c) for c in groups.values())
    full = sorted(b for b, c in groups.items() if len(c) == k)
    first = anchor if anchor in full else full[0]
    if any(len(v.shape) > 2 for _k, v in groups[first]):
        return None
    rows = [v.rows for _k, v in groups[first]]
    on_axis = {b for b, caps in groups.items() if len(caps) > 1 or b in drops or caps[0][1].rows == rows[0]}
    short = [b for b in on_axis if len(groups[b]) < k]
    if not short:
        return None
    sigs = [[_tag(d, groups[b][i][1].name) for b in full] for i in range(k)]
    index = _index(sigs)
    left = LeftOut(total=k)
    where: dict[str, list[int]] = {}
    for b in sorted(short):
        got = _assign(groups[b], [_tag(d, v.name) for _k, v in groups[b]], index, rows)
        if got is None:
            left.names.append(b)
        else:
            where[b] = got
    held = [set(w) for w in where.values()]
    keep = [i for i in range(k) if all(i in h for h in held)]
    for b, w in where.items():
        left.lacking[b] = k - len(w)
    kept = set(keep)
    for i in range(k):
        if i in kept:
            continue
        left.passes += 1
        tags = [s for s in sigs[i] if s is not None]
        what = f"{', '.join(sorted({str(t[0]) for t in tags}))} bs={tags[0][1]}" if tags else "eager"
        left.graphs[what] = left.graphs.get(what, 0) + 1
    new_no = {i: j + 1 for j, i in enumerate(keep)}
    out: dict[str, list[tuple[int, TensorView]]] = {}
    for b, caps in groups.items():
        if b in left.names:
            continue
        if b in where:
            out[b] = [(new_no[i], v) for (_k, v), i in zip(caps, where[b], strict=True) if i in new_no]
        elif b in full:
            out[b] = [(new_no[i], caps[i][1]) for i in keep]
        else:
            out[b] = caps  # not on the token axis: kept as it is
    return out, left
