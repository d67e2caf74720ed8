"""A repeating decode step staged from a plan writes exactly what the general path writes.

record/step_plan.py books a repeating step's captures once a step and expands them into keys
and layouts at wait(); any capture off the plan ends it. These scenarios are generated:
steps of every-stream decode with, at random places, what a real run does (a point skipped,
a shape or producer that changes, points out of order, keywords, another tensor between or
inside steps, a prefill-sized capture, token ids, a wait() or a save() in the middle of a
step, a host budget that runs out). Each scenario runs twice on the device path (CUDA stand-ins
of test_async_device_flow.py): with plans and with plans turned off. The two dumps must hold
the same keys, the same bits, the same metadata and the same dropped counts, and what each
key holds must be what the construction captured under it.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from consistency.dump.reader import open_dump
from consistency.record import capture, step_plan
from consistency.record.async_capture import AsyncRecorder
from tests.record.test_async_device_flow import bits, dev, device  # noqa: F401 - the fixture

EVENTS = ("skip", "shape", "producer", "swap", "meta", "other_mid", "other_between", "big", "ids", "wait_mid",
          "save_mid")


def scenario(seed: int, steps: int = 24, points: int = 9, calm: float = 0.8) -> list[tuple]:
    """The ops of one run: ("cap", name, tensor, kwargs) and ("wait",) / ("save",)."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    ops: list[tuple] = []
    for _step in range(steps):
        order = list(range(points))
        ev = None if rng.random() < calm else rng.choice(EVENTS)
        at = rng.randrange(points)
        if ev == "swap":
            order[at], order[(at + 1) % points] = order[(at + 1) % points], order[at]
        if ev == "other_between":
            ops.append(("cap", "draft.hidden", torch.randn(1, 1, 24, generator=g).bfloat16(), {}))
        for j, p in enumerate(order):
            if j == at and ev == "skip":
                continue
            shape = (1, 2, 128) if (j == at and ev == "shape") else (1, 1, 128)
            kw = {"producer": "model.layers.x"} if (j == at and ev == "producer") else {}
            if j == at and ev == "meta":
                kw = {"shard": "tp:replicated"}
            ops.append(("cap", f"hidden.{p}", torch.randn(*shape, generator=g).bfloat16(), kw))
            if j == at and ev == "other_mid":
                ops.append(("cap", "draft.hidden", torch.randn(1, 1, 24, generator=g).bfloat16(), {}))
            if j == at and ev == "big":
                ops.append(("cap", "prefill.hidden", torch.randn(1, 64, 128, generator=g).bfloat16(), {}))
            if j == at and ev == "ids":
                ops.append(("cap", "input_ids", torch.randint(0, 100, (3,), generator=g), {}))
            if j == at and ev in ("wait_mid", "save_mid"):
                ops.append((ev.split("_")[0],))
    return ops


def run(ops: list[tuple], path, plans: bool, monkeypatch, **kw) -> tuple[AsyncRecorder, int]:
    """The ops on a fresh recorder; returns it and how many steps a plan staged."""
    planned = [0]
    end = step_plan.StepPlan.end

    def counted_end(self, staging):  # noqa: ANN001, ANN202
        planned[0] += 1
        return end(self, staging)

    with monkeypatch.context() as m:
        m.setattr(step_plan.StepPlan, "end", counted_end)
        if not plans:
            m.setattr(step_plan.StepPlan, "build", staticmethod(lambda *a, **k: None))
        with AsyncRecorder(path, force=True, small_bytes=2048, **kw) as rec:
            for op in ops:
                if op[0] == "cap":
                    t = op[2]
                    capture(op[1], dev(t) if t.dtype.is_floating_point else t, **op[3])
                elif op[0] == "wait":
                    rec.wait()
                else:
                    rec.save()
    return rec, planned[0]


def expected(ops: list[tuple]) -> dict[str, torch.Tensor]:
    counts: dict[str, int] = {}
    want = {}
    for op in ops:
        if op[0] == "cap":
            n = counts[op[1]] = counts.get(op[1], 0) + 1
            want[op[1] if n == 1 else f"{op[1]}#{n}"] = op[2]
    return want


def dump(path) -> tuple[dict, dict, dict]:  # noqa: ANN001
    with open_dump(path) as d:
        values = {k: d[k].read_all().tobytes() for k in d.tensors}
        meta = {k: tm.model_dump() for k, tm in d.metadata.tensors.items()}
        return values, meta, dict(d.metadata.extra.get("dropped_captures") or {})


@pytest.mark.parametrize("seed", range(24))
def test_a_plan_writes_what_the_general_path_writes(device, tmp_path, monkeypatch, seed):  # noqa: F811
    ops = scenario(seed, steps=30, calm=0.9 if seed % 4 == 3 else 0.85 if seed % 3 else 0.65)
    kw = {"flush_bytes": (0, 512, 1 << 20)[seed % 3]}  # staged steps sent one by one, a few at a time, all at once
    if seed % 4 == 3:  # a budget that runs out mid-run; the ring is no larger, and never fills: a point is
        kw = {"max_host_bytes": 9 * 256 * 14, "flush_bytes": 512}  # 256 bytes, no padding, ring use <= budget
    with_plan, planned = run(ops, tmp_path / "plan.safetensors", True, monkeypatch, **kw)
    general, never = run(ops, tmp_path / "general.safetensors", False, monkeypatch, **kw)
    assert never == 0 and planned > 0, "the scenario never repeated a step: it tests nothing"
    a, b = dump(with_plan.written), dump(general.written)
    assert a[0].keys() == b[0].keys() and a[0] == b[0]
    assert a[1] == b[1]
    assert a[2] == b[2] == with_plan.dropped == general.dropped
    assert with_plan.counts == general.counts
    want = expected(ops)
    assert set(a[0]) <= set(want) and len(want) - len(a[0]) == sum(a[2].values())
    for key, raw in a[0].items():
        assert raw == np.ascontiguousarray(bits(want[key])).tobytes(), key
    if seed % 4 == 3:
        assert a[2], "the budget never ran out"


def test_a_calm_decode_is_staged_from_a_plan_after_two_steps(device, tmp_path, monkeypatch):  # noqa: F811
    ops = scenario(7, steps=20, calm=1.0)
    rec, planned = run(ops, tmp_path / "calm.safetensors", True, monkeypatch)
    assert planned == 17  # the first step checks each point, the next two show the pattern, the 4th opens the plan
    assert not rec.dropped and len(dump(rec.written)[0]) == 20 * 9
