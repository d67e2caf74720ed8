"""Review round of issue 24: inputs this repository's generators do not write, built here by hand.

Each test constructs both sides from numpy (a random target's streams, a toy draft step),
writes them with the plain dump writer and checks the CLI, the Python API and the pytest
helper against what was constructed.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import consistency
from consistency.contract.models import DumpMetadata
from consistency.dump.writer import write_dump
from consistency.testing import assert_consistent
from tests.conftest import run_cli

N, T, H = 6, 20, 32


def _rms(x: np.ndarray) -> np.ndarray:
    return (x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6)).astype(np.float32)


def _target(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    h = [rng.standard_normal((T, H)).astype(np.float32)]
    for _ in range(N):
        h.append((h[-1] + 0.6 * rng.standard_normal((T, H))).astype(np.float32))
    out = {f"hidden.{s}": h[s] for s in range(N + 1)}
    out["final_norm"] = _rms(h[N])
    out["input_ids"] = rng.integers(1, 200, T).astype(np.int64)
    return out


def _steps(t: dict[str, np.ndarray], recycle: str, k_steps: int = 3) -> dict[str, np.ndarray]:
    """A toy MTP draft: step k reads ``cur`` (fnorm(s=N) at step 0), recycles d_norm or d_raw."""
    rng = np.random.default_rng(7)
    w = (rng.standard_normal((2 * H, H)) / np.sqrt(2 * H)).astype(np.float32)
    emb_table = rng.standard_normal((256, H)).astype(np.float32)
    ids = t["input_ids"]
    out: dict[str, np.ndarray] = {}
    cur = t["final_norm"][:T - 1]
    for k in range(k_steps):
        n = T - 1 - k
        hid, tok = cur[:n], ids[k + 1:k + 1 + n]
        emb = emb_table[tok]
        cat = np.concatenate([_rms(emb), _rms(hid)], -1)
        raw = (np.tanh(cat @ w) * 3 + hid).astype(np.float32)
        norm = _rms(raw)
        out["aux.0" if k == 0 else f"recycle.{k}"] = hid.copy()
        out[f"draft_ids.{k}"] = tok.copy()
        out[f"draft_cat.{k}"] = cat
        out[f"draft_out.{k}"] = raw
        out[f"draft_norm.{k}"] = norm
        cur = norm if recycle == "d_norm" else raw
    return out


def _write(path, tensors, side, consumer=None, **meta):
    md = {"side": side, "model": {"num_layers": N}, **meta}
    if consumer is not None:
        md["extra"] = {"consumer": consumer}
    return write_dump(path, tensors, DumpMetadata.model_validate(md))


def _all_three(ref, cand, *cli_args, **api):
    """Exit code and verdict of the CLI, the API's verdict and whether the pytest helper raised."""
    res = run_cli("compare", str(ref), str(cand), "--json", "-", *cli_args)
    rep = json.loads(res.stdout)
    via_api = consistency.compare(str(ref), str(cand), **api)
    try:
        assert_consistent(str(ref), str(cand), **api)
        raised = False
    except AssertionError:
        raised = True
    return res.returncode, rep, via_api, raised


@pytest.mark.parametrize("declared", ["reference", "cli"])
def test_recycle_checked_within_candidate_when_reference_has_no_steps(tmp_path, declared):
    """A reference with the target's streams and a declared d_norm MTP consumer but no per-step
    tensors; the candidate recycles d_raw (its own draft_out.{k-1}): never PASS with recycle.k
    left as "only in the candidate" (issue 24 bar 6)."""
    t = _target()
    consumer = {"kind": "mtp", "recycle": "d_norm"} if declared == "reference" else None
    ref = _write(tmp_path / "ref.safetensors", t, "training", consumer)
    bad = _write(tmp_path / "bad.safetensors", {**_steps(t, "d_raw"), "input_ids": t["input_ids"]}, "serving",
                 {"kind": "mtp", "recycle": "d_raw"})  # the candidate's claim agrees with itself: never used
    good = _write(tmp_path / "good.safetensors", {**_steps(t, "d_norm"), "input_ids": t["input_ids"]}, "serving")
    extra = ["--consumer", "mtp"] if declared == "cli" else []
    kw = {"consumer": "mtp"} if declared == "cli" else {}
    code, rep, api, raised = _all_three(ref, bad, *extra, **kw)
    assert code == 1 and rep["verdict"] == "fail" and api.verdict == "fail" and raised
    codes = {f["tensor"]: f["code"] for f in rep["findings"] if f["severity"] == "error"}
    assert codes.get("recycle.1") == "RECYCLE_NORM_MISSING" and codes.get("recycle.2") == "RECYCLE_NORM_MISSING"
    assert not any(f["code"] == "EXTRA" and f["tensor"] == "recycle.1" for f in rep["findings"])
    code, rep, api, raised = _all_three(ref, good, *extra, **kw)
    assert code == 0 and rep["verdict"] == "pass" and api.verdict == "pass" and not raised
    ok = {f["tensor"] for f in rep["findings"] if f["code"] == "OK"}
    assert {"recycle.1", "recycle.2"} <= ok


@pytest.mark.parametrize("consumer", [{"kind": "mtp", "recycle": "d_norm"}, None])
def test_serving_step0_named_against_a_reference_of_target_streams_only(tmp_path, consumer):
    """A reference of target streams only (no aux.0, no per-step tensors) and a candidate
    whose T-1-row step 0 holds the pre-norm stream N-1: identification sees the streams'
    first T-1 rows, so it is named (LAYER_MISMATCH with a consumer, EXPECTATION_UNKNOWN
    without one), never UNKNOWN / UNMATCHED "matches no reference tensor" (bar 5)."""
    t = _target()
    ref = _write(tmp_path / "ref.npz", t, "training", consumer)
    steps = _steps(t, "d_norm")
    steps["aux.0"] = t[f"hidden.{N - 1}"][:T - 1].copy()
    cand = _write(tmp_path / "cand.npz", {**steps, "input_ids": t["input_ids"]}, "serving")
    code, rep, api, raised = _all_three(ref, cand)
    assert code == 1 and api.verdict == "fail" and raised
    (slot,) = rep["slots"]
    assert slot["identified_stream"] == N - 1
    assert slot["code"] == ("LAYER_MISMATCH" if consumer else "EXPECTATION_UNKNOWN")


def test_reference_recycle_claim_against_its_values(tmp_path):
    """A reference whose per-step values recycle d_norm while its metadata's consumer says
    d_raw: the values decide (a d_norm candidate passes, a d_raw one fails) and the claim is
    reported (REF_CLAIM_CONTRADICTED); a declaration saying d_raw is CONTRACT_CONFLICT (bar 2)."""
    t = _target()
    steps = _steps(t, "d_norm")
    ref = _write(tmp_path / "ref.safetensors", {**t, **steps}, "training", {"kind": "mtp", "recycle": "d_raw"})
    good = _write(tmp_path / "good.safetensors", {**steps, "input_ids": t["input_ids"]}, "serving")
    bad = _write(tmp_path / "bad.safetensors", {**_steps(t, "d_raw"), "input_ids": t["input_ids"]}, "serving")
    code, rep, api, raised = _all_three(ref, good)
    assert code == 0 and api.verdict == "pass" and not raised
    claim = [f for f in rep["findings"] if f["code"] == "REF_CLAIM_CONTRADICTED"]
    assert len(claim) == 1 and claim[0]["severity"] == "warning" and "d_raw" in claim[0]["message"]
    code, rep, api, raised = _all_three(ref, bad)
    assert code == 1 and raised and any(f["code"] == "RECYCLE_NORM_MISSING" for f in rep["findings"])

    plain = _write(tmp_path / "plain.safetensors", {**t, **steps}, "training")
    contract = tmp_path / "k.json"
    contract.write_text(json.dumps({"target": {"num_layers": N}, "slots": [{"stream": N, "norm": "final_norm"}],
                                    "consumer": {"kind": "mtp", "recycle": "d_raw"}}))
    code, rep, api, raised = _all_three(plain, good, "--contract", str(contract), contract=str(contract))
    assert code == 1 and api.verdict == "fail" and raised
    assert rep["findings"][0]["code"] == "CONTRACT_CONFLICT" and "d_raw" in rep["findings"][0]["message"]


def _mlp_partial(seed: int = 0):
    """Stream s = stream s-1 + attention + MLP, the MLP a row-parallel matmul over two ranks:
    (streams, the MLP's output, rank 0's share of it)."""
    rng = np.random.default_rng(seed)
    t = _target(seed)
    act = rng.standard_normal((T, 4 * H))
    w = rng.standard_normal((4 * H, H)) * 0.05
    p0, p1 = act[:, :2 * H] @ w[:2 * H], act[:, 2 * H:] @ w[2 * H:]
    attn = rng.standard_normal((T, H)) * 0.3
    s = 3
    for k in range(s, N + 1):  # rebuild streams s.. so that stream s = s-1 + attn + mlp exactly
        t[f"hidden.{k}"] = (t[f"hidden.{k - 1}"] + (attn + p0 + p1 if k == s else 0.4 * rng.standard_normal((T, H))))
        t[f"hidden.{k}"] = t[f"hidden.{k}"].astype(np.float32)
    t["final_norm"] = _rms(t[f"hidden.{N}"])
    return t, s, (t[f"hidden.{s}"] - p1).astype(np.float32)


@pytest.mark.parametrize("bf16", [False, True])
def test_missing_all_reduce_without_block_outputs_is_partial_shard(tmp_path, bf16):
    """A reference of streams only (no attn_out/mlp_out) and a slot that lost the other rank's
    share of its last MLP (a missing all-reduce): PARTIAL_SHARD on the whole layer's delta,
    never NUMERIC_DRIFT with a quantization fix nor UNKNOWN (bar 5)."""
    from consistency.dump.dtypes import float32_to_bf16_bits

    t, s, short = _mlp_partial()
    ref = _write(tmp_path / "ref.safetensors", {**t, "aux.0": t["hidden.1"], "aux.1": t[f"hidden.{s}"]}, "training",
                 aux={"stream_ids": [1, s]})
    cand = {"aux.0": t["hidden.1"], "aux.1": short, "input_ids": t["input_ids"]}
    if bf16:
        cand = {k: ((float32_to_bf16_bits(v), "bfloat16") if v.dtype == np.float32 else v) for k, v in cand.items()}
    c = _write(tmp_path / "cand.safetensors", cand, "serving")
    code, rep, api, raised = _all_three(ref, c)
    assert code == 1 and api.verdict == "fail" and raised
    slot1 = next(x for x in rep["slots"] if x["slot"] == 1)
    assert slot1["code"] == "PARTIAL_SHARD", rep["summary"]
    f = next(x for x in rep["findings"] if x["code"] == "PARTIAL_SHARD")
    assert f["evidence"]["block"] == "layer" and "no block outputs" in f["message"]


def test_concatenated_reference_aux_split_by_the_candidates_slot_width(tmp_path):
    """A hand-written reference holding only ``aux`` = cat(slots) (no metadata, no streams) and
    a candidate with per-slot ``aux.{i}``: the reference splits by the candidate's slot width,
    slot i meets slot i (docs/format.md), never SHAPE_MISMATCH against the whole concatenation."""
    t = _target()
    ref = tmp_path / "ref.npz"
    np.savez(ref, aux=np.concatenate([t["hidden.1"], t["hidden.3"]], -1), input_ids=t["input_ids"])
    good, bad = tmp_path / "good.npz", tmp_path / "bad.npz"
    np.savez(good, **{"aux.0": t["hidden.1"], "aux.1": t["hidden.3"]}, input_ids=t["input_ids"])
    np.savez(bad, **{"aux.0": t["hidden.1"], "aux.1": t["hidden.4"]}, input_ids=t["input_ids"])
    code, rep, api, raised = _all_three(ref, good)
    assert code == 0 and api.verdict == "pass" and not raised
    assert [s["code"] for s in rep["slots"]] == ["OK", "OK"]
    code, rep, api, raised = _all_three(ref, bad)
    assert code == 1 and raised
    assert [s["code"] for s in rep["slots"]][0] == "OK" and not any(f["code"] == "SHAPE_MISMATCH"
                                                                   for f in rep["findings"])


@pytest.mark.parametrize("case", ["embedding_shard", "embedding_in_slice", "deep_stream_shard_pattern"])
def test_zero_rows_are_a_vocab_shard_only_when_they_follow_one(tmp_path, case):
    """Zero token rows read as a vocab-parallel embedding without its all-reduce only on the
    embedding (stream 0) and only when the zero rows' ids lie outside the one slice the other
    rows' ids share; zero rows of a deeper stream, or with ids inside that slice, are
    BAD_TOKENS (bar 5)."""
    t = _target()
    rng = np.random.default_rng(3)
    ids = rng.integers(10, 120, T)
    ids[[2, 7, 11]] = [200, 150, 190] if case != "embedding_in_slice" else [1, 2, 3]
    t["input_ids"] = ids.astype(np.int64)
    ref = _write(tmp_path / "ref.safetensors", {**t, "aux.0": t["hidden.0"], "aux.1": t["hidden.3"]}, "training",
                 aux={"stream_ids": [0, 3]}, model={"num_layers": N, "vocab_size": 256})
    a0, a1 = t["hidden.0"].copy(), t["hidden.3"].copy()
    if case == "embedding_shard":
        a0[[2, 7, 11]] = 0  # ids 200, 150, 190: rank 1's half of the vocabulary
    elif case == "embedding_in_slice":
        a0[[2, 7, 11]] = 0  # ids 1, 2, 3: outside the kept rows' span, inside the slice [0, 128) they share
    else:
        a1[[2, 7, 11]] = 0  # the same pattern on stream 3, which attention mixes: not an embedding shard
    c = _write(tmp_path / "cand.safetensors", {"aux.0": a0, "aux.1": a1, "input_ids": t["input_ids"]}, "serving")
    code, rep, api, raised = _all_three(ref, c)
    assert code == 1 and raised and api.verdict == "fail"
    codes = {s["slot"]: s["code"] for s in rep["slots"]}
    want = {"embedding_shard": {0: "PARTIAL_SHARD", 1: "OK"}, "embedding_in_slice": {0: "BAD_TOKENS", 1: "OK"},
            "deep_stream_shard_pattern": {0: "OK", 1: "BAD_TOKENS"}}[case]
    assert codes == want, rep["summary"]


def test_same_tensors_in_memory_are_same_input():
    """One mapping passed twice (or a copy of it) to the API or the pytest helper verifies
    nothing: SAME_INPUT, as for a file compared with itself; equal values computed twice
    (other arrays) still compare and pass (bar 3)."""
    t = _target()
    ref = {**t, "aux.0": t["hidden.1"], "aux.1": t["hidden.3"]}
    for cand in (ref, dict(ref)):
        rep = consistency.compare(ref, cand)
        assert rep.verdict == "fail" and rep.findings[0].code == "SAME_INPUT"
        with pytest.raises(AssertionError, match="SAME_INPUT"):
            assert_consistent(ref, cand)
    again = {k: v.copy() for k, v in ref.items()}
    assert consistency.compare(ref, again).verdict == "pass"
    assert_consistent(ref, again)


def test_thin_reference_offset_measured_on_some_slots_consistent_on_the_rest(tmp_path):
    """A speculators hs_* file (streams [2, 4, 5] + the appended last state) and a server one
    layer late ([3, 5, 6]): slots 1 and 2 are measured (the file holds 5 and 6), slot 0 lies
    between 2 and 4 where only stream 3 fits. The headline is the one offset for every slot,
    saying which slots measure it, not slot 0's UNKNOWN (bar 5: whether all slots moved the
    same way)."""
    from safetensors.numpy import save_file

    t = _target(11)
    hs = tmp_path / "hs_0.safetensors"
    save_file({"hidden_states": np.stack([t["hidden.2"], t["hidden.4"], t["hidden.5"], t[f"hidden.{N}"]], 1),
               "token_ids": t["input_ids"]}, str(hs))
    cand = _write(tmp_path / "serve.safetensors", {"aux.0": t["hidden.3"], "aux.1": t["hidden.5"],
                                                   "aux.2": t["hidden.6"], "input_ids": t["input_ids"]}, "serving")
    args = ["--layer-ids", "2,4,5,6", "--convention", "speculators"]
    code, rep, api, raised = _all_three(hs, cand, *args, layer_ids="2,4,5,6", convention="speculators")
    assert code == 1 and api.verdict == "fail" and raised
    assert rep["findings"][0]["code"] == "LAYER_OFFSET", rep["summary"]
    assert "every slot is 1 layer later" in rep["summary"] and "measured on slots [1, 2]" in rep["summary"]
    assert "stream 3" in rep["summary"] and api.summary == rep["summary"]


def test_stage_layout_larger_than_the_set_its_names_say_is_refused(tmp_path):
    """Two rank files named -of2 whose layouts declare 3 pipeline stages (tp 1, dp 1): no
    rank is missing, the layout does not fit the names; one line, exit 2, from the CLI and
    the API (bar 7), never "stage 2 of 3 wrote no rank file (ranks [] of 2 missing)"."""
    from safetensors.numpy import save_file

    from consistency.errors import InputError

    t = _target()
    ref = _write(tmp_path / "ref.safetensors", {**t, "aux.0": t["hidden.1"], "aux.1": t["hidden.4"]}, "training",
                 aux={"stream_ids": [1, 4]})
    d = tmp_path / "serve"
    d.mkdir()
    for rank, (layers, tens) in enumerate((((0, 3), {"aux.0": t["hidden.1"]}), ((3, 6), {"aux.1": t["hidden.4"]}))):
        meta = {"side": "serving", "rank": rank, "world_size": 2,
                "extra": {"parallel": {"pp": {"rank": rank, "size": 3, "layers": list(layers)}}}}
        save_file({**tens, "input_ids": t["input_ids"]}, str(d / f"s.rank{rank}-of2.safetensors"),
                  metadata={"consistency": json.dumps(meta)})
    res = run_cli("compare", str(ref), str(d), "-q")
    assert res.returncode == 2, res.stderr
    assert "3 ranks, but their names say 2" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    with pytest.raises(InputError, match="their names say 2"):
        consistency.compare(str(ref), str(d))


@pytest.mark.parametrize("k", [-1, 2])
def test_offset_other_than_plus_one_is_not_called_the_sglang_plus_one_family(tmp_path, k):
    """Every slot k layers off: only k = +1 is SGLang's +1; -1 is it the other way round,
    +2 no family at all (a message that misleads)."""
    t = _target()
    ref = _write(tmp_path / "ref.safetensors", {**t, "aux.0": t["hidden.2"], "aux.1": t["hidden.3"]}, "training")
    cand = _write(tmp_path / "cand.safetensors", {"aux.0": t[f"hidden.{2 + k}"], "aux.1": t[f"hidden.{3 + k}"],
                                                  "input_ids": t["input_ids"]}, "serving")
    code, rep, api, raised = _all_three(ref, cand)
    assert code == 1 and raised and f"off by {k:+d}" in rep["summary"]
    assert ("the other way round" in rep["summary"]) == (k == -1)
    assert (", the SGLang +1 family)" in rep["summary"]) is False


def test_a_pass_on_a_neighbour_closer_than_the_noise_does_not_say_it_holds_the_expected_streams(tmp_path) -> None:
    """Streams 2->3 and 4->5 differ by less than bf16 noise: a bf16 candidate holding [3, 5]
    passes (the values cannot tell them apart for a bf16 draft), but the headline must not say
    the slots hold the streams training expects."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    h = [rng.standard_normal((T, H)).astype(np.float32)]
    for s in range(N):
        h.append((h[-1] + (0.003 if s in (2, 4) else 0.6) * rng.standard_normal((T, H))).astype(np.float32))
    ref = {f"hidden.{s}": h[s] for s in range(N + 1)}
    ref.update({"input_ids": np.arange(T, dtype=np.int64) + 5, "aux.0": h[2], "aux.1": h[4]})
    _write(tmp_path / "ref.safetensors", ref, "training", aux={"stream_ids": [2, 4]})
    bf = lambda x: torch.from_numpy(x).to(torch.bfloat16).float().numpy()  # noqa: E731
    _write(tmp_path / "cand.safetensors", {"aux.0": bf(h[3]), "aux.1": bf(h[5]), "input_ids": ref["input_ids"]},
           "serving")
    code, rep, _api, _raised = _all_three(tmp_path / "ref.safetensors", tmp_path / "cand.safetensors")
    head = rep["summary"]
    assert "[3, 5]" in head and "cannot tell apart" in head and "as training expects" not in head, head


@pytest.mark.parametrize("ids_name", ["input_ids", "token_ids"])
def test_two_files_holding_only_token_ids_compare_nothing(tmp_path, ids_name: str) -> None:
    """Two npz files with the same token ids and no activation (a serving recording with no aux
    slots, ``aux_layers=[]``) printed ``PASS pass: 1 tensor compared``: the token ids were
    counted as a compared tensor though no hidden state was verified."""
    ids = np.arange(3, 11, dtype=np.int64)
    a, b = tmp_path / "a.npz", tmp_path / "b.npz"
    np.savez(a, **{ids_name: ids})
    np.savez(b, **{ids_name: ids.copy()})
    r = run_cli("compare", str(a), str(b), "-q")
    assert r.returncode == 1 and "NOTHING_COMPARED" in r.stdout and "PASS" not in r.stdout, (r.returncode, r.stdout)
    rep = consistency.compare(str(a), str(b))
    assert rep.verdict == "fail" and "NOTHING_COMPARED" in [f.code for f in rep.findings]
    c = tmp_path / "c.npz"  # one activation beside the ids: compared, and a pass
    np.savez(c, **{ids_name: ids, "aux.0": np.ones((8, 4), np.float32)})
    np.savez(b, **{ids_name: ids, "aux.0": np.ones((8, 4), np.float32)})
    assert consistency.compare(str(c), str(b)).verdict == "pass"


def test_a_reference_recording_no_stream_says_so_in_plain_words() -> None:
    """A thin reference (one declared slot, no hidden.*) read 'The reference records streams
    none only (... the highest recorded stream is not its top)': words about streams it has not got."""
    rng = np.random.default_rng(3)
    a = rng.standard_normal((10, 16)).astype(np.float32)
    b = rng.standard_normal((10, 16)).astype(np.float32)
    rep = consistency.compare({"aux.0": a}, {"aux.0": b}, layer_ids=[2])
    assert rep.verdict == "fail"
    assert "streams none" not in rep.summary and "highest recorded stream" not in rep.summary, rep.summary
    assert "records no stream (hidden.*)" in rep.summary, rep.summary


def test_a_pass_on_part_of_the_tokens_says_how_many_were_verified() -> None:
    """A candidate that went on differently after 10 of 24 tokens passes on those 10 (the rest
    is a continuation, TOKENS_REPLACED, info): the verdict line says 10 of 24, never a bare pass."""
    import consistency

    rng = np.random.default_rng(0)
    h = [rng.standard_normal((24, 32)).astype(np.float32) for _ in range(3)]
    ids = np.arange(100, 124)
    other = ids.copy()
    other[10:] = np.arange(500, 514)
    g = [x.copy() for x in h]
    for x in g:
        x[10:] = rng.standard_normal((14, 32))
    rep = consistency.compare({"input_ids": ids, **{f"aux.{i}": h[i] for i in range(3)}},
                              {"input_ids": other, **{f"aux.{i}": g[i] for i in range(3)}})
    assert rep.verdict == "pass" and rep.summary.endswith("verified on 10 of 24 reference tokens (the other 14 "
                                                          "are not on both sides)"), rep.summary
    whole = consistency.compare({"input_ids": ids, **{f"aux.{i}": h[i] for i in range(3)}},
                                {"input_ids": ids.copy(), **{f"aux.{i}": h[i].copy() for i in range(3)}})
    assert whole.verdict == "pass" and "reference tokens" not in whole.summary, whole.summary
