"""Merging pipeline-stage and DP-attention rank files, on files written directly (no processes).

The layouts here are built by hand so that each rule -- overlapping or gapped stage ranges,
a stage boundary stream, token order by request, malformed or contradictory layouts -- is
exercised with a known answer; tests/dump/test_parallel_layouts.py runs the real processes.
"""

from __future__ import annotations

import numpy as np
import pytest

from consistency.contract.models import DumpMetadata, ModelInfo, ShardSpec, TensorMeta
from consistency.dump.ranks import parse_shard
from consistency.dump.sets import open_side
from consistency.diagnose.layout import findings as layout_findings
from consistency.dump.stages import StagedDump
from consistency.dump.writer import write_dump
from consistency.errors import InputError, UsageError
from tests.conftest import cli

H = 8
RNG = np.random.default_rng(0)
STREAMS = [RNG.standard_normal((6, H)).astype(np.float32) for _ in range(5)]  # streams 0..4 of a 4-layer model


def _write(path, rank, world, tensors, parallel, shards=None):  # noqa: ANN001, ANN202
    meta = DumpMetadata(model=ModelInfo(num_layers=4), extra={"parallel": parallel})
    for k, spec in (shards or {}).items():
        meta.tensors[k] = TensorMeta(shard=spec)
    return write_dump(path / f"s.rank{rank}-of{world}.safetensors", tensors, meta, force=True)


def _stage(path, stage, layers, world=2, streams=None):  # noqa: ANN001, ANN202
    lo, hi = layers
    ss = streams if streams is not None else range(lo, hi + 1)
    _write(path, stage, world, {f"hidden.{s}": STREAMS[s] for s in ss},
           {"pp": {"rank": stage, "size": world, "layers": [lo, hi]}, "node": f"node{stage}"})


def test_stages_merge_and_the_boundary_stream_is_a_checked_replica(tmp_path):
    _stage(tmp_path, 0, (0, 2))
    _stage(tmp_path, 1, (2, 4))
    with open_side(str(tmp_path / "s.safetensors")) as d:
        assert isinstance(d, StagedDump) and layout_findings(d) == [] and d.nodes == ["node0", "node1"]
        assert d.names == [f"hidden.{s}" for s in range(5)]
        assert d.boundary == {"hidden.2": ([0, 1], 0.0)}
        np.testing.assert_array_equal(d["hidden.4"].read_all(), STREAMS[4])
        assert d.metadata.extra["parallel_merged"]["stages"] == {"0": [0, 2], "1": [2, 4]}


def test_overlapping_stage_ranges_are_named(tmp_path):
    _stage(tmp_path, 0, (0, 3))
    _stage(tmp_path, 1, (2, 4))
    with open_side(str(tmp_path / "s.safetensors")) as d:
        [f] = [f for f in layout_findings(d) if f.code == "STAGE_RANGES"]
        assert "stages 0 (layers [0, 3)) and 1 (layers [2, 4)) overlap on layers [2, 3)" in f.message
        assert not [f for f in layout_findings(d) if f.code == "STAGE_CONFLICT"]  # the copies agree


def test_a_gap_between_stages_and_a_short_last_stage_are_named(tmp_path):
    _stage(tmp_path, 0, (0, 1))
    _stage(tmp_path, 1, (2, 3))
    with open_side(str(tmp_path / "s.safetensors")) as d:
        msgs = [f.message for f in layout_findings(d) if f.code == "STAGE_RANGES"]
        assert any("layers [1, 2) belong to no pipeline stage" in m for m in msgs)
        assert any("ends at layer 3, but the model has 4 layers" in m for m in msgs)


def test_a_stream_two_stages_hold_with_different_values_is_a_conflict(tmp_path):
    _stage(tmp_path, 0, (0, 2))
    _write(tmp_path, 1, 2, {"hidden.2": STREAMS[3], "hidden.3": STREAMS[3], "hidden.4": STREAMS[4]},
           {"pp": {"rank": 1, "size": 2, "layers": [2, 4]}})
    with open_side(str(tmp_path / "s.safetensors")) as d:
        [f] = layout_findings(d)
        assert f.code == "STAGE_CONFLICT" and f.tensor == "hidden.2" and f.evidence["stages"] == [0, 1]
        np.testing.assert_array_equal(d["hidden.2"].read_all(), STREAMS[2])  # the first stage's copy is kept
    with open_side(str(tmp_path / "s.safetensors")) as d:
        ref_side = layout_findings(d, "reference")
        assert ref_side[0].message.startswith("reference: pipeline stages 0 and 1") and ref_side[0].tensor is None


def test_dp_tokens_by_request_merge_in_request_order_and_gaps_are_named(tmp_path):
    x = RNG.standard_normal((7, H)).astype(np.float32)  # request 'a' has 3 tokens, 'b' 4
    keys = [("a", 0), ("a", 1), ("a", 2), ("b", 0), ("b", 1), ("b", 2), ("b", 3)]
    own = [[3, 0, 2], [5, 4, 6]]  # rank 0: b0, a0, a2; rank 1: b2, b1, b3 -- a1 held by nobody
    for r, rows in enumerate(own):
        _write(tmp_path, r, 2, {"hidden.1": x[rows]},
               {"dp": {"rank": r, "size": 2, "requests": [keys[i][0] for i in rows],
                       "positions": [keys[i][1] for i in rows]}},
               {"hidden.1": ShardSpec(kind="split", dim=-2, rank=r, world_size=2, group="dp")})
    with open_side(str(tmp_path / "s.safetensors")) as d:
        [f] = layout_findings(d)
        assert f.code == "TOKEN_UNOWNED" and "request 'a' pos 1" in f.message
        np.testing.assert_array_equal(d["hidden.1"].read_all(), x[[0, 2, 3, 4, 5, 6]])


def test_dp_rows_must_match_the_declared_tokens(tmp_path):
    for r in range(2):
        _write(tmp_path, r, 2, {"hidden.1": np.zeros((3, H), np.float32)},
               {"dp": {"rank": r, "size": 2, "rows": [r, 2 + r]}},
               {"hidden.1": ShardSpec(kind="split", dim=-2, rank=r, world_size=2, group="dp")})
    with pytest.raises(InputError, match="3 token rows but the layout declares 2 tokens"):
        open_side(str(tmp_path / "s.safetensors"))


@pytest.mark.parametrize("bad, needle", [
    ({"pp": {"rank": 2, "size": 2, "layers": [0, 2]}}, "bad parallel layout"),
    ({"pp": {"rank": 0, "size": 2, "layers": [3, 1]}}, "bad parallel layout"),
    ({"dp": {"rank": 0, "size": 2, "rows": [0], "requests": ["a"], "positions": [0]}}, "bad parallel layout"),
    ({"pp": {"rank": 0, "size": 2, "layers": [0, 2]}, "surprise": 1}, "bad parallel layout"),
])
def test_a_malformed_layout_is_one_line_exit_2(tmp_path, bad, needle):
    _write(tmp_path, 0, 2, {"hidden.0": STREAMS[0]}, bad)
    _write(tmp_path, 1, 2, {"hidden.0": STREAMS[0]}, {"pp": {"rank": 1, "size": 2, "layers": [2, 4]}})
    write_dump(tmp_path / "ref.safetensors", {"hidden.0": STREAMS[0]}, force=True)
    r = cli("compare", str(tmp_path / "ref.safetensors"), str(tmp_path / "s.safetensors"))
    assert r.returncode == 2 and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert "s.rank0-of2.safetensors" in r.stderr


def test_contradictory_sets_are_refused(tmp_path):
    _stage(tmp_path, 0, (0, 2))
    _write(tmp_path, 1, 2, {"hidden.2": STREAMS[2]}, {"pp": {"rank": 0, "size": 2, "layers": [0, 2]}})
    with pytest.raises(InputError, match="rank 1 and rank 0 both claim stage 0"):
        open_side(str(tmp_path / "s.safetensors"))
    write_dump(tmp_path / "s.rank1-of2.safetensors", {"hidden.2": STREAMS[2]}, force=True)  # no layout at all
    with pytest.raises(InputError, match="declares no pipeline/data-parallel layout"):
        open_side(str(tmp_path / "s.safetensors"))


def test_one_token_scheme_per_set(tmp_path):
    spec = {"hidden.1": ShardSpec(kind="split", dim=-2, rank=0, world_size=2, group="dp")}
    _write(tmp_path, 0, 2, {"hidden.1": STREAMS[1][:1]}, {"dp": {"rank": 0, "size": 2, "rows": [0]}}, spec)
    _write(tmp_path, 1, 2, {"hidden.1": STREAMS[1][:1]},
           {"dp": {"rank": 1, "size": 2, "requests": [7], "positions": [0]}}, spec)
    with pytest.raises(InputError, match="one scheme per set"):
        open_side(str(tmp_path / "s.safetensors"))


def test_shard_annotations_take_the_group_rank_of_a_declared_layout():
    lay = {"tp": {"rank": 1, "size": 2}, "dp": {"rank": 0, "size": 4}}
    s = parse_shard("h[tp]", 3, 4, lay)
    assert (s.kind, s.dim, s.rank, s.world_size, s.group) == ("split", -1, 1, 2, "tp")
    s = parse_shard("t[dp]", 3, 4, lay)
    assert (s.kind, s.dim, s.rank, s.world_size, s.group) == ("split", -2, 0, 4, "dp")
    s = parse_shard("ep:partial", 3, 4, lay)  # no ep group declared: the global rank
    assert (s.kind, s.rank, s.world_size, s.group) == ("partial", 3, 4, "ep")
    assert parse_shard("tp:replicated", 0, 2).kind == "replicated"


def test_declare_writes_the_layout_and_refuses_half_layouts(tmp_path):
    from consistency.record import Recorder, parallel

    with Recorder(tmp_path / "x.safetensors") as rec:
        lay = parallel.declare(pp=(1, 2), layers=(2, 4), tp=(0, 1), node="h1")
        assert lay is not None and rec.metadata.extra["parallel"]["pp"] == {"rank": 1, "size": 2, "layers": (2, 4)}
        rec.capture("hidden.2", STREAMS[2])
    with pytest.raises(UsageError, match="needs layers"):
        parallel.declare(pp=(0, 2), recorder=rec)
    with pytest.raises(UsageError):
        parallel.declare(dp=(0, 2), rows=[0], requests=["a"], positions=[0], recorder=rec)
