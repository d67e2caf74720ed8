"""MTP drafts under CUDA graphs (issue 36 item 4): graph-safe buffers, anchors computed on the device.

The released SGLang ``DeepseekModelNextN.forward`` with its patch applied
(tests/record/test_patch_mtp.py) runs in an SGLang-shaped runner (tests/mtp_graph_loop.py): a
prefill round whose draft extend runs eagerly, then decode rounds whose draft extend
(step 0) and draft steps 1..K-1 are graph replays, batches padded up to the captured
sizes, requests of different prompt lengths (so one pass's rows stand at different
anchors). Without CUDA the graphs are tests/graph_loop.py's ``EagerGraph`` (the same
capture hooks, buffers, trimming and drain); bench/graph_mtp.py runs the same on
``torch.cuda.CUDAGraph`` (docs/performance.md). One dump per draft chain (a round: step 0
and its later steps), since compare stitches a name's captures as one pass each. Expected
anchors and rows come from the construction: prompt lengths, the width accepted per round.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from consistency.pipeline.compare import compare
from consistency.dump.reader import open_dump
from consistency.record import Recorder, graphs, mtp_patch, patch
from tests.mtp_graph_loop import Bugs, anchors, chains, record
from tests.mtp_graph_loop import step_of as _step

LENS = ((5, 7, 6), (8,), (4, 9, 5, 6))  # prompt lengths per batch: 3 requests pad to the bs-4 graphs
CAPTURE_BS = (1, 2, 4)
STEPS, WIDTH, ROUNDS = 3, 2, 2  # draft steps 0..2; 2 tokens accepted per request and round


@pytest.fixture(autouse=True)
def _graph_mode(monkeypatch):
    monkeypatch.delenv("CONSISTENCY_RECORD", raising=False)
    graphs.enable(hook_torch=False, budget_bytes=graphs.DEFAULT_BYTES)
    mtp_patch.reset()
    patch._state.pending_ids = None
    with torch.no_grad():
        yield
    graphs.disable()
    mtp_patch.reset()


def _record(d: Path, mode: str | None, bugs: Bugs | None = None) -> list[Path]:
    return record(d, mode, LENS, CAPTURE_BS, STEPS, WIDTH, ROUNDS, bugs)


def _read(p: Path) -> tuple[dict[str, np.ndarray], object]:
    with open_dump(p) as d:
        return {n: d[n].read_all() for n in d.tensors}, d.metadata


def _chains() -> list[tuple[tuple[int, ...], int]]:
    return chains(LENS, ROUNDS)


def _anchors(lens: tuple[int, ...], r: int, k: int) -> list[int]:
    return anchors(lens, r, k, WIDTH)


@pytest.fixture(scope="module")
def eager(tmp_path_factory) -> list[Path]:  # noqa: ANN001
    graphs.enable(hook_torch=False, budget_bytes=graphs.DEFAULT_BYTES)
    with torch.no_grad():
        out = _record(tmp_path_factory.mktemp("eager"), None)
    graphs.disable()
    return out


def test_graph_replays_record_what_the_eager_draft_records_with_its_anchors(eager, tmp_path):
    graph = _record(tmp_path, "emulate")
    assert len(eager) == len(graph) == len(_chains())
    per = {f"{n}.{k}" for n in ("draft_ids", "draft_embed", "draft_cat", "draft_norm") for k in range(STEPS)}
    per |= {"aux.0"} | {f"recycle.{k}" for k in range(1, STEPS)}
    replays: dict[str, int] = {}
    for (lens, r), a, b in zip(_chains(), eager, graph, strict=True):
        ta, ma = _read(a)
        tb, mb = _read(b)
        assert set(ta) == set(tb) == per
        padded = len(lens) not in CAPTURE_BS
        for name in per:
            want = _anchors(lens, r, _step(name))
            # the anchors: from positions on the host (eager), on the device inside the graph (graph replays)
            assert ma.tensors[name].token_index == mb.tensors[name].token_index == want, (lens, r, name)
            assert tb[name].shape == ta[name].shape and tb[name].shape[0] == len(want)
            if padded and ta[name].dtype.kind == "f":  # a 4-row matmul beside a 3-row one: float32 rounding only
                np.testing.assert_allclose(tb[name], ta[name], rtol=0, atol=1e-5)
            else:
                assert np.array_equal(tb[name], ta[name]), (lens, r, name)
        bs = next(c for c in CAPTURE_BS if c >= len(lens))
        for name in per:
            tag = mb.tensors[name].graph
            if r == 0 and _step(name) == 0:
                assert tag is None  # the prefill's draft extend is eager in every mode
                continue
            label = "EAGLEDraftExtendCudaGraphRunner" if _step(name) == 0 else "EAGLEDraftCudaGraphRunner"
            key = f"{label} bs={bs} {name}"
            replays[key] = replays.get(key, 0) + 1
            assert (tag.label, tag.batch_size, tag.real_batch_size, tag.replay) == \
                (f"sglang.{label}", bs, len(lens), replays[key]), (lens, r, name)
            per_request = WIDTH if _step(name) == 0 else 1
            assert (tag.rows, tag.kept) == (bs * per_request, len(lens) * per_request)  # padded rows trimmed
        info = mb.extra.get("cuda_graphs", {})
        assert "not_recorded" not in info
        rep = compare(str(a), str(b))
        assert rep.verdict == "pass", (lens, r, rep.summary)


def test_a_stale_draft_buffer_fails_on_the_steps_it_feeds(eager, tmp_path):
    """The draft graph's hidden input refreshed at the prefill round only: every decode round's
    recycle.1 holds, bit for bit, the prefill round's recycle.1 of its batch."""
    bad = _record(tmp_path, "emulate", Bugs(stale=True))
    for i, ((lens, r), a, b) in enumerate(zip(_chains(), eager, bad, strict=True)):
        rep = compare(str(a), str(b))
        if r == 0:
            assert rep.verdict == "pass", rep.summary
            continue
        first = _read(eager[i - r])[0]["recycle.1"]
        got = _read(b)[0]["recycle.1"]
        assert np.array_equal(got, first) and not np.array_equal(got, _read(a)[0]["recycle.1"])
        errs = [f for f in rep.findings if f.severity.value == "error"]
        assert rep.verdict == "fail" and errs and {f.tensor for f in errs} == {"recycle.1"}, rep.summary


def test_anchors_off_by_the_step_are_caught(eager, tmp_path):
    """The draft graph's positions not advanced per step: values unchanged (the NextN block
    is position-free), anchors k too low at step k, and compare pairs the rows by them."""
    bad = _record(tmp_path, "emulate", Bugs(frozen_positions=True))
    for (lens, r), a, b in zip(_chains(), eager, bad, strict=True):
        ta, ma = _read(a)
        tb, mb = _read(b)
        for name in ta:
            k = _step(name)
            assert np.array_equal(ta[name], tb[name]) or (len(lens) not in CAPTURE_BS)
            assert mb.tensors[name].token_index == [i - k for i in ma.tensors[name].token_index], (r, name)
        rep = compare(str(a), str(b))
        errs = [f for f in rep.findings if f.severity.value == "error"]
        assert rep.verdict == "fail" and errs
        assert all(_step(f.tensor) >= 1 for f in errs), [(f.code, f.tensor) for f in errs]
        if len(lens) == 1:  # one request: no other request's row stands at the lowered anchor
            end = lens[0] + r * WIDTH - 1
            for k in range(1, STEPS):
                (nv,) = [f for f in errs if f.tensor == f"draft_ids.{k}"]
                assert nv.code == "NOT_VERIFIED" and f"anchor [{end - k}]" in nv.message, nv.message


def test_a_graph_with_no_step_known_at_capture_is_counted_not_guessed(tmp_path):
    """No step index and no forward mode (vLLM's proposer replays one graph for every step):
    the passes are said in the dump's metadata, never recorded under a guessed step."""
    from tests.graph_loop import EagerGraph

    x, h = torch.arange(4), torch.randn(4, 8)
    g = EagerGraph()
    with Recorder(tmp_path / "v.safetensors", force=True) as rec:
        rec.capture("marker", torch.zeros(1))
        g.capture(lambda: mtp_patch.capture_mtp_input(x, x, h))
        for _ in range(3):
            g.replay()
    assert sorted(rec.tensors) == ["marker"]
    nr = rec.metadata.extra["cuda_graphs"]["not_recorded"]
    assert nr == {mtp_patch.UNKNOWN_STEP: {"aux.0/recycle.k": 3}}  # once per replay


def test_the_async_recorder_writes_the_same_anchors(eager, tmp_path):
    """The async recorder keeps a replay's anchors as a HostIndex until the dump is written."""
    from consistency.record.async_capture import AsyncRecorder

    lens = LENS[:1]
    asy = record(tmp_path, "emulate", lens, CAPTURE_BS, STEPS, WIDTH, ROUNDS, rec_cls=AsyncRecorder)
    for (sizes, r), a, b in zip(chains(lens, ROUNDS), eager[:1 + ROUNDS], asy, strict=True):
        ta, ma = _read(a)
        tb, mb = _read(b)
        assert set(ta) == set(tb)
        assert all(mb.tensors[n].token_index == ma.tensors[n].token_index == _anchors(sizes, r, _step(n)) for n in ta)


def test_host_index_reads_cpu_anchors_at_once_and_resolve_leaves_lists_alone():
    from consistency.record.graph_plan import HostIndex, resolve

    idx = HostIndex(torch.tensor([[7], [3]]) - 1)
    assert idx.value == [6, 2] and resolve({"token_index": idx, "norm": "other"}) == {"token_index": [6, 2],
                                                                                      "norm": "other"}
    plain = {"token_index": [1, 2]}
    assert resolve(plain) is plain


def test_the_monkey_patch_records_the_same_under_graphs(tmp_path):
    """mtp_install's hooks on the released forward call the same functions as the file patch:
    under emulated graphs too, the same names, values and anchors."""
    lens = LENS[2:]
    a = record(tmp_path / "file", "emulate", lens, CAPTURE_BS, STEPS, WIDTH, 1)
    b = record(tmp_path / "hooks", "emulate", lens, CAPTURE_BS, STEPS, WIDTH, 1, patched=False)
    assert len(a) == len(b) == 2
    for x, y in zip(a, b, strict=True):
        tx, mx = _read(x)
        ty, my = _read(y)
        assert set(tx) == set(ty) and len(tx) == 5 * STEPS
        for n in tx:
            assert np.array_equal(tx[n], ty[n]) and mx.tensors[n].token_index == my.tensors[n].token_index, n
            assert (mx.tensors[n].graph is None) == (my.tensors[n].graph is None), n
