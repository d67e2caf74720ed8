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

DATA = Path(__file__).parents[1] / "data" / "graph_causes_h200"
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


def _rows_of(case: str) -> int:
    """How many compared rows per slot the planted cause reaches, from the construction."""
    n = 0
    for _k, _rid, real, bs, step in _passes():
        if step is None:
            continue
        n += {"graph_early": real, "graph_noresid": real, "graph_swap": 2 if real >= 2 else 0,
              "graph_padrow": 1 if real < bs else 0}[case]
    return n


# what `compare` must say of each real H200 dump against the training reference (every stream):
# the cause named for exactly the rows it reaches; rows that hold nothing recorded stay BAD_TOKENS
@pytest.mark.parametrize("case, code", [("graph_early", "LAYER_MISMATCH"), ("graph_noresid", "RESIDUAL_MISSING"),
                                        ("graph_swap", "ROWS_SWAPPED"), ("graph_padrow", "BAD_TOKENS")])
def test_compare_names_each_graph_only_cause_on_the_h200_dumps(case: str, code: str) -> None:
    import consistency

    rep = consistency.compare(DATA / "training.safetensors", DATA / f"{case}.safetensors")
    assert rep.verdict == "fail"
    by_slot = {f.tensor: f for f in rep.findings if f.tensor and f.tensor.startswith("aux.")
               and f.severity.name == "error"}
    assert sorted(by_slot) == [f"aux.{i}" for i in range(len(AUX))], [(f.code, f.tensor) for f in rep.findings]
    for slot, f in by_slot.items():
        assert f.code == code, (slot, f.code, f.message)
        groups = f.evidence.get("row_groups")
        if code == "BAD_TOKENS":  # a pad token's state is no recorded row: not dressed up as a norm or a stream
            assert f.evidence["count"] == _rows_of(case) and not groups
            continue
        assert groups and sum(g["count"] for g in groups if g.get("cause") == code) == _rows_of(case)
        assert all(g["phase"] == "decode" and g["graph"] == "loop.draft" for g in groups)
        if code == "LAYER_MISMATCH":  # captured before the layers were set: the construction's early layers
            assert groups[0]["holds_stream"] == META["early_layers"][int(slot[4:])]


@pytest.mark.parametrize("ref", ["training", "eager"])
def test_compare_never_passes_a_planted_graph_cause(ref: str) -> None:
    import consistency

    assert consistency.compare(DATA / f"{ref}.safetensors", DATA / "graph.safetensors").verdict == "pass"
    for case, code in (("graph_stale", "STALE_ROWS"), ("graph_budget", "CAPTURES_DROPPED")):
        rep = consistency.compare(DATA / f"{ref}.safetensors", DATA / f"{case}.safetensors")
        assert rep.verdict == "fail" and code in {f.code for f in rep.findings}, (ref, case)
    for case in ("graph_early", "graph_noresid", "graph_swap", "graph_padrow"):
        assert consistency.compare(DATA / f"{ref}.safetensors", DATA / f"{case}.safetensors").verdict == "fail"
