"""TransformerLens and nnsight caches, recorded as dumps, compare clean against our recorder.

Real objects: TransformerLens 4.3 ``TransformerBridge.run_with_cache`` and nnsight 0.8
``tracer.cache()`` on a tiny HF Llama (both optional: the tests that need them skip when
the package is missing; the name mapping is tested without them).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from consistency.pipeline.compare import compare as run_compare
from consistency.dump.reader import open_dump
from consistency.interop import from_nnsight_cache, record_activation_cache, record_nnsight_cache, tl_names
from consistency.interop.transformerlens import NOTE_NORMALIZED, from_activation_cache
from consistency.record.api import record_reference
from consistency.record.hf import capture_streams
from tests.conftest import prompt_ids, tiny

N = 12


def _tl_keys(n: int, final_out: bool = True) -> list[str]:
    """The hook names TransformerLens caches for an n-block model (as run_with_cache lists them)."""
    keys = ["hook_embed"]
    for k in range(n):
        keys += [f"blocks.{k}.hook_resid_pre", f"blocks.{k}.ln1.hook_normalized", f"blocks.{k}.attn.hook_z",
                 f"blocks.{k}.hook_attn_out", f"blocks.{k}.hook_resid_mid", f"blocks.{k}.hook_mlp_out",
                 f"blocks.{k}.hook_resid_post"]
    keys += ["ln_final.hook_scale", "ln_final.hook_normalized"] + (["ln_final.hook_out"] if final_out else [])
    return keys


def test_tl_names_map_onto_streams_and_deltas():
    m = tl_names(_tl_keys(3))
    assert m["blocks.0.hook_resid_pre"] == "hidden.0" and m["blocks.2.hook_resid_post"] == "hidden.3"
    assert "blocks.1.hook_resid_post" not in m  # hidden.2 comes from blocks.2.hook_resid_pre (same values)
    assert m["blocks.1.hook_attn_out"] == "attn_out.1" and m["blocks.1.hook_mlp_out"] == "mlp_out.1"
    assert m["blocks.1.hook_resid_mid"] == "resid_mid.1" and m["ln_final.hook_out"] == "final_norm"
    assert "ln_final.hook_normalized" not in m and "hook_embed" not in m
    assert len(set(m.values())) == len(m)
    legacy = tl_names(_tl_keys(3, final_out=False))  # HookedTransformer 3.x: no hook_out
    assert legacy["ln_final.hook_normalized"] == "final_norm"
    cache = {k: torch.zeros(1, 4, 8) for k in _tl_keys(3, final_out=False)}
    named, notes = from_activation_cache(cache)
    assert notes == [NOTE_NORMALIZED] and set(named) >= {"hidden.0", "hidden.3", "final_norm"}


def _model_with_a_real_norm_weight():  # noqa: ANN202
    m = tiny("tiny-llama")
    with torch.no_grad():  # a final norm weight != 1 tells hook_out from hook_normalized
        m.model.norm.weight.copy_(torch.linspace(0.5, 1.5, m.config.hidden_size))
    return m


@pytest.mark.slow
def test_transformerlens_bridge_cache_compares_clean(tmp_path, monkeypatch):
    pytest.importorskip("transformer_lens")
    from tokenizers import Tokenizer, models
    from transformer_lens.model_bridge import TransformerBridge
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    m = _model_with_a_real_norm_weight()
    vocab = {f"t{i}": i for i in range(m.config.vocab_size)}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")),
                                  bos_token="t1", eos_token="t2", unk_token="t0")
    m.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    bridge = TransformerBridge.boot_transformers(str(tmp_path / "m"), hf_model=m, dtype=torch.float32,
                                                 tokenizer=AutoTokenizer.from_pretrained(tmp_path / "m"))
    ids = torch.as_tensor(prompt_ids(m, 24))[None]
    logits, cache = bridge.run_with_cache(ids)
    out = record_activation_cache(cache, tmp_path / "tl.safetensors", input_ids=ids, logits=logits, aux_layers=[2, 6, 9])
    ref = record_reference(m, ids[0].numpy(), tmp_path / "ref.safetensors", [2, 6, 9], logits=True)
    with open_dump(out) as d:
        assert d.metadata.runtime.name == "transformerlens" and d.metadata.aux.stream_ids == [2, 6, 9]
        assert {f"hidden.{s}" for s in range(N + 1)} | {"final_norm", "logits", "resid_mid.3"} <= set(d.tensors)
    rep = run_compare(str(ref), str(out))
    assert rep.verdict == "pass", rep.summary
    ok = {f.tensor for f in rep.findings if f.code == "OK"}
    assert {f"hidden.{s}" for s in range(N + 1)} | {f"mlp_out.{k}" for k in range(N)} | {"final_norm", "logits"} <= ok
    assert {"aux.0", "aux.1", "aux.2"} <= ok


@pytest.mark.slow
def test_nnsight_trace_cache_compares_clean(tmp_path):
    pytest.importorskip("nnsight")
    from nnsight import NNsight

    m = _model_with_a_real_norm_weight()
    ids = torch.as_tensor(prompt_ids(m, 24))[None]
    with NNsight(m).trace(ids) as tracer:
        cache = tracer.cache(include_inputs=True)
    out = record_nnsight_cache(cache, tmp_path / "nn.safetensors", input_ids=ids, aux_layers=[1, 5, 8],
                               convention="specforge")  # output-of-layer ids: streams 2, 6, 9
    ref = record_reference(m, ids[0].numpy(), tmp_path / "ref.safetensors", [2, 6, 9], logits=True)
    rep = run_compare(str(ref), str(out))
    assert rep.verdict == "pass", rep.summary
    ok = {f.tensor for f in rep.findings if f.code == "OK"}
    want = {f"hidden.{s}" for s in range(N + 1)} | {f"attn_out.{k}" for k in range(N)} | {"final_norm", "logits"}
    assert want | {"aux.0", "aux.1", "aux.2"} <= ok


@pytest.mark.slow
def test_nnsight_on_a_fused_residual_model_sums_the_pair(tmp_path):
    """nnsight on vLLM (nnsight issue #630): layers return (hidden_states, residual)."""
    pytest.importorskip("nnsight")
    from nnsight import NNsight

    from tests.record.test_patch_models import InnerModel, engine_args

    model = InnerModel("vllm-llama", False, [])
    ids = torch.as_tensor(prompt_ids(tiny("tiny-llama"), 16))
    with NNsight(model).trace(*engine_args(model, ids)) as tracer:
        cache = tracer.cache(include_inputs=True)
    named, notes = from_nnsight_cache(cache)
    assert any("fused-residual" in n for n in notes)
    streams, _ = capture_streams(tiny("tiny-llama"), ids[None])
    for s in range(N + 1):
        assert np.allclose(named[f"hidden.{s}"].numpy(), streams[f"hidden.{s}"][0].numpy(), atol=1e-5), s
    for k in range(N):  # the first part alone is the MLP delta: what a .clone() would capture
        assert np.allclose(named[f"mlp_out.{k}"].numpy(), streams[f"mlp_out.{k}"][0].numpy(), atol=1e-5), k


def test_nnsight_mapping_of_saved_outputs_without_nnsight():
    """A plain {module path: output} mapping (what .save() collects) maps the same way."""
    m = tiny("tiny-llama")
    ids = torch.as_tensor(prompt_ids(m, 10))[None]
    streams, _ = capture_streams(m, ids)
    saved = {f"model.model.layers.{k}": (streams[f"hidden.{k + 1}"],) for k in range(N)}
    saved["model.model.embed_tokens"] = streams["hidden.0"]
    saved["model.model.norm"] = streams["final_norm"]
    named, notes = from_nnsight_cache(saved)
    assert set(named) == {f"hidden.{s}" for s in range(N + 1)} | {"final_norm"}
    assert any("include_inputs" in n for n in notes)  # hidden.0 came from the embedding module
    with pytest.raises(ValueError, match="numbered"):
        from_nnsight_cache({"model.norm": streams["final_norm"]})
