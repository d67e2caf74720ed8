"""The compare front door (consistency/pipeline, issue 38 item 1): one request in, one report
out; what the user declares becomes values, and the dumps the caller holds come back as they
went in (written nowhere, closed by nobody but their owner)."""

from __future__ import annotations

import inspect
from pathlib import Path

import numpy as np
import pytest

import consistency
from consistency.compare.request import CompareRequest
from consistency.dump.memory import MemoryDump
from consistency.dump.reader import open_dump
from consistency.dump.writer import write_dump
from consistency.pipeline import compare as front_door
from consistency.pipeline.claims import claims_of

T, H = 8, 16


def _streams() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {f"hidden.{i}": rng.standard_normal((T, H)).astype(np.float32) for i in range(5)}


def _state(d) -> tuple:  # noqa: ANN001 - a Dump
    """Everything a compare could write into a dump: its metadata, its names, its views."""
    return d.metadata.model_dump(mode="json"), list(d.tensors), {k: id(v) for k, v in d.tensors.items()}


@pytest.mark.parametrize("options", [{"cand_layer_ids": [2, 3]}, {"layer_ids": [1, 3]},
                                     {"ref_layer_ids": [1, 3], "cand_layer_ids": [1, 3]}, {"consumer": "mtp"}])
def test_the_callers_memory_dumps_are_unchanged_after_a_compare(options: dict) -> None:
    h = _streams()
    ref = MemoryDump({**h, "aux.0": h["hidden.1"], "aux.1": h["hidden.3"]}, name="ref")
    cand = MemoryDump({"aux.0": h["hidden.1"].copy(), "aux.1": h["hidden.3"].copy()},
                      {"model": {"num_layers": 4}}, name="cand")
    before = _state(ref), _state(cand)
    first = consistency.api.compare(ref, cand, **options)
    assert _state(ref) == before[0] and _state(cand) == before[1]
    assert cand.metadata.aux is None  # the claims the options stated were never written into it
    again = consistency.api.compare(ref, cand)  # compared again without ids: it claims nothing
    assert not any("--cand-layer-ids" in a or "--layer-ids" in a for a in again.assumptions)
    if "cand_layer_ids" in options:  # the claim was carried (as a value) into the first compare
        said = f"from --cand-layer-ids {options['cand_layer_ids']}"
        assert any(said in a for a in first.assumptions), first.assumptions


def test_a_dump_the_caller_opened_is_neither_written_nor_closed(tmp_path: Path) -> None:
    """The old pipeline entered every side into its ExitStack, closing the caller's own
    Dump: reading it after ``consistency.compare`` was EBADF."""
    h = _streams()
    p = write_dump(tmp_path / "ref.safetensors", {**{k: (v, "float32") for k, v in h.items()},
                                                  "aux.0": (h["hidden.1"], "float32")}, None)
    q = write_dump(tmp_path / "cand.safetensors", {"aux.0": (h["hidden.1"], "float32")}, None)
    with open_dump(p) as ref, open_dump(q) as cand:
        before = _state(ref), _state(cand)
        rep = consistency.api.compare(ref, cand, cand_layer_ids=[1])
        assert rep.verdict == "pass"
        assert _state(ref) == before[0] and _state(cand) == before[1]
        assert np.array_equal(ref["aux.0"].read_all(), h["hidden.1"])  # still open
        assert np.array_equal(cand["aux.0"].read_all(), h["hidden.1"])


def test_the_front_door_takes_the_request_whole() -> None:
    assert list(inspect.signature(front_door.run).parameters) == ["req"]
    h = _streams()
    req = CompareRequest.build({**h, "aux.0": h["hidden.1"]}, {"aux.0": h["hidden.2"]}, layer_ids="1")
    from dataclasses import replace

    from consistency.dump.memory import as_side

    req = replace(req, reference=as_side(req.reference, "reference"), candidate=as_side(req.candidate, "candidate"))
    rep = front_door.run(req)
    assert rep.verdict == "fail" and rep.slots[0].identified_as == "hidden.2"


def test_declared_ids_are_one_value_for_either_side() -> None:
    """One function reads a side's ids (the old declare_ids / apply_ids twins): common ids are
    not applied to a side that records others, and it says so; own ids always are."""
    h = _streams()
    recorded = MemoryDump({"aux.0": h["hidden.1"], "aux.1": h["hidden.3"]},
                          {"aux": {"stream_ids": [1, 3]}, "model": {"num_layers": 4}}, name="r.safetensors")
    common = CompareRequest.build("a", "b", layer_ids="2,3")
    own = CompareRequest.build("a", "b", ref_layer_ids="2,3", cand_layer_ids="2,3")
    for side in ("reference", "candidate"):
        c = claims_of(recorded, side, common)
        assert c is not None and not c.applied and c.recorded == (1, 3) and c.notes[0].key == "ids_not_applied"
        o = claims_of(recorded, side, own)
        assert o is not None and o.applied and o.streams == (2, 3)
    assert claims_of(recorded, "reference", own).declared().origin == "--ref-layer-ids [2, 3]"
    with pytest.raises(Exception, match="frozen|cannot assign"):
        o.applied = False  # type: ignore[misc]
    assert recorded.metadata.aux.stream_ids == [1, 3]


def test_refuted_anchors_are_dropped_from_the_side_as_compared_not_from_the_callers() -> None:
    """prepare drops a refuted token_index (TOKEN_INDEX_FALSE) and the ids become claims: both
    on the sides as compared; the caller's dump keeps its own claims for the next compare."""
    h = _streams()
    ids = np.arange(100, 100 + T)
    ref = MemoryDump({**h, "aux.0": h["hidden.1"], "input_ids": ids}, name="ref")
    cand = MemoryDump({"aux.0": h["hidden.1"].copy(), "input_ids": ids.copy()},
                      {"tensors": {"aux.0": {"token_index": list(range(T))[::-1]}}}, name="cand")
    before = _state(ref), _state(cand)
    rep = consistency.api.compare(ref, cand, cand_layer_ids=[1])
    assert [f.code for f in rep.findings][0] == "TOKEN_INDEX_FALSE"
    assert _state(ref) == before[0] and _state(cand) == before[1]
    assert cand.metadata.tensors["aux.0"].token_index == list(range(T))[::-1] and cand.metadata.aux is None
