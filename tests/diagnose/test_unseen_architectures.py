"""Faults planted in real forward passes of architectures the repository's generators do not
use (OLMo2 sandwich norms, built in memory, seeded): the expected answer follows from the
construction -- which rows, streams or requests were put where.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import consistency  # noqa: E402
from consistency.dump.dtypes import float32_to_bf16_bits  # noqa: E402

L, SLOTS = 6, [1, 3, 4]


def _olmo2():  # noqa: ANN202
    torch.manual_seed(0)
    cfg = transformers.Olmo2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=L,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def _streams(m, ids: list[int]) -> list[np.ndarray]:  # noqa: ANN001
    """Streams 0..L-1 (HF's output_hidden_states[s] for s < L: pre-norm)."""
    with torch.no_grad():
        out = m(input_ids=torch.tensor([ids]), output_hidden_states=True)
    return [x[0].double().numpy() for x in out.hidden_states[:L]]


def _bf16(x: np.ndarray) -> tuple[np.ndarray, str]:
    return float32_to_bf16_bits(np.asarray(x, np.float32)), "bfloat16"


@pytest.mark.parametrize("rich", [True, False], ids=["rich", "thin"])
def test_two_requests_swapped_whole_are_rows_swapped_not_unknown(rich: bool) -> None:
    """A batch of two requests whose candidate rows are each other's (a request index mixed
    up: request 0 got request 1's states and back) differs at every row, yet every row is a
    row the reference recorded for the other request at the same position: ROWS_SWAPPED,
    never UNKNOWN. The same values with the token ids swapped too are the same batch in
    another order, and agree."""
    m = _olmo2()
    rng = np.random.default_rng(1)
    ids = [rng.integers(1, 256, 20).tolist() for _ in range(2)]
    hs = [_streams(m, x) for x in ids]
    ref = {f"aux.{i}": np.stack([hs[0][s], hs[1][s]]).astype(np.float32) for i, s in enumerate(SLOTS)}
    if rich:
        ref |= {f"hidden.{s}": np.stack([hs[0][s], hs[1][s]]).astype(np.float32) for s in range(L)}
    ref["input_ids"] = np.array(ids)
    cand = {f"aux.{i}": _bf16(np.stack([hs[1][s], hs[0][s]])) for i, s in enumerate(SLOTS)}
    cand["input_ids"] = np.array(ids)
    rep = consistency.compare(ref, cand)
    assert rep.verdict == "fail"
    errors = {f.tensor: f for f in rep.findings if f.severity.value == "error"}
    assert sorted(errors) == [f"aux.{i}" for i in range(len(SLOTS))]
    for f in errors.values():
        assert f.code == "ROWS_SWAPPED", (f.code, f.message)
        assert "another request's row at the same position" in f.message
        pairs = {int(k): int(v) for k, v in f.evidence["row_groups"][0]["holds_rows"].items()}
        assert pairs == {i: (i + 20) % 40 for i in range(40)}  # row i of request 0 is row i of request 1
    same = dict(cand, input_ids=np.array(ids[::-1]))
    assert consistency.compare(ref, same).verdict == "pass"


def _top(m, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:  # noqa: ANN001
    """Stream L (a hook on the last decoder layer: pre-norm) and HF's output_hidden_states[-1]
    (the same state after the final norm)."""
    got = {}
    h = m.model.layers[-1].register_forward_hook(lambda mod, i, o: got.__setitem__("x", o[0] if isinstance(o, tuple)
                                                                                    else o))
    with torch.no_grad():
        out = m(input_ids=torch.tensor([ids]), output_hidden_states=True)
    h.remove()
    return got["x"][0].double().numpy(), out.hidden_states[-1][0].double().numpy()


def test_hf_post_norm_last_state_in_another_slot_is_norm_applied_on_stream_n() -> None:
    """A slot meant for stream 4 fed HF's output_hidden_states[-1] (stream L after the final
    norm, with a trained weight): a reference recording every stream pre-norm proves it is
    stream L normed -- NORM_APPLIED naming stream L, not UNKNOWN."""
    m = _olmo2()
    with torch.no_grad():
        m.model.norm.weight.copy_(1 + 0.5 * torch.randn(64, generator=torch.Generator().manual_seed(3)))
    ids = np.random.default_rng(2).integers(1, 256, 24).tolist()
    hs = _streams(m, ids)
    top, post = _top(m, ids)
    hs.append(top)
    ref = {f"hidden.{s}": hs[s].astype(np.float32) for s in range(L + 1)}
    ref |= {f"aux.{i}": hs[s].astype(np.float32) for i, s in enumerate(SLOTS)}
    ref["input_ids"] = np.array(ids)
    cand = {"aux.0": _bf16(hs[SLOTS[0]]), "aux.1": _bf16(hs[SLOTS[1]]), "aux.2": _bf16(post),
            "input_ids": np.array(ids)}
    rep = consistency.compare(ref, cand)
    assert rep.verdict == "fail"
    errors = [f for f in rep.findings if f.severity.value == "error"]
    assert [(f.code, f.tensor) for f in errors] == [("NORM_APPLIED", "aux.2")], [(f.code, f.message) for f in errors]
    assert f"holds stream {L} " in errors[0].message and f"not stream {SLOTS[2]}" in errors[0].message
    assert "with a weight" in errors[0].message
    # the same slot holding stream L pre-norm is another stream, not a norm
    cand["aux.2"] = _bf16(top)
    errors = [f for f in consistency.compare(ref, cand).findings if f.severity.value == "error"]
    assert {f.code for f in errors} == {"LAYER_MISMATCH"}


@pytest.mark.parametrize("rich", [True, False], ids=["rich", "thin"])
def test_a_request_packed_inside_another_is_rows_swapped_not_drift(rich: bool) -> None:
    """Two requests packed in one flat batch ([T1 + T2, H], ids concatenated); the candidate
    packed request 2's rows after request 1's first 16 (a wrong start offset) while its ids
    say the reference's order. Rows 0-15 agree; every other row is a row the reference
    recorded elsewhere: ROWS_SWAPPED naming them -- never NUMERIC_DRIFT ('still holds stream
    s') nor UNKNOWN, though too many rows differ for a BAD_TOKENS status."""
    m = _olmo2()
    rng = np.random.default_rng(4)
    a, b = rng.integers(1, 256, 24).tolist(), rng.integers(1, 256, 16).tolist()
    ha, hb = _streams(m, a), _streams(m, b)
    ref = {f"aux.{i}": np.concatenate([ha[s], hb[s]]).astype(np.float32) for i, s in enumerate(SLOTS)}
    if rich:
        ref |= {f"hidden.{s}": np.concatenate([ha[s], hb[s]]).astype(np.float32) for s in range(L)}
    ref["input_ids"] = np.array(a + b)
    cand = {f"aux.{i}": _bf16(np.concatenate([ha[s][:16], hb[s], ha[s][16:]])) for i, s in enumerate(SLOTS)}
    cand["input_ids"] = np.array(a + b)
    rep = consistency.compare(ref, cand)
    assert rep.verdict == "fail"
    errors = {f.tensor: f for f in rep.findings if f.severity.value == "error"}
    assert sorted(errors) == [f"aux.{i}" for i in range(len(SLOTS))]
    want = {16 + j: 24 + j for j in range(16)} | {32 + j: 16 + j for j in range(8)}
    for f in errors.values():
        assert f.code == "ROWS_SWAPPED", (f.code, f.message)
        held = {int(k): int(v) for g in f.evidence["row_groups"] for k, v in g.get("holds_rows", {}).items()}
        assert held == want


def test_most_rows_another_stream_or_a_block_delta_are_said_by_rows_not_drift() -> None:
    """Rows 8-23 of 24 (too many for a BAD_TOKENS status) hold the next stream, or the
    layer's block delta (the residual not added), as a graph path would feed while eager
    prefill rows agree. A rich reference names each group: LAYER_MISMATCH on those rows
    (stream s+1), RESIDUAL_MISSING on those rows -- never NUMERIC_DRIFT ('still holds stream
    s') nor a thin-reference offset story."""
    m = _olmo2()
    ids = np.random.default_rng(5).integers(1, 256, 24).tolist()
    hs = _streams(m, ids)
    ref = {f"hidden.{s}": hs[s].astype(np.float32) for s in range(L)}
    ref |= {f"aux.{i}": hs[s].astype(np.float32) for i, s in enumerate(SLOTS)}
    ref["input_ids"] = np.array(ids)
    rows = list(range(8, 24))

    def fed(build) -> dict:  # noqa: ANN001
        out = {}
        for i, s in enumerate(SLOTS):
            x = hs[s].copy()
            x[rows] = build(s)[rows]
            out[f"aux.{i}"] = _bf16(x)
        return out | {"input_ids": np.array(ids)}

    for build, code in ((lambda s: hs[s + 1], "LAYER_MISMATCH"), (lambda s: hs[s] - hs[s - 1], "RESIDUAL_MISSING")):
        rep = consistency.compare(ref, fed(build))
        assert rep.verdict == "fail"
        errors = {f.tensor: f for f in rep.findings if f.severity.value == "error"}
        for i in (1, 2):  # slots whose block delta is far from the stream (stream 1's is not: a tiny embedding)
            f = errors[f"aux.{i}"]
            assert f.code == code, (f.code, f.message)
            groups = [g for g in f.evidence["row_groups"] if g["cause"] == code]
            assert [r for g in groups for r in g["rows"]] == rows
            if code == "LAYER_MISMATCH":
                assert {g["holds_stream"] for g in groups} == {SLOTS[i] + 1}
        assert not {f.code for f in rep.findings} & {"NUMERIC_DRIFT", "LAYER_OFFSET", "UNKNOWN"}


def test_a_reference_recording_every_stream_tells_no_unmeasured_offset() -> None:
    """Every slot fed a state between stream s and stream s+1 (s + 0.6 of layer s's delta:
    no stream at all), against a reference recording every stream: the reference measured
    that it is neither s nor s+1, so no 'layer offset this reference cannot measure' (in
    streams '3..2', ranges with no stream in them) nor a 'consistent with a layer offset'
    reading -- the slots stay unexplained."""
    m = _olmo2()
    ids = np.random.default_rng(6).integers(1, 256, 24).tolist()
    hs = _streams(m, ids)
    ref = {f"hidden.{s}": hs[s].astype(np.float32) for s in range(L)}
    ref |= {f"aux.{i}": hs[s].astype(np.float32) for i, s in enumerate(SLOTS)}
    ref["input_ids"] = np.array(ids)
    cand = {f"aux.{i}": _bf16(hs[s] + 0.6 * (hs[s + 1] - hs[s])) for i, s in enumerate(SLOTS)}
    rep = consistency.compare(ref, cand | {"input_ids": np.array(ids)})
    assert rep.verdict == "fail"
    said = [f.code for f in rep.findings if f.severity.value == "error"]
    assert "LAYER_OFFSET" not in said and "cannot measure" not in rep.summary and "cannot be proven" not in rep.summary
    assert said.count("UNKNOWN") == len(SLOTS), said


def test_a_layernorm_input_norm_is_not_worded_as_a_fused_rmsnorm() -> None:
    """GPT-NeoX (parallel blocks, LayerNorm with a bias): every slot fed the next layer's
    input LayerNorm (trained weight and bias) of its stream. NORM_APPLIED, worded as what was
    fitted: a LayerNorm with weight and bias -- not 'with a weight' twice, not a fused
    add+RMSNorm (GPT-NeoX has none)."""
    torch.manual_seed(0)
    cfg = transformers.GPTNeoXConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=L,
                                     num_attention_heads=4, max_position_embeddings=128)
    m = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "layernorm" in n:
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    ids = np.random.default_rng(1).integers(1, 256, 24).tolist()
    with torch.no_grad():
        hs = [x[0].double() for x in m(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states[:L]]
        normed = [m.gpt_neox.layers[s].input_layernorm(hs[s].float()).double().numpy() for s in SLOTS]
    ref = {f"aux.{i}": hs[s].numpy().astype(np.float32) for i, s in enumerate(SLOTS)} | {"input_ids": np.array(ids)}
    cand = {f"aux.{i}": _bf16(x) for i, x in enumerate(normed)} | {"input_ids": np.array(ids)}
    errors = [f for f in consistency.compare(ref, cand).findings if f.severity.value == "error"]
    assert [f.code for f in errors] == ["NORM_APPLIED"] * len(SLOTS), [(f.code, f.message) for f in errors]
    for f in errors:
        assert "after LayerNorm (weight and bias) (" in f.message, f.message
        assert "RMSNorm" not in f.message and "with a weight" not in f.message


def test_rows_holding_another_slot_of_a_thin_reference_are_named() -> None:
    """A thin reference (aux slots only, no metadata: no stream known for any slot); the
    candidate's slot 1 holds, at rows 16-23 only, what the reference put in slot 2 (the
    next slot's stream: graph rows capturing a later layer). Those rows are LAYER_MISMATCH
    naming reference slot 2 -- not BAD_TOKENS, as if they held nothing known."""
    m = _olmo2()
    ids = np.random.default_rng(8).integers(1, 256, 24).tolist()
    hs = _streams(m, ids)
    ref = {f"aux.{i}": hs[s].astype(np.float32) for i, s in enumerate(SLOTS)} | {"input_ids": np.array(ids)}
    one = hs[SLOTS[1]].copy()
    one[16:] = hs[SLOTS[2]][16:]
    cand = {"aux.0": _bf16(hs[SLOTS[0]]), "aux.1": _bf16(one), "aux.2": _bf16(hs[SLOTS[2]]),
            "input_ids": np.array(ids)}
    errors = [f for f in consistency.compare(ref, cand).findings if f.severity.value == "error"]
    assert [(f.code, f.tensor) for f in errors] == [("LAYER_MISMATCH", "aux.1")], [(f.code, f.message) for f in errors]
    assert "what the reference put in slot 2 (aux.2) (8 rows)" in errors[0].message
    groups = [g for g in errors[0].evidence["row_groups"]]
    assert [(g["rows"], g["holds"]) for g in groups] == [(list(range(16, 24)), "aux.2")]
