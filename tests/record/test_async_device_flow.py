"""The AsyncRecorder's device path, end to end, on this CPU: captures that say they are on a GPU.

The device path (staging, the pinned ring, the side stream, the writer thread and its lazy
hand-over) only runs where ``tensor.is_cuda`` is true, so CPU tests never reached it and its
bookkeeping was checked only on a GPU (the CUDA tests of test_record_faults.py, run with the
device tool). Here the CUDA runtime is replaced by the smallest stand-in that keeps its
ordering: a copy "on the side stream" happens when it is issued, an event is done once
recorded, pinned memory is plain memory. Everything else is the recorder's own code: the
per-point fast path, staging, batches handed to the writer many at a time, the ring's spans
given back in the order they were taken. A span given back early would be overwritten by a
later capture before the writer copies it out, so every test checks each capture bit for bit.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from consistency.dump.reader import open_dump
from consistency.record import async_capture, capture
from consistency.record.async_capture import AsyncRecorder


class OnDevice(torch.Tensor):
    """A host tensor that answers ``is_cuda`` with True (the recorder's only question)."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True


class _Stream:
    def wait_stream(self, other: object) -> None:
        pass

    def wait_event(self, event: object) -> None:
        pass


class _Event:
    def __init__(self, *a: object, **kw: object) -> None:
        self.recorded = False

    def record(self, stream: object = None) -> None:
        self.recorded = True

    def synchronize(self) -> None:
        assert self.recorded, "the writer waited on an event nothing recorded"

    def query(self) -> bool:
        return self.recorded


@pytest.fixture
def device(monkeypatch):
    """The CUDA calls the device path makes, as host stand-ins."""
    stream = _Stream()
    empty = torch.empty

    def host_empty(*a, pin_memory=False, **kw):  # noqa: ANN002, ANN003, ANN202
        return empty(*a, **kw)

    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **kw: _Stream())
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **kw: stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch, "empty", host_empty)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: None, raising=False)


def dev(t: torch.Tensor) -> OnDevice:
    return t.as_subclass(OnDevice)


def bits(t: torch.Tensor) -> np.ndarray:
    t = t.detach().contiguous()
    return t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()


def check(path, want: dict[str, torch.Tensor]) -> None:
    with open_dump(path) as d:
        assert sorted(d.tensors) == sorted(want), set(d.tensors) ^ set(want)
        for key, t in want.items():
            got = d[key].read_all()
            assert got.shape == tuple(t.shape), key
            assert np.array_equal(got.view(np.int16) if t.dtype == torch.bfloat16 else got, bits(t)), key


def decode(rec_kw: dict, steps: int, points: int = 33, hidden: int = 64, big_every: int = 0, seed: int = 0):  # noqa: ANN201
    """An every-stream decode: ``points`` small captures a step, and a large (prefill-sized) one
    every ``big_every`` steps; returns the recorder and what each key must hold."""
    g = torch.Generator().manual_seed(seed)
    want: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}

    def take(name: str, t: torch.Tensor) -> None:
        counts[name] = counts.get(name, 0) + 1
        want[name if counts[name] == 1 else f"{name}#{counts[name]}"] = t.clone()
        capture(name, dev(t))

    with AsyncRecorder(kw_path := rec_kw.pop("path"), force=True, **rec_kw) as rec:
        for step in range(steps):
            if big_every and step % big_every == 0:
                take("prefill.hidden", torch.randn(1, 48, hidden, generator=g).bfloat16())
            for p in range(points):
                take(f"hidden.{p}", torch.randn(1, 1, hidden, generator=g).bfloat16())
    assert rec.written == kw_path
    return rec, want


def test_every_stream_decode_lands_bit_for_bit_through_lazy_handover(device, tmp_path):
    # 128-byte captures pad to 256: a 2 KiB flush sends a batch every step, and 80 steps make
    # 80 batches, so the writer is handed them HANDOVER_BATCHES at a time, then the rest at save
    rec, want = decode({"path": tmp_path / "a.safetensors", "flush_bytes": 2048}, steps=80)
    assert len(want) == 80 * 33 and not rec.dropped
    check(rec.written, want)


def test_the_ring_gives_spans_back_in_take_order_when_large_captures_come_between_batches(device, tmp_path,
                                                                                          monkeypatch):
    # a ring of 96 KiB wraps (300 KiB go through it): each 6 KiB prefill capture goes to the writer at once,
    # behind the staged batches sent before it. The ring gives back its oldest span each time the
    # writer finishes one, so the writer must finish them in the order they were taken: out of
    # order, a later capture may overwrite a span before it is copied out (whether it does
    # depends on the threads' timing, so the order itself is checked, and then the bits)
    from consistency.record import pinned, tensors

    taken, done = [], []
    take, copy_out, to_numpy = pinned.PinnedRing.take, async_capture.copy_out, tensors.to_numpy

    def logged_take(self, *a):  # noqa: ANN001, ANN002, ANN202
        host = take(self, *a)
        if host is not None:
            taken.append(host.data_ptr())
        return host

    monkeypatch.setattr(pinned.PinnedRing, "take", logged_take)
    monkeypatch.setattr(async_capture, "copy_out", lambda host, batch: done.append(host.data_ptr()) or copy_out(host, batch))
    monkeypatch.setattr(tensors, "to_numpy", lambda host: done.append(host.data_ptr()) or to_numpy(host))
    rec, want = decode({"path": tmp_path / "b.safetensors", "flush_bytes": 2048, "ring_bytes": 96 << 10,
                        "small_bytes": 4096}, steps=60, points=12, big_every=3)
    assert len(taken) > 20 and done == taken
    # a writer slower than the captures (a loaded machine) lets the ring fill: those captures
    # are dropped and counted, never waited for; what was kept is exact
    with open_dump(rec.written) as d:
        kept = set(d.tensors)
    assert len(kept) == len(want) - sum(rec.dropped.values())
    check(rec.written, {k: v for k, v in want.items() if k in kept})


def test_a_full_ring_drops_whole_batches_counts_them_and_keeps_the_rest_exact(device, tmp_path, monkeypatch):
    # hand-over only every 1,000 batches: the ring (16 KiB) fills with sent batches and the
    # next ones are dropped and counted; what was kept is exact
    monkeypatch.setattr(async_capture, "HANDOVER_BATCHES", 1000)
    monkeypatch.setattr(async_capture, "HANDOVER_RING", 1)
    rec, want = decode({"path": tmp_path / "c.safetensors", "flush_bytes": 2048, "ring_bytes": 16 << 10},
                       steps=30, points=8)
    dropped = sum(rec.dropped.values())
    assert dropped > 0 and dropped % 8 == 0, rec.dropped  # whole steps, every point alike
    with open_dump(rec.written) as d:
        kept = set(d.tensors)
        assert d.metadata.extra["dropped_captures"] == rec.dropped
    assert len(kept) == len(want) - dropped
    check(rec.written, {k: v for k, v in want.items() if k in kept})


def test_the_fast_path_follows_every_change_of_a_point(device, tmp_path):
    """A staged point's later captures skip the checks only while dtype, shape, stride, class,
    device and producer stay those checked; each change is checked and described afresh."""
    base = torch.randn(1, 1, 16).bfloat16()
    strided = torch.randn(1, 1, 32).bfloat16()[..., ::2]  # the same shape, every other element
    with AsyncRecorder(tmp_path / "d.safetensors", force=True) as rec:
        capture("hidden.1", dev(base))
        capture("hidden.1", dev(base + 1))  # the fast path
        capture("hidden.1", dev(base.float()))  # dtype
        capture("hidden.1", dev(torch.randn(1, 2, 16).bfloat16()))  # shape
        capture("hidden.1", dev(strided))  # stride
        capture("hidden.1", dev(base), producer="model.layers.0")  # producer
        capture("hidden.1", base * 2)  # a host tensor: the host path
        capture("hidden.1", dev(base), shard="tp:replicated")  # keywords
        capture("hidden.1", dev(base * 3))  # the fast path again, after all of them
    with open_dump(rec.written) as d:
        m = d.metadata.tensors
        assert [m[f"hidden.1#{k}"].dtype for k in (2, 3, 4)] == ["bfloat16", "float32", "bfloat16"]
        assert m["hidden.1#4"].shape == [1, 2, 16]
        assert m["hidden.1#5"].stride == [32, 32, 2] and m["hidden.1#5"].contiguous is False
        assert m["hidden.1#6"].producer == "model.layers.0" and m["hidden.1#7"].producer is None
        assert m["hidden.1#7"].device == "cpu"
        for key, t in {"hidden.1#2": base + 1, "hidden.1#5": strided, "hidden.1#7": base * 2,
                       "hidden.1#9": base * 3}.items():
            assert np.array_equal(d[key].read_all().view(np.int16).reshape(t.shape), bits(t)), key
    assert not rec.refused


def test_a_name_the_fast_path_knows_refused_later_for_another_reason_keeps_the_rest(device, tmp_path):
    with AsyncRecorder(tmp_path / "e.safetensors", force=True) as rec:
        capture("hidden.1", dev(torch.ones(1, 1, 8).bfloat16()))
        capture("hidden.1", dev(torch.ones(1, 1, 8).bfloat16()))
        capture("hidden.1", dev(torch.ones(1, 1, 8, dtype=torch.complex64)))  # a dtype no dump holds
        capture("hidden.1", dev(torch.full((1, 1, 8), 2.0).bfloat16()))
    assert "hidden.1" in rec.refused
    with open_dump(rec.written) as d:
        assert sorted(d.tensors) == ["hidden.1", "hidden.1#2", "hidden.1#3"]  # a refused capture takes no number
        assert (d["hidden.1#3"].read_all().view(np.int16) == bits(torch.full((1, 1, 8), 2.0).bfloat16())).all()
