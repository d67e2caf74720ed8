"""The MTP patches record what the draft is fed at step 0 and at every later step.

The released forwards (tests/record/test_patch_src_mtp.py, verbatim: vLLM 0.33.0
``DeepSeekMultiTokenPredictorLayer.forward`` / ``DeepSeekMultiTokenPredictor.forward`` /
``Qwen3NextMultiTokenPredictor.forward`` / ``Qwen3NextMTP.forward``, SGLang 0.5.23
``DeepseekModelNextN.forward``) run with the patches from patches/ applied, on the tiny
MTP module of tests/record/test_record_mtp.py, driven the way the runtimes drive them: one pass
over the prompt (step 0, the target's post-norm state), then one-row passes that feed the
previous pass's last returned state back. Whatever upstream names a forward needs but
these tests do not exercise (NPU, CP, DSA top-k sharing, the MoE recorder) is a stub.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from consistency.dump.reader import open_dump
from consistency.record import Recorder, mtp_install, mtp_patch, patch
from tests.record import test_patch_src_mtp as src
from tests.record.test_patch_models import apply, compile_method
from tests.record.test_record_mtp import MTP, H, T, ids, rms, target

ENV = "CONSISTENCY_RECORD"


@pytest.fixture(autouse=True)
def _fresh_chain():
    mtp_patch.reset()
    patch._state.pending_ids = None
    with torch.no_grad():  # expected values are recomputed from modules that hold parameters
        yield
    mtp_patch.reset()
    patch._state.pending_ids = None


def _method(name: str, patch_file: str | None, ns: dict[str, Any]) -> Any:
    text = getattr(src, name)
    if patch_file is not None:
        text, n = apply(patch_file, text)
        assert n >= 1, (name, patch_file)  # the patch's hunks landed in the quoted method
    return compile_method(text, {"torch": torch, **ns}, name)


# -- vLLM DeepSeek MTP -------------------------------------------------------------------------

def vllm_deepseek(mtp: MTP, patched: bool) -> nn.Module:
    p = "vllm-deepseek_mtp.patch" if patched else None
    layer_fwd = _method("VLLM_0330_MTP_LAYER_FORWARD", p, {"tensor_model_parallel_all_gather": None})
    pred_fwd = _method("VLLM_0330_MTP_PREDICTOR_FORWARD", p, {})

    class Block(nn.Module):
        use_sequence_parallel_moe = False

        def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: Any) -> Any:
            return mtp.block(hidden_states)

    layer = type("DeepSeekMultiTokenPredictorLayer", (nn.Module,), {"forward": layer_fwd})()
    layer.enorm, layer.hnorm, layer.eh_proj, layer.mtp_block = mtp.enorm, mtp.hnorm, mtp.eh_proj, Block()
    layer.shared_head = mtp.shared_head.norm
    pred = type("DeepSeekMultiTokenPredictor", (nn.Module,), {"forward": pred_fwd})()
    pred.embed_tokens, pred.num_mtp_layers, pred.mtp_start_layer_idx = mtp.embed, 1, 2
    pred.layers = nn.ModuleDict({"2": layer})
    return pred


def propose(model: nn.Module, x: torch.Tensor, fn: torch.Tensor, steps: int, numbered: bool,
            target_ids: torch.Tensor | None = None) -> list[torch.Tensor]:
    """vLLM's propose: the target's forward (its patch's capture_input_ids), then a pass over
    the shifted prompt, then one-row passes on the last row's recycled state."""
    patch.capture_input_ids(target_ids if target_ids is not None else x, torch.arange(x.shape[0]))
    tok = torch.cat([x[1:], x[:1]])  # set_inputs_first_pass: ids shifted left, the sampled token last
    pos = torch.arange(x.shape[0])
    recycled, fed = fn, []
    for k in range(steps):
        fed.append(recycled)
        kw = {"spec_step_idx": k} if numbered else {}
        raw, normed = model(tok, pos, recycled, **kw)
        recycled, tok, pos = normed[-1:], tok[-1:] + 1, pos[-1:] + 1
    return fed


def _read(path: Path) -> tuple[dict[str, np.ndarray], Any]:
    with open_dump(path) as d:
        return {n: d[n].read_all() for n in d.tensors}, d.metadata


@pytest.mark.parametrize("numbered", [True, False])
def test_vllm_deepseek_mtp_patch_records_every_step(numbered, tmp_path, monkeypatch):
    """``numbered``: the proposer passes spec_step_idx; otherwise every pass says 0 (a
    single-layer MTP) and the target's forward in between is what starts a chain."""
    monkeypatch.setenv(ENV, str(tmp_path / "unused.safetensors"))
    model, x = target(), ids()
    mtp = MTP(model.get_input_embeddings())
    with torch.no_grad():
        fn = model(x[None], output_hidden_states=True).hidden_states[-1][0]
        pred = vllm_deepseek(mtp, patched=True)
        with Recorder(tmp_path / "serve.safetensors"):
            fed = propose(pred, x, fn, 3, numbered)
            propose(pred, x, fn, 2, numbered)  # the next round: a new chain
    t, meta = _read(tmp_path / "serve.safetensors")
    assert {"aux.0", "aux.0#2", "recycle.1", "recycle.1#2", "recycle.2", "draft_norm.2", "input_ids"} <= set(t)
    assert "recycle.2#2" not in t and "aux.0#3" not in t and "recycle.3" not in t
    assert np.array_equal(t["aux.0"], fn.numpy()) and np.array_equal(t["input_ids"], x.numpy())
    shifted = torch.cat([x[1:], x[:1]])
    assert t["draft_ids.0"].tolist() == shifted.tolist()
    emb = mtp.embed(shifted)
    assert not t["draft_embed.0"][0].any()  # inputs_embeds[positions == 0] = 0
    assert np.allclose(t["draft_embed.0"][1:], emb[1:].numpy())
    masked = torch.as_tensor(t["draft_embed.0"])
    assert np.allclose(t["draft_cat.0"][:, :H], rms(masked, mtp.enorm.weight).numpy(), atol=1e-5)
    assert np.allclose(t["draft_cat.0"][:, H:], rms(fn, mtp.hnorm.weight).numpy(), atol=1e-5)
    for k in (1, 2):  # what step k is fed is the post-norm output of step k-1, last row
        assert t[f"recycle.{k}"].shape == (1, H)
        assert np.array_equal(t[f"recycle.{k}"], t[f"draft_norm.{k - 1}"][-1:]), k
        assert np.array_equal(t[f"recycle.{k}"], fed[k].numpy())
        assert np.allclose(t[f"draft_norm.{k}"], rms(torch.as_tensor(t[f"draft_out.{k}"]),
                                                     mtp.shared_head.norm.weight).numpy(), atol=1e-5)
    assert meta.extra["consumer"]["kind"] == "mtp" and meta.extra["consumer"]["recycle"] == "d_norm"
    assert meta.extra["consumer"]["pos0_embed"] == "zeroed" and meta.extra["consumer_row"] == "vllm-deepseek-mtp"
    assert meta.tensors["draft_cat.0"].token_index == list(range(T))
    assert meta.tensors["recycle.1"].token_index == [T - 1] == meta.tensors["draft_norm.2"].token_index  # anchor T-1
    assert meta.tensors["aux.0"].norm is None


def test_patched_and_released_vllm_mtp_compute_the_same_and_record_nothing_when_off(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    model, x = target(), ids()
    mtp = MTP(model.get_input_embeddings())
    with torch.no_grad():
        fn = model(x[None], output_hidden_states=True).hidden_states[-1][0]
        pos = torch.arange(T)
        a = vllm_deepseek(mtp, patched=True)(x, pos, fn)
        b = vllm_deepseek(mtp, patched=False)(x, pos, fn)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert mtp_patch._state.step is None and not list(tmp_path.iterdir())


def test_token_filter_records_the_prompt_chain_only(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, str(tmp_path / "unused.safetensors"))
    monkeypatch.setenv(patch.ENV_TOKENS, str(T))
    model, x = target(), ids()
    mtp = MTP(model.get_input_embeddings())
    with torch.no_grad():
        fn = model(x[None], output_hidden_states=True).hidden_states[-1][0]
        pred = vllm_deepseek(mtp, patched=True)
        with Recorder(tmp_path / "serve.npz") as rec:
            propose(pred, x[:5], fn[:5], 3, numbered=False)  # a warm-up of another length: skipped, with its steps
            propose(pred, x, fn, 3, numbered=False)
    names = set(rec.tensors)
    assert "aux.0" in names and "aux.0#2" not in names and "recycle.2" in names and "recycle.2#2" not in names
    assert rec.tensors["aux.0"][0].shape == (T, H)


# -- vLLM Qwen3-Next MTP -----------------------------------------------------------------------

def vllm_qwen3_next(mtp: MTP, patched: bool) -> nn.Module:
    p = "vllm-qwen3_next_mtp.patch" if patched else None
    inner_fwd = _method("VLLM_0330_QWEN3_NEXT_PREDICTOR_FORWARD", p,
                        {"get_pp_group": lambda: SimpleNamespace(is_first_rank=True, is_last_rank=True)})
    outer_fwd = _method("VLLM_0330_QWEN3_NEXT_MTP_FORWARD", p, {})

    class Layer(nn.Module):
        use_attn_reduce_scatter_for_moe = False

        def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: Any) -> Any:
            return mtp.block(hidden_states)

    inner = type("Qwen3NextMultiTokenPredictor", (nn.Module,), {"forward": inner_fwd})()
    inner.embed_input_ids, inner.pre_fc_norm_embedding, inner.pre_fc_norm_hidden = mtp.embed, mtp.enorm, mtp.hnorm
    inner.fc, inner.num_mtp_layers, inner.layers, inner.norm = mtp.eh_proj, 1, nn.ModuleList([Layer()]), mtp.shared_head.norm
    outer = type("Qwen3NextMTP", (nn.Module,), {"forward": outer_fwd})()
    outer.model = inner
    return outer


def drive_qwen3_next(outer: nn.Module, x: torch.Tensor, fn: torch.Tensor) -> list[torch.Tensor]:
    patch.capture_input_ids(x, torch.arange(T))
    tok = torch.cat([x[1:], x[:1]])
    out0 = outer(tok, torch.arange(T), fn)
    out1 = outer(tok[-1:], torch.tensor([T]), out0[-1:])  # Qwen3NextMTP passes no step index on
    return [out0, out1]


def test_vllm_qwen3_next_patch_records_input_concat_and_output(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, str(tmp_path / "unused.safetensors"))
    model, x = target(), ids()
    mtp = MTP(model.get_input_embeddings())
    outer = vllm_qwen3_next(mtp, patched=True)
    fn = model(x[None], output_hidden_states=True).hidden_states[-1][0]
    with Recorder(tmp_path / "q.safetensors"):
        out0, out1 = drive_qwen3_next(outer, x, fn)
    tok = torch.cat([x[1:], x[:1]])
    t, meta = _read(tmp_path / "q.safetensors")
    assert np.array_equal(t["aux.0"], fn.numpy()) and np.array_equal(t["recycle.1"], out0[-1:].numpy())
    assert np.allclose(t["draft_embed.0"], mtp.embed(tok).numpy())  # no position-0 masking in Qwen3-Next
    assert np.array_equal(t["draft_norm.0"], out0.numpy()) and np.array_equal(t["draft_norm.1"], out1.numpy())
    assert "draft_out.0" not in t and meta.extra["consumer"]["pos0_embed"] == "kept"


# -- SGLang DeepSeek NextN ---------------------------------------------------------------------

def sglang_nextn(mtp: MTP, patched: bool = True) -> nn.Module:
    state: dict[str, Any] = {}

    class ResidualBatch:  # layer_boundary: the block's residual kept beside the batch
        def start(self, fb: Any) -> None:
            state.clear()

        def complete_output(self, h: torch.Tensor, fb: Any) -> torch.Tensor:
            return h

        def final_norm(self, h: torch.Tensor, fb: Any, norm: nn.Module) -> torch.Tensor:
            return norm(h, state["residual"])[0]

    class Share:
        topk_indices = None

        def update(self, _t: Any) -> None: ...

        def publish(self) -> None: ...

    def decoder(positions: torch.Tensor, h: torch.Tensor, fb: Any, zero_allocator: Any, prev_topk_indices: Any) -> Any:
        delta, state["residual"] = mtp.block(h)
        return delta, None

    ns = {"ExitStack": contextlib.ExitStack, "_is_npu": False, "_is_cuda": False, "BumpAllocator": lambda **kw: None,
          "ReplicatedLinear": type("ReplicatedLinear", (), {}), "residual_batch": ResidualBatch(),
          "IndexTopKShareState": SimpleNamespace(from_mtp_carry=lambda fb: Share()),
          "get_global_expert_distribution_recorder": lambda: SimpleNamespace(disable_this_region=contextlib.nullcontext)}
    fwd = _method("SGLANG_0523_NEXTN_FORWARD", "sglang-deepseek_nextn.patch" if patched else None, ns)
    m = type("DeepseekModelNextN", (nn.Module,), {"forward": fwd})()
    m.embed_tokens = mtp.embed
    m.embed_input_ids = lambda input_ids, fb: mtp.embed(input_ids)
    m.rot_weight, m.quant_config, m.enorm, m.hnorm, m.eh_proj = None, None, mtp.enorm, mtp.hnorm, mtp.eh_proj
    m.decoder, m.shared_head = decoder, mtp.shared_head
    return m


def _batch(mode: str, hidden: torch.Tensor) -> Any:
    fm = SimpleNamespace(is_idle=lambda: mode == "idle", is_decode=lambda: mode == "decode",
                         is_extend=lambda **kw: mode == "extend")
    return SimpleNamespace(forward_mode=fm, spec_info=SimpleNamespace(hidden_states=hidden))


def drive_sglang(m: nn.Module, x: torch.Tensor, fn: torch.Tensor) -> list[torch.Tensor]:
    """forward_draft_extend (extend: step 0), then the draft's decode passes (steps 1, 2)."""
    tok = torch.cat([x[1:], x[:1]])  # prepare_for_extend: cat(input_ids[1:], verified_id)
    outs = [m(tok, torch.arange(T), _batch("extend", fn))]
    for k in (1, 2):
        outs.append(m(tok[-1:], torch.tensor([T - 1 + k]), _batch("decode", outs[-1][-1:])))
    m(tok[:0], torch.arange(0), _batch("idle", fn[:0]))  # an idle DP rank: nothing
    return outs


def test_sglang_nextn_patch_numbers_steps_by_forward_mode(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, str(tmp_path / "unused.safetensors"))
    model, x = target(), ids()
    mtp = MTP(model.get_input_embeddings(), fused=True)
    fn = model(x[None], output_hidden_states=True).hidden_states[-1][0]
    with Recorder(tmp_path / "s.safetensors"):
        outs = drive_sglang(sglang_nextn(mtp), x, fn)
    t, meta = _read(tmp_path / "s.safetensors")
    assert set(t) == {f"{n}.{k}" for n in ("draft_ids", "draft_embed", "draft_cat", "draft_norm") for k in range(3)} \
        | {"aux.0", "recycle.1", "recycle.2"}
    tok = torch.cat([x[1:], x[:1]])
    assert np.array_equal(t["aux.0"], fn.numpy())
    assert np.allclose(t["draft_embed.0"], mtp.embed(tok).numpy())  # SGLang's NextN keeps position 0
    assert np.allclose(t["draft_cat.0"][:, H:], rms(fn, mtp.hnorm.weight).numpy(), atol=1e-5)
    for k in (1, 2):
        assert np.array_equal(t[f"recycle.{k}"], t[f"draft_norm.{k - 1}"][-1:])
        assert np.array_equal(t[f"draft_norm.{k}"], outs[k].numpy())
    assert meta.extra["consumer_row"] == "sglang-deepseek-nextn" and meta.extra["consumer"]["pos0_embed"] == "kept"


# -- the monkey patch records what the file patches record ----------------------------------------

RUNTIMES = {
    "vllm-deepseek_mtp": (lambda mtp, p: vllm_deepseek(mtp, p), lambda m: m,
                          lambda m, x, fn: (propose(m, x, fn, 3, False), propose(m, x, fn, 2, False))),
    "vllm-qwen3_next_mtp": (lambda mtp, p: vllm_qwen3_next(mtp, p), lambda m: m.model, drive_qwen3_next),
    "sglang-deepseek_nextn": (lambda mtp, p: sglang_nextn(mtp, p), lambda m: m, drive_sglang),
}


@pytest.mark.parametrize("runtime", sorted(RUNTIMES))
def test_monkey_patch_records_what_the_file_patch_records(runtime, tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, str(tmp_path / "unused.safetensors"))
    build, draft_module, drive = RUNTIMES[runtime]
    model, x = target(), ids()
    mtp = MTP(model.get_input_embeddings(), fused=runtime.startswith("sglang"))
    fn = model(x[None], output_hidden_states=True).hidden_states[-1][0]
    got = []
    for patched in (True, False):
        m = build(mtp, patched)
        inst = None if patched else mtp_install.install(draft_module(m))
        mtp_patch.reset()
        with Recorder(tmp_path / f"{runtime}-{patched}.safetensors") as rec:
            drive(m, x, fn)
        if inst is not None:
            inst.remove()
        got.append(dict(rec.tensors))
    a, b = got
    assert len(a) >= 10 and set(a) == set(b), set(a) ^ set(b)
    for name in a:
        assert a[name][1] == b[name][1] and np.array_equal(a[name][0], b[name][0]), name


def test_monkey_patch_is_inert_without_the_variable(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    m = vllm_deepseek(MTP(target().get_input_embeddings()), False)
    assert mtp_install.install(m) is None
    assert not [mod for mod in m.modules() if mod._forward_hooks or mod._forward_pre_hooks]
    with pytest.raises(ValueError, match="not an MTP draft module"):
        mtp_install.install(nn.Linear(2, 2), force=True)


def test_a_patched_class_hooks_its_instances_and_survives_an_unknown_layout(tmp_path, monkeypatch, capsys):
    """What ``auto()`` does to vLLM's class as it is imported: every instance installs itself."""
    monkeypatch.setenv(ENV, str(tmp_path / "unused.safetensors"))
    model, x = target(), ids()
    proto = vllm_deepseek(MTP(model.get_input_embeddings()), False)

    class Pred(type(proto)):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.embed_tokens, self.layers = proto.embed_tokens, proto.layers
            self.num_mtp_layers, self.mtp_start_layer_idx = 1, 2

    class Elsewhere(nn.Module):
        pass

    mtp_install.patch_class(Pred)
    mtp_install.patch_class(Elsewhere)
    fn = model(x[None], output_hidden_states=True).hidden_states[-1][0]
    with Recorder(tmp_path / "a.safetensors") as rec:
        propose(Pred(), x, fn, 2, numbered=False)
    assert {"aux.0", "recycle.1", "draft_cat.1", "draft_norm.1"} <= set(rec.tensors)
    Elsewhere()  # an MTP module this does not know: one line on stderr, no exception
    assert "Elsewhere not recorded: not an MTP draft module" in capsys.readouterr().err
