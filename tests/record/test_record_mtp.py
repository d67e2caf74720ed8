"""Recording an MTP / EAGLE-1 draft: every per-step name lands with the right rows and values.

A tiny DeepSeek-V3 target (transformers, 2 layers, hidden 64, seeded) is recorded by the HF
recorder (``hidden.*``, ``final_norm``); a DeepSeek-style MTP module written here (enorm,
hnorm, eh_proj, one block, shared_head.norm; random norm gains so every norm shows) runs
K steps on it and is recorded through consistency.record.draft. Expected values are
recomputed from the construction (``draft_cat.k[:, :H] == enorm(emb(ids[k+1:]))``), never
read back from what the recorder wrote.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from consistency.contract.models import ConcatOrder, Consumer, ConsumerSpec, NormState, Pos0, Recycle
from consistency.dump.reader import open_dump
from consistency.errors import UsageError
from consistency.record import Recorder
from consistency.record.api import record_reference
from consistency.record.draft import DraftHooks, capture_draft_step, consumer_of, find_layout, input_name, shift_rows

H, T, K, V = 64, 12, 3, 128
SPEC = ConsumerSpec(kind=Consumer.mtp, recycle=Recycle.d_norm, pos0_embed=Pos0.kept, steps=K, source="test")


@lru_cache(maxsize=1)
def target() -> nn.Module:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    cfg = DeepseekV3Config(vocab_size=V, hidden_size=H, intermediate_size=128, moe_intermediate_size=32,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                           num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
                           q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                           max_position_embeddings=64, num_nextn_predict_layers=1,
                           architectures=["DeepseekV3ForCausalLM"])
    return DeepseekV3ForCausalLM(cfg).eval()


def ids() -> torch.Tensor:
    return torch.randint(0, V, (T,), generator=torch.Generator().manual_seed(3))


def rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


class Norm(nn.Module):
    """RMSNorm; ``norm(x, residual)`` is the runtimes' fused add+norm (returns normed, x + residual)."""

    def __init__(self, g: torch.Generator) -> None:
        super().__init__()
        self.weight = nn.Parameter(1 + 0.5 * torch.randn(H, generator=g))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> object:
        if residual is None:
            return rms(x, self.weight)
        s = x + residual
        return rms(s, self.weight), s


class Block(nn.Module):
    """One decoder block, runtime-shaped: returns (its delta, the residual it was handed)."""

    def __init__(self, g: torch.Generator) -> None:
        super().__init__()
        self.norm = Norm(g)
        self.up = nn.Linear(H, 2 * H, bias=False)
        self.down = nn.Linear(2 * H, H, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.down(torch.nn.functional.silu(self.up(self.norm(x)))), x


class MTP(nn.Module):
    """DeepSeek-V3 NextN: eh_proj(cat(enorm(emb), hnorm(h))) -> block -> shared_head.norm."""

    def __init__(self, embed: nn.Embedding, fused: bool = False) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(7)
        torch.manual_seed(7)
        self.embed, self.fused = embed, fused
        self.enorm, self.hnorm = Norm(g), Norm(g)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.block = Block(g)
        self.shared_head = nn.Module()
        self.shared_head.norm = Norm(g)

    def forward(self, hidden: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
        emb = self.embed(tok)
        delta, residual = self.block(self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(hidden)], dim=-1)))
        if self.fused:  # SGLang/vLLM: shared_head.norm(hidden_states, residual)
            return self.shared_head.norm(delta, residual)[0]
        return self.shared_head.norm(delta + residual)


def explicit_loop(mtp: MTP, x: torch.Tensor):  # noqa: ANN201
    """A training loop (speculators' MTP core, shift pairing): step k reads T-1-k rows."""

    def run(rec: Recorder, streams: dict) -> None:
        cur = streams["final_norm"]  # fnorm(s=N): what every runtime hands an MTP draft
        for k in range(K):
            n = shift_rows(T, k)
            hid, tok = cur[:n], x[k + 1:k + 1 + n]
            emb = mtp.embed(tok)
            cat = torch.cat([mtp.enorm(emb), mtp.hnorm(hid)], dim=-1)
            delta, res = mtp.block(mtp.eh_proj(cat))
            d_raw = delta + res
            d_norm = mtp.shared_head.norm(d_raw)
            capture_draft_step(rec, k, hidden_in=hid, ids=tok, embed=emb, cat=cat, out=d_raw, out_norm=d_norm,
                               hidden_norm=NormState.final_norm if k == 0 else None)
            cur = d_norm
        rec.metadata.extra["consumer"] = SPEC.model_dump(mode="json")

    return run


def _read(path: Path) -> tuple[dict[str, np.ndarray], object]:
    with open_dump(path) as d:
        return {n: d[n].read_all() for n in d.tensors}, d.metadata


def _check_steps(t: dict[str, np.ndarray], mtp: MTP, x: torch.Tensor, final_norm: np.ndarray) -> None:
    """Every name of every step, recomputed from the construction."""
    with torch.no_grad():
        for k in range(K):
            n = T - 1 - k
            hid = final_norm[:n] if k == 0 else t[f"draft_norm.{k - 1}"][:n]
            fed = t[input_name(k)]
            assert fed.shape == (n, H), (k, fed.shape)
            assert np.array_equal(fed, hid), k  # aux.0 = fnorm rows 0..T-2; recycle.k = d_norm of step k-1
            tok = x[k + 1:k + 1 + n]
            assert t[f"draft_ids.{k}"].tolist() == tok.tolist()  # row r pairs hidden r with token r+1+k
            emb = mtp.embed(tok)
            assert np.allclose(t[f"draft_embed.{k}"], emb.numpy(), atol=1e-6)
            cat = t[f"draft_cat.{k}"]
            assert cat.shape == (n, 2 * H)
            assert np.allclose(cat[:, :H], rms(emb, mtp.enorm.weight).numpy(), atol=1e-5)
            assert np.allclose(cat[:, H:], rms(torch.as_tensor(hid), mtp.hnorm.weight).numpy(), atol=1e-5)
            x0 = mtp.eh_proj(torch.as_tensor(cat))
            delta, _ = mtp.block(x0)
            assert np.allclose(t[f"draft_out.{k}"], (delta + x0).numpy(), atol=1e-5)  # d_raw = block delta + residual
            assert np.allclose(t[f"draft_norm.{k}"], rms(torch.as_tensor(t[f"draft_out.{k}"]),
                                                         mtp.shared_head.norm.weight).numpy(), atol=1e-5)
        assert not any(name.endswith(f".{K}") for name in t if name.startswith(("draft", "recycle")))


@pytest.mark.parametrize("suffix", [".safetensors", ".npz"])
def test_reference_dump_holds_target_streams_and_every_draft_step(suffix, tmp_path):
    model, x = target(), ids()
    mtp = MTP(model.get_input_embeddings())
    with torch.no_grad():
        p = record_reference(model, x, tmp_path / f"ref{suffix}", components=False, draft=explicit_loop(mtp, x))
    t, meta = _read(p)
    assert {"hidden.0", "hidden.1", "hidden.2", "final_norm", "input_ids"} <= set(t)
    with torch.no_grad():
        want = model(x[None], output_hidden_states=True).hidden_states[-1][0].numpy()
    assert np.allclose(t["final_norm"], want, atol=1e-5)  # the HF recorder's post-norm last state
    _check_steps(t, mtp, x, t["final_norm"])
    assert "recycle.0" not in t and "aux.1" not in t
    assert consumer_of(meta) == SPEC  # DumpMetadata.extra["consumer"], read back through the model
    assert meta.tensors["aux.0"].norm == NormState.final_norm
    assert meta.tensors["draft_out.1"].norm == NormState.none and meta.tensors["draft_norm.1"].norm == NormState.other
    assert meta.tensors["recycle.1"].norm is None  # what a step >= 1 was fed is never claimed


def test_hooks_on_a_fused_residual_draft_record_what_the_explicit_calls_record(tmp_path):
    """The runtimes' ``shared_head.norm(hidden_states, residual)``: draft_out is the sum."""
    model, x = target(), ids()
    plain, fused = MTP(model.get_input_embeddings()), MTP(model.get_input_embeddings(), fused=True)
    with torch.no_grad():
        a = record_reference(model, x, tmp_path / "a.safetensors", components=False, draft=explicit_loop(plain, x))
        fn = torch.as_tensor(_read(a)[0]["final_norm"])

        with Recorder(tmp_path / "b.safetensors") as rec:
            hooks = DraftHooks(fused, rec, hidden_norm=NormState.final_norm, consumer=SPEC)
            assert hooks.layout.family == "deepseek"
            cur = fn
            for k in range(K):
                n = shift_rows(T, k)
                with hooks.step(k, ids=x[k + 1:k + 1 + n]):
                    cur = fused(cur[:n], x[k + 1:k + 1 + n])
            hooks.remove()
    ta, tb = _read(a)[0], _read(tmp_path / "b.safetensors")[0]
    draft_names = {n for n in ta if n.startswith(("draft", "recycle", "aux"))}
    assert draft_names == set(tb), draft_names ^ set(tb)
    for name in draft_names:
        assert ta[name].shape == tb[name].shape and np.allclose(ta[name], tb[name], atol=1e-5), name
    _check_steps(tb, fused, x, fn.numpy())


def test_hooks_number_steps_by_themselves_and_trim_rows(tmp_path):
    """Without ``hooks.step``: each forward is the next step; ``reset`` starts a new chain."""
    model, x = target(), ids()
    mtp = MTP(model.get_input_embeddings())
    h = torch.randn(T, H, generator=torch.Generator().manual_seed(5))
    with torch.no_grad(), Recorder(tmp_path / "c.npz") as rec:
        hooks = DraftHooks(mtp, rec)
        out = mtp(h[:T - 1], x[1:])
        mtp(out[:T - 2], x[2:])
        hooks.reset()
        mtp(h[:T - 1], x[1:])  # a second chain: aux.0#2
        with hooks.step(1, ids=x[2:], rows=shift_rows(T, 1)):
            mtp(out, torch.cat([x[2:], x[:1]]))  # a runtime's full-length pass, trimmed to T-2 rows
    t, _ = _read(tmp_path / "c.npz")
    assert {"aux.0", "aux.0#2", "recycle.1", "recycle.1#2", "draft_cat.1#2", "draft_ids.1"} <= set(t)
    assert np.array_equal(t["recycle.1"], out[:T - 2].numpy()) and t["recycle.1#2"].shape == (T - 2, H)
    assert np.allclose(t["draft_norm.0"], out.numpy()) and "draft_ids.0" not in t


def test_eagle1_layout_splits_the_concat_into_its_inputs(tmp_path):
    """EAGLE-1 (cnets.py ``fc(cat(emb, h))``, no norms): embed and hidden are the concat's halves,
    draft_out is what the module returns (it has no final norm)."""

    class Eagle1(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(11)
            self.embed = nn.Embedding(V, H)
            self.fc = nn.Linear(2 * H, H)
            self.block = Block(torch.Generator().manual_seed(12))

        def forward(self, hidden: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
            delta, res = self.block(self.fc(torch.cat([self.embed(tok), hidden], dim=-1)))
            return delta + res

    d, x = Eagle1(), ids()
    assert find_layout(d).family == "eagle1"
    h = torch.randn(T - 1, H, generator=torch.Generator().manual_seed(13))
    with torch.no_grad(), Recorder(tmp_path / "e.safetensors") as rec:
        DraftHooks(d, rec, hidden_norm="final_norm")
        out = d(h, x[1:])
        d(out[:T - 2], x[2:])
    t, meta = _read(tmp_path / "e.safetensors")
    assert np.array_equal(t["aux.0"], h.numpy()) and meta.tensors["aux.0"].norm == NormState.final_norm
    assert np.allclose(t["draft_embed.0"], d.embed(x[1:]).detach().numpy())
    assert np.allclose(t["draft_out.0"], out.numpy()) and "draft_norm.0" not in t
    assert np.allclose(t["recycle.1"], out[:T - 2].numpy())  # EAGLE-1 recycles d_raw


def test_mimo_concat_order_is_hidden_first():
    class MiMo(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            g = torch.Generator().manual_seed(1)
            self.token_layernorm, self.hidden_layernorm, self.final_layernorm = Norm(g), Norm(g), Norm(g)
            self.input_proj = nn.Linear(2 * H, H)

    lay = find_layout(MiMo())
    assert lay.family == "mimo" and lay.order == ConcatOrder.hidden_embed
    with pytest.raises(UsageError, match="no draft layout"):
        find_layout(nn.Linear(2, 2))


def test_misaligned_or_negative_steps_are_refused(tmp_path):
    rec = Recorder(tmp_path / "x.safetensors")
    with pytest.raises(UsageError, match="draft_cat.1: 3 rows, but step 1 should have 10"):
        capture_draft_step(rec, 1, cat=torch.zeros(3, 2 * H), rows=shift_rows(T, 1))
    with pytest.raises(UsageError, match="negative"):
        capture_draft_step(rec, -1, hidden_in=torch.zeros(2, H))
    assert capture_draft_step(rec, 2, hidden_in=torch.zeros(1, 9, H)) == ["recycle.2"]
    assert rec.tensors["recycle.2"][0].shape == (9, H)  # the batch dim of one sequence is dropped
