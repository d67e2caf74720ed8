"""MTP (DeepSeek-V3 NextN) and EAGLE-1 replay: parity with reference implementations, the
recycle bug's cost derived from a construction, and the refusals.

References, each a port or an installed package (never what our code prints):
- speculators 0.9.0 ``MTPDraftModel`` (installed; Qwen3 family): per-step hidden outputs.
- vllm ``vllm/model_executor/models/deepseek_mtp.py`` at 03356f8 (``DeepSeekMultiTokenPredictorLayer.forward``,
  ``compute_logits``) with SGLang ``python/sglang/srt/models/deepseek_nextn.py`` at c28bdc9's recycle
  (``shared_head.norm(hidden, residual)`` is what the next step reads), run as a KV cache
  would run it: a growing sequence, recomputed in full at every step.
- vllm ``vllm/model_executor/models/llama_eagle.py`` at 00da923 (``LlamaModel.forward``), whose
  first layer skips ``input_layernorm`` as SafeAILab/EAGLE ``eagle/model/cnets.py``
  (``if self.index != 0``) does, ported with a plain-torch Llama layer.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

from consistency.contract.models import DumpMetadata, ModelInfo
from consistency.dump import names
from consistency.dump.writer import write_dump
from consistency.replay.engine import run_replay
from consistency.replay.steps import run_steps
from tests.conftest import run_cli

V, H, T = 128, 64, 24


def _dsv3_config():  # noqa: ANN202
    from transformers import DeepseekV3Config

    return DeepseekV3Config(vocab_size=V, hidden_size=H, intermediate_size=96, moe_intermediate_size=32,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                            num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1,
                            q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                            num_nextn_predict_layers=1, max_position_embeddings=256, tie_word_embeddings=False)


def _randomize(module: torch.nn.Module, seed: int) -> None:
    """Large enough that every term matters; norm gains around 1, not uniform (a uniform
    shared_head.norm gain would make hnorm(d_raw) == hnorm(d_norm): RMSNorm is scale-free)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            scale, base = (0.3, 1.0) if "norm" in name else (0.15, 0.0)
            p.copy_(torch.randn(p.shape, generator=g) * scale + base)


def _save_mtp_checkpoint(d: Path, seed: int = 1, with_mtp: bool = True):  # noqa: ANN202
    """A tiny DeepSeek-V3 target saved by transformers, plus its MTP layer model.layers.2.*
    (seeded) written into the same safetensors file, as DeepSeek ships it."""
    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV3ForCausalLM

    from consistency.replay.mtp import MTPDraft, _family

    torch.manual_seed(0)
    target = DeepseekV3ForCausalLM(_dsv3_config()).eval()
    target.save_pretrained(d)
    if with_mtp:
        mtp = MTPDraft(target.config, *_family(target), 2)
        _randomize(mtp, seed)
        w = load_file(str(d / "model.safetensors"))
        for k, t in mtp.state_dict().items():
            if not k.startswith("rotary."):
                w["model.layers.2." + k.removeprefix("block.")] = t.contiguous()
        save_file(w, str(d / "model.safetensors"), metadata={"format": "pt"})
    return target


@pytest.fixture(scope="module")
def dsv3(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    d = tmp_path_factory.mktemp("dsv3") / "ckpt"
    target = _save_mtp_checkpoint(d)
    from consistency.replay.mtp import load_mtp

    return d, target, load_mtp(d, target)


# --- parity -------------------------------------------------------------------------------


def _causal(n: int) -> torch.Tensor:
    return torch.full((n, n), torch.finfo(torch.float32).min).triu(1)[None, None]


def vllm_mtp_rows(mtp, hidden: torch.Tensor, ids: torch.Tensor,  # noqa: ANN001, ANN201
                  positions: torch.Tensor, zero_pos0: bool):
    """Port of vllm deepseek_mtp.py (03356f8) DeepSeekMultiTokenPredictorLayer.forward over a
    whole sequence (no cache: every row recomputed), then compute_logits; returns (d_raw,
    d_norm = shared_head(hidden), logits)."""
    inputs_embeds = mtp.embed_tokens(ids).clone()
    if zero_pos0:
        inputs_embeds[positions == 0] = 0  # "masking inputs at position 0, as not needed by MTP"
    inputs_embeds = mtp.enorm(inputs_embeds)
    previous_hidden_states = mtp.hnorm(hidden)
    hidden_states = mtp.eh_proj(torch.cat([inputs_embeds, previous_hidden_states], dim=-1))
    pos = positions[None]
    x = hidden_states[None]
    # mtp_block: DeepseekV2DecoderLayer returns (hidden, residual); `residual + hidden_states` is the layer output
    out = mtp.block(x, attention_mask=_causal(len(ids)), position_ids=pos, position_embeddings=mtp.rotary(x, pos))[0]
    normed = mtp.shared_head.norm(out)  # SharedHead.forward; SGLang returns this (recycled)
    return out, normed, mtp.shared_head.head(normed)


def growing_sequence(row_fn, hidden: torch.Tensor, ids: torch.Tensor,  # noqa: ANN001, ANN201
                     r: int, steps: int, recycle: str):
    """Anchor r's chain as a runtime runs it: the extend rows 0..r (h[j], x[j+1], position j),
    then per step k one row (recycled state, x[r+1+k], position r+k), the whole sequence
    recomputed causally each step (what a KV cache computes)."""
    hs, toks, pos = list(hidden[:r + 1]), list(ids[1:r + 2]), list(range(r + 1))
    outs = []
    for k in range(steps):
        o_raw, o_norm, logits = row_fn(torch.stack(hs), torch.stack(toks), torch.tensor(pos))
        outs.append((o_raw[-1], None if o_norm is None else o_norm[-1], logits[-1]))
        hs.append(o_norm[-1] if recycle == "d_norm" else o_raw[-1])
        toks.append(ids[r + 2 + k])
        pos.append(r + 1 + k)
    return outs


@pytest.mark.parametrize("recycle,zero", [("d_norm", False), ("d_raw", True)])
def test_mtp_chain_equals_vllm_port_on_a_growing_sequence(dsv3, recycle: str, zero: bool) -> None:
    """Our chain (every anchor at once, KV-cache mask) equals the vLLM/SGLang forward run
    anchor by anchor on a growing sequence, on a DeepSeek-V3 MTP block (MLA + MoE)."""
    from consistency.contract.models import Pos0

    _d, target, lo = dsv3
    mtp = lo.model
    mtp.pos0 = Pos0.zeroed if zero else Pos0.kept
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, V, (14,), generator=g)
    with torch.no_grad():
        hidden = target(ids[None], output_hidden_states=True).hidden_states[-1][0]
        out = run_steps(mtp, hidden, ids, 3, recycle, attention="chain")
        for r in (0, 4, 9):
            ref = growing_sequence(lambda h, x, p: vllm_mtp_rows(mtp, h, x, p, zero), hidden, ids, r, 3, recycle)
            for k, (o_raw, o_norm, logits) in enumerate(ref):
                torch.testing.assert_close(out.tensors[f"draft_out.{k}"][r], o_raw, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(out.tensors[f"draft_norm.{k}"][r], o_norm, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(out.logits[k][r], logits, rtol=1e-5, atol=1e-5)
    mtp.pos0 = Pos0.kept
    assert zero or not torch.equal(out.tensors["draft_embed.0"][0], torch.zeros(H))
    if zero:
        assert torch.equal(out.tensors["draft_embed.0"][0], torch.zeros(H))


def test_mtp_tensor_names_rows_and_recycle(dsv3) -> None:
    """Step k holds T-1-k rows under the design's names; recycle.k is what step k read."""
    _d, target, lo = dsv3
    ids = torch.randint(0, V, (12,), generator=torch.Generator().manual_seed(4))
    hidden = torch.randn(12, H, generator=torch.Generator().manual_seed(5))
    for rec in ("d_norm", "d_raw", "target"):
        out = run_steps(lo.model, hidden, ids, 3, rec)
        for k in range(3):
            assert out.tensors[f"draft_ids.{k}"].tolist() == ids[1 + k:].tolist()
            assert out.tensors[f"draft_cat.{k}"].shape == (11 - k, 2 * H)
        want = {"d_norm": out.tensors["draft_norm.0"][:10], "d_raw": out.tensors["draft_out.0"][:10],
                "target": hidden[1:11]}[rec]
        assert torch.equal(out.tensors["recycle.1"], want)
    # concat order: [embed, hidden] as DeepSeek; the halves are the normed embedding and hidden
    e, h = lo.model.enorm(out.tensors["draft_embed.0"]), lo.model.hnorm(hidden[:11])
    torch.testing.assert_close(out.tensors["draft_cat.0"], torch.cat([e, h], -1))


def test_mtp_spec_sets_concat_order_and_pos0(dsv3) -> None:
    """A contract's ConsumerSpec decides the concat order (MiMo: [hidden, embed]) and the
    position-0 rule (vLLM zeroes the embedding there)."""
    from consistency.contract.models import ConcatOrder, Consumer, ConsumerSpec, Pos0
    from consistency.replay.mtp import load_mtp

    d, target, lo = dsv3
    spec = ConsumerSpec(kind=Consumer.mtp, concat_order=ConcatOrder.hidden_embed, pos0_embed=Pos0.zeroed)
    mimo = load_mtp(d, target, spec=spec)
    ids = torch.randint(0, V, (9,), generator=torch.Generator().manual_seed(6))
    hidden = torch.randn(9, H, generator=torch.Generator().manual_seed(7))
    a = run_steps(lo.model, hidden, ids, 1)
    b = run_steps(mimo.model, hidden, ids, 1)
    torch.testing.assert_close(b.tensors["draft_cat.0"][1:, :H], a.tensors["draft_cat.0"][1:, H:])
    torch.testing.assert_close(b.tensors["draft_cat.0"][1:, H:], a.tensors["draft_cat.0"][1:, :H])
    assert torch.equal(b.tensors["draft_embed.0"][0], torch.zeros(H))
    assert torch.equal(b.tensors["draft_embed.0"][1:], a.tensors["draft_embed.0"][1:])
    assert not torch.allclose(b.tensors["draft_out.0"], a.tensors["draft_out.0"])  # eh_proj sees another input


def test_mtp_parity_with_speculators_mtp_draft_model(tmp_path: Path) -> None:
    """speculators 0.9.0 MTPDraftModel (Qwen3) and our module on its weights, loaded from a
    speculators-layout checkpoint: per-step hidden outputs (d_norm) and logits agree."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    pytest.importorskip("speculators")
    from safetensors.torch import save_file
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.mtp import MTPDraftModel, MTPSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from consistency.replay.mtp import load_mtp

    qc = dict(vocab_size=V, hidden_size=H, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)
    torch.manual_seed(0)
    verifier = Qwen3ForCausalLM(Qwen3Config(**qc)).eval()
    vdir = tmp_path / "verifier"
    verifier.save_pretrained(vdir)
    tl = Qwen3Config(**qc)
    tl._attn_implementation = "eager"
    steps = 3
    cfg = MTPSpeculatorConfig(transformer_layer_config=tl, speculators_config=SpeculatorsConfig(
        algorithm="mtp", default_proposal_method="greedy",
        proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=steps)],
        verifier=VerifierConfig.from_pretrained(str(vdir))))
    ref = MTPDraftModel(cfg).eval()
    _randomize(ref, 7)
    with torch.no_grad():
        ref.embed_tokens.weight.copy_(verifier.get_input_embeddings().weight)
        ref.lm_head.weight.copy_(verifier.get_output_embeddings().weight)
    ddir = tmp_path / "mtp"
    ddir.mkdir()
    keep = {k: v.contiguous() for k, v in ref.state_dict().items() if k.startswith("mtp_layers.")}
    save_file(keep, str(ddir / "model.safetensors"))
    (ddir / "config.json").write_text(json.dumps({"speculators_model_type": "mtp", "num_nextn_predict_layers": 1}))
    lo = load_mtp(ddir, verifier)
    assert lo.layout == "speculators" and lo.sources == {"embed_tokens": "target", "lm_head": "target"}
    g = torch.Generator().manual_seed(8)
    ids = torch.randint(0, V, (1, 16), generator=g)
    hidden = torch.randn(1, 16, H, generator=g)
    captured: list[torch.Tensor] = []
    hook = ref.mtp_layers[0].register_forward_hook(lambda _m, _i, o: captured.append(o.detach()))
    with torch.no_grad():
        logits, _loss, _ = ref(input_ids=ids, hidden_states=hidden)
    hook.remove()
    ours = run_steps(lo.model, hidden[0], ids[0], steps, "d_norm", attention="causal", rope_offset=False)
    valid = 16 - steps - 1  # speculators keeps the same rows at every step
    assert len(captured) == steps
    for k in range(steps):
        torch.testing.assert_close(ours.tensors[f"draft_norm.{k}"][:valid], captured[k][0], rtol=1e-6, atol=2e-6)
        torch.testing.assert_close(ours.logits[k][:valid], logits[k][0], rtol=1e-5, atol=1e-5)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


class _CnetsLayer(torch.nn.Module):
    """Plain-torch port of SafeAILab cnets.py LlamaDecoderLayer (v1): rotate-half RoPE,
    softmax in fp32, SiLU MLP; layer 0 skips input_layernorm (`if self.index != 0`)."""

    def __init__(self, hf_layer, index: int, heads: int, kv: int, hd: int, theta: float) -> None:  # noqa: ANN001
        super().__init__()
        self.l, self.index, self.heads, self.kv, self.hd, self.theta = hf_layer, index, heads, kv, hd, theta

    def rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        inv = 1.0 / (self.theta ** (torch.arange(0, self.hd, 2).float() / self.hd))
        f = pos.float()[:, None] * inv[None]
        emb = torch.cat([f, f], -1)
        cos, sin = emb.cos(), emb.sin()
        rot = torch.cat([-x[..., self.hd // 2:], x[..., :self.hd // 2]], -1)
        return x * cos + rot * sin

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        a, n = self.l.self_attn, len(x)
        residual = x
        if self.index != 0:
            x = self.l.input_layernorm(x)
        q = a.q_proj(x).view(n, self.heads, self.hd).transpose(0, 1)
        k = a.k_proj(x).view(n, self.kv, self.hd).transpose(0, 1)
        v = a.v_proj(x).view(n, self.kv, self.hd).transpose(0, 1)
        q, k = self.rope(q, pos), self.rope(k, pos)
        rep = self.heads // self.kv
        k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
        w = q @ k.transpose(1, 2) / math.sqrt(self.hd) + _causal(n)[0]
        o = (torch.softmax(w.float(), -1) @ v).transpose(0, 1).reshape(n, -1)
        x = residual + a.o_proj(o)
        m = self.l.mlp
        return x + m.down_proj(torch.nn.functional.silu(m.gate_proj(self.l.post_attention_layernorm(x))) *
                               m.up_proj(self.l.post_attention_layernorm(x)))


def _eagle1_checkpoint(d: Path, target, layers: int = 2, hass: bool = False, seed: int = 11) -> None:  # noqa: ANN001
    from safetensors.torch import save_file

    from consistency.replay.eagle1 import Eagle1Draft, layer_config

    tc = target.config
    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": tc.hidden_size, "intermediate_size": 96,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": tc.hidden_size // 4, "rms_norm_eps": 1e-6,
           "rope_theta": 10000.0, "vocab_size": tc.vocab_size, "num_hidden_layers": layers,
           "max_position_embeddings": 512}
    if hass:
        cfg["add_para_norm"] = True
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(cfg))
    m = Eagle1Draft(layer_config(cfg, d / "config.json"), layers, fc_bias=True, para_norm=hass)
    _randomize(m, seed)
    w = {k: v.contiguous() for k, v in m.state_dict().items()
         if not k.startswith(("rotary.", "lm_head.", "embed_tokens."))}
    w["layers.0.input_layernorm.weight"] = torch.full((tc.hidden_size,), 7.0)  # cnets v1 keeps it; unused
    save_file(w, str(d / "model.safetensors"))


@pytest.mark.parametrize("hass", [False, True])
def test_eagle1_chain_equals_cnets_port(tmp_path: Path, hass: bool) -> None:
    """EAGLE-1 (and HASS): fc(cat(emb, h)) [+ para norms], layer 0 without input_layernorm,
    no final norm, d_raw recycled and read by the target's lm_head: equal to the port run as
    a growing sequence, and the unused layer-0 input_layernorm is ignored with a note."""
    from consistency.replay.eagle1 import load_eagle1
    from consistency.replay.multistep import detect_method
    from tests.conftest import tiny

    target = tiny("tiny-llama")
    d = tmp_path / "eagle1"
    _eagle1_checkpoint(d, target, hass=hass)
    assert detect_method(d) == "eagle1"
    lo = load_eagle1(d, target)
    assert lo.sources == {"embed_tokens": "target", "lm_head": "target"}
    assert any("layers.0.input_layernorm.weight" in n for n in lo.notes)
    m = lo.model
    hd = m.config.hidden_size // 4
    port = [_CnetsLayer(layer, i, 4, 2, hd, 10000.0) for i, layer in enumerate(m.layers)]

    def rows(h: torch.Tensor, x: torch.Tensor, p: torch.Tensor):  # noqa: ANN202
        """vllm llama_eagle.py (00da923) LlamaModel.forward."""
        input_embeds = m.embed_tokens(x)
        if hass:
            input_embeds, h = m.embedding_layernorm(input_embeds), m.hidden_states_layernorm(h)
        z = m.fc(torch.cat((input_embeds, h), dim=-1))
        for layer in port:
            z = layer(z, p)
        return z, None, m.lm_head(z)  # no final norm: the head reads d_raw

    ids = torch.randint(0, target.config.vocab_size, (13,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        hidden = target(ids[None], output_hidden_states=True).hidden_states[-1][0]
        out = run_steps(m, hidden, ids, 3, lo.spec.recycle, attention="chain")
        assert "draft_norm.0" not in out.tensors
        for r in (0, 5, 8):
            for k, (o_raw, _n, logits) in enumerate(growing_sequence(rows, hidden, ids, r, 3, "d_raw")):
                # the port computes RoPE angles its own way (cnets' cache): rounding, relative 1e-6
                assert _rel(out.tensors[f"draft_out.{k}"][r], o_raw) < 1e-5
                assert _rel(out.logits[k][r], logits) < 1e-5


# --- replay: the recycle bug's cost, by construction ----------------------------------------


def self_consistent_text(mtp, t: int, seed: int = 9) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
    """Text and target states on which the d_norm chain is exact: h[r+1] := d_norm.0[r] and
    x[r+2] := argmax of step 0 at row r, built row by row (row r sees rows <= r only). Then
    chain step k of anchor r reads exactly what step 0 reads at row r+k (same hidden, token,
    position and keys), so a d_norm draft accepts every step, and the text is its greedy text."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(t, dtype=torch.long)
    ids[:2] = torch.randint(0, V, (2,), generator=g)
    hidden = torch.zeros(t, H)
    hidden[0] = torch.randn(H, generator=g)
    with torch.no_grad():
        for r in range(t - 1):
            out = run_steps(mtp, hidden[:r + 2], ids[:r + 2], 1, attention="chain")
            hidden[r + 1] = out.tensors["draft_norm.0"][r]
            if r + 2 < t:
                ids[r + 2] = int(out.logits[0][r].argmax())
    return ids, hidden


def _dump(path: Path, ids: torch.Tensor, hidden: torch.Tensor, side: str, extra: dict | None = None,
          last: int = 0) -> Path:
    """``last``: the target's next token after the final one (the text's continuation)."""
    logits = torch.zeros(len(ids), V)
    logits[torch.arange(len(ids)), torch.cat([ids[1:], torch.tensor([last])])] = 10.0  # greedy text: next = recorded
    meta = DumpMetadata(side=side, model=ModelInfo(architecture="DeepseekV3ForCausalLM", num_layers=2, hidden_size=H,
                                                   vocab_size=V))
    tensors = {names.INPUT_IDS: ids.numpy(), names.aux(0): hidden.numpy(), names.LOGITS: logits.numpy()}
    tensors.update({k: v.numpy() for k, v in (extra or {}).items()})
    return write_dump(path, tensors, meta)


def _recorded(mtp, ids: torch.Tensor, hidden: torch.Tensor, recycle: str, steps: int = 3) -> dict:  # noqa: ANN001
    out = run_steps(mtp, hidden, ids, steps, recycle, attention="chain")
    return {k: v for k, v in out.tensors.items() if k.startswith(names.RECYCLE)}


@pytest.fixture(scope="module")
def bug_dumps(dsv3, tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    d, _target, lo = dsv3
    full, hidden = self_consistent_text(lo.model, T + 1)
    ids, hidden, last = full[:T], hidden[:T], int(full[T])
    out = tmp_path_factory.mktemp("bug")
    ref = _dump(out / "train.safetensors", ids, hidden, "training", last=last)
    good = _dump(out / "serve-fixed.safetensors", ids, hidden, "serving", _recorded(lo.model, ids, hidden, "d_norm"),
                 last=last)
    bad = _dump(out / "serve-raw.safetensors", ids, hidden, "serving", _recorded(lo.model, ids, hidden, "d_raw"),
                last=last)
    return d, ref, good, bad, ids, hidden


def test_replay_mtp_d_raw_recycle_loses_acceptance_after_step_one(bug_dumps) -> None:
    d, ref, good, bad, _ids, _hidden = bug_dumps
    rep = run_replay(str(d), None, ref, bad, steps=3)
    r, c = rep.reference, rep.candidate
    assert rep.method == "mtp" and rep.draft.layout == "deepseek" and rep.feed == "own"
    # the reference is the d_norm draft's own greedy text: every step accepted (by construction)
    assert [s.conditional for s in r.per_step] == [1.0, 1.0, 1.0]
    # step 1 reads the same aux.0 and tokens on both sides: exactly the same hits
    assert c.hits == r.hits and rep.drop.lost == 0
    # steps >= 2 read d_raw on the candidate: fewer accepted
    assert c.per_step[1].conditional is not None and c.per_step[1].conditional < 0.9
    assert c.acceptance_rate < r.acceptance_rate and rep.verdict == "fail"
    assert [f.code for f in rep.findings][:1] == ["ACCEPTANCE_DROP"]
    assert (c.recycle_fed or "").startswith("recorded: d_raw") and (r.recycle_fed or "").startswith("d_norm (contract")
    assert any("serve-raw.safetensors recycles d_raw" in n and "RECYCLE_NORM_MISSING" in n for n in rep.notes)


def test_replay_mtp_fixed_serving_matches_training_exactly(bug_dumps) -> None:
    d, ref, good, _bad, _ids, _hidden = bug_dumps
    rep = run_replay(str(d), None, ref, good, steps=3)
    assert rep.verdict == "pass"
    assert [s.accepted for s in rep.candidate.per_step] == [s.accepted for s in rep.reference.per_step]
    assert rep.candidate.acceptance_rate == rep.reference.acceptance_rate == 1.0
    assert rep.candidate.recycle_fed is not None and rep.candidate.recycle_fed.startswith("recorded: d_norm")


def test_replay_mtp_cli_and_json(bug_dumps, tmp_path: Path) -> None:
    d, ref, _good, bad, _ids, _hidden = bug_dumps
    res = run_cli("replay", "--draft", str(d), str(ref), str(bad), "--steps", "3", "--json", str(tmp_path / "r.json"))
    assert res.returncode == 1, res.stderr
    assert res.stdout.startswith("consistency replay") and "FAIL" in res.stdout and "recycle fed" in res.stdout
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["method"] == "mtp" and data["draft"]["consumer"]["recycle"] == "d_norm"
    from consistency.replay.report import ReplayReport

    ReplayReport.model_validate(data)


# --- refusals -----------------------------------------------------------------------------


def _one_line_error(res, *words: str) -> None:  # noqa: ANN001
    assert res.returncode == 2, (res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("consistency: error:"), res.stderr
    for w in words:
        assert w in lines[0], lines[0]


def test_refuses_corrupt_weights_and_missing_mtp_layer(bug_dumps, tmp_path: Path) -> None:
    _d, ref, _good, bad, _ids, _hidden = bug_dumps
    corrupt = tmp_path / "corrupt"
    _save_mtp_checkpoint(corrupt)
    raw = (corrupt / "model.safetensors").read_bytes()
    (corrupt / "model.safetensors").write_bytes(raw[:8] + b"{not json" + raw[17:])
    _one_line_error(run_cli("replay", "--draft", str(corrupt), "--method", "mtp", str(ref), str(bad)),
                    "model.safetensors")
    nomtp = tmp_path / "nomtp"
    _save_mtp_checkpoint(nomtp, with_mtp=False)
    _one_line_error(run_cli("replay", "--draft", str(nomtp), str(ref), str(bad)), "has no MTP layer", "model.layers.2.")
    cfg = json.loads((nomtp / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 0
    (nomtp / "config.json").write_text(json.dumps(cfg))
    _one_line_error(run_cli("replay", "--draft", str(nomtp), "--method", "mtp", str(ref), str(bad)),
                    "num_nextn_predict_layers")


def test_refuses_nan_mtp_weights_and_a_bad_recycle_shape(dsv3, bug_dumps, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    _d, ref, _good, _bad, ids, hidden = bug_dumps
    nan = tmp_path / "nan"
    _save_mtp_checkpoint(nan)
    w = load_file(str(nan / "model.safetensors"))
    w["model.layers.2.eh_proj.weight"][0, 0] = float("nan")
    save_file(w, str(nan / "model.safetensors"), metadata={"format": "pt"})
    _one_line_error(run_cli("replay", "--draft", str(nan), str(ref), str(ref)), "eh_proj.weight", "NaN")
    short = _dump(tmp_path / "short.safetensors", ids, hidden, "serving", {"recycle.1": torch.randn(5, H)})
    _one_line_error(run_cli("replay", "--draft", str(dsv3[0]), str(ref), str(short)), "recycle.1", "rows")


def test_replay_eagle1_end_to_end_and_the_unevaluated_steps_note(tmp_path: Path) -> None:
    """An EAGLE-1 draft replays through the same entry point (method auto). Identical dumps
    give identical numbers; a candidate that records no recycle.k says steps >= 2 were not
    evaluated against the server (never a silent pass on them)."""
    from tests.conftest import prompt_ids, tiny

    target = tiny("tiny-llama")
    d = tmp_path / "eagle1"
    _eagle1_checkpoint(d, target, layers=1)
    ids = torch.from_numpy(prompt_ids(target, 20))
    with torch.no_grad():
        fnorm = target(ids[None], output_hidden_states=True).hidden_states[-1][0]
    meta = DumpMetadata(side="training")
    ref = write_dump(tmp_path / "a.safetensors", {"input_ids": ids.numpy(), "aux.0": fnorm.numpy()}, meta)
    cand = write_dump(tmp_path / "b.safetensors", {"input_ids": ids.numpy(), "aux.0": fnorm.numpy()},
                      DumpMetadata(side="serving"))
    rep = run_replay(str(d), target, ref, cand, steps=3)
    assert rep.method == "eagle1" and rep.draft.layout == "eagle1" and rep.draft.consumer.recycle.value == "d_raw"
    assert [s.accepted for s in rep.candidate.per_step] == [s.accepted for s in rep.reference.per_step]
    assert rep.drop.top1_points == 0 and rep.drop.lost == 0
    assert any("b.safetensors records no recycle.k" in n for n in rep.notes)
    assert rep.candidate.recycle_fed == "d_raw (contract; no recycle.k recorded)"


def test_refuses_a_chain_too_large_for_memory() -> None:
    """A 40,000-token chain of 8 steps needs a 48 GiB mask: one line, not an OOM; 4,096
    tokens x 3 steps with 128 heads (a 0.2 GiB mask, 1.5 GiB of scores per block) run."""
    from types import SimpleNamespace

    from consistency.errors import UsageError
    from consistency.replay.multistep import _check_memory

    big = SimpleNamespace(config=SimpleNamespace(num_attention_heads=128))
    with pytest.raises(UsageError, match="GiB of attention"):
        _check_memory(big, 39999, 8)
    _check_memory(big, 4095, 3)


def test_blocked_attention_equals_one_block(dsv3, monkeypatch: pytest.MonkeyPatch) -> None:
    """Query blocks of 4 rows give what one block of every row gives (the chain's mask rows
    are sliced with their queries)."""
    from consistency.replay import steps

    _d, _target, lo = dsv3
    ids = torch.randint(0, V, (15,), generator=torch.Generator().manual_seed(12))
    hidden = torch.randn(15, H, generator=torch.Generator().manual_seed(13))
    whole = run_steps(lo.model, hidden, ids, 3, attention="chain")
    monkeypatch.setattr(steps, "QUERY_BLOCK", 4)
    blocked = run_steps(lo.model, hidden, ids, 3, attention="chain")
    for name, t in whole.tensors.items():
        torch.testing.assert_close(blocked.tensors[name], t, rtol=1e-5, atol=1e-5)  # rounding only
