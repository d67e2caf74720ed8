"""Graph-safe capture (consistency/record/graphs.py): what each CUDA-graph replay computes.

A real transformers Llama decodes batches the way a server's graph runner does
(tests/graph_loop.py): one graph per captured batch size, real batches padded up to it,
several replays per graph with new tokens, a draft in its own graph fed from a static
buffer. Without CUDA the graphs are :class:`EagerGraph` s, which run the very same capture
hooks, buffers, trimming, tags and drain; the ``torch.cuda.CUDAGraph`` tests run where CUDA
is (bench/graph_proof.py ran them on an H200: docs/performance.md). Expected answers come
from the construction: which batch pads to which graph, which rows the planted bugs touch.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from consistency.pipeline.compare import compare
from consistency.dump.reader import open_dump
from consistency.record import Recorder, capture, graphs
from consistency.record.async_capture import AsyncRecorder
from consistency.record.graph_plan import Budget, Plan, Replay, parse_bytes, trim
from tests.conftest import tiny
from tests.graph_loop import Bugs, EagerGraph, Loop

BATCHES = (3, 1, 4, 5, 3)  # -> graphs 4, 1, 4, 8, 4 (capture sizes 1, 2, 4, 8)
CAPTURE_BS = (1, 2, 4, 8)
STEPS, PROMPT = 3, 5
AUX = (2, 6, 9)


@pytest.fixture(autouse=True)
def _graph_mode():
    graphs.enable(hook_torch=False, budget_bytes=graphs.DEFAULT_BYTES)
    with torch.no_grad():
        yield
    graphs.disable()


def _model(dtype: torch.dtype = torch.float32):  # noqa: ANN202
    model = tiny("tiny-llama").to(dtype)
    torch.manual_seed(0)
    draft = torch.nn.Linear(len(AUX) * model.config.hidden_size, model.config.hidden_size).to(dtype)
    return model, draft


def _record(path, mode, pad=True, bugs=None, dtype=torch.float32, rec_cls=Recorder):  # noqa: ANN001, ANN202
    model, draft = _model(dtype)
    loop = Loop(model, draft, AUX, CAPTURE_BS, PROMPT + STEPS + 1, graphs=mode, bugs=bugs, pad=pad)
    g = torch.Generator().manual_seed(1)
    with rec_cls(path, force=True) as rec:
        rid = 0
        for real in BATCHES:
            loop.run_batch(torch.randint(0, model.config.vocab_size, (real, PROMPT), generator=g), STEPS,
                           list(range(rid, rid + real)))
            rid += real
    return rec


def _tensors(path) -> dict[str, np.ndarray]:  # noqa: ANN001
    with open_dump(path) as d:
        return {n: d[n].read_all() for n in d.tensors}


def _padded(real: int) -> int:
    return next(b for b in CAPTURE_BS if b >= real)


def _decode_rows(bug: str) -> list[int]:
    """Stitched rows (request by request: its prompt, then its decode steps) a bug corrupts."""
    per, rows, rid = PROMPT + STEPS, [], 0
    for real in BATCHES:
        for r in range(rid, rid + real):
            if bug == "stale":
                rows += [r * per + PROMPT + t for t in range(1, STEPS)]
            elif r == rid + real - 1 and real < _padded(real):
                rows += [r * per + PROMPT + t for t in range(STEPS)]
        rid += real
    return rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_recording_equals_the_same_loop_recorded_eagerly(dtype, tmp_path):
    eager = _record(tmp_path / "eager.safetensors", None, dtype=dtype)
    graph = _record(tmp_path / "graph.safetensors", "emulate", dtype=dtype)
    a, b = _tensors(eager.written), _tensors(graph.written)
    assert sorted(a) == sorted(b)
    assert all(np.array_equal(a[n], b[n]) for n in a), [n for n in a if not np.array_equal(a[n], b[n])]
    # 5 names per pass (+ request ids); one prefill pass and STEPS decode passes per batch
    assert sum(1 for n in b if n.split("#")[0] == "aux.0") == len(BATCHES) * (1 + STEPS)
    with open_dump(graph.written) as d:
        meta = d.metadata
    k = 0
    replays: dict[int, int] = {}
    for real in BATCHES:
        bs = _padded(real)
        k += 1  # the prefill: eager, untagged
        assert meta.tensors["aux.0" if k == 1 else f"aux.0#{k}"].graph is None
        for _ in range(STEPS):
            k += 1
            replays[bs] = replays.get(bs, 0) + 1
            tag = meta.tensors[f"aux.1#{k}"].graph
            assert (tag.label, tag.batch_size, tag.real_batch_size, tag.replay, tag.rows, tag.kept) == \
                ("loop.draft", bs, real, replays[bs], bs, real)
            assert meta.tensors[f"input_ids#{k}"].graph.label == "loop.target"
            assert b[f"aux.1#{k}"].shape[0] == real  # padded rows trimmed
    info = meta.extra["cuda_graphs"]
    assert {g: v["replays"] for g, v in info["graphs"].items()} == \
        {f"loop.{w} bs={bs}": n for bs, n in replays.items() for w in ("target", "draft")}
    assert info["graphs"]["loop.draft bs=8"]["captures"] == ["aux.0", "aux.1", "aux.2"]
    assert "not_recorded" not in info
    assert compare(str(eager.written), str(graph.written)).verdict == "pass"


def test_graph_recording_passes_against_an_unpadded_eager_server(tmp_path):
    eager = _record(tmp_path / "eager.safetensors", None, pad=False)
    graph = _record(tmp_path / "graph.safetensors", "emulate")
    assert sorted(_tensors(eager.written)) == sorted(_tensors(graph.written))
    rep = compare(str(eager.written), str(graph.written))
    assert rep.verdict == "pass", rep.summary


@pytest.mark.parametrize("bug,code", [("stale", "STALE_ROWS"), ("padded_row", "BAD_TOKENS")])
def test_a_graph_only_bug_is_found_with_its_rows(bug, code, tmp_path):
    eager = _record(tmp_path / "eager.safetensors", None)
    bad = _record(tmp_path / "bad.safetensors", "emulate", bugs=Bugs(**{bug: True}))
    rep = compare(str(eager.written), str(bad.written))
    assert rep.verdict == "fail"
    errs = [f for f in rep.findings if f.severity.value == "error"]
    assert {f.code for f in errs} == {code}
    assert {f.tensor for f in errs} == {"aux.0", "aux.1", "aux.2"}
    want = _decode_rows("stale" if bug == "stale" else "padded")
    for f in errs:
        assert sorted(f.evidence.get("stale_rows") or f.evidence.get("token_rows")) == want, f.message


def test_eager_capture_is_unchanged_in_graph_safe_mode(tmp_path):
    on = _record(tmp_path / "on.safetensors", None)
    graphs.disable()
    off = _record(tmp_path / "off.safetensors", None)
    a, b = _tensors(on.written), _tensors(off.written)
    assert sorted(a) == sorted(b) and all(np.array_equal(a[n], b[n]) for n in a)


def test_the_async_recorder_drains_the_same(tmp_path):
    plain = _record(tmp_path / "plain.safetensors", "emulate")
    asy = _record(tmp_path / "async.safetensors", "emulate", rec_cls=AsyncRecorder)
    a, b = _tensors(plain.written), _tensors(asy.written)
    assert sorted(a) == sorted(b) and all(np.array_equal(a[n], b[n]) for n in a)


def test_over_the_budget_is_said_once_per_graph_and_never_passes(tmp_path, capsys):
    eager = _record(tmp_path / "eager.safetensors", None)
    h = tiny("tiny-llama").config.hidden_size * 4
    # room for the bs-4 target and draft and the bs-1 graphs, not for bs 8 (aux: 8 rows x h each)
    graphs.enable(hook_torch=False, budget_bytes=4 * 3 * 8 + 4 * 3 * h + 3 * 8 + 3 * h + 8 * 3 * 8 + 8 * h)
    small = _record(tmp_path / "small.safetensors", "emulate")
    said = [ln for ln in capsys.readouterr().err.splitlines() if "graph-safe capture" in ln]
    # the sizes in the unit that fits: a bs-8 slot of h bytes a row is 8*h bytes, never "0.0 MiB"
    need, held, limit = 8 * h, graphs.budget().used, graphs.budget().limit
    assert 1 << 10 <= need < 1 << 20 and held < 1 << 20
    assert len(said) == 1 and said[0].startswith("consistency: graph-safe capture: graph loop.draft bs=8: 'aux.1' "
                                                 f"needs {need / 1024:.1f} KiB, the graph buffers hold "
                                                 f"{held / 1024:.1f} KiB of {limit / 1024:.1f} KiB"), said
    assert "raise CONSISTENCY_RECORD_GRAPH_BYTES" in said[0]
    with open_dump(small.written) as d:
        nr = d.metadata.extra["cuda_graphs"]["not_recorded"]
    reason = next(iter(nr))
    assert reason.startswith("over the graph-buffer budget") and nr[reason] == {"aux.1": STEPS, "aux.2": STEPS}
    # compared what it holds: the bs-8 draft replays lack aux.1 and aux.2 (their aux.0 fits), paired by
    # graph tags and replay numbers; those passes are left out, the rest compared, and it never passes
    rep = compare(str(eager.written), str(small.written))
    assert rep.verdict == "fail" and rep.summary.startswith("CAPTURES_DROPPED"), rep.summary
    (drop,) = [f for f in rep.findings if f.code == "CAPTURES_DROPPED"]
    eights = sum(1 for real in BATCHES if _padded(real) == 8) * STEPS
    passes = len(BATCHES) * (1 + STEPS)
    assert drop.metrics["left_out"] == {"passes": eights, "of": passes, "graphs": {"loop.draft, loop.target bs=8": eights},
                                        "lacking": {"aux.1": eights, "aux.2": eights}, "names": []}
    assert f"{eights} of {passes} forward passes (loop.draft, loop.target bs=8 x{eights}) lack aux.1, aux.2" \
        in drop.message
    assert [f.code for f in rep.findings if f.severity.value == "error"] == ["CAPTURES_DROPPED"]


def test_a_whole_graph_left_out_fails_with_captures_dropped(tmp_path):
    """Every name of the bs-8 graphs over the budget: counts stay equal, stitching accepts the
    dump, and only the recorder's own words stop a pass on the tokens that remain."""
    eager = _record(tmp_path / "eager.safetensors", None)
    h = tiny("tiny-llama").config.hidden_size * 4
    graphs.enable(hook_torch=False, budget_bytes=4 * 3 * 8 + 4 * 3 * h + 3 * 8 + 3 * h)  # bs 4 and 1 only
    small = _record(tmp_path / "small.safetensors", "emulate")
    rep = compare(str(eager.written), str(small.written))
    assert rep.verdict == "fail"
    drop = [f for f in rep.findings if f.code == "CAPTURES_DROPPED"]
    assert len(drop) == 1 and drop[0].metrics["dropped"] == {n: STEPS for n in
                                                            ("aux.0", "aux.1", "aux.2", "input_ids", "positions",
                                                             "request_ids")}
    assert rep.summary.startswith("CAPTURES_DROPPED")


def test_a_budget_that_fits_the_target_graphs_but_not_every_draft_graph(tmp_path):
    """The bs-8 draft graph over the budget whole (its target graph fits): aux.* have fewer
    captures than input_ids, paired with the target's passes by batch size and replay number;
    those passes are left out and said, the rest compared: CAPTURES_DROPPED, never exit 2."""
    eager = _record(tmp_path / "eager.safetensors", None)
    h = tiny("tiny-llama").config.hidden_size * 4
    graphs.enable(hook_torch=False, budget_bytes=4 * 3 * 8 + 4 * 3 * h + 3 * 8 + 3 * h + 8 * 3 * 8)
    small = _record(tmp_path / "small.safetensors", "emulate")
    rep = compare(str(eager.written), str(small.written))
    eights = sum(1 for real in BATCHES if _padded(real) == 8) * STEPS
    (drop,) = [f for f in rep.findings if f.code == "CAPTURES_DROPPED"]
    assert rep.verdict == "fail" and rep.summary.startswith("CAPTURES_DROPPED"), rep.summary
    assert drop.metrics["left_out"]["lacking"] == {f"aux.{i}": eights for i in range(3)}
    assert drop.metrics["left_out"]["graphs"] == {"loop.target bs=8": eights}
    assert [f.code for f in rep.findings if f.severity.value == "error"] == ["CAPTURES_DROPPED"]


def test_trim_cuts_dim0_by_tokens_or_batch_and_says_when_it_cannot():
    buf = torch.arange(8 * 3).view(8, 3)
    assert trim(buf, Replay(real_tokens=5), 8, None)[1] == 5
    assert trim(buf, Replay(real_bs=2), 16, 8)[0].shape == (2, 3)  # rows are the padded batch, not tokens
    kept = trim(buf, Replay(real_tokens=5), 16, 4)  # neither: kept whole, and said so
    assert kept[1] is None and kept[0].shape == (8, 3)
    assert trim(buf, Replay(), 8, 8)[1] is None  # no real size known: untrimmed
    assert trim(torch.tensor(3.0), Replay(real_tokens=1), 1, 1)[1] is None


def test_recapture_reuses_the_buffers_and_the_budget():
    b = Budget(1 << 20)
    plan = Plan("p", 4, None, b)
    x = torch.randn(4, 8)
    for _ in range(3):
        plan.cursor = 0
        plan.add("aux.0", x, "runtime", {})
        plan.add("aux.1", x * 2, "runtime", {"positions": torch.arange(4)})
        plan.end()
    assert b.used == 4 * 8 * 4 * 2 + 4 * 8 and len(plan.entries) == 2
    plan.cursor = 0
    plan.add("aux.0", torch.randn(4, 9), "runtime", {})  # another shape: a new buffer, the old ones go
    plan.end()
    assert b.used == 4 * 9 * 4 and [e.name for e in plan.entries] == ["aux.0"]
    plan.release()
    assert b.used == 0


def test_a_host_value_inside_a_graph_is_counted_not_recorded(tmp_path):
    g = EagerGraph()
    with Recorder(tmp_path / "h.safetensors", force=True) as rec:
        g.capture(lambda: (capture("aux.0", torch.ones(2, 4)), capture("note", np.ones(3))))
        for _ in range(2):
            g.replay()
    assert sorted(rec.tensors) == ["aux.0", "aux.0#2"]  # the capture itself records nothing: replays do
    nr = rec.metadata.extra["cuda_graphs"]["not_recorded"]
    assert nr == {"host value inside a captured graph (a replay never refreshes it)": {"note": 2}}


def test_parse_bytes():
    assert parse_bytes("512M") == 512 << 20 and parse_bytes("2G") == 2 << 30 and parse_bytes("4096") == 4096
    assert parse_bytes("64KiB") == 64 << 10
    with pytest.raises(ValueError, match="CONSISTENCY_RECORD_GRAPH_BYTES='lots'"):
        parse_bytes("lots")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (bench/graph_proof.py ran it on an H200)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graphs_equal_the_eager_loop(dtype, tmp_path):
    graphs.enable(hook_torch=True)
    model, draft = _model(dtype)
    model, draft = model.cuda(), draft.cuda()
    out = {}
    for mode in (None, "cuda"):
        loop = Loop(model, draft, AUX, CAPTURE_BS, PROMPT + STEPS + 1, graphs=mode)
        g = torch.Generator().manual_seed(1)
        with AsyncRecorder(tmp_path / f"{mode}.safetensors", force=True) as rec:
            rid = 0
            for real in BATCHES:
                loop.run_batch(torch.randint(0, model.config.vocab_size, (real, PROMPT), generator=g).cuda(), STEPS,
                               list(range(rid, rid + real)))
                rid += real
        out[mode] = _tensors(rec.written)
    assert sorted(out[None]) == sorted(out["cuda"])
    assert all(np.array_equal(out[None][n], out["cuda"][n]) for n in out[None])


@pytest.mark.parametrize("bug", ["early_layers", "swap_rows", "no_residual"])
def test_the_planted_graph_only_causes_touch_the_rows_their_construction_says(bug, tmp_path):
    """tests/graph_loop.py's graph-only causes (the H200 runs of bench/graph_causes.py plant them
    too): the graph path differs from the same loop recorded eagerly exactly at the decode rows
    the cause reaches, and the prefill (eager in every mode) never."""
    eager = _tensors(_record(tmp_path / "eager.safetensors", None).written)
    bad = _tensors(_record(tmp_path / "bad.safetensors", "emulate", bugs=Bugs(**{bug: True})).written)
    assert sorted(eager) == sorted(bad)
    k, want, got = 0, set(), set()
    for real in BATCHES:
        for step in range(1 + STEPS):  # the prefill pass, then the decode replays
            k += 1
            for slot in range(len(AUX)):
                key = f"aux.{slot}" if k == 1 else f"aux.{slot}#{k}"
                a, b = eager[key], bad[key]
                got |= {(k, slot, r) for r in range(a.shape[0]) if not np.array_equal(a[r], b[r])}
                if step == 0:
                    continue
                if bug == "swap_rows" and real >= 2:
                    want |= {(k, slot, 0), (k, slot, 1)}
                    assert np.array_equal(b[[1, 0]], a[[0, 1]])  # the other request's row, bit for bit
                elif bug != "swap_rows":
                    want |= {(k, slot, r) for r in range(real)}
    assert want and got == want
