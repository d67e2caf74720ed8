"""A real serving capture of an MTP draft against a training reference: rows paired by anchor.

The serving side is the runtime's own forward with the record patch applied (the released
vLLM ``DeepSeekMultiTokenPredictor`` / SGLang ``DeepseekModelNextN`` methods of
tests/record/test_patch_mtp.py, on the tiny MTP module of tests/record/test_record_mtp.py), driven the
runtime's way: a prompt pass (T rows, the last paired with the sampled token) and one-row
passes at anchor T-1. The reference is a training loop over the same module recorded with
``capture_draft_step`` (shift pairing: step k has T-1-k rows, anchors 0..T-2-k, no
token_index). So step 0 meets on anchors 0..T-2 (anchor T-1 is the candidate's only), and
steps >= 1 have no reference row at all: their recycle rule is checked within the candidate.
Faults are made in the construction (what the runtime recycles, what it feeds at step 0).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from consistency.contract.models import Consumer, ConsumerSpec, DumpMetadata, NormState, Pos0, Recycle
from consistency.pipeline.compare import compare as run
from consistency.dump.reader import open_dump
from consistency.dump.writer import write_dump
from consistency.record import Recorder, mtp_patch, patch
from consistency.record.api import record_reference
from consistency.record.draft import capture_draft_step, shift_rows
from consistency.record.hf import capture_streams
from tests.record.test_patch_mtp import ENV, _batch, sglang_nextn, vllm_deepseek
from tests.record.test_record_mtp import MTP, T, ids, target

K = 3


@pytest.fixture(autouse=True)
def _fresh_chain():
    mtp_patch.reset()
    patch._state.pending_ids = None
    with torch.no_grad():
        yield
    mtp_patch.reset()
    patch._state.pending_ids = None


def _streams() -> dict[str, torch.Tensor]:
    s, _ = capture_streams(target(), ids()[None], components=False)
    return {k: v[0] for k, v in s.items()}


def reference(path: Path, mtp: MTP, *, zero_pos0: bool, declare: bool = True, step0: str = "final_norm") -> str:
    """A training loop: step k pairs hidden row r with token r+1+k (T-1-k rows), fed
    fnorm(s=N) at step 0 and its own post-norm output after; recorded per step."""
    x = ids()

    def loop(rec: Recorder, streams: dict) -> None:
        cur = streams[step0]
        for k in range(K):
            n = shift_rows(T, k)
            hid, tok = cur[:n], x[k + 1:k + 1 + n]
            emb = mtp.embed(tok).clone()
            if zero_pos0 and k == 0:
                emb[0] = 0  # vLLM's inputs_embeds[positions == 0] = 0, trained the same way
            cat = torch.cat([mtp.enorm(emb), mtp.hnorm(hid)], dim=-1)
            delta, res = mtp.block(mtp.eh_proj(cat))
            d_raw = delta + res
            d_norm = mtp.shared_head.norm(d_raw)
            capture_draft_step(rec, k, hidden_in=hid, ids=tok, embed=emb, cat=cat, out=d_raw, out_norm=d_norm,
                               hidden_norm=NormState.final_norm if k == 0 else None)
            cur = d_norm
        if declare:
            spec = ConsumerSpec(kind=Consumer.mtp, recycle=Recycle.d_norm, steps=K, source="test",
                                pos0_embed=Pos0.zeroed if zero_pos0 else Pos0.kept)
            rec.metadata.extra["consumer"] = spec.model_dump(mode="json")

    return str(record_reference(target(), x, path, components=False, draft=loop))


def serve_vllm(path: Path, mtp: MTP, *, recycle: str = "d_norm", step0: str = "final_norm") -> str:
    """vLLM's propose with the patched DeepSeek MTP forward: the target pass (its patch's
    capture_input_ids), a prompt pass (ids shifted left, the sampled token last), then
    one-row passes fed the last row's ``recycle`` state (d_raw: vLLM before #45895)."""
    s, x = _streams(), ids()
    pred = vllm_deepseek(mtp, patched=True)
    with Recorder(path, DumpMetadata(side="serving")):
        patch.capture_input_ids(x, torch.arange(T))
        tok, pos, fed = torch.cat([x[1:], x[:1]]), torch.arange(T), s["hidden.2" if step0 == "pre" else "final_norm"]
        for k in range(K):
            raw, normed = pred(tok, pos, fed, spec_step_idx=k)
            fed = (normed if recycle == "d_norm" else raw)[-1:]
            tok, pos = tok[-1:] + 1, pos[-1:] + 1
    return str(path)


def serve_sglang(path: Path, mtp: MTP, *, recycle: str = "d_norm") -> str:
    """SGLang's draft extend (step 0) then its decode passes; ``recycle`` d_raw feeds the
    block's output plus residual (the pre-norm state), which SGLang's NextN does not record."""
    s, x = _streams(), ids()
    m = sglang_nextn(mtp)
    tok = torch.cat([x[1:], x[:1]])
    def d_raw(t: torch.Tensor, h: torch.Tensor) -> torch.Tensor:  # the pass's output before shared_head.norm
        delta, res = mtp.block(mtp.eh_proj(torch.cat([mtp.enorm(mtp.embed(t)), mtp.hnorm(h)], -1)))
        return (delta + res)[-1:]

    with Recorder(path, DumpMetadata(side="serving")):
        fed = s["final_norm"]
        out = m(tok, torch.arange(T), _batch("extend", fed))
        fed = out[-1:] if recycle == "d_norm" else d_raw(tok, fed)
        for k in (1, 2):
            out = m(tok[-1:], torch.tensor([T - 1 + k]), _batch("decode", fed))
            fed = out[-1:] if recycle == "d_norm" else d_raw(tok[-1:], fed)
    return str(path)


def _errors(rep) -> list:  # noqa: ANN001
    return [(f.code, f.tensor) for f in rep.findings if f.severity.value == "error"]


def _by_tensor(rep, name: str):  # noqa: ANN001, ANN202
    return [f for f in rep.findings if f.tensor == name]


@pytest.fixture(autouse=True)
def _record_env(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, str(tmp_path / "unused.safetensors"))


def test_serving_capture_has_the_runtime_row_layout(tmp_path: Path) -> None:
    """The construction the rest relies on: T rows at step 0 (anchors 0..T-1), one row at
    anchor T-1 later; the reference T-1-k rows without token_index."""
    mtp = MTP(target().get_input_embeddings())
    cand = serve_vllm(tmp_path / "c.safetensors", mtp)
    ref = reference(tmp_path / "r.safetensors", mtp, zero_pos0=True)
    with open_dump(cand) as c, open_dump(ref) as r:
        assert c["draft_ids.0"].rows == T and r["draft_ids.0"].rows == T - 1
        assert c.metadata.tensors["draft_cat.0"].token_index == list(range(T))
        assert c["recycle.1"].rows == 1 and c.metadata.tensors["recycle.2"].token_index == [T - 1]
        assert r["recycle.1"].rows == T - 2 and r.metadata.tensors["recycle.1"].token_index is None
        assert np.allclose(c["draft_norm.0"].read_all()[:T - 1], r["draft_norm.0"].read_all(), atol=1e-5)


@pytest.mark.parametrize("runtime", ["vllm", "sglang"])
def test_correct_runtime_passes_with_rows_reported(tmp_path: Path, runtime: str) -> None:
    mtp = MTP(target().get_input_embeddings(), fused=runtime == "sglang")
    ref = reference(tmp_path / "ref.safetensors", mtp, zero_pos0=runtime == "vllm")
    cand = (serve_vllm if runtime == "vllm" else serve_sglang)(tmp_path / "serve.safetensors", mtp)
    rep = run(ref, cand)
    assert rep.verdict == "pass", _errors(rep)
    ok0 = _by_tensor(rep, "draft_cat.0")[0]
    assert ok0.code == "OK" and f"{T - 1} of {T} candidate rows compared" in ok0.message
    assert f"candidate only: anchor [{T - 1}]" in ok0.message and "past the reference's last anchor" in ok0.message
    assert ok0.evidence["rows"]["compared"] == T - 1 and ok0.evidence["rows"]["candidate_only"] == [T - 1]
    for k in (1, 2):  # the recycle rule, checked within the candidate, as the reference's consumer says
        f = _by_tensor(rep, f"recycle.{k}")[0]
        assert f.code == "OK" and f"candidate:draft_norm.{k - 1}" in f.message and "reference metadata" in f.message
        assert f.evidence["rows"]["compared"] == 0
        later = _by_tensor(rep, f"draft_cat.{k}")[0]  # no reference row: not compared, never OK
        assert later.code == "NOT_VERIFIED" and later.severity.value == "warning"
    assert not [f for f in rep.findings if f.code == "SHAPE_MISMATCH"]


def test_d_raw_recycling_vllm_is_recycle_norm_missing(tmp_path: Path) -> None:
    """vLLM before #45895 fed step k the draft's pre-norm output."""
    mtp = MTP(target().get_input_embeddings())
    ref = reference(tmp_path / "ref.safetensors", mtp, zero_pos0=True)
    rep = run(ref, serve_vllm(tmp_path / "serve.safetensors", mtp, recycle="d_raw"))
    assert rep.verdict == "fail"
    assert _errors(rep) == [("RECYCLE_NORM_MISSING", "recycle.1"), ("RECYCLE_NORM_MISSING", "recycle.2")]
    f = _by_tensor(rep, "recycle.1")[0]
    assert "candidate:draft_out.0" in f.message and f.evidence["expected_recycle"] == "d_norm"


def test_d_raw_recycle_not_recorded_is_never_ok(tmp_path: Path) -> None:
    """SGLang does not record draft_out: a d_raw recycle matches none of the candidate's own states."""
    mtp = MTP(target().get_input_embeddings(), fused=True)
    ref = reference(tmp_path / "ref.safetensors", mtp, zero_pos0=False)
    rep = run(ref, serve_sglang(tmp_path / "serve.safetensors", mtp, recycle="d_raw"))
    assert rep.verdict == "fail"
    f = _by_tensor(rep, "recycle.1")[0]
    assert f.code == "MISMATCH" and "none of the candidate's own states" in f.message


def test_pre_norm_step0_is_norm_missing(tmp_path: Path) -> None:
    mtp = MTP(target().get_input_embeddings())
    ref = reference(tmp_path / "ref.safetensors", mtp, zero_pos0=True)
    rep = run(ref, serve_vllm(tmp_path / "serve.safetensors", mtp, step0="pre"))
    assert rep.verdict == "fail"
    assert _errors(rep) == [("NORM_MISSING", "aux.0")]  # every later step-0 tensor follows from it (PROPAGATED)
    f = _by_tensor(rep, "aux.0")[0]
    assert f.identified_as == "hidden.2" and f.evidence["rows"]["candidate_only"] == [T - 1]


def test_no_rule_is_not_verified(tmp_path: Path) -> None:
    """Neither the contract nor either dump says what the draft recycles: not verified, never OK."""
    mtp = MTP(target().get_input_embeddings(), fused=True)
    ref = reference(tmp_path / "ref.safetensors", mtp, zero_pos0=False, declare=False)
    cand = serve_sglang(tmp_path / "serve.safetensors", mtp)
    with open_dump(cand) as c:
        t = {n: c[n].read_all() for n in c.tensors}
        meta = c.metadata.model_copy(deep=True)
    meta.extra.pop("consumer", None)
    bare = str(write_dump(tmp_path / "bare.safetensors", t, meta))
    rep = run(ref, bare)
    f = _by_tensor(rep, "recycle.1")[0]
    assert f.code == "NOT_VERIFIED" and f.severity.value == "error" and "not verified" in f.message
    assert rep.verdict == "fail"


def test_nothing_overlaps_is_never_a_pass(tmp_path: Path) -> None:
    """Every candidate row sits at anchors the reference lacks: nothing compared, not a pass."""
    mtp = MTP(target().get_input_embeddings(), fused=True)
    ref = reference(tmp_path / "ref.safetensors", mtp, zero_pos0=False)
    cand = serve_sglang(tmp_path / "serve.safetensors", mtp)
    with open_dump(cand) as c:
        t = {n: c[n].read_all() for n in c.tensors if n != "input_ids"}
        meta = c.metadata.model_copy(deep=True)
    for tm in meta.tensors.values():
        if tm.token_index is not None:
            tm.token_index = [a + 1000 for a in tm.token_index]
    far = str(write_dump(tmp_path / "far.safetensors", t, meta))
    rep = run(ref, far)
    assert rep.verdict == "fail"
    codes = {f.code for f in rep.findings}
    assert "NOTHING_COMPARED" in codes
    assert "OK" not in {f.code for f in rep.findings if f.tensor not in ("recycle.1", "recycle.2")}
    assert _by_tensor(rep, "draft_cat.0")[0].code == "NOT_VERIFIED"


def test_contract_rule_and_a_real_pos0_difference(tmp_path: Path) -> None:
    """Under vLLM's MTP contract the recycle rule is the contract's; the same vLLM capture
    against a reference that keeps the position-0 embedding is POS0_EMBED on the paired rows."""
    from consistency.contract import consumers
    from consistency.record.recorder import model_info

    mtp = MTP(target().get_input_embeddings())
    row = consumers.lookup("mtp", "vllm", None, "deepseek_v3")
    con = tmp_path / "mtp.json"
    con.write_text(consumers.contract_for("mtp", model_info(target().config), row, steps=K)
                   .model_dump_json(exclude_none=True))
    cand = serve_vllm(tmp_path / "serve.safetensors", mtp)
    rep = run(reference(tmp_path / "zero.safetensors", mtp, zero_pos0=True), cand, contract=str(con))
    assert rep.verdict == "pass", _errors(rep)
    f = _by_tensor(rep, "recycle.1")[0]
    # the reference declares the same consumer as the contract: its word outranks the contract's
    assert f.code == "OK" and "the reference metadata's mtp consumer recycles d_norm" in f.message
    aux0 = _by_tensor(rep, "aux.0")[0]
    assert aux0.code == "OK" and aux0.expected == "final_norm"
    rep = run(reference(tmp_path / "kept.safetensors", mtp, zero_pos0=False), cand)
    assert _errors(rep)[0] == ("POS0_EMBED", "draft_embed.0"), _errors(rep)


def test_a_token_index_that_does_not_fit_is_ignored(tmp_path: Path) -> None:
    """An untrusted token_index of the wrong length pairs nothing: rows pair by order (strict)."""
    mtp = MTP(target().get_input_embeddings(), fused=True)
    ref = reference(tmp_path / "ref.safetensors", mtp, zero_pos0=False)
    cand = serve_sglang(tmp_path / "serve.safetensors", mtp)
    with open_dump(cand) as c:
        t = {n: c[n].read_all() for n in c.tensors}
        meta = c.metadata.model_copy(deep=True)
    meta.tensors["draft_cat.0"].token_index = [0, 1, 2]
    bad = str(write_dump(tmp_path / "bad.safetensors", t, meta))
    rep = run(ref, bad)
    f = _by_tensor(rep, "draft_cat.0")[0]
    assert f.code == "SHAPE_MISMATCH" and rep.verdict == "fail"
    assert any("token_index ignored" in n for n in rep.assumptions), rep.assumptions


def test_two_requests_pair_occurrence_by_occurrence(tmp_path: Path) -> None:
    """A batch of two requests: every anchor appears twice. Request B's rows are A's times 2
    (so B's recycle.1 is B's own draft_norm.0 at anchor T-1, not A's): the i-th row at an
    anchor meets the i-th row there on the other tensor; the reference meets request A."""
    mtp = MTP(target().get_input_embeddings(), fused=True)
    ref = reference(tmp_path / "ref.safetensors", mtp, zero_pos0=False)
    cand = serve_sglang(tmp_path / "serve.safetensors", mtp)
    with open_dump(cand) as c:
        t = {n: c[n].read_all() for n in c.tensors}
        meta = c.metadata.model_copy(deep=True)
    for n, a in list(t.items()):
        tm = meta.tensors.get(n)
        if tm is None or tm.token_index is None:
            continue
        t[n] = np.concatenate([a, 2 * a if a.dtype.kind == "f" else a])
        tm.token_index = tm.token_index * 2
        tm.shape = list(t[n].shape)
    two = str(write_dump(tmp_path / "two.safetensors", t, meta))
    rep = run(ref, two)
    assert rep.verdict == "pass", _errors(rep)
    for k in (1, 2):
        f = _by_tensor(rep, f"recycle.{k}")[0]
        assert f.code == "OK" and f"candidate:draft_norm.{k - 1}" in f.message
    rows = _by_tensor(rep, "draft_cat.0")[0].evidence["rows"]
    assert (rows["compared"], rows["candidate_only_count"], rows["past_reference_end"]) == (T - 1, T + 1, False)
    # were B's recycle rows A's (a runtime that fed every request the first one's state), B would not match
    t["recycle.1"] = np.concatenate([t["recycle.1"][:1]] * 2)
    rep = run(ref, str(write_dump(tmp_path / "mixed.safetensors", t, meta)))
    assert _by_tensor(rep, "recycle.1")[0].code == "MISMATCH" and rep.verdict == "fail"


def test_a_training_style_step0_meets_the_target_stream_by_position(tmp_path: Path) -> None:
    """No token_index anywhere: a draft's step-0 input has T-1 rows (row r is position r) and
    final_norm has T. The reference's own aux.0 is what the candidate's is compared with (its
    values outrank the contract), and it is identified as final_norm on rows 0..T-2 of the
    streams; identification sees those rows too, so a pre-norm step 0 is NORM_MISSING (and
    the reverse NORM_APPLIED) without a contract or metadata."""
    from consistency.contract import consumers
    from consistency.record.recorder import model_info

    mtp = MTP(target().get_input_embeddings(), fused=True)
    ref = reference(tmp_path / "ref.safetensors", mtp, zero_pos0=False)
    con = tmp_path / "mtp.json"
    con.write_text(consumers.contract_for("mtp", model_info(target().config),
                                          consumers.lookup("mtp", "sglang", None, "deepseek_v3"), steps=K)
                   .model_dump_json(exclude_none=True))
    same = reference(tmp_path / "same.safetensors", mtp, zero_pos0=False)
    rep = run(ref, same, contract=str(con))
    assert rep.verdict == "pass", _errors(rep)
    aux0 = _by_tensor(rep, "aux.0")[0]
    assert aux0.code == "OK" and aux0.expected == "final_norm" and aux0.identified_as == "final_norm"
    pre = reference(tmp_path / "pre.safetensors", mtp, zero_pos0=False, declare=False, step0="hidden.2")
    bare = reference(tmp_path / "bare.safetensors", mtp, zero_pos0=False, declare=False)
    rep = run(bare, pre)
    assert _errors(rep)[0] == ("NORM_MISSING", "aux.0"), _errors(rep)
    assert _by_tensor(rep, "aux.0")[0].identified_as == "hidden.2"  # found across the row offset
    rep = run(pre, bare)  # training fed the pre-norm stream, serving the post-norm one
    assert _errors(rep)[0] == ("NORM_APPLIED", "aux.0"), _errors(rep)
