"""Issue 34 items 4-5: claims inside files are checked against values, callers' inputs are
never written, and two declarations of one reference are never silently one.

Each test builds its inputs from a construction (a random-walk residual stream in memory,
or a tiny Llama's recorded streams) and derives the expected verdict from it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from consistency.contract.models import AuxContract, AuxInfo, DumpMetadata, ModelInfo, SlotSpec
from consistency.pipeline.compare import compare as run
from consistency.dump.memory import MemoryDump
from consistency.errors import UsageError

T, H, N = 16, 32, 4


def _walk(seed: int = 0) -> tuple[np.ndarray, list[np.ndarray]]:
    """Token ids and the residual streams 0..N of a construction: each layer adds a delta."""
    rng = np.random.default_rng(seed)
    h = [rng.standard_normal((T, H)).astype(np.float32)]
    for _ in range(N):
        h.append(h[-1] + 0.5 * rng.standard_normal((T, H)).astype(np.float32))
    return rng.integers(0, 1000, T).astype(np.int64), h


def _codes(rep) -> list[str]:
    return [f.code for f in rep.findings]


def test_compare_never_writes_the_callers_dump():
    """--layer-ids given for a candidate that records none are its claims for this compare
    only: a later compare of the same in-memory dump must not find them in it."""
    ids, h = _walk()
    ref = MemoryDump({"input_ids": ids, **{f"hidden.{s}": h[s] for s in range(N + 1)}}, name="ref")
    cand = MemoryDump({"input_ids": ids, **{f"aux.{i}": h[s] for i, s in enumerate((1, 2, 3))}}, name="cand")
    assert cand.metadata.aux is None
    first = run(ref, cand, layer_ids=[1, 2, 3])
    assert first.verdict == "pass"
    assert cand.metadata.aux is None  # the claims went on a copy, never into the caller's dump
    from consistency import api

    assert api.compare(ref, cand, layer_ids=[1, 2, 3]).verdict == "pass" and cand.metadata.aux is None
    again = run(ref, cand)  # nothing declared, nothing claimed: nothing says what the slots should hold
    assert again.verdict == "fail" and "EXPECTATION_UNKNOWN" in _codes(again)
    assert not [n for n in again.assumptions if "[1, 2, 3]" in n]


def test_contract_and_ref_layer_ids_conflict_or_combine(tmp_path):
    ids, h = _walk()
    ref = MemoryDump({"input_ids": ids, **{f"hidden.{s}": h[s] for s in range(N + 1)}}, name="ref")
    cand = MemoryDump({"input_ids": ids, **{f"aux.{i}": h[s] for i, s in enumerate((1, 2, 3))}}, name="cand")
    contract = tmp_path / "contract.json"
    contract.write_text(AuxContract(target=ModelInfo(num_layers=N, hidden_size=H),
                                    slots=[SlotSpec(stream=s) for s in (1, 2, 3)]).model_dump_json())
    agree = run(ref, cand, contract=str(contract), ref_layer_ids=[1, 2, 3])
    assert agree.verdict == "pass" and any("declare the same streams" in n for n in agree.assumptions)
    with pytest.raises(UsageError, match=r"\[0, 2, 3\].*\[1, 2, 3\]"):  # silently the contract's before
        run(ref, cand, contract=str(contract), ref_layer_ids=[0, 2, 3])


@pytest.mark.parametrize("cand_shape", ["[1, T]", "[T]"])
def test_input_ids_of_a_batch_of_one_are_the_same_tokens(cand_shape):
    ids, h = _walk()
    ref = MemoryDump({"input_ids": ids, **{f"hidden.{s}": h[s] for s in range(N + 1)}},
                     {"aux": {"stream_ids": [1, 2, 3]}}, name="ref")
    cand_ids = ids[None] if cand_shape == "[1, T]" else ids
    cand = MemoryDump({"input_ids": cand_ids, **{f"aux.{i}": h[s] for i, s in enumerate((1, 2, 3))}}, name="cand")
    rep = run(ref, cand)
    assert rep.verdict == "pass" and "SHAPE_MISMATCH" not in _codes(rep), rep.summary
    other = ids.copy()
    other[::2] = (other[::2] + 1) % 1000  # other tokens in a [1, T] batch still differ: nothing aligns
    bad = MemoryDump({"input_ids": other[None] if cand_shape == "[1, T]" else other,
                      **{f"aux.{i}": h[s] for i, s in enumerate((1, 2, 3))}}, name="bad")
    assert run(ref, bad).verdict == "fail"


@pytest.fixture(scope="module")
def streams(tmp_path_factory) -> dict[str, np.ndarray]:
    from consistency.dump.reader import open_dump
    from consistency.record.api import record_reference
    from tests.conftest import prompt_ids, tiny

    p = tmp_path_factory.mktemp("claims") / "streams.safetensors"
    record_reference(tiny("tiny-llama"), prompt_ids(tiny("tiny-llama"), 64), p, None)
    with open_dump(p) as f:
        return {n: f[n].read_all() for n in f.names}


def _thin(path: Path, A: dict[str, np.ndarray], held: list[int], claim: list[int]) -> str:
    from consistency.dump.writer import write_dump

    return str(write_dump(path, {"input_ids": A["input_ids"], **{f"aux.{i}": A[f"hidden.{s}"] for i, s in enumerate(held)}},
                          DumpMetadata(aux=AuxInfo(stream_ids=claim))))


def test_thin_story_keeps_a_slot_below_the_lowest_recorded_stream(streams, tmp_path):
    """A thin reference of streams [2, 5, 8]; the candidate holds [1, 4, 7] and says so. Slot 0
    lies below stream 2, the lowest recorded: its range is 0..1, and the true claim agrees."""
    ref = _thin(tmp_path / "thin.safetensors", streams, [2, 5, 8], [2, 5, 8])
    cand = _thin(tmp_path / "cand.safetensors", streams, [1, 4, 7], [1, 4, 7])
    rep = run(ref, cand)
    assert rep.verdict == "fail"
    assert "[0..1, 3..4, 6..7]" in rep.summary, rep.summary
    assert "which the values agree with" in rep.summary and "do not bear out" not in rep.summary
    lie = _thin(tmp_path / "lie.safetensors", streams, [1, 4, 7], [3, 6, 9])  # a false claim is still called false
    assert "do not bear out" in run(ref, lie).summary


@pytest.mark.parametrize("lossy_rank", [0, 1])
@pytest.mark.parametrize("loss", ["dropped", "refused", "graph"])
def test_every_ranks_recorder_losses_are_read(tmp_path, lossy_rank, loss):
    """A two-rank set (replicated slots) whose rank ``lossy_rank`` says its recorder left
    captures out: never PASS, whichever rank says it (the merged metadata is rank 0's)."""
    from consistency.dump.writer import write_dump

    ids, h = _walk()
    ref = MemoryDump({"input_ids": ids, **{f"hidden.{s}": h[s] for s in range(N + 1)}},
                     {"aux": {"stream_ids": [1, 2, 3]}}, name="ref")
    said = {"dropped": {"dropped_captures": {"aux.0": 3}},
            "refused": {"refused_captures": {"draft_out.0": {"count": 2, "reason": "dtype complex64"}}},
            "graph": {"cuda_graphs": {"not_recorded": {"host value in a graph": {"aux.1": 1}}}}}[loss]
    for r in range(2):
        extra = said if r == lossy_rank else {}
        write_dump(tmp_path / f"serve.rank{r}-of2.safetensors",
                   {"input_ids": ids, **{f"aux.{i}": h[s] for i, s in enumerate((1, 2, 3))}},
                   DumpMetadata(rank=r, world_size=2, extra=extra))
    rep = run(ref, str(tmp_path / "serve.rank*-of2.safetensors"))
    assert rep.verdict == "fail" and rep.findings[0].code == "CAPTURES_DROPPED", rep.summary
    assert f"serve.rank{lossy_rank}-of2.safetensors" in rep.findings[0].message
    clean = tmp_path / "clean"
    clean.mkdir()
    for r in range(2):
        write_dump(clean / f"serve.rank{r}-of2.safetensors",
                   {"input_ids": ids, **{f"aux.{i}": h[s] for i, s in enumerate((1, 2, 3))}},
                   DumpMetadata(rank=r, world_size=2))
    assert run(ref, str(clean / "serve.rank*-of2.safetensors")).verdict == "pass"


# -- token_index: anchors are claims, checked against values (compare/anchors.py) ----------------------

def _draft_sides(T: int = 26, draft_ids: bool = True) -> tuple[np.ndarray, list[np.ndarray], MemoryDump]:
    """A training reference of a last-state draft's step 0: row r is the target's last state at
    position r and the token after it (shift pairing: T-1 rows)."""
    rng = np.random.default_rng(1)
    h = [rng.standard_normal((T, H)).astype(np.float32)]
    for _ in range(N):
        h.append(h[-1] + 0.5 * rng.standard_normal((T, H)).astype(np.float32))
    ids = rng.integers(0, 1000, T).astype(np.int64)
    ref = MemoryDump({"input_ids": ids, **{f"hidden.{s}": h[s] for s in range(N + 1)}, "aux.0": h[N][:T - 1],
                      **({"draft_ids.0": ids[1:]} if draft_ids else {})}, {"aux": {"stream_ids": [N]}}, name="ref")
    return ids, h, ref


@pytest.mark.parametrize("claimed", ["both", "input_only", "ids_only"])
@pytest.mark.parametrize("own_ids", [True, False])
def test_a_shifted_token_index_never_pairs_the_next_tokens_state(claimed, own_ids):
    """The draft was fed the next token's state (row r holds h[r+1] beside token r+1) and the
    file's token_index says anchor r+1, so pairing by it would meet the reference's row r+1
    and pass. The tokens the rows hold (its own ids, the reference's), or the row-aligned
    tensors' other anchors, refute it: a finding, and the rows pair by order (a token shift)."""
    T = 26
    ids, h, ref = _draft_sides(T, draft_ids=False)  # a reference of the target's states and tokens only
    rows = np.arange(1, T)  # the bug: the state of the next token
    shifted, honest = rows.tolist(), list(range(T - 1))
    tensors = {"aux.0": h[N][rows], "draft_ids.0": ids[1:]}
    if own_ids:
        tensors["input_ids"] = ids
    claims = {"both": {"aux.0": shifted, "draft_ids.0": shifted}, "input_only": {"aux.0": shifted},
              "ids_only": {"aux.0": shifted, "draft_ids.0": honest}}[claimed]
    cand = MemoryDump(tensors, {"tensors": {k: {"token_index": v} for k, v in claims.items()}}, name="cand")
    rep = run(ref, cand)
    assert rep.verdict == "fail" and rep.findings[0].code == "TOKEN_INDEX_FALSE", rep.summary
    aux = next(f for f in rep.findings if f.tensor == "aux.0" and f.code != "TOKEN_INDEX_FALSE")
    assert aux.code != "OK", rep.summary  # paired by order: h[r+1] against the reference's h[r]
    honest_cand = MemoryDump({"aux.0": h[N][:T - 1].copy(), "draft_ids.0": ids[1:].copy(),
                              **({"input_ids": ids.copy()} if own_ids else {})},
                             {"tensors": {k: {"token_index": honest} for k in ("aux.0", "draft_ids.0")}}, name="ok")
    assert run(ref, honest_cand).verdict == "pass"  # the same file with true anchors passes


@pytest.mark.parametrize("positions", [False, True])
def test_one_state_repeated_at_one_anchor_is_never_a_pairing(positions):
    """26 copies of the state at position 0, token_index [0]*26, in a file whose own ids hold
    one sequence of 26 tokens: refuted (its pass's positions, one sequence), compared by order."""
    T = 26
    ids, h, ref = _draft_sides(T)
    ref = MemoryDump({"input_ids": ids, **{f"hidden.{s}": h[s] for s in range(N + 1)}}, {"aux": {"stream_ids": [2]}},
                     name="ref")
    extra = {"positions": np.arange(T, dtype=np.int64)} if positions else {}
    cand = MemoryDump({"input_ids": ids, "aux.0": np.repeat(h[2][:1], T, axis=0), **extra},
                      {"tensors": {"aux.0": {"token_index": [0] * T}}}, name="cand")
    rep = run(ref, cand)
    assert rep.verdict == "fail" and rep.findings[0].code == "TOKEN_INDEX_FALSE", rep.summary
    assert rep.findings[0].metrics["check"] == "positions"
    subset = MemoryDump({"input_ids": ids, "aux.0": np.repeat(h[2][:1], 5, axis=0), **extra},
                        {"tensors": {"aux.0": {"token_index": [0] * 5}}}, name="cand5")  # fewer rows: the repeat
    rep = run(ref, subset)
    assert rep.verdict == "fail" and rep.findings[0].code == "TOKEN_INDEX_FALSE"
    assert rep.findings[0].metrics["check"] == "repeat" and rep.findings[0].metrics["sequences"] == 1


def test_anchors_of_a_batch_of_two_requests_may_repeat_twice():
    """A [2, T] batch of two requests holds each anchor twice: its own ids say so; no finding."""
    T = 13
    ids, h, _ref = _draft_sides(T)
    ref = MemoryDump({"input_ids": ids, **{f"hidden.{s}": h[s] for s in range(N + 1)}}, {"aux": {"stream_ids": [2]}},
                     name="ref")
    twice = list(range(T)) * 2
    cand = MemoryDump({"input_ids": np.stack([ids, ids]), "aux.0": np.concatenate([h[2], h[2]])},
                      {"tensors": {"aux.0": {"token_index": twice}}}, name="batch")
    rep = run(ref, cand)
    assert "TOKEN_INDEX_FALSE" not in _codes(rep), rep.summary
    thrice = MemoryDump({"input_ids": np.stack([ids, ids]), "aux.0": np.concatenate([h[2][:1]] * 3 + [h[2], h[2][3:]])},
                        {"tensors": {"aux.0": {"token_index": [0, 0, 0] + list(range(T)) + list(range(3, T))}}},
                        name="thrice")
    rep = run(ref, thrice)
    assert rep.findings[0].code == "TOKEN_INDEX_FALSE", rep.summary


def test_the_callers_dump_keeps_its_refuted_token_index():
    ids, h, ref = _draft_sides(26)
    cand = MemoryDump({"input_ids": ids, "aux.0": h[N][1:], "draft_ids.0": ids[1:]},
                      {"tensors": {"aux.0": {"token_index": list(range(1, 26))}}}, name="cand")
    run(ref, cand)
    assert cand.metadata.tensors["aux.0"].token_index == list(range(1, 26))


def test_a_candidate_claim_its_values_contradict_is_a_finding() -> None:
    """Values over claims, and a conflict is a finding: --cand-layer-ids 2,4 on slots whose values
    are streams 1 and 3 (what training expects) passes on the values, with one warning a slot."""
    import consistency

    rng = np.random.default_rng(0)
    h = [rng.standard_normal((12, 32)).astype(np.float32)]
    for _ in range(5):
        h.append(h[-1] + 0.3 * rng.standard_normal((12, 32)).astype(np.float32))
    ids = np.arange(12)
    ref = {"input_ids": ids, **{f"hidden.{i}": h[i] for i in range(6)}, "aux.0": h[1], "aux.1": h[3]}
    cand = {"input_ids": ids, "aux.0": h[1].copy(), "aux.1": h[3].copy()}
    rep = consistency.compare(ref, cand, cand_layer_ids=[2, 4])
    said = [f for f in rep.findings if f.code == "CAND_CLAIM_CONTRADICTED"]
    assert rep.verdict == "pass" and [(f.evidence["claimed"], f.evidence["values"]) for f in said] == [(2, 1), (4, 3)]
    assert all(f.severity.value == "warning" for f in said)
    right = consistency.compare(ref, cand, cand_layer_ids=[1, 3])
    assert not [f for f in right.findings if f.code == "CAND_CLAIM_CONTRADICTED"]
