"""Tensor parallel with real processes: record on every rank, unshard, catch the missing all-reduce."""

from __future__ import annotations

import pytest

from consistency.pipeline.compare import compare as run_compare
from consistency.dump.ranks import RankDump, parse_shard
from consistency.dump.sets import open_side
from tests import tp_model as tp
from tests.conftest import cli


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    return tp.reference_dump(tmp_path_factory.mktemp("tp") / "ref.safetensors")


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_rank_files_unshard_to_the_single_process_model(ref, tmp_path, world):
    files = tp.run(world, tmp_path / "serve.safetensors")
    assert all(f.is_file() for f in files)
    with open_side(str(tmp_path / "serve.rank*-of*.safetensors")) as d:
        assert isinstance(d, RankDump) and d.world == world
        assert d["col_out.0"].shape == (tp.T, tp.F)  # concatenated along the sharded dim
        assert d["row_out.1"].dtype == "float32"  # partials summed
        assert all(spread == 0.0 for spread, _ in d.replica_checks.values())
    for spec in (str(tmp_path / "serve.safetensors"), str(tmp_path)):  # un-ranked name, or the directory
        rep = run_compare(str(ref), spec)
        assert rep.verdict == "pass", [(f.code, f.message) for f in rep.findings if f.severity.value == "error"]
        assert {f.tensor for f in rep.findings if f.code == "OK"} >= {"col_out.0", "row_out.0", "hidden.2", "aux.2"}


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_missing_embedding_all_reduce_is_partial_shard_with_ranks_and_rows(ref, tmp_path, world):
    tp.run(world, tmp_path / "broken.safetensors", embed_all_reduce=False)
    rep = run_compare(str(ref), str(tmp_path / "broken.safetensors"))
    assert rep.verdict == "fail"
    f = next(f for f in rep.findings if f.tensor == "aux.0")
    assert f.code == "PARTIAL_SHARD" and f.identified_as == "hidden.0"
    assert f.evidence["ranks"] == world and f.evidence["after"] < 1e-9 < f.evidence["before"]
    rows = f.evidence["zero_token_rows_by_rank"]
    for r in range(world):
        assert rows[str(r)] == tp.token_rows_outside_rank(r, world)[:64]
    assert any(x.code == "REPLICA_MISMATCH" and x.tensor == "hidden.0" for x in rep.findings)
    # one rank's file alone: in-shard rows exact, the rest zero, the rank named
    one = run_compare(str(ref), str(tmp_path / f"broken.rank1-of{world}.safetensors"))
    g = next(x for x in one.findings if x.tensor == "aux.0")
    assert g.code == "PARTIAL_SHARD" and g.evidence["rank"] == 1
    assert g.evidence["zero_token_rows"] == tp.token_rows_outside_rank(1, world)[:64]
    assert g.message.startswith(f"slot 0 (aux.0) rank 1 of {world}:") or f"rank 1 of {world}" in g.message


def test_incomplete_or_mixed_rank_sets_are_refused_with_one_line(tmp_path):
    from consistency.dump.writer import write_dump

    import numpy as np

    for r in (0, 2):
        write_dump(tmp_path / f"s.rank{r}-of3.safetensors", {"aux.0": np.ones((2, 4), np.float32)})
    r = cli("compare", str(tmp_path / "s.rank0-of3.safetensors"), str(tmp_path / "s.safetensors"))
    assert r.returncode == 2 and "ranks [1] of 3 are missing" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_rank_files_from_several_nodes_form_one_set_and_missing_ranks_are_named(tmp_path):
    import numpy as np

    from consistency.dump.writer import write_dump
    from consistency.errors import InputError

    x = np.arange(32, dtype=np.float32).reshape(4, 8)
    for r in range(4):  # per-node disks copied under one directory: nodes/node0 holds ranks 0-1, node1 ranks 2-3
        node = tmp_path / "nodes" / f"node{r // 2}"
        node.mkdir(parents=True, exist_ok=True)
        write_dump(node / f"s.rank{r}-of4.safetensors", {"col.0": x[:, 2 * r:2 * r + 2]},
                   _meta("col.0", parse_shard("h[tp]", r, 4)))
    for spec in (tmp_path / "nodes", tmp_path / "nodes" / "*" / "s.rank*-of4.safetensors"):
        with open_side(str(spec)) as d:
            assert isinstance(d, RankDump) and d.world == 4
            assert (d["col.0"].read_all() == x).all()  # concatenated across both nodes' files
    (tmp_path / "nodes" / "node1" / "s.rank3-of4.safetensors").unlink()
    with pytest.raises(InputError, match=r"ranks \[3\] of 4 are missing \(found 3 in .*node0, .*node1\)"):
        open_side(str(tmp_path / "nodes"))
    (tmp_path / "nodes" / "node0" / "s.rank3-of4.safetensors").write_bytes(b"")  # a second copy of one rank
    (tmp_path / "nodes" / "node1" / "s.rank3-of4.safetensors").write_bytes(b"")
    with pytest.raises(InputError, match="rank 3 given twice"):
        open_side(str(tmp_path / "nodes" / "*" / "s.rank*-of4.safetensors"))


def _meta(name, spec):  # noqa: ANN001, ANN202
    from consistency.contract.models import DumpMetadata, TensorMeta

    return DumpMetadata(tensors={name: TensorMeta(shard=spec)})


def test_shard_annotations():
    assert parse_shard("h[tp]", 1, 4).dim == -1 and parse_shard("tp:partial", 0, 2).kind == "partial"
    assert parse_shard("t[tp]", 0, 2).dim == -2 and parse_shard(None, 0, 1) is None
    with pytest.raises(ValueError):
        parse_shard("x[ep]", 0, 2)
