"""One step's small captures leave the device together: one staging copy per step.

A decode step captures a few rows per point (3 aux slots, or every stream). Each one going
to the host on its own costs a D2H copy, an event and a queue item, and unpacking it costs
the writer thread a handful of torch calls that hold the GIL the model's thread needs
(measured on an H200: eager decode of an 8B model 1.09x with 3 slots, 1.16x with every
stream, bench/record_probe.py). Here a small capture is one device-to-device copy into a
view of a device staging buffer (a snapshot, in stream order; the view is cached, since a
decode step's captures fall at the same offsets step after step), and at a step's end (a
point staged in this step is captured again) once the staged steps hold ``flush_bytes``, or
when the buffer fills, the used bytes go to the pinned ring in one copy on the side stream
with one event: whole steps, never a step cut in two unless one step outgrows the buffer. Two buffers alternate; before one
is reused the compute stream waits for its last copy on the GPU, never on the host. The
writer thread unpacks a step with numpy slices of the pinned span (no torch call, so no GIL
held through torch's dispatcher).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from consistency.dump import dtypes

ALIGN = 256
MAX_VIEWS = 4096  # cached staging views; a pattern that never repeats is not kept forever


class StepStaging:
    """The device side: staging buffers, the current step's items, the cached views."""

    def __init__(self, nbytes: int, device: Any, flush_bytes: int = 1 << 20) -> None:
        import torch

        self.size = nbytes
        # a batch goes to the host at the first step boundary past flush_bytes (0: every step):
        # a few steps per copy spare the host a D2H call, an event and a writer wake-up per step
        self.flush_bytes = flush_bytes
        self.bufs = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(2)]
        self.cur = 0
        self.at = 0
        self.items: list[tuple[str, int, int, str, tuple[int, ...]]] = []  # key, offset, bytes, dtype name, shape
        self.names: set[str] = set()
        self.done: list[Any] = [None, None]
        self._views: dict[tuple, Any] = {}
        self._names: dict[Any, str] = {}  # torch dtype -> canonical name

    def due(self, name: str, nbytes: int) -> bool:
        """True when the staged steps go to the host before ``name`` is staged: it does not fit,
        or it starts a new step (already staged in this one) and the batch holds flush_bytes."""
        if not self.items:
            return False
        if self.at + aligned(nbytes) > self.size:
            return True
        if name in self.names:  # a new step begins: whole steps only ever leave together
            self.names = set()
            return self.at >= self.flush_bytes
        return False

    def put(self, key: str, name: str, sel: Any, nbytes: int, dtype: Any = None, shape: tuple[int, ...] | None = None,
            dname: str | None = None, pad: int | None = None) -> None:
        """Stage ``sel``; ``dtype``/``shape``/``dname`` are what the caller already knows of it
        (the recorder keeps them per point), so the hot path asks the tensor nothing twice."""
        if dtype is None:
            dtype, shape = sel.dtype, tuple(sel.shape)
        at = self.at
        vk = (self.cur, at, dtype, shape)
        view = self._views.get(vk)
        if view is None:
            if len(self._views) >= MAX_VIEWS:
                self._views.clear()
            view = self._views[vk] = self.bufs[self.cur][at:at + nbytes].view(dtype).view(shape)
        view.copy_(sel)
        if dname is None:
            dname = self._names.get(dtype)
            if dname is None:
                dname = self._names[dtype] = str(dtype).removeprefix("torch.")
        self.items.append((key, at, nbytes, dname, shape))
        self.names.add(name)
        self.at = at + (aligned(nbytes) if pad is None else pad)

    def take(self) -> tuple[Any, int, list]:
        """The current buffer's used bytes and items; the staging moves on to the other buffer."""
        used, items, buf = self.at, self.items, self.bufs[self.cur]
        self.items, self.names, self.at = [], set(), 0
        return buf, used, items

    def send(self, buf: Any, used: int, host: Any, stream: Any) -> Any:
        """One D2H of ``buf[:used]`` into ``host`` on ``stream``; returns its event. The compute
        stream waits (on the GPU) for the other buffer's last copy before it is written again."""
        import torch

        compute = torch.cuda.current_stream(buf.device)
        stream.wait_stream(compute)
        with torch.cuda.stream(stream):
            host.copy_(buf[:used], non_blocking=True)
            done = torch.cuda.Event(blocking=True)  # the writer sleeps on it, never spins
            done.record(stream)
        self.done[self.cur] = done
        self.cur ^= 1
        nxt = self.done[self.cur]
        if nxt is not None:
            compute.wait_event(nxt)
        return done


def unpack(host: Any, items: list) -> dict[str, tuple[np.ndarray, str]]:
    """The step's captures as (storage array, dtype name), out of the pinned span in one copy."""
    return views(copy_out(host, items), items)


def copy_out(host: Any, items: list) -> np.ndarray:
    """The batch's bytes in one host copy (numpy drops the GIL for it), so the pinned span can
    be given back; the per-capture views wait for :func:`views`. One copy instead of one per
    capture: the writer thread then takes the model thread's GIL once a batch, not 3 times a
    capture (33 captures a step with every stream)."""
    raw = host.numpy() if not isinstance(host, np.ndarray) else host
    end = max((at + nbytes for _key, at, nbytes, _name, _shape in items), default=0)
    return raw[:end].copy()


def views(raw: np.ndarray, items: list) -> dict[str, tuple[np.ndarray, str]]:
    """Each capture of a batch copied out by :func:`copy_out`, as a view of that copy."""
    out: dict[str, tuple[np.ndarray, str]] = {}
    for key, at, nbytes, name, shape in items:
        out[key] = (raw[at:at + nbytes].view(dtypes.BY_NAME[name].storage).reshape(shape), name)
    return out


def aligned(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN
