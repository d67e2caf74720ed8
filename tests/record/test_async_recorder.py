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


def test_step_staging_packs_a_step_and_unpacks_it_bit_for_bit():
    """record/staging.py's packing (on a CPU buffer here; the D2H send is CUDA-only, measured by
    bench/bench_record_gpu.py): a step's small captures land at aligned offsets of one buffer,
    the step ends when a point staged in it comes again or the buffer is full, and the writer's
    numpy unpacking returns each capture's bits, dtype and shape."""
    from consistency.dump.dtypes import torch_storage
    from consistency.record.staging import ALIGN, StepStaging, unpack

    st = StepStaging(4 * ALIGN, "cpu", flush_bytes=0)  # every step leaves alone
    g = torch.Generator().manual_seed(0)
    step = [("hidden.2", torch.randn(1, 1, 40, generator=g).bfloat16()),  # 80 bytes
            ("ids", torch.tensor([7, -3, 2**40])),
            ("mask", torch.tensor([True, False, True])),
            ("hidden.5", torch.randn(2, 30, generator=g))]  # 240 bytes: the 4th ALIGN span
    for i, (name, t) in enumerate(step):
        assert not st.due(name, t.numel() * t.element_size())
        st.put(f"{name}#1", name, t, t.numel() * t.element_size())
        assert st.at == (i + 1) * ALIGN
    assert st.due("hidden.2", 80)  # the next step's first capture
    assert StepStaging(4 * ALIGN, "cpu").due("hidden.2", 80) is False  # nothing staged: nothing to send
    buf, used, items = st.take()
    assert used == 4 * ALIGN and not st.items and not st.names
    out = unpack(buf[:used].numpy(), items)
    for name, t in step:
        arr, dt = out[f"{name}#1"]
        want, want_dt = torch_storage(t)
        assert dt == want_dt and arr.dtype == want.dtype and np.array_equal(arr, want)
    buf[:] = 0  # unpacked arrays are copies: the staging buffer may be reused at once
    assert np.array_equal(out["ids#1"][0], torch_storage(step[1][1])[0])
    # the same pattern next step reuses the cached views: same offsets, new values
    views = len(st._views)
    x = torch.ones(1, 1, 40).bfloat16()
    st.put("hidden.2#2", "hidden.2", x, 80)
    assert len(st._views) == views and st.due("hidden.9", 4 * ALIGN)  # full: sent whatever the step
    _buf, _used, items = st.take()
    assert np.array_equal(unpack(_buf.numpy(), items)["hidden.2#2"][0], torch_storage(x)[0])
    # with flush_bytes, whole steps gather until the batch holds that many bytes
    st = StepStaging(8 * ALIGN, "cpu", flush_bytes=3 * ALIGN)
    for k in range(1, 4):
        for name in ("a", "b"):
            sent = st.due(name, 80)
            assert sent == (k == 3 and name == "a"), (k, name)  # the third step's start: 2 steps staged, 4 spans
            if sent:
                assert [i[0] for i in st.take()[2]] == ["a#1", "b#1", "a#2", "b#2"]
            st.put(f"{name}#{k}", name, x, 80)

