"""The dumps of bench/graph_causes.py recorded on an H200 (tests/data/graph_causes_h200/): real
CUDA-graph replays of tests/graph_loop.py's runner, one planted graph-only cause each.

These are inputs for the row diagnosis (issue 36); here they are checked against their own
construction, read from causes.json (batches, capture sizes, prompt, steps, aux streams), with
numpy only: the graph path equals the same padded batches run eagerly bit for bit except at
exactly the rows each cause reaches, and a cause's rows hold what the cause says they hold.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from consistency.dump.dtypes import to_float
from consistency.dump.reader import open_dump

DATA = Path(__file__).parent / "data" / "graph_causes_h200"
META = json.loads((DATA / "causes.json").read_text())
BATCHES, CAPTURE_BS = META["batches"], META["capture_bs"]
STEPS, PROMPT, AUX = META["steps"], META["prompt"], META["aux_streams"]


def _dump(name: str) -> tuple[dict[str, np.ndarray], object]:
    with open_dump(DATA / f"{name}.safetensors") as d:
        return {n: d[n].read_all() for n in d.tensors}, d.metadata


def _passes():
    """(pass number k, batch's first request id, real requests, padded size, decode step or None)."""
    k, rid = 0, 0
    for real in BATCHES:
        bs = next(b for b in CAPTURE_BS if b >= real)
        for step in [None, *range(STEPS)]:
            k += 1
            yield k, rid, real, bs, step
        rid += real


def _key(name: str, k: int) -> str:
    return name if k == 1 else f"{name}#{k}"


def _differ(a: dict, b: dict) -> set[tuple[int, int, int]]:
    out = set()
    for k, *_ in _passes():
        for slot in range(len(AUX)):
            x, y = a[_key(f"aux.{slot}", k)], b[_key(f"aux.{slot}", k)]
            out |= {(k, slot, r) for r in range(x.shape[0]) if not np.array_equal(x[r], y[r])}
    return out


def test_the_h200_dumps_say_where_they_come_from():
    assert META["device"].startswith("NVIDIA H200") and META["graphs"] == "cuda"
    assert len(set(AUX)) == len(AUX)  # distinct slots: a row holding another slot's stream is tellable
    ref, _ = _dump("eager_padded")
    graph, meta = _dump("graph")
    assert sorted(ref) == sorted(graph) and not _differ(ref, graph)  # graph replays == eager, bit for bit
    tagged = [m.graph for m in meta.tensors.values() if m.graph is not None]
    assert len(tagged) == len(BATCHES) * STEPS * 6  # 3 target + 3 draft captures per replay


@pytest.mark.parametrize("case", ["graph_stale", "graph_padrow", "graph_early", "graph_swap", "graph_noresid"])
def test_each_planted_cause_touches_exactly_its_rows(case):
    ref, _ = _dump("eager_padded")
    bad, _ = _dump(case)
    want = set()
    for k, _rid, real, bs, step in _passes():
        if step is None:
            continue  # the prefill runs eagerly in every mode
        rows = {"graph_stale": range(real) if step > 0 else (),
                "graph_padrow": [real - 1] if real < bs else (),
                "graph_swap": [0, 1] if real >= 2 else (),
                "graph_early": range(real), "graph_noresid": range(real)}[case]
        want |= {(k, slot, r) for slot in range(len(AUX)) for r in rows}
    got = _differ(ref, bad)
    if case == "graph_stale":  # a row equal to the step before (a token repeated) cannot differ
        assert got <= want and len(got) >= 0.9 * len(want)
    else:
        assert want and got == want


def test_the_early_capture_rows_hold_the_stream_one_layer_deeper():
    """Against the training reference (every stream, HF hooks, a batch of the requests'
    whole sequences): each decode row of graph_early is nearest to hidden.{s+1}, the eager
    rows of the same dump to hidden.{s}."""
    train, _ = _dump("training")
    early, _ = _dump("graph_early")
    hidden = {s: to_float(train[f"hidden.{s}"], "bfloat16") for s in range(META["layers"] + 1)}
    for k, rid, real, _bs, step in _passes():
        for slot, s in enumerate(AUX):
            x = to_float(early[_key(f"aux.{slot}", k)], "bfloat16")
            for r in range(real):
                req, pos = (rid + r // PROMPT, r % PROMPT) if step is None else (rid + r, PROMPT + step)
                dist = {t: float(np.linalg.norm(x[r] - h[req, pos])) for t, h in hidden.items()}
                assert min(dist, key=dist.get) == (s if step is None else s + 1), (k, slot, r, step)
