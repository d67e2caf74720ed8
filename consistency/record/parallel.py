"""Declare where this process sits in a parallel layout, so its rank file can be merged.

Tensor parallelism needs nothing: the file name carries the rank. Pipeline stages and
DP attention need one call per process, before or while recording::

    from consistency.record import parallel
    parallel.declare(pp=(stage, num_stages), layers=(start_layer, end_layer),
                     tp=(tp_rank, tp_size))                       # a pipeline stage
    parallel.declare(dp=(dp_rank, dp_size), rows=[...])           # DP attention: my tokens

``layers`` is the stage's *global* layer range (``start_layer``/``end_layer`` in SGLang
and vLLM); tensors are then named by global ids (``hidden.{start_layer + i}``), which the
merger checks. ``rows`` are the logical (whole-batch) indices of the tokens this rank
holds, one per row it records; or give ``requests`` (request id per row) and
``positions`` (position within the request). After ``declare``, ``shard='h[tp]'`` and
``'t[dp]'`` take the rank within that group, not the global rank. The host name is
recorded too, so a set gathered from several nodes says where each file came from.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Any

from consistency.dump.layout import KEY, Layout
from consistency.errors import UsageError
from consistency.record import recorder as _rec


def _pair(x: tuple[int, int] | None, what: str) -> dict[str, int] | None:
    if x is None:
        return None
    try:
        r, n = (int(v) for v in x)
    except (TypeError, ValueError):
        raise UsageError(f"{what} must be (rank, size), got {x!r}") from None
    return {"rank": r, "size": n}


def _ints(x: Any) -> list[int] | None:
    if x is None:
        return None
    return [int(v) for v in (x.tolist() if hasattr(x, "tolist") else x)]


def declare(*, pp: tuple[int, int] | None = None, layers: tuple[int, int] | None = None,
            tp: tuple[int, int] | None = None, dp: tuple[int, int] | None = None, ep: tuple[int, int] | None = None,
            rows: Sequence[int] | Any = None, requests: Sequence[int | str] | None = None,
            positions: Sequence[int] | Any = None, total: int | None = None, node: str | None = None,
            recorder: _rec.Recorder | None = None) -> Layout | None:
    """Write the layout into the active (or given) recorder's metadata; None if not recording."""
    rec = recorder or _rec.active() or _rec._from_env()
    raw: dict[str, Any] = {"node": node if node is not None else socket.gethostname()}
    if pp is not None:
        if layers is None:
            raise UsageError("a pipeline stage needs layers=(start_layer, end_layer), its global layer range")
        raw["pp"] = {**(_pair(pp, "pp") or {}), "layers": [int(layers[0]), int(layers[1])]}
    for key, val in (("tp", tp), ("ep", ep)):
        if val is not None:
            raw[key] = _pair(val, key)
    if dp is not None:
        tok: dict[str, Any] = {**(_pair(dp, "dp") or {}), "rows": _ints(rows), "positions": _ints(positions),
                               "total": total}
        tok["requests"] = None if requests is None else [q if isinstance(q, str) else int(q) for q in requests]
        raw["dp"] = tok
    try:
        layout = Layout.model_validate(raw)
    except ValueError as exc:
        raise UsageError(f"parallel.declare: {str(exc).splitlines()[-1] if str(exc) else exc}") from None
    if rec is not None:
        rec.metadata.extra[KEY] = layout.model_dump(exclude_none=True)
    return layout
