"""The buffers of graph-safe capture: one plan per captured graph, a process-wide budget.

A plan holds, in capture order, one entry per ``capture()`` made while its graph was
captured: the device buffer the graph copies the tensor into (so each replay refreshes it),
or why there is none (over the budget; a host value no replay can refresh; a host value
the runtime supplies at replay instead). A graph captured again (SGLang re-captures on a
mode change; the CPU emulation in the tests captures per replay) reuses the entries that
still match name, shape and dtype, so its buffers, and the budget, stay the same.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

ENV_BYTES = "CONSISTENCY_RECORD_GRAPH_BYTES"  # the buffers' budget: bytes, or 512M / 2G
DEFAULT_BYTES = 1 << 30
_lock = threading.Lock()


def parse_bytes(text: str) -> int:
    """``'1073741824'``, ``'512M'``, ``'2G'``, ``'64k'`` -> bytes; ValueError names the value."""
    s = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
    digits = s[:-1] if s[-1:] in "KMG" and s[-1:] else s
    if not digits.isdigit():
        raise ValueError(f"{ENV_BYTES}={text!r}: not a byte count (e.g. 536870912, 512M, 2G)")
    return int(digits) * mult


class Budget:
    """Device bytes the graph buffers may hold, across every graph of the process."""

    def __init__(self, limit: int) -> None:
        self.limit, self.used = limit, 0

    def reserve(self, nbytes: int) -> bool:
        with _lock:
            if self.used + nbytes > self.limit:
                return False
            self.used += nbytes
            return True

    def release(self, nbytes: int) -> None:
        with _lock:
            self.used = max(0, self.used - nbytes)


@dataclass
class Replay:
    """What the runtime knows at a replay, on the host: real and padded rows, host values."""

    real_tokens: int | None = None
    padded_tokens: int | None = None
    real_bs: int | None = None
    padded_bs: int | None = None
    values: dict[str, Callable[[int | None], Any]] = field(default_factory=dict)  # deferred name -> maker


@dataclass
class Entry:
    name: str
    producer: str | None
    meta: dict[str, Any]
    buf: Any = None  # the device buffer the graph copies into; None: not recorded (reason) or deferred
    positions: Any = None
    anchors: Any = None  # each row's anchor (token_index), computed on the device inside the graph
    reason: str | None = None  # why it is not recorded from this graph
    deferred: bool = False  # a host value the runtime hook supplies at replay (request ids)
    nbytes: int = 0


@dataclass
class Session:
    """A runtime's capture of one graph shape: labels plans; suppresses its eager warm-ups."""

    label: str
    bs: int | None = None
    tokens: int | None = None
    suppress_eager: bool = True
    suppressed: int = 0


class Plan:
    """The captures of one graph (so of one batch size): entries in capture order."""

    def __init__(self, label: str, bs: int | None, tokens: int | None, budget: Budget) -> None:
        self.label, self.bs, self.tokens, self.budget = label, bs, tokens, budget
        self.entries: list[Entry] = []
        self.cursor = 0
        self.draft_passes = 0  # MTP draft passes made so far in the capture in progress (record/mtp_patch.py)
        self.replays = 0
        self.warned = False

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def key(self) -> str:
        return f"{self.label} bs={self.bs}" if self.bs is not None else self.label

    def add(self, name: str, t: Any, producer: str | None, meta: dict[str, Any]) -> None:
        """Register ``t`` (or refresh the entry at the cursor when the graph is captured again)."""
        positions = meta.pop("positions", None)
        anchors = meta.pop("token_index", None) if hasattr(meta.get("token_index"), "copy_") else None
        reuse = self.entries[self.cursor] if self.cursor < len(self.entries) else None
        if reuse is not None and reuse.name == name and reuse.buf is None and reuse.reason is not None:
            self.cursor += 1  # still not recorded, for the same reason (said once)
            return
        if reuse is not None and (reuse.name != name or reuse.deferred or not _fits(reuse.buf, t)
                                  or not _fits(reuse.positions, positions) or not _fits(reuse.anchors, anchors)):
            self._drop_from(self.cursor)
            reuse = None
        self.cursor += 1
        if reuse is not None:
            _copy(reuse.buf, t)
            _copy(reuse.positions, positions)
            _copy(reuse.anchors, anchors)
            return
        e = Entry(name, producer, {**meta, **_layout(t)})
        self.entries.append(e)
        if not hasattr(t, "copy_") or (stream_capturing() and not getattr(t, "is_cuda", False)):
            e.reason = "host value inside a captured graph (a replay never refreshes it)"
            return
        need = _bytes(t) + sum(_bytes(x) for x in (positions, anchors) if x is not None)
        if not self.budget.reserve(need):
            e.reason = f"over the graph-buffer budget ({ENV_BYTES}={self.budget.limit})"
            self._warn(name, need)
            return
        e.nbytes = need
        e.buf = _new_copy(t)
        e.positions = _new_copy(positions) if positions is not None else None
        e.anchors = _new_copy(anchors) if anchors is not None else None

    def skip(self, name: str, reason: str) -> None:
        """A point of this graph that is not recorded: each replay's drain says it (counted)."""
        reuse = self.entries[self.cursor] if self.cursor < len(self.entries) else None
        if reuse is not None and not (reuse.name == name and reuse.buf is None and reuse.reason == reason):
            self._drop_from(self.cursor)
            reuse = None
        if reuse is None:
            self.entries.append(Entry(name, None, {}, reason=reason))
        self.cursor += 1

    def defer(self, name: str, producer: str | None) -> None:
        if self.cursor < len(self.entries) and not (self.entries[self.cursor].deferred
                                                    and self.entries[self.cursor].name == name):
            self._drop_from(self.cursor)
        if self.cursor >= len(self.entries):
            self.entries.append(Entry(name, producer, {}, deferred=True))
        self.cursor += 1

    def end(self) -> None:
        self._drop_from(self.cursor)  # what the previous capture had past this one's last point

    def _drop_from(self, i: int) -> None:
        for e in self.entries[i:]:
            self.budget.release(e.nbytes)
        del self.entries[i:]

    def _warn(self, name: str, need: int) -> None:
        b = self.budget
        if not self.warned:
            self.warned = True
            _say(f"graph {self.key()}: {name!r} needs {size_text(need)}, the graph buffers hold "
                 f"{size_text(b.used)} of {size_text(b.limit)} ({ENV_BYTES}); it is not recorded from this "
                 f"graph's replays (raise {ENV_BYTES}, record fewer slots, or capture fewer batch sizes)")

    def release(self) -> None:
        self._drop_from(0)


def trim(buf: Any, sizes: Replay, padded_tokens: int | None, padded_bs: int | None) -> tuple[Any, int | None]:
    """The real rows of a padded buffer: dim 0 cut to the real tokens (when it has the graph's
    padded token count) or the real batch (when it has the padded batch); else kept whole
    (``kept`` None says no cut was known, so a reader can tell padding may be in it)."""
    if buf.dim() == 0:
        return buf, None
    rows = int(buf.shape[0])
    if padded_tokens is not None and rows == padded_tokens and sizes.real_tokens is not None:
        n = min(sizes.real_tokens, rows)
    elif padded_bs is not None and rows == padded_bs and sizes.real_bs is not None:
        n = min(sizes.real_bs, rows)
    else:
        return buf, None
    return buf[:n], n


class HostIndex:
    """A replay's row anchors on their way to ``token_index`` (host metadata) without a wait:
    a CUDA buffer is copied to pinned memory in stream order and read when the dump is
    written (:func:`resolve`, after the recorder's own wait); a CPU one is read at once."""

    def __init__(self, t: Any) -> None:
        self.value: list[int] | None = None
        self.host = self.done = None
        if not getattr(t, "is_cuda", False):
            self.value = [int(i) for i in t.reshape(-1).tolist()]
            return
        import torch

        self.host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        self.host.copy_(t, non_blocking=True)
        self.done = torch.cuda.Event()
        self.done.record()

    def resolve(self) -> list[int]:
        if self.value is None:
            self.done.synchronize()
            self.value = [int(i) for i in self.host.reshape(-1).tolist()]
            self.host = self.done = None
        return self.value


def resolve(meta: dict[str, Any]) -> dict[str, Any]:
    """``meta`` with a :class:`HostIndex` token_index read (the recorders call it before the
    metadata model is built)."""
    idx = meta.get("token_index")
    return {**meta, "token_index": idx.resolve()} if isinstance(idx, HostIndex) else meta


# -- helpers --------------------------------------------------------------------------------------
def size_text(nbytes: int) -> str:
    """Bytes in the unit that fits (a 4 KiB buffer is not '0.0 MiB')."""
    if nbytes < 1 << 10:
        return f"{nbytes} B"
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):.1f} {unit}"
    return f"{nbytes} B"  # pragma: no cover


def _say(msg: str) -> None:
    from consistency.record.fallback import emit

    emit(f"consistency: graph-safe capture: {msg}")


def stream_capturing() -> bool:
    """Is this thread's current CUDA stream being captured? False where torch was never imported."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
    except RuntimeError:
        return False


def _bytes(t: Any) -> int:
    return int(t.numel()) * int(t.element_size()) if hasattr(t, "numel") else 0


def _layout(t: Any) -> dict[str, Any]:
    """The captured tensor's own layout (the buffer is contiguous; users suspect layouts)."""
    if not hasattr(t, "stride"):
        return {}
    return {"stride": list(t.stride()), "contiguous": bool(t.is_contiguous())}


def _fits(buf: Any, t: Any) -> bool:
    if buf is None or t is None:
        return buf is None and t is None
    return tuple(buf.shape) == tuple(t.shape) and buf.dtype == t.dtype and buf.device == t.device


def _new_copy(t: Any) -> Any:
    import torch

    buf = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    buf.copy_(t)  # recorded into the graph: every replay refreshes the buffer
    return buf


def _copy(buf: Any, t: Any) -> None:
    if buf is not None and t is not None:
        buf.copy_(t)
