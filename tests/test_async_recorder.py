"""AsyncRecorder: token subsets, the host-memory bound, and the same dump as the plain recorder.

The asynchronous device path (pinned buffers, side stream, writer thread) runs on a GPU;
bench/bench_record_gpu.py measures it there (docs/performance.md). On this CPU machine
captures take the synchronous path, which shares the selection and bounding logic.
"""

from __future__ import annotations

import numpy as np
import torch

from consistency.dump.reader import open_dump
from consistency.record import capture
from consistency.record.async_capture import AsyncRecorder


def test_token_subset_and_last_tokens(tmp_path):
    x = torch.arange(2 * 10 * 4, dtype=torch.float32).reshape(2, 10, 4)
    with AsyncRecorder(tmp_path / "a.safetensors", tokens=[0, 3, 9]) as rec:
        capture("hidden.1", x)
    assert rec.written is not None
    with open_dump(rec.written) as d:
        assert d["hidden.1"].shape == (2, 3, 4)
        assert np.array_equal(d["hidden.1"].read_all(), x[:, [0, 3, 9]].numpy())
        assert d.metadata.extra["token_index"] == [0, 3, 9]
    with AsyncRecorder(tmp_path / "b.safetensors", last_tokens=2) as rec:
        capture("hidden.1", x.bfloat16())
    with open_dump(rec.written) as d:
        assert d["hidden.1"].shape == (2, 2, 4) and d["hidden.1"].dtype == "bfloat16"


def test_host_memory_bound_drops_and_counts(tmp_path):
    big = torch.zeros(256, 1024)  # 1 MiB each
    with AsyncRecorder(tmp_path / "c.safetensors", max_host_bytes=3 << 20) as rec:
        for _ in range(5):
            capture("hidden.2", big)
    with open_dump(rec.written) as d:
        kept = [n for n in d.tensors if n.startswith("hidden.2")]
        assert len(kept) == 3
        assert d.metadata.extra["dropped_captures"] == {"hidden.2": 2}


def test_discard_writes_nothing_and_restores_the_previous_recorder(tmp_path):
    from consistency.record import active

    rec = AsyncRecorder(tmp_path / "d.safetensors")
    rec.__enter__()
    capture("aux.0", torch.ones(3, 4))
    rec.discard()
    assert active() is None and not (tmp_path / "d.safetensors").exists()
