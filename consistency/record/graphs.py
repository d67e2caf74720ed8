"""Graph-safe capture: record what every CUDA-graph replay computes, not what the capture saw.

A ``capture(name, t)`` inside a region that ``torch.cuda.CUDAGraph`` captures runs once, at
capture, on dummy inputs; a replay runs no Python. In graph-safe mode such a capture
instead allocates a device buffer for ``t`` (once per graph, so once per graph batch size)
and copies ``t`` into it with a device-side op the graph records, so every replay
refreshes the buffer. After each replay (a wrapper around ``CUDAGraph.replay``, or the
runtime's graph runner: :mod:`consistency.record.graph_runners`) the buffers are drained to
the active recorder in capture order, so names number ``#k`` as an eager run numbers them;
padded rows are trimmed to the real token count the runtime used, and each capture is
tagged (``TensorMeta.graph``) with the graph, its batch size and the replay.

What is never done: a synchronisation inside capture or replay (the drain issues copies in
stream order; the async recorder moves them to the host on a side stream), a host value
read inside a capture (it would be the capture's value forever: counted instead, see
``not_recorded``), or more device memory than the budget (``CONSISTENCY_RECORD_GRAPH_BYTES``,
default 1 GiB): a point that does not fit is not recorded in that graph, said once on
stderr and in the dump's metadata, never silently. Eager captures are untouched.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from consistency.record import recorder
from consistency.record.fallback import env_count, say
from consistency.record.graph_plan import (DEFAULT_BYTES, ENV_BYTES, Budget, HostIndex, Plan, Replay, Session,
                                          parse_bytes, stream_capturing, trim)

ENV_GRAPHS = "CONSISTENCY_RECORD_GRAPHS"  # "1": graph-safe mode (the autopatch turns it on)
ENV_TOKENS = "CONSISTENCY_RECORD_TOKENS"  # patch.ENV_TOKENS: under graphs it filters on the real rows
META_KEY = "cuda_graphs"  # DumpMetadata.extra[META_KEY]: budget, graphs, replays, what was not recorded

_tls = threading.local()  # plan: the graph this thread is capturing; session; pending replays; next sizes
_lock = threading.Lock()


# -- module state -------------------------------------------------------------------------------
_budget: Budget | None = None
_enabled = False
_count = [0]  # graphs planned so far: names the unlabelled ones


def budget() -> Budget:
    global _budget
    if _budget is None:
        try:  # inside the host's graph capture: a bad value is said once and the default used, never raised
            limit = parse_bytes(os.environ[ENV_BYTES]) if os.environ.get(ENV_BYTES, "").strip() else DEFAULT_BYTES
        except ValueError as exc:
            say(f"{exc}; using the default {DEFAULT_BYTES} bytes")
            limit = DEFAULT_BYTES
        _budget = Budget(limit)
    return _budget


def env_on() -> bool:
    return os.environ.get(ENV_GRAPHS, "") not in ("", "0")


def on() -> bool:
    return _enabled


def enable(budget_bytes: int | None = None, hook_torch: bool = True) -> None:
    """Turn graph-safe mode on: captures inside a graph capture go to buffers, replays drain them.

    ``hook_torch`` wraps ``torch.cuda.CUDAGraph.capture_begin/capture_end/replay`` (every
    graph of the process, whoever captures it); without it only graphs that call
    :func:`on_capture_begin` / :func:`on_replay` themselves are seen."""
    global _enabled, _budget
    if budget_bytes is not None:
        _budget = Budget(budget_bytes)
    _enabled = True
    recorder.graph_hook = intercept
    if hook_torch:
        hook_cuda_graphs()


def disable() -> None:
    global _enabled
    _enabled = False
    recorder.graph_hook = None


def capturing() -> bool:
    """True while this thread captures a graph that graph-safe mode plans (cheap: a thread-local)."""
    return getattr(_tls, "plan", None) is not None


def plan_of(graph: Any) -> Plan | None:
    return graph.__dict__.get("_consistency_plan") if hasattr(graph, "__dict__") else None


# -- capture side --------------------------------------------------------------------------------
def on_capture_begin(graph: Any) -> None:
    if not _enabled:
        return
    plan = plan_of(graph)
    if plan is None:
        sess = getattr(_tls, "session", None)
        with _lock:
            _count[0] += 1
            n = _count[0]
        plan = Plan(sess.label if sess else f"graph {n}", sess.bs if sess else None, sess.tokens if sess else None,
                    budget())
        graph.__dict__["_consistency_plan"] = plan
        try:
            weakref.finalize(graph, plan.release)  # a graph's buffers go with it, and leave the budget
        except TypeError:
            pass
    plan.cursor = plan.draft_passes = 0
    _tls.plan = plan


def on_capture_end(graph: Any) -> None:
    plan = getattr(_tls, "plan", None)
    _tls.plan = None
    if plan is not None:
        plan.end()
        if plan.tokens is None:  # an unlabelled graph: its padded rows are its first capture's
            plan.tokens = next((int(e.buf.shape[0]) for e in plan.entries if e.buf is not None and e.buf.dim()), None)


def intercept(rec: Any, name: str, tensor: Any, producer: str | None, meta: dict[str, Any]) -> bool:
    """recorder.capture's hook: True when graph-safe mode took the capture (nothing else to do)."""
    if not getattr(rec, "enabled", True):
        return True  # a recorder that records nothing (rank0_only on another rank)
    plan = getattr(_tls, "plan", None)
    if plan is not None:
        plan.add(name, tensor, producer, meta)
        return True
    if stream_capturing():  # a capture graph-safe mode does not plan (not torch.cuda.CUDAGraph)
        _note(rec, "unplanned graph capture (not a torch.cuda.CUDAGraph)", name)
        return True
    sess = getattr(_tls, "session", None)
    if sess is not None and sess.suppress_eager:  # the runtime's warm-up forwards before a capture
        sess.suppressed += 1
        return True
    return False


def draft_pass() -> int | None:
    """How many MTP draft passes the graph being captured made before this one (and count
    this one); None outside a capture graph-safe mode plans. Known at capture, unlike any
    value a replay computes: record/mtp_patch.py numbers a graph's draft steps by it."""
    plan = getattr(_tls, "plan", None)
    if plan is None:
        return None
    plan.draft_passes += 1
    return plan.draft_passes - 1


def not_recorded(reason: str, name: str) -> None:
    """A point of the graph being captured that is not recorded: every replay of it is
    counted under the dump's ``cuda_graphs.not_recorded``, as a point over the budget is."""
    plan = getattr(_tls, "plan", None)
    if plan is not None:
        plan.skip(name, reason)


def defer(name: str, producer: str | None = None) -> None:
    """A host value of this pass (request ids) the runtime hook supplies at each replay."""
    plan = getattr(_tls, "plan", None)
    if plan is not None:
        plan.defer(name, producer or name)


@contextmanager
def session(label: str, bs: int | None = None, tokens: int | None = None,
            suppress_eager: bool = True) -> Iterator[Session]:
    """A runtime captures one graph shape inside: its plans get these labels, and eager
    captures in it (the warm-up forwards on dummy inputs) are not recorded."""
    prev = getattr(_tls, "session", None)
    _tls.session = s = Session(label, bs, tokens, suppress_eager)
    try:
        yield s
    finally:
        _tls.session = prev


# -- replay side ---------------------------------------------------------------------------------
class Pending:
    """Replays seen inside :func:`deferred`, drained when the runtime knows the real rows."""

    def __init__(self) -> None:
        self.plans: list[Plan] = []

    def drain(self, sizes: Replay) -> None:
        plans, self.plans = self.plans, []
        for plan in plans:
            drain(plan, sizes)


@contextmanager
def deferred() -> Iterator[Pending]:
    prev = getattr(_tls, "pending", None)
    _tls.pending = p = Pending()
    try:
        yield p
    finally:
        _tls.pending = prev


@contextmanager
def replay_sizes(real_tokens: int | None = None, real_bs: int | None = None) -> Iterator[None]:
    """The real rows of the replays inside (a loop of your own): padded rows past them are trimmed."""
    prev = getattr(_tls, "sizes", None)
    _tls.sizes = Replay(real_tokens=real_tokens, real_bs=real_bs)
    try:
        yield
    finally:
        _tls.sizes = prev


def expect(sizes: Replay | None) -> None:
    """The next replay on this thread has these sizes (a runtime hook that learns them early);
    None drops sizes no replay took."""
    _tls.next_sizes = sizes


def on_replay(graph: Any) -> None:
    plan = plan_of(graph)
    if plan is None or not plan.entries:
        return
    pending = getattr(_tls, "pending", None)
    if pending is not None:
        pending.plans.append(plan)
        return
    sizes = getattr(_tls, "next_sizes", None) or getattr(_tls, "sizes", None) or Replay()
    _tls.next_sizes = None
    drain(plan, sizes)


def drain(plan: Plan, sizes: Replay, rec: Any = None) -> None:
    """Hand one replay's buffers to the recorder, trimmed and tagged, in capture order.

    Device work only (slices and the recorder's own stream-ordered copies): the host never
    waits here. A replay with no real token (an idle or dummy batch) records nothing."""
    from consistency.contract.models import GraphTag

    plan.replays += 1
    rec = rec if rec is not None else recorder.active()
    if rec is None or not getattr(rec, "enabled", True) or sizes.real_tokens == 0 or sizes.real_bs == 0:
        return
    padded_tokens = sizes.padded_tokens if sizes.padded_tokens is not None else plan.tokens
    padded_bs = sizes.padded_bs if sizes.padded_bs is not None else plan.bs
    want = env_count(ENV_TOKENS)
    if want is not None and (sizes.real_tokens if sizes.real_tokens is not None else padded_tokens) != want:
        return
    info = _summary(rec, plan)
    info["replays"] += 1
    for e in plan.entries:
        if e.deferred:
            make = sizes.values.get(e.name)
            value = make(sizes.real_tokens) if make is not None else None
            if value is None:
                _note(rec, "not available at replay", e.name)
            else:
                rec.capture(e.name, value, e.producer)
            continue
        if e.buf is None:
            _note(rec, e.reason or "not recorded", e.name)
            continue
        t, kept = trim(e.buf, sizes, padded_tokens, padded_bs)
        pos = trim(e.positions, sizes, padded_tokens, padded_bs)[0] if e.positions is not None else None
        extra = {} if e.anchors is None else \
            {"token_index": HostIndex(trim(e.anchors, sizes, padded_tokens, padded_bs)[0])}  # no wait: read at write
        tag = GraphTag.model_construct(label=plan.label, batch_size=padded_bs, real_batch_size=sizes.real_bs,
                                       tokens=padded_tokens, real_tokens=sizes.real_tokens, replay=plan.replays,
                                       rows=int(e.buf.shape[0]) if e.buf.dim() else None, kept=kept)
        rec.capture(e.name, t, e.producer, positions=pos, **e.meta, **extra, graph=tag)


# -- helpers --------------------------------------------------------------------------------------
def _summary(rec: Any, plan: Plan) -> dict[str, Any]:
    root = rec.metadata.extra.setdefault(META_KEY, {"budget_bytes": budget().limit, "graphs": {}})
    root["buffer_bytes"] = budget().used
    g = root["graphs"].get(plan.key())
    if g is None:
        g = root["graphs"][plan.key()] = {"label": plan.label, "batch_size": plan.bs, "tokens": plan.tokens,
                                          "replays": 0, "buffer_bytes": plan.nbytes,
                                          "captures": [e.name for e in plan.entries]}
    return g


def _note(rec: Any, reason: str, name: str) -> None:
    """A capture that graph-safe mode could not record: counted per reason and name, and for
    the async recorder also in its dropped counts (so the dump says it, never silently)."""
    if rec is None:
        return
    nr = rec.metadata.extra.setdefault(META_KEY, {"budget_bytes": budget().limit, "graphs": {}})
    per = nr.setdefault("not_recorded", {}).setdefault(reason, {})
    per[name] = per.get(name, 0) + 1
    dropped = getattr(rec, "dropped", None)
    if isinstance(dropped, dict):
        dropped[name] = dropped.get(name, 0) + 1


# -- torch.cuda.CUDAGraph ---------------------------------------------------------------------------
def hook_cuda_graphs() -> bool:
    """Wrap torch.cuda.CUDAGraph's capture_begin/capture_end/replay (once); False without torch.cuda."""
    try:
        import torch
    except ImportError:
        return False
    cls = getattr(getattr(torch, "cuda", None), "CUDAGraph", None)
    if cls is None or cls.__dict__.get("_consistency_hooked"):
        return cls is not None
    begin, end, replay = cls.capture_begin, cls.capture_end, cls.replay

    def capture_begin(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = begin(self, *args, **kwargs)
        on_capture_begin(self)
        return out

    def capture_end(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return end(self, *args, **kwargs)
        finally:
            on_capture_end(self)

    def replay_(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = replay(self, *args, **kwargs)
        if _enabled:
            on_replay(self)
        return out

    for name, fn, orig in (("capture_begin", capture_begin, begin), ("capture_end", capture_end, end),
                           ("replay", replay_, replay)):
        fn.__wrapped__ = orig  # type: ignore[attr-defined]
        fn.__doc__ = orig.__doc__
        setattr(cls, name, fn)
    cls._consistency_hooked = True
    return True
