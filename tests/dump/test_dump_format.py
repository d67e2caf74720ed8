"""The dump format: every recorder dtype round-trips in both containers, lazily."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from consistency.contract.models import AuxInfo, DumpMetadata
from consistency.dump.reader import open_dump
from consistency.dump.writer import write_dump
from consistency.record.tensors import to_numpy

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int64, torch.bool]


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {}
    for dt in DTYPES:
        x = torch.randn(3, 5, 7, generator=g) * 10
        out[f"t.{str(dt)[6:]}"] = x.to(dt) if dt != torch.bool else x > 0
    return out


@pytest.mark.parametrize("suffix", [".safetensors", ".npz"])
def test_every_dtype_round_trips(tmp_path, suffix):
    ts = _tensors()
    p = write_dump(tmp_path / f"d{suffix}", {k: to_numpy(v) for k, v in ts.items()},
                   DumpMetadata(aux=AuxInfo(stream_ids=[0, 3, 31])))
    with open_dump(p) as d:
        assert d.metadata is not None and d.metadata.aux.stream_ids == [0, 3, 31]
        for k, v in ts.items():
            view = d[k]
            assert view.dtype == str(v.dtype)[6:], k
            assert view.shape == tuple(v.shape)
            got = view.read_all()
            want = to_numpy(v)[0]
            assert got.dtype == want.dtype and np.array_equal(got, want), k
            if v.is_floating_point():
                assert np.array_equal(view.rows_float(0, view.rows), v.float().reshape(-1, 7).numpy())


def test_safetensors_dump_is_readable_by_the_reference_library(tmp_path):
    ts = _tensors()
    p = write_dump(tmp_path / "d.safetensors", {k: to_numpy(v) for k, v in ts.items()})
    loaded = load_file(str(p))
    for k, v in ts.items():
        assert loaded[k].dtype == v.dtype and torch.equal(loaded[k], v)


def test_npz_stores_bf16_as_uint16_bits_named_in_metadata(tmp_path):
    x = torch.randn(4, 8).bfloat16()
    p = write_dump(tmp_path / "d.npz", {"hidden.0": to_numpy(x)})
    raw = np.load(p, allow_pickle=False)
    assert raw["hidden.0"].dtype == np.uint16
    meta = json.loads(str(raw["__consistency__"]))
    assert meta["tensors"]["hidden.0"]["dtype"] == "bfloat16"


def test_plain_user_npz_without_metadata_opens(tmp_path):
    np.savez(tmp_path / "mine.npz", aux=np.ones((5, 12), np.float32), input_ids=np.arange(5))
    with open_dump(tmp_path / "mine.npz") as d:
        assert d.metadata is None
        assert d["aux"].shape == (5, 12) and d["input_ids"].dtype == "int64"


def test_compressed_npz_members_are_read_lazily_and_correctly(tmp_path):
    x = np.random.default_rng(0).standard_normal((50, 16)).astype(np.float32)
    np.savez_compressed(tmp_path / "c.npz", hidden=x)
    with open_dump(tmp_path / "c.npz") as d:
        assert np.array_equal(d["hidden"].take_rows([0, 7, 8, 49]), x[[0, 7, 8, 49]])


def test_rows_are_read_without_loading_the_file(tmp_path):
    x = np.arange(1000 * 64, dtype=np.float32).reshape(1000, 64)
    p = write_dump(tmp_path / "big.safetensors", {"hidden.1": x})
    with open_dump(p) as d:
        v = d["hidden.1"]
        assert np.array_equal(v.read_rows(10, 12), x[10:12])
        assert np.array_equal(v.column_view(16, 32, "aux.1").read_rows(3, 4), x[3:4, 16:32])


def test_existing_output_is_never_clobbered_without_force(tmp_path):
    from consistency.errors import OutputExistsError

    p = tmp_path / "d.safetensors"
    write_dump(p, {"a": np.zeros(3, np.float32)})
    before = p.read_bytes()
    with pytest.raises(OutputExistsError):
        write_dump(p, {"a": np.ones(3, np.float32)})
    assert p.read_bytes() == before
    write_dump(p, {"a": np.ones(3, np.float32)}, force=True)
    assert p.read_bytes() != before
