"""What the runtime patches record for stitching: positions always, request ids on SGLang.

The upstream forwards (tests/record/test_patch_models.py) run with the file patch applied and,
separately, unpatched under ``install``; both must record the engine's own ``positions``
and, from an SGLang ``forward_batch``, one request id per token -- and the result must
stitch into per-request segments.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from consistency.dump.reader import open_dump
from consistency.dump.stitch import layout
from consistency.record import Recorder
from consistency.record.patch import install, request_keys
from tests.record.test_patch import CAPTURE, _ids
from tests.record.test_patch_models import CASES, InnerModel, engine_args

ENV = "CONSISTENCY_RECORD"


def _batch(**kw):
    return SimpleNamespace(can_run_tbo=False, forward_mode=SimpleNamespace(is_idle=lambda: False), **kw)


def _record(model, path, ids, positions, batch):
    args = engine_args(model, ids)  # sets the attention context for len(ids) tokens
    with Recorder(path) as rec, torch.no_grad():
        if batch is None:
            model(ids, positions, args[2])
        else:
            model(ids, positions, batch)
    return rec


@pytest.mark.parametrize("case", list(CASES))
def test_patches_record_positions_and_request_ids(case, tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, str(tmp_path / "unused.safetensors"))
    ids = _ids(20)
    positions = torch.cat([torch.arange(12), torch.arange(8)])  # two requests in one ragged batch
    sglang = case.startswith("sglang")
    batch = _batch(rids=["req-a", "req-b"], extend_seq_lens=torch.tensor([12, 8])) if sglang else None
    got = []
    for patched in (True, False):
        model = InnerModel(case, patched, CAPTURE[case])
        inst = None if patched else install(model)
        rec = _record(model, tmp_path / f"{patched}.safetensors", ids, positions, batch)
        if inst is not None:
            inst.remove()
        got.append(rec)
        assert np.array_equal(rec.tensors["positions"][0], positions.numpy())
        if sglang:
            assert rec.tensors["request_ids"][0].tolist() == [0] * 12 + [1] * 8
            assert rec.metadata.extra["requests"] == {"0": "req-a", "1": "req-b"}
        else:
            assert "request_ids" not in rec.tensors  # vLLM's model forward has no request ids at hand
    assert set(got[0].tensors) == set(got[1].tensors)  # the file patch and the monkey patch agree
    with open_dump(got[0].written) as d:
        lay = layout(d)
        assert [s.positions for s in lay.segments] == [list(range(12)), list(range(8))]
        assert lay.source == ("request_ids" if sglang else "positions")


def test_request_keys_from_pool_slots_and_decode_batches():
    decode = SimpleNamespace(req_pool_indices=torch.tensor([3, 5]), extend_seq_lens=None)
    assert request_keys(decode, 2) == ["slot 3", "slot 5"]
    verify = SimpleNamespace(req_pool_indices=torch.tensor([3, 5]))  # 4 draft tokens each
    assert request_keys(verify, 8) == ["slot 3"] * 4 + ["slot 5"] * 4
    assert request_keys(verify, 7) is None  # cannot tell which token is whose: record none
    assert request_keys(None, 4) is None


def test_a_reused_pool_slot_is_a_new_request(tmp_path, monkeypatch):
    """SGLang hands a finished request's pool slot to the next one: positions restart."""
    monkeypatch.setenv(ENV, str(tmp_path / "unused.safetensors"))
    model = InnerModel("sglang-classic-llama", False, CAPTURE["sglang-classic-llama"])
    install(model)
    path = tmp_path / "slots.safetensors"
    ids = _ids(10)
    with Recorder(path) as rec, torch.no_grad():
        for _ in range(2):  # the same slot, two requests one after the other
            args = engine_args(model, ids)
            model(ids, torch.arange(10), _batch(req_pool_indices=torch.tensor([4]), extend_seq_lens=torch.tensor([10])))
            del args
    assert rec.tensors["request_ids"][0].tolist() == [0] * 10
    assert rec.tensors["request_ids#2"][0].tolist() == [1] * 10
    with open_dump(path) as d:
        assert [len(s.rows) for s in layout(d).segments] == [10, 10]
