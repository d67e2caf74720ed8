"""The contract: schemas never drift from the models; contracts load from YAML/JSON and drive compare."""

from __future__ import annotations

import json

import pytest

from consistency.pipeline.compare import compare as run_compare
from consistency.contract.io import read_contract
from consistency.contract.schema import all_schemas
from consistency.errors import InputError
from consistency.record.api import record_reference, record_serving
from tests.conftest import ROOT, prompt_ids, tiny


def test_checked_in_schemas_match_the_models():
    for name, text in all_schemas().items():
        path = ROOT / "schemas" / name
        assert path.is_file(), f"{name} missing: run `consistency schema`"
        assert path.read_text() == text, f"{name} drifted from its model: run `consistency schema`"


def test_contract_yaml_round_trip_and_validation(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("target: {num_layers: 12, hidden_size: 64}\nslots:\n  - {stream: 0}\n  - {stream: 3}\n  - {stream: 7}\n")
    c = read_contract(p)
    assert c.stream_ids == [0, 3, 7]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"target": {"num_layers": 12}, "slots": [{"stream": 13}]}))
    with pytest.raises(InputError, match="bad.json: invalid contract"):
        read_contract(bad)


def test_contract_sets_what_each_slot_must_hold(tmp_path):
    m = tiny("tiny-llama")
    ids = prompt_ids(m, 32)
    ref = record_reference(m, ids, tmp_path / "streams.safetensors", None)  # no aux slots: only streams
    cand = record_serving(tiny("tiny-llama"), ids, tmp_path / "serve.safetensors", [3, 7, 10], dtype="bfloat16")
    c = tmp_path / "contract.json"
    c.write_text(json.dumps({"target": {"num_layers": 12, "hidden_size": 64},
                             "slots": [{"stream": 0}, {"stream": 3}, {"stream": 7}]}))
    rep = run_compare(str(ref), str(cand), contract=str(c))
    assert [s.expected for s in rep.slots] == ["hidden.0", "hidden.3", "hidden.7"]
    assert [s.identified_stream for s in rep.slots] == [3, 7, 10]
    assert rep.findings[0].code == "SLOT_SHIFT"
