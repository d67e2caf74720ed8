"""Causes on what was recorded (issue 24, item 5): targeted cases beside the scenario tables
(tests/scenarios/arch_faults.py), each built so its answer follows from the construction.

* the HF recorder reads what each block *adds* to the stream on architectures beyond
  Llama-style pre-norm (parallel blocks, sandwich norms, residual multipliers), checked with
  the test's own hooks;
* the premise of the thin-reference story (streams move monotonically with depth);
* a partial block proven by every rank's file; a few bad rows of a rank file are bad tokens
  unless they follow a vocab shard; the highest recorded stream is not the model's top;
* thin references written by speculators and SpecForge: where the slots lie, and that they
  all moved the same way;
* identification stays cheap: RESIDUAL_MISSING never computes a distance row.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from consistency.contract.models import AuxInfo, DumpMetadata, ModelInfo
from consistency.pipeline.compare import compare as run_compare
from consistency.dump.writer import write_dump
from tests.scenarios.build import ARCH_FAMILIES, PARALLEL, SANDWICH, _tiny_model, record

TRAIN = [0, 3, 7]


def _errors(rep) -> dict[str, list]:  # noqa: ANN001
    out: dict[str, list] = {}
    for f in rep.findings:
        if f.severity.value == "error":
            out.setdefault(f.code, []).append(f)
    return out


def _meta(n: int = 12, h: int = 64, side: str = "training", claims: list[int] | None = None, **kw) -> DumpMetadata:  # noqa: ANN003
    return DumpMetadata(side=side, model=ModelInfo(num_layers=n, hidden_size=h, vocab_size=384),
                        aux=AuxInfo(stream_ids=claims) if claims is not None else None, **kw)


def _bf16(x: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.ascontiguousarray(x, np.float32)).to(torch.bfloat16).float().numpy()


# -- the recorder --------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", list(ARCH_FAMILIES))
def test_the_recorder_reads_what_each_block_adds(arch: str) -> None:
    """hidden.{k+1} = hidden.k + attn_out.k + mlp_out.k on every family, with the deltas being
    what the stream receives: a sandwich norm's output (Gemma2/3), the block's output times
    the residual multiplier (Granite), the plain outputs of a parallel block (GPT-NeoX, Cohere,
    Falcon); and the final norm is found (GPT-NeoX names it final_layer_norm)."""
    from consistency.record.hf import capture_streams, find_layers

    model = _tiny_model(arch)
    layers = find_layers(model)[1]
    mine: dict[tuple[int, str], torch.Tensor] = {}
    hooks = []
    for k, layer in enumerate(layers):
        for attr in ("post_attention_layernorm", "post_feedforward_layernorm", "mlp"):
            if arch in SANDWICH or attr == "mlp":
                mod = getattr(layer, attr)
                hooks.append(mod.register_forward_hook(lambda _m, _a, o, k=k, a=attr: mine.__setitem__((k, a),
                                                                                                      o.detach().clone())))
    ids = torch.arange(2, 50)[None]
    try:
        out, _notes = capture_streams(model, ids)
    finally:
        for h in hooks:
            h.remove()
    n = model.config.num_hidden_layers
    assert "final_norm" in out
    for k in range(n):
        h0, h1 = out[f"hidden.{k}"].double(), out[f"hidden.{k + 1}"].double()
        a, m = out[f"attn_out.{k}"].double(), out[f"mlp_out.{k}"].double()
        assert float((h0 + a + m - h1).norm() / h1.norm()) < 1e-5, (arch, k)
        if arch in SANDWICH:
            assert torch.equal(out[f"attn_out.{k}"], mine[(k, "post_attention_layernorm")])
            assert torch.equal(out[f"mlp_out.{k}"], mine[(k, "post_feedforward_layernorm")])
        elif arch == "granite":
            np.testing.assert_allclose(m.numpy(), 0.22 * mine[(k, "mlp")].double().numpy(), rtol=1e-5, atol=1e-7)
        else:
            assert torch.equal(out[f"mlp_out.{k}"], mine[(k, "mlp")])
    if arch in PARALLEL:  # one residual add: each block reads the layer's input, not the attention's sum
        assert float(out["attn_out.0"].norm()) > 0 and float(out["mlp_out.0"].norm()) > 0


@pytest.mark.parametrize("arch", list(ARCH_FAMILIES))
def test_serving_style_recording_reproduces_the_forward_or_refuses(arch: str, tmp_path) -> None:  # noqa: ANN001
    """``record --style serving`` (the fused-residual loop) on the same weights as a training
    recording: the same streams (sandwich norms and Granite's multipliers followed), or a
    one-line refusal for layers it does not model (parallel blocks) -- never a dump of
    streams the model does not compute, which compare would then blame on the serving side."""
    from consistency.errors import UsageError
    from consistency.record.api import record_reference, record_serving

    model = _tiny_model(arch)
    ids = np.arange(2, 40)
    ref = record_reference(model, ids, tmp_path / "train.safetensors", aux_streams=[1, 4, 7])
    try:
        cand = record_serving(model, ids, tmp_path / "serve.safetensors", [1, 4, 7])
    except UsageError as e:
        assert arch in PARALLEL and len(str(e).splitlines()) == 1 and "--style training" in str(e), (arch, str(e))
        assert not (tmp_path / "serve.safetensors").exists()
        return
    assert arch not in PARALLEL
    rep = run_compare(str(ref), str(cand))
    assert rep.verdict == "pass", (arch, rep.summary)


@pytest.mark.parametrize("arch", ["llama", "deepseek_v3", "gpt_neox", "gemma2", "granite"])
def test_streams_move_monotonically_with_depth(arch: str) -> None:
    """diagnose.thin's premise: the distance from stream a to stream b grows with |a - b|
    (strictly over the 6 nearest layers; farther, where it saturates towards 1, within 0.01)."""
    from consistency.compare.identify import token_distance

    st = record(arch)
    h = [x[:64].astype(np.float64) for x in st.hidden]
    for a in range(st.n + 1):
        row = [token_distance(h[a], h[b]) for b in range(a, st.n + 1)]
        assert all(x < y for x, y in zip(row[:7], row[1:7])), (arch, a, np.round(row, 3))
        assert all(x < y + 0.01 for x, y in zip(row, row[1:])), (arch, a, np.round(row, 3))


def test_rank_zero_share_is_a_partial_sum() -> None:
    """tests/scenarios/taps.py: rank 0's share and the rest sum to the MLP's output, and neither
    part is the whole (dense: row-parallel halves; MoE: local experts + shared vs the rest)."""
    from consistency.compare.identify import token_distance

    for arch in ("llama", "deepseek_v3"):
        st = record(arch)
        for k in (1, 5):
            m, p = st.mlp_out[k][:64].astype(np.float64), st.mlp_part[k][:64].astype(np.float64)
            assert token_distance(p, m) > 0.05 and token_distance(m - p, m) > 0.05, (arch, k)


def test_a_fused_add_norm_capture_of_a_gemma2_target_is_named_in_bf16(tmp_path) -> None:  # noqa: ANN001
    """A Gemma-2 target of other sizes than the scenario families (8 layers, hidden 96, gains
    1 + 0.2 randn on every norm) recorded by ``consistency.record``; the serving side, a bf16
    forward, hands over layer 4's input-norm output where stream 4 was meant (a fused
    add+RMSNorm): NORM_APPLIED, not UNKNOWN, though the sandwich-normed stream is flat."""
    import transformers

    from consistency.record.api import record_reference

    cfg = transformers.Gemma2Config(hidden_size=96, intermediate_size=192, num_hidden_layers=8, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=24, vocab_size=500, max_position_embeddings=512)
    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for mod in model.modules():
            if "Norm" in type(mod).__name__:
                mod.weight.add_(0.2 * torch.randn_like(mod.weight))
    ids = np.arange(3, 83)
    ref = record_reference(model, ids, tmp_path / "train.safetensors", aux_streams=[1, 4, 7])
    low = model.to(torch.bfloat16)
    got: dict[str, torch.Tensor] = {}
    hook = low.model.layers[4].input_layernorm.register_forward_hook(lambda _m, _a, o: got.__setitem__("in4", o))
    with torch.no_grad():
        hs = low(input_ids=torch.from_numpy(ids)[None], output_hidden_states=True).hidden_states
    hook.remove()
    cand = tmp_path / "serve.npz"  # a user's own np.savez of .float() tensors: no metadata
    np.savez(cand, **{"aux.0": hs[1][0].float().numpy(), "aux.1": got["in4"][0].float().numpy(),
                      "aux.2": hs[7][0].float().numpy(), "input_ids": ids})
    rep = run_compare(str(ref), str(cand))
    errs = _errors(rep)
    assert [f.tensor for f in errs.get("NORM_APPLIED", [])] == ["aux.1"], sorted(errs)
    assert "UNKNOWN" not in errs and {s.slot: s.code for s in rep.slots} == {0: "OK", 1: "NORM_APPLIED", 2: "OK"}


# -- partial blocks, shards and bad rows ------------------------------------------------------------

def _reference(d, st, t: int = 64):  # noqa: ANN001, ANN202
    tens = {"input_ids": st.ids[:t]} | {f"hidden.{s}": st.hidden[s][:t] for s in range(st.n + 1)}
    tens |= {f"attn_out.{k}": st.attn_out[k][:t] for k in range(st.n)}
    tens |= {f"mlp_out.{k}": st.mlp_out[k][:t] for k in range(st.n)}
    tens |= {f"aux.{i}": st.hidden[s][:t] for i, s in enumerate(TRAIN)}
    return write_dump(d / "ref.safetensors", tens, _meta(claims=TRAIN), force=True)


def test_a_partial_block_is_proven_by_every_rank_file(tmp_path) -> None:  # noqa: ANN001
    """Each slot past the embedding captured before its layer's MLP all-reduce, on both ranks
    of TP=2: the ranks' copies sum to W copies of the replicated part plus the MLP output, so
    PARTIAL_SHARD is proven (no longer inferred), and the replicated copies disagree."""
    st, t = record("llama"), 64
    ref = _reference(tmp_path, st, t)
    for rank in (0, 1):
        slots = {}
        for i, s in enumerate(TRAIN):
            share = st.mlp_part[s - 1][:t] if rank == 0 else st.mlp_out[s - 1][:t] - st.mlp_part[s - 1][:t]
            slots[f"aux.{i}"] = st.hidden[s][:t] if s == 0 else st.hidden[s][:t] - st.mlp_out[s - 1][:t] + share
        write_dump(tmp_path / f"cand.rank{rank}-of2.safetensors", {"input_ids": st.ids[:t]} | slots,
                   _meta(side="serving", claims=TRAIN, rank=rank, world_size=2), force=True)
    rep = run_compare(str(ref), str(tmp_path / "cand.safetensors"))
    errs = _errors(rep)
    assert rep.verdict == "fail" and "NUMERIC_DRIFT" not in errs
    got = {f.tensor: f for f in errs.get("PARTIAL_SHARD", [])}
    assert set(got) >= {"aux.1", "aux.2"}, sorted(errs)
    for f in got.values():
        assert f.evidence["proven_by_ranks"] == 2 and f.evidence["block"] == "MLP"
        assert "ranks' copies sum" in f.message and "all-reduce" in f.message
    assert got["aux.1"].evidence["layer"] == 2 and got["aux.2"].evidence["layer"] == 6
    assert {f.tensor for f in errs.get("REPLICA_MISMATCH", [])} >= {"aux.1", "aux.2"}
    # rank 0's file alone: inferred from the split, said as such
    one = _errors(run_compare(str(ref), str(tmp_path / "cand.rank0-of2.safetensors")))
    f = next(f for f in one["PARTIAL_SHARD"] if f.tensor == "aux.1")
    assert f.evidence["proven_by_ranks"] == 0 and f.evidence["approximate"] and "rank 0 of 2" in f.message


def test_bad_rows_of_a_rank_file_are_bad_tokens_unless_they_follow_a_shard(tmp_path) -> None:  # noqa: ANN001
    """A rank file (world size 2) whose slot has two zeroed and two swapped rows: BAD_TOKENS, never
    a vocab-parallel partial shard; the same file whose embedding rows are zero exactly for the
    tokens outside rank 0's vocabulary slice: PARTIAL_SHARD."""
    st, t = record("llama"), 64
    ref = _reference(tmp_path, st, t)
    ids = st.ids[:t]

    def cand(name: str, fix) -> str:  # noqa: ANN001
        slots = {f"aux.{i}": _bf16(st.hidden[s][:t]) for i, s in enumerate(TRAIN)}
        fix(slots)
        p = tmp_path / name
        write_dump(p, {"input_ids": ids} | slots, _meta(side="serving", claims=TRAIN, rank=0, world_size=2), force=True)
        return str(p)

    def few(slots) -> None:  # noqa: ANN001
        x = slots["aux.1"].copy()
        x[[5, 40]] = 0
        x[[11, 23]] = x[[23, 11]]
        slots["aux.1"] = x

    rep = run_compare(str(ref), cand("few.safetensors", few))
    errs = _errors(rep)
    assert "PARTIAL_SHARD" not in errs and [f.tensor for f in errs["BAD_TOKENS"]] == ["aux.1"], sorted(errs)
    assert errs["BAD_TOKENS"][0].evidence["token_rows"] == [5, 11, 23, 40]

    def vocab(slots) -> None:  # noqa: ANN001
        x = slots["aux.0"].copy()
        x[ids >= 192] = 0  # rank 0 of 2 holds ids [0, 192) of a 384-token vocabulary
        slots["aux.0"] = x

    errs = _errors(run_compare(str(ref), cand("vocab.safetensors", vocab)))
    f = next(f for f in errs["PARTIAL_SHARD"] if f.tensor == "aux.0")
    assert "vocab-parallel embedding" in f.message and f.evidence["zero_rows_inside_range"] == 0


def test_the_highest_recorded_stream_is_not_the_top(tmp_path) -> None:  # noqa: ANN001
    """A reference recording streams 0..7 of a 12-layer model (its metadata says N = 12) and a
    slot that holds stream 8 where 7 was meant: the nearest recorded stream is still 7, clearly,
    but stream 8 is not recorded and 7 is not the top, so it is no drift: it is no stream
    before 7, possibly one of streams 8..12 (never "the last layer's output")."""
    st, t = record("llama"), 64
    tens = {"input_ids": st.ids[:t]} | {f"hidden.{s}": st.hidden[s][:t] for s in range(8)}
    tens |= {f"aux.{i}": st.hidden[s][:t] for i, s in enumerate(TRAIN)}
    ref = write_dump(tmp_path / "ref.safetensors", tens, _meta(claims=TRAIN), force=True)
    slots = {f"aux.{i}": _bf16(st.hidden[s][:t]) for i, s in enumerate([0, 3, 8])}
    cand = write_dump(tmp_path / "cand.safetensors", {"input_ids": st.ids[:t]} | slots,
                      _meta(side="serving", claims=TRAIN), force=True)
    rep = run_compare(str(ref), str(cand))
    errs = _errors(rep)
    assert "NUMERIC_DRIFT" not in errs and "OK" not in {f.code for f in rep.findings if f.tensor == "aux.2"}
    f = next(f for fs in errs.values() for f in fs if f.tensor == "aux.2")
    assert "no stream before 7" in f.message and "8..12" in f.message and "last layer" not in f.message


# -- thin references written by the training libraries ---------------------------------------------

def test_speculators_and_specforge_references_say_every_slot_moved_later(tmp_path) -> None:  # noqa: ANN001
    """A serving side one layer late on every slot (the SGLang +1 family), against a
    speculators hs_* file and a SpecForge .ckpt (aux slots, the last state): no stream says by
    how much, but every slot lies after the stream training used, and the report says so."""
    from tests.dump.test_formats import N, serving, specforge_record, write_hs, write_specforge

    late = serving(tmp_path / "late.safetensors", [3, 7, 10], "stream", [3, 7, 10])
    hs = write_hs(tmp_path / "hs_0.safetensors", [2, 6, 9, N])
    ckpt = write_specforge(tmp_path / "data_0.ckpt", specforge_record([1, 5, 8]), False)
    for ref, kw in ((hs, {"ref_layer_ids": f"2,6,9,{N}", "convention": "speculators"}),
                    (ckpt, {"ref_layer_ids": "1,5,8", "convention": "specforge"})):
        rep = run_compare(str(ref), str(late), **kw)
        errs = _errors(rep)
        assert rep.verdict == "fail" and "NUMERIC_DRIFT" not in errs, (ref.name, sorted(errs))
        assert "every slot lies later" in rep.summary, (ref.name, rep.summary)
        story = errs["LAYER_OFFSET"][0]
        assert story.evidence["direction"] == "later" and story.evidence["expected"] == [2, 6, 9]
        slot = next(f for f in rep.findings if f.tensor == "aux.1")
        assert "lies after stream 6" in slot.message and "7..8" in slot.message, slot.message


def test_a_thin_reference_says_when_the_slots_moved_different_ways(tmp_path) -> None:  # noqa: ANN001
    """Serving slots [1, 2, 9] against training's [0, 3, 7] on an aux-only reference (N = 12 in
    its metadata): slot 0 lies after stream 0, slot 1 before stream 3, slot 2 past stream 7 --
    no single offset, and the report says so instead of telling an offset story."""
    st, t = record("llama"), 64
    ref = write_dump(tmp_path / "ref.safetensors", {"input_ids": st.ids[:t]} |
                     {f"aux.{i}": st.hidden[s][:t] for i, s in enumerate(TRAIN)}, _meta(claims=TRAIN), force=True)
    cand = write_dump(tmp_path / "cand.safetensors", {"input_ids": st.ids[:t]} |
                      {f"aux.{i}": _bf16(st.hidden[s][:t]) for i, s in enumerate([1, 2, 9])},
                      _meta(side="serving"), force=True)
    rep = run_compare(str(ref), str(cand))
    errs = _errors(rep)
    assert "LAYER_OFFSET" not in errs and "NUMERIC_DRIFT" not in errs, sorted(errs)
    assert rep.summary.startswith("the slots did not all move the same way"), rep.summary
    assert "slot 0 lies after stream 0 (one of 1..2)" in rep.summary, rep.summary
    assert "slot 1 lies before stream 3 (one of 1..2)" in rep.summary and "slot 2 is no stream before 7" in rep.summary
    assert errs["UNKNOWN"][0].tensor == "aux"


# -- cost ----------------------------------------------------------------------------------------------

def test_residual_missing_tries_the_blocks_next_to_the_stream_pair_by_pair(tmp_path) -> None:  # noqa: ANN001
    """RESIDUAL_MISSING looks at layers s-1 and s only, one pair at a time: no distance row
    over every reference tensor is computed (thousands of differing tensors stay linear)."""
    from consistency.compare.engine import compare
    from consistency.diagnose import hypotheses
    from consistency.diagnose.evidence import Evidence
    from consistency.dump.reader import Dump

    st, t = record("llama"), 64
    ref = _reference(tmp_path, st, t)
    slots = {f"aux.{i}": _bf16(st.hidden[s][:t]) for i, s in enumerate(TRAIN)}
    slots["aux.1"] = _bf16(st.mlp_out[2][:t])
    cand = write_dump(tmp_path / "cand.safetensors", {"input_ids": st.ids[:t]} | slots,
                      _meta(side="serving", claims=TRAIN), force=True)
    with Dump(ref) as r, Dump(cand) as c:
        cmp = compare(r, c)
        res = cmp.result("aux.1")
        fp, rfp = cmp.cand_fp[(t, 64)], cmp.ref_fp[(t, 64)]
        fp._memo.clear()
        rfp._memo.clear()
        x = hypotheses.residual_missing(Evidence(cmp), res)
        assert x is not None and x.identified_as == "mlp_out.2" and x.detail == {"layer": 2, "block": "MLP"}
        assert not fp._memo and not rfp._memo  # pair distances only: no row was computed
