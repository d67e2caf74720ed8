"""``consistency.testing.assert_consistent``: silent on a pass, an explaining AssertionError
on a real shift (a tiny HF model recorded with our own recorder, both ways)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from consistency.testing import assert_consistent
from tests.conftest import prompt_ids, recorded, tiny

TRAIN = [1, 3]


@pytest.fixture(scope="module")
def dumps(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("testing")
    m = tiny()
    ids = prompt_ids(m)
    return {
        "train": recorded("training", "tiny-llama", ids, d / "train.safetensors", TRAIN),
        "serve": recorded("serving", "tiny-llama", ids, d / "serve.safetensors", TRAIN),  # fused-residual loop, same streams
        "shifted": recorded("serving", "tiny-llama", ids, d / "shifted.safetensors", [s + 1 for s in TRAIN]),  # the +1 bug
    }


def test_passes_silently_and_returns_the_report(dumps: dict[str, Path]) -> None:
    rep = assert_consistent(dumps["train"], dumps["serve"])
    assert rep.verdict == "pass"


def test_a_shift_fails_with_summary_and_slot_table(dumps: dict[str, Path]) -> None:
    with pytest.raises(AssertionError) as info:
        assert_consistent(dumps["train"], dumps["shifted"])
    msg = str(info.value)
    lines = msg.splitlines()
    assert "train.safetensors" in lines[0] and "shifted.safetensors" in lines[0] and "not consistent" in lines[0]
    header = next(i for i, ln in enumerate(lines) if ln.split()[:2] == ["slot", "tensor"])
    for k, s in enumerate(TRAIN):  # slot k should hold stream s and holds s + 1, by construction
        row = lines[header + 1 + k].split()
        assert row[0] == str(k) and row[1] == f"aux.{k}"
        assert f"hidden.{s + 1}" in lines[header + 1 + k], lines[header + 1 + k]
        assert re.search(rf"\(stream {s}\)|hidden\.{s}\b", lines[header + 1 + k])
    assert "LAYER_OFFSET" in msg and msg.count("LAYER_MISMATCH") >= 2 * len(TRAIN), msg  # table + one error each
    assert msg.count("Mismatched elements:") == len(TRAIN)


def test_message_says_how_many_elements_how_far_and_where() -> None:
    """Element-level numbers as torch.testing.assert_close gives them, from a known edit."""
    rng = np.random.default_rng(0)
    h = {f"hidden.{k}": rng.standard_normal((16, 32)).astype(np.float32) for k in range(4)}
    cand = h["hidden.2"].copy()
    cand[5, 7] += 4.0  # one element, 4.0 off, at (5, 7)
    with pytest.raises(AssertionError) as info:
        assert_consistent({**h, "aux.0": h["hidden.2"]}, {"aux.0": cand}, rtol=1e-5, atol=1e-5)
    msg = str(info.value)
    assert "Mismatched elements: 1 / 512 (0.2%)" in msg, msg
    assert "greatest absolute difference 4 at index (5, 7)" in msg, msg
    assert "worst token 5" in msg, msg


def test_options_reach_the_pipeline(dumps: dict[str, Path]) -> None:
    rep = assert_consistent(dumps["train"], dumps["serve"], tolerance={r"aux\..*": 1e-3})
    assert rep.verdict == "pass"
    with pytest.raises(Exception, match="tolerance"):
        assert_consistent(dumps["train"], dumps["serve"], tolerance=["not a rule"])
