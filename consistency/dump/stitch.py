"""Join the captures of one name into one token axis, request by request.

A serving runtime runs a prompt as several forward passes (chunked prefill, then one
decode step per token, several requests per batch), and the recorder writes one capture
per pass: ``aux.0``, ``aux.0#2``, ``aux.0#3``, ... beside ``input_ids``/``input_ids#k``,
``positions``/``positions#k`` and, where the runtime has them, ``request_ids#k``. Capture
``#k`` of every name belongs to forward pass k. Stitching concatenates the passes and
orders their rows into per-request segments:

* with ``request_ids``: rows group by request; inside a request, positions rise, except
  where a verify pass rewinds into the drafted rows of the pass before it
  (:mod:`consistency.dump.segments`: the rejected drafts' rows are superseded);
* with ``positions`` only: a row continues the open segment that expects its position
  (its last position + 1), else rewinds one (a verify pass); a run starting at 0 is a new
  request; the first pass may start anywhere (a prefix-cache hit computes only the suffix);
* with neither: capture order, one segment.

A ``[B, T]`` ``input_ids`` of a single capture (an HF batch) is B segments of T rows.
Without request ids, two requests whose positions happen to be consecutive inside one
pass (a decode at 6 right after another's at 5) read as one run; the ids guard against
that: a mis-stitched token no longer matches the reference's ids and is reported as
extra or missing by the alignment, never compared against the wrong row.

The rules are strict because a wrong stitch would compare the wrong tokens silently:
captures counts that differ between names, rows that differ from the ids of the same
pass, ids without states, and positions that go backwards or overlap inside a request
(other than a verify pass's rewind) are one-line :class:`InputError` s naming the file and
the tensor.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from consistency.dump import names, passes
from consistency.dump.reader import Dump, TensorView
from consistency.dump.segments import Gap, Segment, Verify, by_positions, by_request
from consistency.dump.rows import ConcatView, RowView, ViewDump, array_view
from consistency.errors import InputError

POSITIONS = "positions"
REQUEST_IDS = "request_ids"
LAYOUT_NAMES = (POSITIONS, REQUEST_IDS)  # consumed here, never compared
MAX_ID_ROWS = 1 << 24  # ids/positions are read whole (8 bytes each); past this they are not token ids
_KEY = re.compile(r"^(?P<base>.+)#(?P<k>[0-9]{1,9})$")


def split_key(key: str) -> tuple[str, int]:
    """``'aux.0#3'`` -> ``('aux.0', 3)``; ``'aux.0'`` -> ``('aux.0', 1)``."""
    m = _KEY.match(key)
    return (m.group("base"), int(m.group("k"))) if m else (key, 1)


@dataclass
class Layout:
    """How a dump's captures became one token axis."""

    captures: int
    source: str  # 'request_ids', 'positions', 'batch rows', 'capture order'
    segments: list[Segment]
    per_pass: list[int]  # token rows of each forward pass
    ids: np.ndarray | None  # stitched ids, segment after segment
    positions: np.ndarray | None
    gaps: list[Gap] = field(default_factory=list)  # positions a request skips (never captured)
    verify: Verify = field(default_factory=Verify)  # what verify passes superseded (dump.segments)
    pass_positions: list[np.ndarray] | None = None  # each pass's positions as recorded (naming rows)
    declared: bool = False  # the positions are the DP ranks' declaration, not recorded: the values may overrule them

    def response(self) -> np.ndarray | None:
        """Per stitched row: True from its request's first decode or verify pass on (what a
        server drafts on); None when no request shows one."""
        if not any(s.generated_from is not None for s in self.segments):
            return None
        out = [np.asarray(s.positions) >= (s.generated_from if s.generated_from is not None else 1 << 62)
               for s in self.segments]
        return np.concatenate(out) if out else np.zeros(0, bool)

    @property
    def tokens(self) -> int:
        return sum(len(s.rows) for s in self.segments)

    def bounds(self) -> list[tuple[int, int]]:
        """[start, stop) of each segment on the stitched axis."""
        out, at = [], 0
        for s in self.segments:
            out.append((at, at + len(s.rows)))
            at += len(s.rows)
        return out


def _groups(d: Dump) -> dict[str, list[tuple[int, TensorView]]]:
    groups: dict[str, list[tuple[int, TensorView]]] = {}
    for key, v in d.tensors.items():
        base, k = split_key(key)
        groups.setdefault(base, []).append((k, v))
    for base, caps in groups.items():
        caps.sort(key=lambda c: c[0])
        ks = [k for k, _v in caps]
        if ks != list(range(1, len(ks) + 1)):
            i = next(i for i, k in enumerate(ks) if k != i + 1)  # never materialise range(max k): k is untrusted
            what = f"capture {base}#{ks[i]} is numbered twice" if ks[i] == i else f"capture {base}#{i + 1} is missing"
            raise InputError(d.path, f"tensor {base!r} has captures {_show(ks)}: {what} (mismatched #k sequence)")
    return groups


def _show(ks: list[int]) -> str:
    return "[" + ", ".join(str(k) for k in ks[:8]) + (", ..." if len(ks) > 8 else "") + "]"


def _ints(d: Dump, v: TensorView) -> np.ndarray:
    if v.is_float:
        raise InputError(d.path, f"tensor {v.name!r} must hold integers, it is {v.dtype}")
    if v.numel > MAX_ID_ROWS:
        raise InputError(d.path, f"tensor {v.name!r} has {v.numel} values, too many for token ids")
    return v.read_all().reshape(-1).astype(np.int64)


def needs_stitching(d: Dump) -> bool:
    """True when the dump holds ``#k`` captures or layout tensors (positions, request ids),
    or is a data-parallel merge whose ranks declared their tokens."""
    return any(_KEY.match(k) for k in d.tensors) or any(n in d.tensors for n in LAYOUT_NAMES) \
        or (bool(getattr(d, "token_keys", None)) and (_unowned(d) or _requests(d) > 1))


def _unowned(d: Dump) -> bool:
    return any(f.code == "TOKEN_UNOWNED" for f in getattr(d, "layout_facts", []))


def _requests(d: Dump) -> int:
    """Requests the data-parallel ranks declared their tokens by (0: rows, or no declaration)."""
    keys = getattr(d, "token_keys", None) or []
    return len({k[0] for k in keys}) if keys and len(keys[0]) == 2 else 0


def complete_groups(d: Dump) -> tuple[dict[str, list[tuple[int, TensorView]]], passes.LeftOut | None]:
    """The dump's capture groups; where its recorder declares captures it did not record,
    renumbered to the passes every name holds (dump.passes), with what was left out."""
    groups = _groups(d)
    anchor = names.INPUT_IDS if names.INPUT_IDS in groups else POSITIONS
    got = passes.complete(d, groups, anchor)
    return (groups, None) if got is None else got


def layout(d: Dump, grouped: tuple[dict, passes.LeftOut | None] | None = None) -> Layout:
    """Segments of the dump's captures (see the module docstring); no tensor data is read
    except the ids, positions and request ids."""
    groups = (grouped or complete_groups(d))[0]
    ids_caps = groups.get(names.INPUT_IDS)
    k = max(len(c) for c in groups.values())
    per_pass: list[int] | None = None
    ids_parts: list[np.ndarray] | None = None
    batch_rows: int | None = None
    if ids_caps is not None:
        if len(ids_caps) != k:
            other = next(b for b, c in groups.items() if len(c) == k)
            raise InputError(d.path, f"tensor {names.INPUT_IDS!r} has {len(ids_caps)} captures but {other!r} has {k}: "
                             f"ids without states (or states without ids) in some forward pass")
        ids_parts = [_ints(d, v) for _k, v in ids_caps]
        per_pass = [len(p) for p in ids_parts]
        if k == 1 and len(ids_caps[0][1].shape) == 2 and ids_caps[0][1].shape[0] > 1:
            batch_rows = ids_caps[0][1].shape[1]
    pos_parts = _layout_parts(d, groups, POSITIONS, k, per_pass)
    declared = False  # positions from the ranks' ownership declaration, not a recorded tensor: a claim
    if per_pass is None and pos_parts is not None:
        per_pass = [len(p) for p in pos_parts]
    req_parts = _layout_parts(d, groups, REQUEST_IDS, k, per_pass)
    if req_parts is None and k == 1:
        own_pos, req_parts = _from_ownership(d, per_pass)
        declared = pos_parts is None and own_pos is not None
        pos_parts = pos_parts if pos_parts is not None else own_pos
    if per_pass is None:
        per_pass = _rows_per_pass(d, groups, k)
    total = sum(per_pass)
    offsets = np.concatenate(([0], np.cumsum(per_pass))).astype(np.int64)
    gaps: list[Gap] = []
    verify = Verify()
    key_of = lambda k: POSITIONS if k == 0 else f"{POSITIONS}#{k + 1}"  # noqa: E731
    if req_parts is not None:
        j = by_request(d.path, np.concatenate(req_parts), _positions_or_order(pos_parts, total), offsets, key_of,
                       pos_parts is not None)
        segs, verify, gaps = j.finish(), j.verify, j.gaps
        source = REQUEST_IDS
    elif pos_parts is not None:
        j = by_positions(d.path, pos_parts, offsets, key_of)
        segs, verify, gaps = j.finish(), j.verify, j.gaps
        source = POSITIONS
    elif batch_rows:
        segs = [Segment(f"row {b}", list(range(b * batch_rows, (b + 1) * batch_rows)), list(range(batch_rows)))
                for b in range(total // batch_rows)]
        source = "batch rows"
    else:
        # ranges, not lists: a dump with no ids and no layout stays O(1) in its token count
        # (a 67M-row tensor must not become two 67M-element Python lists)
        segs = [Segment("all", range(total), range(total))]  # type: ignore[arg-type]
        source = "capture order"
        if ids_parts is None:
            return Layout(k, source, segs, per_pass, None, None, gaps)
    order = np.asarray([r for s in segs for r in s.rows], dtype=np.int64)
    ids = np.concatenate(ids_parts)[order] if ids_parts is not None else None
    pos = np.asarray([p for s in segs for p in s.positions], dtype=np.int64)
    if pos_parts is None and batch_rows:
        pos_parts = [np.tile(np.arange(batch_rows, dtype=np.int64), total // batch_rows)]
    return Layout(k, source, segs, per_pass, ids, pos if (pos_parts is not None or batch_rows) else None, gaps,
                  verify, pos_parts, declared)


def _layout_parts(d: Dump, groups: dict, name: str, k: int, per_pass: list[int] | None) -> list[np.ndarray] | None:
    caps = groups.get(name)
    if caps is None:
        return None
    if len(caps) != k:
        raise InputError(d.path, f"tensor {name!r} has {len(caps)} captures but the states have {k} (mismatched #k sequence)")
    parts = [_ints(d, v) for _k, v in caps]
    if per_pass is not None:
        for i, (p, n) in enumerate(zip(parts, per_pass, strict=True)):
            if len(p) != n:
                key = name if i == 0 else f"{name}#{i + 1}"
                raise InputError(d.path, f"tensor {key!r} has {len(p)} values but its forward pass has {n} token ids")
    return parts


def _from_ownership(d: Dump, per_pass: list[int] | None) -> tuple[list[np.ndarray] | None, list[np.ndarray] | None]:
    """A data-parallel merge without recorded request ids: each rank declared which tokens its
    rows are (request + position, or the row of a one-sequence batch), so a token no rank
    holds is a gap the positions jump over, not a change of context, and the merged rows
    (sorted by request, then position) are one segment per request, never one sequence."""
    keys = getattr(d, "token_keys", None)
    if not keys or (per_pass is not None and len(keys) != per_pass[0]) or not (_unowned(d) or _requests(d) > 1):
        return None, None  # one sequence, nothing missing: the merged rows are the tokens in order
    if len(keys[0]) == 1:
        return [np.asarray([int(k[0]) for k in keys], np.int64)], None
    reqs = {q: i for i, q in enumerate(dict.fromkeys(k[0] for k in keys))}
    return [np.asarray([int(k[1]) for k in keys], np.int64)], [np.asarray([reqs[k[0]] for k in keys], np.int64)]


def _rows_per_pass(d: Dump, groups: dict, k: int) -> list[int]:
    """Without ids or positions: the rows of the first multi-capture float tensor."""
    for base, caps in sorted(groups.items()):
        if len(caps) == k and caps[0][1].is_float:
            return [v.rows for _k, v in caps]
    return [next(iter(groups.values()))[0][1].rows]


def _positions_or_order(pos_parts: list[np.ndarray] | None, total: int) -> np.ndarray:
    return np.concatenate(pos_parts) if pos_parts is not None else np.arange(total, dtype=np.int64)


def stitch(d: Dump) -> tuple[Dump, Layout]:
    """``d`` with every name's captures joined into one tensor on the stitched token axis.

    Returns the dump unchanged (and a one-segment layout) when it holds single captures
    and no layout tensors. Layout tensors (positions, request ids) are consumed, not kept.
    """
    groups, left = grouped = complete_groups(d)
    lay = layout(d, grouped)
    if not needs_stitching(d) and lay.source == "capture order":
        return d, lay
    order = np.asarray([r for s in lay.segments for r in s.rows], dtype=np.int64)
    tensors: dict[str, TensorView] = {}
    joins: dict[str, tuple[list[str], np.ndarray]] = {}  # stitched name -> (capture keys, row order)
    for base, caps in groups.items():
        if base in LAYOUT_NAMES:
            continue
        if base == names.INPUT_IDS and lay.ids is not None:
            tensors[base] = array_view(base, lay.ids, d.path, caps[0][1].dtype if not caps[0][1].is_float else "int64")
            continue
        views = [v for _k, v in caps]
        if len(views) == 1 and lay.captures > 1 and not (views[0].is_float and views[0].rows == lay.per_pass[0]):
            tensors[base] = views[0]  # not on the token axis (a constant, a summary): kept as it is
            continue
        if len(views) != lay.captures:
            raise InputError(d.path, f"tensor {base!r} has {len(views)} capture(s) but input_ids has {lay.captures} "
                             f"(mismatched #k sequence)")
        if lay.captures == 1 and views[0].rows != len(order):
            tensors[base] = views[0]
            continue
        widths = {v.cols for v in views}
        if len(widths) > 1:
            raise InputError(d.path, f"tensor {base!r}: its captures have different widths {sorted(widths)}")
        for v, n in zip(views, lay.per_pass, strict=True):
            if v.rows != n:
                raise InputError(d.path, f"tensor {v.name!r} has {v.rows} rows but its forward pass has {n} token ids "
                                 f"(ids without states, or states without ids)")
        joins[base] = ([base if k == 1 else f"{base}#{k}" for k, _v in caps] if left is None
                       else [v.name for _k, v in caps], order)
        joined = views[0] if len(views) == 1 else ConcatView.of(views, base)
        tensors[base] = RowView.of(joined, order, base) if not _identity(order) else _renamed(joined, base)
    meta = (d.metadata.model_copy(deep=True) if d.metadata else None)
    if meta is not None:
        meta.tensors = {k: v for k, v in meta.tensors.items() if k in tensors}
        meta.extra["stitched"] = {"captures": lay.captures, "source": lay.source, "segments": len(lay.segments),
                                  "tokens": lay.tokens, **({"verify": lay.verify.as_dict()} if lay.verify.any else {}),
                                  **({"left_out": left.as_dict()} if left is not None else {})}
    out = ViewDump(d, tensors, meta, fmt=f"{d.format} ({lay.captures} captures stitched)")
    out.joins = joins  # rank_views of a tensor-parallel set follow the same stitch
    # naming a compared row by its capture and position (dump.rows.origin); a file's #k is no
    # longer pass k once passes were left out, so its rows are named without a position
    out.pass_positions = lay.pass_positions if left is None else None
    return out, lay


def _identity(order: np.ndarray) -> bool:
    return bool(len(order) == 0 or (order[0] == 0 and np.all(np.diff(order) == 1)))


def _renamed(v: TensorView, name: str) -> TensorView:
    if v.name == name:
        return v
    return RowView.of(v, np.arange(v.rows), name)
