"""Rows and causes on real weights (issue 36, item 5): massive activations and a sink row.

A row holding another token's state must never be within the per-row bar, however close
neighbouring tokens are (tests/massive.py builds a model whose every row carries a large
constant direction: neighbouring rows ~7e-3 apart, bf16 noise ~1e-5). Expected answers
follow from the construction: which rows were replaced, by what.
"""

from __future__ import annotations

import numpy as np
import pytest

from consistency.contract.models import AuxInfo, DumpMetadata, ModelInfo
from consistency.pipeline.compare import compare as run_compare
from consistency.dump.writer import write_dump
from tests.massive import HIDDEN, N_LAYERS, VOCAB, ZERO_COL, massive

SLOTS = [2, 4, 6]
STALE = [10, 31, 32, 50, 77, 90]  # rows that hold the row before them (a buffer one step behind)


def _meta(side: str) -> DumpMetadata:
    return DumpMetadata(side=side, model=ModelInfo(num_layers=N_LAYERS, hidden_size=HIDDEN, vocab_size=VOCAB),
                        aux=AuxInfo(stream_ids=SLOTS))


def _reference(tmp_path, m, parts: bool = False):  # noqa: ANN001, ANN202
    tens = {"input_ids": m.ids} | {f"hidden.{s}": m.hidden[s] for s in range(N_LAYERS)}
    tens |= {k: v for k, v in m.parts.items() if k != "final_norm"} if parts else {}
    tens |= {f"aux.{i}": m.hidden[s] for i, s in enumerate(SLOTS)}
    return write_dump(tmp_path / "ref.safetensors", tens, _meta("training"), force=True)


def _errors(rep) -> dict[str, list]:  # noqa: ANN001
    out: dict[str, list] = {}
    for f in rep.findings:
        if f.severity.value == "error":
            out.setdefault(f.code, []).append(f)
    return out


def test_the_construction_has_close_neighbours_and_small_noise() -> None:
    """The premise: neighbouring rows are under the old bar (10 x the bf16 floor, 2e-2), far
    above the bf16 rows' own noise, and the sink row stands apart."""
    m = massive()
    h, low = m.hidden[4].astype(np.float64), m.bf16[4].astype(np.float64)

    def rel(a, b):  # noqa: ANN001, ANN202
        d = a - b
        return (d * d).sum(1) / ((a * a).sum(1) + (b * b).sum(1))

    nb = rel(h[2:], h[1:-1])
    at = np.asarray(STALE)
    assert rel(h[at], h[at - 1]).max() < 2e-2 and np.median(nb) > 1e-3
    assert rel(h, low).max() < nb.min() / 20
    assert rel(h[:1], h[1:2])[0] > 0.5  # the sink


def test_rows_holding_the_previous_token_are_never_within_the_bar(tmp_path) -> None:  # noqa: ANN001
    """bf16 serving slots whose six rows hold the row before them: no PASS, and the rows are
    named exactly, as a stale buffer (each holds the reference's row one step back)."""
    m = massive()
    ref = _reference(tmp_path, m)
    slots = {f"aux.{i}": m.bf16[s].copy() for i, s in enumerate(SLOTS)}
    x = slots["aux.1"]
    for r in STALE:
        x[r] = m.bf16[SLOTS[1]][r - 1]
    cand = write_dump(tmp_path / "cand.safetensors", {"input_ids": m.ids} | slots, _meta("serving"), force=True)
    rep = run_compare(str(ref), str(cand))
    assert rep.verdict == "fail", rep.summary
    errs = _errors(rep)
    assert set(errs) == {"STALE_ROWS"}, sorted(errs)
    (f,) = errs["STALE_ROWS"]
    assert f.tensor == "aux.1" and f.evidence["stale_rows"] == STALE and f.evidence["steps_back"] == [1]


def test_bf16_rows_of_the_massive_model_pass(tmp_path) -> None:  # noqa: ANN001
    """The lowered bar is no false alarm: the plain bf16 forward passes."""
    m = massive()
    ref = _reference(tmp_path, m)
    slots = {f"aux.{i}": m.bf16[s] for i, s in enumerate(SLOTS)}
    cand = write_dump(tmp_path / "cand.safetensors", {"input_ids": m.ids} | slots, _meta("serving"), force=True)
    rep = run_compare(str(ref), str(cand))
    assert rep.verdict == "pass", rep.summary


def _bf16(x: np.ndarray) -> np.ndarray:
    import torch

    return torch.from_numpy(np.ascontiguousarray(x, np.float32)).to(torch.bfloat16).float().numpy()


def _slot(tmp_path, m, slot: int, values: np.ndarray, name: str = "cand.safetensors"):  # noqa: ANN001, ANN202
    slots = {f"aux.{i}": m.bf16[s] for i, s in enumerate(SLOTS)} | {f"aux.{slot}": values.astype(np.float32)}
    return write_dump(tmp_path / name, {"input_ids": m.ids} | slots, _meta("serving"), force=True)


def test_a_zero_column_the_reference_shares_is_the_models_not_a_shard(tmp_path) -> None:  # noqa: ANN001
    """Every layer's MLP output is zero in one channel (the model's own weights), which the
    reference's recorded mlp_out.* show. A slot holding the fused layer's hidden_states alone
    (the MLP output: residual not added) is zero there too: RESIDUAL_MISSING, not ZERO_VALUES."""
    m = massive()
    assert not np.any(m.parts["mlp_out.3"][:, ZERO_COL]) and np.all(m.hidden[4][:, ZERO_COL] != 0)
    ref = _reference(tmp_path, m, parts=True)
    cand = _slot(tmp_path, m, 1, m.bf16_parts[f"mlp_out.{SLOTS[1] - 1}"])
    errs = _errors(run_compare(str(ref), str(cand)))
    assert set(errs) == {"RESIDUAL_MISSING"}, {k: [f.message for f in v] for k, v in errs.items()}
    assert [f.tensor for f in errs["RESIDUAL_MISSING"]] == ["aux.1"]


def test_the_residual_alone_is_the_stream_before_plus_the_attention(tmp_path) -> None:  # noqa: ANN001
    """A fused-residual runtime's ``residual`` after layer s-1 (hidden.{s-1} + attn_out.{s-1},
    both recorded): RESIDUAL_MISSING naming it, not UNKNOWN."""
    m = massive()
    ref = _reference(tmp_path, m, parts=True)
    s = SLOTS[2]
    cand = _slot(tmp_path, m, 2, _bf16(m.bf16[s - 1] + m.bf16_parts[f"attn_out.{s - 1}"]))
    errs = _errors(run_compare(str(ref), str(cand)))
    assert set(errs) == {"RESIDUAL_MISSING"}, {k: [f.message for f in v] for k, v in errs.items()}
    (f,) = errs["RESIDUAL_MISSING"]
    assert f.tensor == "aux.2" and "residual alone" in f.message and f"attn_out.{s - 1}" in f.message


@pytest.mark.pretrained
def test_smollm2_rows_holding_the_previous_token_are_never_within_the_bar(tmp_path) -> None:  # noqa: ANN001
    """Real pretrained weights (SmolLM2-135M, loaded offline): the rows whose previous token's
    state is within the old bar (10x the bf16 floor) of their own -- the rows after the sink --
    hold it in a bf16 serving capture: no PASS; the rows are named as stale."""
    from tests.scenarios.build import SMOL, record, smollm2_dir

    if smollm2_dir() is None:
        pytest.skip("SmolLM2-135M package not installed")
    st, t, slots = record(SMOL), 128, [3, 9, 15]
    low = st.bf16
    h = [x[:t].astype(np.float64) for x in st.hidden]

    def rel(a, b):  # noqa: ANN001, ANN202
        d = a - b
        return (d * d).sum(1) / ((a * a).sum(1) + (b * b).sum(1))

    near = {i: [int(r) + 1 for r in np.flatnonzero(rel(h[s][1:], h[s][:-1]) < 2e-2)] for i, s in enumerate(slots)}
    assert any(near.values()), near  # the premise: such rows exist on real weights
    meta = {"model": ModelInfo(num_layers=st.n, hidden_size=st.hidden_size, vocab_size=49152),
            "aux": AuxInfo(stream_ids=slots)}
    tens = {"input_ids": st.ids[:t]} | {f"hidden.{s}": st.hidden[s][:t] for s in range(st.n)}
    tens |= {f"aux.{i}": st.hidden[s][:t] for i, s in enumerate(slots)}
    ref = write_dump(tmp_path / "ref.safetensors", tens, DumpMetadata(side="training", **meta), force=True)
    cand_slots = {}
    for i, s in enumerate(slots):
        x = low.hidden[s][:t].copy()
        for r in near[i]:
            x[r] = low.hidden[s][r - 1]
        cand_slots[f"aux.{i}"] = x
    plain = write_dump(tmp_path / "plain.safetensors", {"input_ids": st.ids[:t]} | {
        f"aux.{i}": low.hidden[s][:t] for i, s in enumerate(slots)}, DumpMetadata(side="serving", **meta), force=True)
    assert run_compare(str(ref), str(plain)).verdict == "pass"  # the bf16 forward itself: no false alarm
    cand = write_dump(tmp_path / "cand.safetensors", {"input_ids": st.ids[:t]} | cand_slots,
                      DumpMetadata(side="serving", **meta), force=True)
    rep = run_compare(str(ref), str(cand))
    assert rep.verdict == "fail", rep.summary
    errs = _errors(rep)
    assert set(errs) == {"STALE_ROWS"}, {k: [f.message for f in v] for k, v in errs.items()}
    got = {f.tensor: f.evidence["stale_rows"] for f in errs["STALE_ROWS"]}
    assert got == {f"aux.{i}": rows for i, rows in near.items() if rows}


def _hf_reference(tmp_path, n: int, hidden: list, final_norm: np.ndarray, ids: np.ndarray, slots: list[int],  # noqa: ANN001
                  meta: dict, parts: dict | None = None):  # noqa: ANN202
    """An HF ``output_hidden_states`` reference: streams 0..N-1 pre-norm, its last entry (N) post-norm."""
    hf = list(hidden[:n]) + [final_norm]
    tens = {"input_ids": ids} | {f"hidden.{s}": hf[s] for s in range(n + 1)} | (parts or {})
    tens |= {f"aux.{i}": hf[s] for i, s in enumerate(slots)}
    return write_dump(tmp_path / "ref.safetensors", tens, DumpMetadata(side="training", **meta), force=True)


def test_the_top_stream_is_named_right_against_a_post_norm_reference(tmp_path) -> None:  # noqa: ANN001
    """The reference's last slot is HF's last hidden state (post-norm); the candidate's is the
    raw top stream: NORM_MISSING, naming the top (stream N), never stream N-1 (the nearest
    raw stream the reference records, far from the slot)."""
    m = massive()
    slots = [2, 4, N_LAYERS]
    meta = {"model": ModelInfo(num_layers=N_LAYERS, hidden_size=HIDDEN, vocab_size=VOCAB),
            "aux": AuxInfo(stream_ids=slots)}
    ref = _hf_reference(tmp_path, N_LAYERS, list(m.hidden), m.parts["final_norm"], m.ids, slots, meta)
    c = {f"aux.{i}": m.bf16[s] for i, s in enumerate(slots)}
    cand = write_dump(tmp_path / "cand.safetensors", {"input_ids": m.ids} | c, DumpMetadata(side="serving", **meta),
                      force=True)
    errs = _errors(run_compare(str(ref), str(cand)))
    assert set(errs) == {"NORM_MISSING"}, {k: [f.message for f in v] for k, v in errs.items()}
    (f,) = errs["NORM_MISSING"]
    assert f.tensor == "aux.2" and f"top (stream {N_LAYERS})" in f.message and f"hidden.{N_LAYERS - 1}" not in f.message


@pytest.mark.pretrained
@pytest.mark.parametrize("cause", ["residual_alone", "top_post_norm"])
def test_smollm2_causes(cause: str, tmp_path) -> None:  # noqa: ANN001
    """SmolLM2-135M (real weights, offline): the fused layer's residual alone is RESIDUAL_MISSING
    (from hidden.{s-1} + attn_out.{s-1}, both recorded); the raw top stream against HF's
    post-norm last hidden state is NORM_MISSING naming the top, not stream N-1."""
    from tests.scenarios.build import SMOL, record, smollm2_dir

    if smollm2_dir() is None:
        pytest.skip("SmolLM2-135M package not installed")
    st, t = record(SMOL), 128
    low, n = st.bf16, st.n
    slots = [3, 9, n] if cause == "top_post_norm" else [3, 9, 15]
    meta = {"model": ModelInfo(num_layers=n, hidden_size=st.hidden_size, vocab_size=49152),
            "aux": AuxInfo(stream_ids=slots)}
    parts = {f"attn_out.{k}": st.attn_out[k][:t] for k in range(n)} if cause == "residual_alone" else None
    ref = _hf_reference(tmp_path, n, [h[:t] for h in st.hidden], st.final_norm[:t], st.ids[:t], slots, meta, parts)
    c = {f"aux.{i}": low.hidden[s][:t] for i, s in enumerate(slots)}
    if cause == "residual_alone":
        c["aux.2"] = _bf16(low.hidden[14][:t] + low.attn_out[14][:t])  # the runtime's residual, in bf16
    cand = write_dump(tmp_path / "cand.safetensors", {"input_ids": st.ids[:t]} | c,
                      DumpMetadata(side="serving", **meta), force=True)
    errs = _errors(run_compare(str(ref), str(cand)))
    want = "RESIDUAL_MISSING" if cause == "residual_alone" else "NORM_MISSING"
    assert set(errs) == {want}, {k: [f.message for f in v] for k, v in errs.items()}
    (f,) = errs[want]
    assert f.tensor == "aux.2"
    if cause == "residual_alone":
        assert "residual alone" in f.message and "attn_out.14" in f.message
    else:
        assert f"top (stream {n})" in f.message and f"hidden.{n - 1}" not in f.message


def test_a_dropped_bos_is_not_a_prefix_cache_hit(tmp_path) -> None:  # noqa: ANN001
    """A capture without positions of the prompt minus its first token (the sink, BOS): every
    slot's first rows differ (BAD_TOKENS on each), which proves no shared context: the token
    is missing from the candidate's computation, not read from a prefix cache."""
    from tests.massive import streams

    m = massive()
    ref = _reference(tmp_path, m)
    st = streams(m.ids[1:], "bfloat16")
    cand = tmp_path / "cand.npz"  # a user's own np.savez: no positions, no metadata
    np.savez(cand, input_ids=m.ids[1:], **{f"aux.{i}": st[f"hidden.{s}"] for i, s in enumerate(SLOTS)})
    rep = run_compare(str(ref), str(cand))
    assert rep.verdict == "fail"
    codes = {f.code: f for f in rep.findings}
    assert "CONTEXT_DIFFERS" in _errors(rep) and "NOT_CAPTURED" not in codes, sorted(codes)
    assert "not read from a prefix cache" in codes["TOKENS_MISSING"].message
    assert not any("prefix-cache hit" in n for n in rep.alignment.get("notes", []))
