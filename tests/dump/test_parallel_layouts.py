"""Pipeline stages x tensor parallel, DP attention and expert parallel with real gloo processes.

Each correct layout, merged, must equal the single-process model on the same weights; each
broken one (a local layer index, a stage that recorded nothing, tokens no DP rank or two
DP ranks hold, a missing expert all-reduce) must be found and named. One spawn per layout
records every variant (process start-up dominates on a small CPU box).
"""

from __future__ import annotations

import shutil

import pytest

from consistency.diagnose.layout import findings as layout_findings
from consistency.pipeline.compare import compare as run_compare
from consistency.dump.sets import open_side
from consistency.dump.stages import StagedDump
from tests import tp_model as tp

PP_LAYERS, PP_AUX = 4, [1, 2, 4]  # stage 0 runs layers [0, 2), stage 1 [2, 4)


def _errors(rep):  # noqa: ANN001, ANN202
    return [(f.code, f.tensor) for f in rep.findings if f.severity.value == "error"]


def _codes(d):  # noqa: ANN001, ANN202
    return [f.code for f in layout_findings(d)]


@pytest.fixture(scope="module")
def pp(tmp_path_factory):
    d = tmp_path_factory.mktemp("pp")
    job = {"kind": "pp", "tp": 2, "layers": PP_LAYERS, "aux": PP_AUX}
    tp.run_many(4, [(d / "ok.safetensors", job), (d / "local.safetensors", {**job, "local_index": True}),
                    (d / "silent.safetensors", {**job, "silent": [1]})])
    tp.reference_dump(d / "ref.safetensors", layers=PP_LAYERS, aux=PP_AUX)
    return d


@pytest.mark.slow
def test_pp2_x_tp2_merges_to_the_single_process_model(pp):
    with open_side(str(pp / "ok.safetensors")) as d:
        assert isinstance(d, StagedDump) and d.pp == 2 and d.world == 4
        assert d.ranges == {0: (0, 2), 1: (2, 4)} and layout_findings(d) == []
        assert d.boundary["hidden.2"] == ([0, 1], 0.0)  # the boundary stream, held by both stages, agrees
        assert d["col_out.3"].shape == (tp.T, tp.F)  # stage 1's TP group unsharded
        assert d.owner["hidden.4"] == 1 and d.owner["hidden.1"] == 0
    rep = run_compare(str(pp / "ref.safetensors"), str(pp / "ok.safetensors"))
    assert rep.verdict == "pass", _errors(rep)
    assert {f.tensor for f in rep.findings if f.code == "OK"} >= {"hidden.4", "aux.0", "aux.2", "row_out.3"}


@pytest.mark.slow
def test_local_layer_index_on_stage_1_is_named(pp):
    with open_side(str(pp / "local.safetensors")) as d:
        out = next(f for f in layout_findings(d) if f.code == "STAGE_OUT_OF_RANGE")
        # stage 1 (layers [2, 4)) wrote its input stream 2 as hidden.0 and stream 3 as hidden.1
        assert out.evidence["stage"] == 1 and out.evidence["local_index"] is True
        assert set(out.evidence["names"]) == {"hidden.0", "hidden.1", "aux.0"}
        assert "pipeline stage 1 (layers [2, 4))" in out.message and "local layer index" in out.message
        [c] = [f for f in layout_findings(d) if f.code == "STAGE_CONFLICT"]  # one finding per pair of stages
        assert c.evidence["stages"] == [0, 1] and c.message.startswith("pipeline stages 0 and 1 both recorded")
        assert {"hidden.0", "hidden.1", "hidden.2", "aux.0", "col_out.0"} <= set(c.evidence["names"])
        assert _codes(d).index("STAGE_OUT_OF_RANGE") < _codes(d).index("STAGE_CONFLICT")  # the cause first
        assert "hidden.3" not in d.names and "hidden.4" not in d.names
    rep = run_compare(str(pp / "ref.safetensors"), str(pp / "local.safetensors"))
    assert rep.verdict == "fail"


@pytest.mark.slow
def test_a_stage_that_recorded_nothing_is_named(pp):
    assert not list(pp.glob("silent.rank2-of4*")) and not list(pp.glob("silent.rank3-of4*"))
    with open_side(str(pp / "silent.safetensors")) as d:
        [f] = layout_findings(d)
        assert f.code == "STAGE_MISSING" and f.evidence["stage"] == 1 and f.evidence["missing_ranks"] == [2, 3]
        assert f.evidence["layers"] == [2, 4] and "pipeline stage 1 of 2" in f.message
    rep = run_compare(str(pp / "ref.safetensors"), str(pp / "silent.safetensors"))
    assert rep.verdict == "fail" and ("MISSING", None) in _errors(rep)
    # the missing stage leads: it is why the slots are missing (issue 24), not a MISSING aux slot
    assert rep.summary.startswith("STAGE_MISSING") and rep.findings[0].code == "STAGE_MISSING"


@pytest.mark.slow
def test_rank_files_from_several_nodes_form_one_set(pp, tmp_path):
    for r in range(4):  # per-node disks, copied to one place: a directory per node
        node = tmp_path / "nodes" / f"node{r // 2}"
        node.mkdir(parents=True, exist_ok=True)
        shutil.copy(pp / f"ok.rank{r}-of4.safetensors", node)
    for spec in (tmp_path / "nodes", tmp_path / "nodes" / "*" / "ok.rank*-of4.safetensors"):
        with open_side(str(spec)) as d:
            assert isinstance(d, StagedDump) and layout_findings(d) == [] and len(d.nodes) >= 1
    (tmp_path / "nodes" / "node1" / "ok.rank3-of4.safetensors").unlink()  # one rank's copy was forgotten
    from consistency.errors import InputError

    with pytest.raises(InputError, match=r"pipeline stage 1 is incomplete.*global ranks \[3\] of 4 missing"):
        open_side(str(tmp_path / "nodes"))


@pytest.fixture(scope="module")
def dp(tmp_path_factory):
    d = tmp_path_factory.mktemp("dp")
    everyone = list(range(tp.T))
    reqs = [(q, p) for q, n in enumerate((5, 9, 10)) for p in range(n)]  # 3 requests, 24 tokens in order
    jobs = {
        "uneven": {"rows": [[3, 4, 5, 10, 11], [r for r in everyone if r not in (3, 4, 5, 10, 11)]]},
        "none": {"rows": [[], everyone]},  # rank 0's batch is empty
        "requests": {"rows": [list(range(5, 14)), list(range(0, 5)) + list(range(14, 24))], "requests": reqs},
        "unowned": {"rows": [list(range(0, 10)), list(range(11, 24))]},  # token 10: nobody's
        "duplicate": {"rows": [list(range(0, 13)), list(range(12, 24))]},  # token 12: both ranks'
    }
    tp.run_many(2, [(d / f"{k}.safetensors", {"kind": "dp", **j}) for k, j in jobs.items()])
    tp.reference_dump(d / "ref.safetensors")
    return d


@pytest.mark.slow
@pytest.mark.parametrize("case", ["uneven", "none", "requests"])
def test_dp_attention_tokens_merge_in_order(dp, case):
    with open_side(str(dp / f"{case}.safetensors")) as d:
        assert isinstance(d, StagedDump) and d.dp == 2 and layout_findings(d) == []
        assert d["hidden.2"].shape == (tp.T, tp.H) and d["input_ids"].shape == (tp.T,)
    rep = run_compare(str(dp / "ref.safetensors"), str(dp / f"{case}.safetensors"))
    assert rep.verdict == "pass", _errors(rep)


@pytest.mark.slow
def test_a_token_held_by_no_dp_rank_is_reported(dp):
    with open_side(str(dp / "unowned.safetensors")) as d:
        [f] = layout_findings(d)
        assert f.code == "TOKEN_UNOWNED" and "[10]" in f.message and f.evidence["tokens"] == 1
        assert d["hidden.1"].shape == (tp.T - 1, tp.H)
    assert run_compare(str(dp / "ref.safetensors"), str(dp / "unowned.safetensors")).verdict == "fail"


@pytest.mark.slow
def test_a_token_held_by_two_dp_ranks_is_reported(dp):
    with open_side(str(dp / "duplicate.safetensors")) as d:
        [f] = layout_findings(d)
        assert f.code == "TOKEN_DUPLICATE" and "dp ranks [0, 1]: [12]" in f.message
        assert f.evidence["token_rel_diff"] == 0.0  # both computed the same token: the bookkeeping is wrong
        assert d["hidden.1"].shape == (tp.T, tp.H)
    rep = run_compare(str(dp / "ref.safetensors"), str(dp / "duplicate.safetensors"))  # diagnosis reports the set's
    assert rep.verdict == "fail" and "TOKEN_DUPLICATE" in {f.code for f in rep.findings}  # findings: never a PASS


@pytest.fixture(scope="module")
def ep(tmp_path_factory):
    d = tmp_path_factory.mktemp("ep")
    job = {"kind": "ep", "experts": 4}
    tp.run_many(2, [(d / "ok.safetensors", job), (d / "broken.safetensors", {**job, "all_reduce": False})])
    tp.reference_dump(d / "ref.safetensors", experts=4)
    return d


@pytest.mark.slow
def test_expert_parallel_records_the_same_streams(ep):
    with open_side(str(ep / "ok.safetensors")) as d:
        assert d.world == 2 and all(spread == 0.0 for spread, _ in d.replica_checks.values())
        assert set(d.replica_checks) >= {"mlp_out.0", "hidden.1", "hidden.2"}
    rep = run_compare(str(ep / "ref.safetensors"), str(ep / "ok.safetensors"))
    assert rep.verdict == "pass", _errors(rep)


@pytest.mark.slow
def test_missing_expert_all_reduce_is_found_and_named(ep):
    with open_side(str(ep / "broken.safetensors")) as d:
        spread, rank = d.replica_checks["mlp_out.0"]
        assert spread > 0.1 and rank == 1
    rep = run_compare(str(ep / "ref.safetensors"), str(ep / "broken.safetensors"))
    assert rep.verdict == "fail"
    assert any(f.code == "REPLICA_MISMATCH" and f.tensor == "mlp_out.0" and "rank 1" in f.message for f in rep.findings)
    f = next(f for f in rep.findings if f.tensor == "mlp_out.0" and f.code == "PARTIAL_SHARD")
    rows = f.evidence["zero_token_rows_by_rank"]  # each rank's zeros: the tokens routed to the other's experts
    assert rows == {str(r): tp.expert_rows_outside_rank(r, 2)[:64] for r in range(2)}
