"""The EAGLE-3 draft forward: parity with speculators, both checkpoint layouts, the chain's
attention against a step-by-step KV-cache run, the d2t offset rule, and loader errors."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

from consistency.errors import InputError
from consistency.replay.chain import run_chain
from consistency.replay.draft import Eagle3Draft
from consistency.replay.load import TargetParts, load_draft
from consistency.replay.train import new_config, save_sglang, save_speculators
from tests.conftest import ROOT, tiny

VT, VD, T = 128, 48, 14


def _random_draft(target, layers: int = 1, seed: int = 0, **flags: bool) -> Eagle3Draft:
    torch.manual_seed(seed)
    cfg = new_config(target, VD, 96, **flags)
    cfg.layer_config["num_hidden_layers"] = layers
    d = Eagle3Draft(cfg, 3, target.config.hidden_size, layers, target.config.vocab_size, VD)
    with torch.no_grad():
        for name, p in d.named_parameters():  # large enough that every term matters
            p.copy_(torch.randn_like(p) * (0.3 if "norm" in name else 0.15) + (1.0 if "norm" in name else 0.0))
        ids = torch.randperm(target.config.vocab_size)[:VD].sort().values
        d.d2t.copy_(ids - torch.arange(VD))
    return d.eval()


@pytest.fixture(scope="module")
def target():
    return tiny("tiny-llama")


@pytest.mark.slow
@pytest.mark.parametrize("layer_type,flags", [
    ("llama", {"norm_before_residual": True}), ("llama", {"norm_before_residual": False}),
    ("llama", {"fc_norm": True, "norm_output": True}), ("llama", {"norm_before_fc": True, "norm_before_residual": True}),
    ("qwen3", {"norm_before_residual": True}),  # Qwen3 layers: q_norm / k_norm per head
    ("qwen3-sliding", {}),  # layer 1 attends a window of 4 (speculators' layer_types)
])
def test_forward_equals_speculators_eagle3_draft_model(tmp_path: Path, layer_type: str, flags: dict) -> None:
    """Same weights, same inputs: our logits equal speculators' Eagle3DraftModel at every TTT step."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    pytest.importorskip("speculators")
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    h = 64
    vdir = tmp_path / "verifier"
    LlamaForCausalLM(LlamaConfig(vocab_size=VT, hidden_size=h, intermediate_size=128, num_hidden_layers=4,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                 tie_word_embeddings=False)).save_pretrained(vdir)
    from transformers import Qwen3Config

    cls = Qwen3Config if layer_type.startswith("qwen3") else LlamaConfig
    extra = {"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 4,
             "use_sliding_window": True} if layer_type.endswith("sliding") else {}
    tl = cls(vocab_size=VT, hidden_size=h, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-6, **extra)
    tl._attn_implementation = "eager"
    cfg = Eagle3SpeculatorConfig(
        transformer_layer_config=tl, draft_vocab_size=VD, eagle_aux_hidden_state_layer_ids=[1, 2, 3],
        speculators_config=SpeculatorsConfig(algorithm="eagle3", default_proposal_method="greedy",
                                             proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
                                             verifier=VerifierConfig.from_pretrained(str(vdir))), **flags)
    ref = Eagle3DraftModel(cfg).eval()
    keep = torch.randperm(VT)[:VD].sort().values
    t2d = torch.zeros(VT, dtype=torch.bool)
    t2d[keep] = True
    ref.load_vocab_mappings(t2d, keep - torch.arange(VD))
    ref.load_verifier_weights()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
            else:
                p.mul_(5.0 if p.requires_grad else 20.0)  # default init is tiny: make every term matter
    out = tmp_path / "draft"
    ref.save_pretrained(out)
    hs, ids = torch.randn(1, T, 3 * h), torch.randint(0, VT, (1, T))
    logits = []
    hook = ref.lm_head.register_forward_hook(lambda _m, _i, o: logits.append(o.detach()))
    with torch.no_grad():
        tokens = ref(hidden_states=hs, input_ids=ids, document_ids=torch.zeros(1, T, dtype=torch.long), ttt_steps=3)
    hook.remove()

    mine = load_draft(out)
    assert mine.config.layout == "speculators" and len(mine.model.layers) == 2
    assert (mine.model.layers[0].self_attn.q_norm is not None) == layer_type.startswith("qwen3")
    assert mine.model.windows == ({1: 4} if layer_type.endswith("sliding") else {})
    teacher = torch.stack([torch.cat([ids[0, 1 + k:], ids.new_zeros(1 + k)]) for k in range(3)], -1)
    with torch.no_grad():
        got = run_chain(mine.model, hs[0], ids[0], 3, feed="teacher", teacher=teacher, keep_logits=True)
    for k in range(3):
        scale = logits[k].abs().max()
        assert scale > 1.0
        torch.testing.assert_close(got.logits[k][0], logits[k][0], rtol=1e-4, atol=1e-4 * float(scale))
        assert torch.equal(got.logits[k][0].argmax(-1), tokens[k][0])
        # our proposals are target ids: i + d2t[i]
        assert torch.equal(got.tokens[k, 0], tokens[k][0] + ref.d2t[tokens[k][0]])


def test_sglang_layout_equals_speculators_layout(tmp_path: Path, target) -> None:
    """midlayer.* names, no embed_tokens (borrowed from the target), LlamaForCausalLMEagle3 config."""
    d = _random_draft(target)
    with torch.no_grad():
        d.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
    save_speculators(d, tmp_path / "spec", [0, 3, 7], "tiny-llama")
    save_sglang(d, tmp_path / "sgl", [-1, 2, 6])
    names = set(json.loads((tmp_path / "sgl" / "config.json").read_text()))
    assert "eagle_config" in names
    parts = TargetParts.from_model(target)
    a, b = load_draft(tmp_path / "spec", parts), load_draft(tmp_path / "sgl", parts)
    assert a.sources["embed_tokens"] == "draft" and b.sources["embed_tokens"] == "target"
    assert b.config.layout == "sglang" and b.config.aux_ids_meaning == "layer output"
    aux, ids = torch.randn(T, 192), torch.randint(0, VT, (T,))
    with torch.no_grad():
        x, y = run_chain(a.model, aux, ids, 3, keep_logits=True), run_chain(b.model, aux, ids, 3, keep_logits=True)
    for k in range(3):
        torch.testing.assert_close(x.logits[k], y.logits[k], rtol=0, atol=0)
    with pytest.raises(InputError, match="no embed_tokens"):
        load_draft(tmp_path / "sgl")


def test_lm_head_borrowed_from_target_through_d2t(tmp_path: Path, target) -> None:
    from safetensors.torch import load_file, save_file

    d = _random_draft(target)
    save_sglang(d, tmp_path / "sgl", [-1, 2, 6])
    w = load_file(str(tmp_path / "sgl" / "model.safetensors"))
    del w["lm_head.weight"]
    save_file(w, str(tmp_path / "sgl" / "model.safetensors"))
    got = load_draft(tmp_path / "sgl", TargetParts.from_model(target))
    assert got.sources["lm_head"] == "target"
    rows = torch.arange(VD) + d.d2t  # target id = i + d2t[i]
    torch.testing.assert_close(got.model.lm_head.weight, target.get_output_embeddings().weight[rows])


def _sequential_chain(d: Eagle3Draft, aux: torch.Tensor, ids: torch.Tensor, anchor: int, steps: int) -> list[int]:
    """What a runtime does for one anchor: extend rows 0..anchor, then one chained row per step
    appended to a plain causal sequence (a KV cache), fed its own proposal and hidden state."""
    import torch.nn.functional as F

    def causal(_layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        g = q.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), is_causal=True)

    hidden = d.combine(aux[None, : anchor + 1])
    tokens = ids[None, 1: anchor + 2]
    positions = 1 + torch.arange(anchor + 1)
    out = []
    for _ in range(steps):
        logits, h = d.step(hidden, tokens, positions, causal)
        prop = d.to_target(logits[:, -1].argmax(-1))
        out.append(int(prop))
        hidden = torch.cat([hidden, h[:, -1:]], 1)  # the draft's own hidden state, never fc again
        tokens = torch.cat([tokens, prop[:, None]], 1)
        positions = torch.cat([positions, positions[-1:] + 1])
    return out


@pytest.mark.parametrize("flags", [{}, {"norm_output": True, "norm_before_residual": True}])
def test_chain_attention_equals_a_kv_cache_run(target, flags: dict) -> None:
    d = _random_draft(target, layers=2, **flags)
    aux, ids = torch.randn(T, 192), torch.randint(0, VT, (T + 1,))
    with torch.no_grad():
        batched = run_chain(d, aux, ids[1:], 4).tokens[:, 0]
        for anchor in (0, 5, T - 1):
            assert batched[:, anchor].tolist() == _sequential_chain(d, aux, ids, anchor, 4)


def test_d2t_must_hold_offsets(tmp_path: Path, target) -> None:
    from safetensors.torch import load_file, save_file

    d = _random_draft(target)
    save_speculators(d, tmp_path / "d", [0, 3, 7], "t")
    w = load_file(str(tmp_path / "d" / "model.safetensors"))
    w["d2t"] = torch.arange(VD) + w["d2t"]  # absolute ids: verl-SpeCo PR #67's double count
    save_file(w, str(tmp_path / "d" / "model.safetensors"))
    with pytest.raises(InputError, match="offsets"):
        load_draft(tmp_path / "d")
    del w["d2t"]
    save_file(w, str(tmp_path / "d" / "model.safetensors"))
    got = load_draft(tmp_path / "d")
    assert got.sources["d2t"] == "identity" and any("PR #2447" in n for n in got.notes)


def test_renames_and_loader_errors(tmp_path: Path, target) -> None:
    from safetensors.torch import load_file, save_file

    d = _random_draft(target, fc_norm=True)
    save_speculators(d, tmp_path / "d", [0, 3, 7], "t")
    w = load_file(str(tmp_path / "d" / "model.safetensors"))
    legacy = {("model." + k if k.startswith("layers") else k): v for k, v in w.items()}
    for i, old in enumerate(("aux_norm_low", "aux_norm_mid", "aux_norm_high")):
        legacy[f"{old}.weight"] = legacy.pop(f"fc_norm.{i}.weight")
    legacy["draft_id_to_target_id"] = legacy.pop("d2t")
    legacy["verifier_lm_head.weight"] = torch.zeros(VD, 64)
    save_file(legacy, str(tmp_path / "d" / "model.safetensors"))
    again = load_draft(tmp_path / "d")
    torch.testing.assert_close(again.model.fc_norm[2].weight, d.fc_norm[2].weight)
    torch.testing.assert_close(again.model.d2t, d.d2t)

    bad = dict(w)
    bad["fc.weight"] = torch.full_like(w["fc.weight"], math.nan)
    save_file(bad, str(tmp_path / "d" / "model.safetensors"))
    with pytest.raises(InputError, match="NaN"):
        load_draft(tmp_path / "d")
    bad["fc.weight"] = torch.zeros(64, 100)
    save_file(bad, str(tmp_path / "d" / "model.safetensors"))
    with pytest.raises(InputError, match="not a multiple"):
        load_draft(tmp_path / "d")
    (tmp_path / "d" / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(InputError, match="safetensors"):
        load_draft(tmp_path / "d")
    (tmp_path / "d" / "config.json").unlink()
    with pytest.raises(InputError, match="config.json"):
        load_draft(tmp_path / "d")


def test_rope_parameters_come_from_the_draft_config(target) -> None:
    """SGLang-style flat configs spell RoPE as rope_theta + rope_scaling; both reach the rotary."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from consistency.replay.config import parse

    base = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 64, "num_attention_heads": 4,
            "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 512, "max_position_embeddings": 4096}
    scaled = dict(base, rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    plain = Eagle3Draft(parse(Path("c.json"), base), 3, 64, 1, 512, VD).rotary.impl.inv_freq
    got = Eagle3Draft(parse(Path("c.json"), scaled), 3, 64, 1, 512, VD).rotary.impl.inv_freq
    want = LlamaRotaryEmbedding(LlamaConfig(**{k: v for k, v in scaled.items() if k != "architectures"}, head_dim=16)).inv_freq
    torch.testing.assert_close(got, want)
    assert not torch.allclose(got, plain)


@pytest.mark.parametrize("edit,msg", [
    ({"hidden_size": "64"}, "hidden_size"), ({"head_dim": 0}, "head_dim"), ({"rms_norm_eps": "tiny"}, "rms_norm_eps"),
    ({"intermediate_size": 10**9}, "gate_proj"), ({"num_key_value_heads": 3}, "multiple"),
])
def test_hostile_draft_configs_are_input_errors(tmp_path: Path, edit: dict, msg: str) -> None:
    import shutil

    committed = ROOT / "fixtures" / "draft" / "drift-eagle3"
    shutil.copytree(committed, tmp_path / "d")
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    cfg["transformer_layer_config"].update(edit)
    (tmp_path / "d" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InputError, match=msg):
        load_draft(tmp_path / "d")
    cfg = json.loads((committed / "config.json").read_text())
    cfg.update({"fc_norm": True, "norm_before_fc": True})
    (tmp_path / "d" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InputError, match="mutually exclusive"):
        load_draft(tmp_path / "d")
