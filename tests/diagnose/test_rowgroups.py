"""Row groups (issue 36, item 1): each planted graph-only cause on a subset of rows, named by
its provenance and identified as compare identifies a slot (tests/rowgen.py generates them;
the expected answer comes from the construction)."""

from __future__ import annotations

import pytest
import torch

from consistency.pipeline.compare import compare
from consistency.record import graphs
from tests import rowgen


@pytest.fixture(autouse=True)
def _graph_mode():
    graphs.enable(hook_torch=False, budget_bytes=graphs.DEFAULT_BYTES)
    with torch.no_grad():
        yield
    graphs.disable()


@pytest.fixture(scope="module")
def ref(tmp_path_factory):  # noqa: ANN001, ANN201
    graphs.enable(hook_torch=False, budget_bytes=graphs.DEFAULT_BYTES)
    try:
        with torch.no_grad():
            return rowgen.reference(tmp_path_factory.mktemp("rowgen"))
    finally:
        graphs.disable()


def test_the_plain_graph_loop_passes_against_the_every_stream_reference(ref, tmp_path) -> None:  # noqa: ANN001
    cand = rowgen.candidate(tmp_path, "none")
    rep = compare(str(ref), str(cand))
    assert rep.verdict == "pass", rep.summary


@pytest.mark.parametrize("cause", list(rowgen.CAUSES))
def test_a_planted_cause_is_named_by_row_group(cause: str, ref, tmp_path) -> None:  # noqa: ANN001
    want = rowgen.expected(cause)
    rep = compare(str(ref), str(rowgen.candidate(tmp_path, cause)))
    assert rep.verdict == "fail"
    errs = [f for f in rep.findings if f.severity.value == "error"]
    assert {f.code for f in errs} == {want.code}, [(f.code, f.message) for f in errs]
    assert {f.tensor for f in errs} == {f"aux.{i}" for i in range(len(rowgen.AUX))}
    for f in errs:
        rows = f.evidence.get("stale_rows") or f.evidence.get("token_rows")
        assert sorted(rows) == want.rows, f.message
        (g,) = f.evidence["row_groups"]
        if cause == "stale":  # named by diagnose.stale, with the rows' provenance
            assert (g["phase"], g["graph"], g["count"]) == ("decode", "loop.draft", len(want.rows)), g
            assert f"decode rows from graph replays (loop.draft, bs {', '.join(map(str, want.sizes))})" in f.message
            continue
        assert (g["phase"], g["graph"], g["batch_sizes"]) == ("decode", "loop.draft", want.sizes), g
        slot = int(f.tensor.split(".")[1])
        if cause == "swap":  # batches of one request agree under graphs too: not a graphs-only difference
            assert "prefill rows (eager) and decode rows from graph replays (loop.draft, bs 1, 4, 8) hold stream " \
                f"{rowgen.AUX[slot]} as the reference expects" in f.message, f.message
            assert "another request's row at the same position" in f.message
            continue
        assert f"prefill rows (eager) hold stream {rowgen.AUX[slot]} as the reference expects" in f.message
        assert f.message.endswith("a difference only under CUDA graphs"), f.message
        if want.holds_stream is not None:
            assert g["holds_stream"] == want.holds_stream[slot]
            assert f"hold stream {want.holds_stream[slot]}" in f.message
