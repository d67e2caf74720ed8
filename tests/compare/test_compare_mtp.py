"""compare on drafts beyond EAGLE-3 (issue 19): an MTP draft's step-0 state and its per-step tensors.

The target is a tiny DeepSeek-V3 (3 layers, hidden 64, seeded, built in memory) recorded with
``consistency.record.hf.capture_streams`` (hidden.0..3, final_norm). The draft is a minimal
DeepSeek-V3-style MTP module built here (enorm, hnorm, eh_proj over cat(embed, hidden), an MLP
block, shared_head.norm), run for K steps; each fault is applied *in the construction* (the
serving side computes the wrong thing), and the expected code and tensor follow from it.
Both dump formats (safetensors, npz) are written with the project's writer.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from consistency.contract import consumers  # noqa: E402
from consistency.contract.models import DumpMetadata, TensorMeta  # noqa: E402
from consistency.pipeline.compare import compare as run  # noqa: E402
from consistency.dump import names  # noqa: E402
from consistency.dump.writer import write_dump  # noqa: E402
from consistency.record.hf import capture_streams  # noqa: E402
from consistency.record.recorder import model_info  # noqa: E402

H, N, T, K = 64, 3, 40, 3
FORMATS = ("safetensors", "npz")


def _target():  # noqa: ANN202
    torch.manual_seed(0)
    cfg = transformers.DeepseekV3Config(
        vocab_size=256, hidden_size=H, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=N,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        first_k_dense_replace=N, max_position_embeddings=128, num_nextn_predict_layers=1)
    m = transformers.DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():
        m.model.norm.weight.uniform_(0.5, 1.5)  # a learned-looking final norm weight, not all ones
    return m


class _RMS(torch.nn.Module):
    def __init__(self, g: torch.Generator) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.empty(H).uniform_(0.5, 1.5, generator=g))

    def forward(self, x):  # noqa: ANN001, ANN201
        return self.w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class _MTP(torch.nn.Module):
    """DeepSeek-V3 MTP shape (conventions-beyond-eagle3.md 2.1): eh_proj(cat(enorm(emb), hnorm(h)))
    -> a block -> shared_head.norm. The block is an MLP (no attention): rows stay independent."""

    def __init__(self, emb: torch.nn.Module) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(7)
        self.emb, self.enorm, self.hnorm, self.bnorm, self.head_norm = emb, _RMS(g), _RMS(g), _RMS(g), _RMS(g)
        self.eh, self.up, self.down = torch.nn.Linear(2 * H, H), torch.nn.Linear(H, 2 * H), torch.nn.Linear(2 * H, H)
        with torch.no_grad():
            for lin in (self.eh, self.up, self.down):
                lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) / lin.weight.shape[1] ** 0.5)
                lin.bias.zero_()


def draft_steps(emb, ids: np.ndarray, h0, *, recycle: str = "d_norm", swap: bool = False, zero_pos0: bool = False,
                shift: int = 1, dtype=None) -> dict:  # noqa: ANN001
    """K steps of the draft; step k row r pairs hidden row r with token r+shift+k (T-1-k rows)."""
    dtype = dtype or torch.float32
    mtp = _MTP(emb).to(dtype)
    out, prev = {}, {}
    ids_t = torch.as_tensor(ids)
    with torch.no_grad():
        for k in range(K):
            n = T - 1 - k
            tok = ids_t[shift + k: shift + k + n]
            src = {"d_norm": prev.get("draft_norm"), "d_raw": prev.get("draft_out"), "target": h0}[recycle]
            h = (h0 if k == 0 else src)[:n].to(dtype)
            e = mtp.emb(tok).to(dtype).clone()
            if zero_pos0:
                e[0] = 0  # vLLM DeepSeek MTP: inputs_embeds[positions == 0] = 0
            parts = (mtp.enorm(e), mtp.hnorm(h))
            cat = torch.cat(parts[::-1] if swap else parts, -1)
            x = mtp.eh(cat)
            raw = x + mtp.down(torch.nn.functional.silu(mtp.up(mtp.bnorm(x))))
            step = {"draft_ids": tok, "draft_embed": e, "draft_cat": cat, "draft_out": raw,
                    "draft_norm": mtp.head_norm(raw)}
            if k >= 1:
                step["recycle"] = h
            out.update({names.draft(kind, k): v for kind, v in step.items()})
            prev = step
    return out


def _np(t):  # noqa: ANN001, ANN202
    if t.dtype == torch.bfloat16:
        return (t.contiguous().view(torch.int16).numpy().view(np.uint16), "bfloat16")
    return t.numpy()


@pytest.fixture(scope="module")
def world():  # noqa: ANN201
    m = _target()
    ids = np.random.default_rng(1).integers(0, 256, size=T).astype("int64")
    s, _ = capture_streams(m, torch.as_tensor(ids)[None], components=False)
    s = {k: v[0] for k, v in s.items()}
    return {"model": m, "ids": ids, "streams": s, "F": s[names.FINAL_NORM], "HN": s[names.hidden(N)],
            "emb": m.model.embed_tokens}


def _ref(w: dict, path: Path, *, step0=None, aux: bool = True, consumer=None, final_norm: bool = True,
         **kw) -> str:  # noqa: ANN001
    """The training side: every stream, final_norm, input_ids, aux.0 (what training fed) and each step."""
    h0 = w["F"] if step0 is None else step0
    t = {k: _np(v) for k, v in w["streams"].items() if final_norm or k != names.FINAL_NORM}
    t["input_ids"] = w["ids"]
    if aux:
        t[names.aux(0)] = _np(h0)
    t.update({k: _np(v) for k, v in draft_steps(w["emb"], w["ids"], h0, **kw).items()})
    meta = DumpMetadata(side="training", model=model_info(w["model"].config))
    if consumer is not None:
        meta.extra["consumer"] = consumer
    if aux and step0 is None:
        meta.tensors[names.aux(0)] = TensorMeta(norm="final_norm")
    return str(write_dump(path, t, meta, force=True))


def _cand(w: dict, path: Path, *, step0=None, drop: tuple[str, ...] = (), only: tuple[str, ...] | None = None,
          dtype=None, **kw) -> str:  # noqa: ANN001
    """The serving side: aux.0 (what the draft is fed at step 0) and the per-step tensors."""
    h0 = (w["F"] if step0 is None else step0)
    if dtype is not None:
        h0 = h0.to(dtype)
    t = {"input_ids": w["ids"], names.aux(0): _np(h0)}
    t.update({k: _np(v) for k, v in draft_steps(w["emb"], w["ids"], h0, dtype=dtype, **kw).items()})
    t = {k: v for k, v in t.items() if k not in drop and (only is None or k in only or k == "input_ids")}
    return str(write_dump(path, t, DumpMetadata(side="serving"), force=True))


def _contract(w: dict, path: Path, method: str = "mtp", runtime: str = "sglang") -> str:
    info = model_info(w["model"].config)
    row = consumers.lookup(method, runtime, None, "deepseek_v3")
    c = consumers.contract_for(method, info, row, steps=K)
    path.write_text(c.model_dump_json(exclude_none=True))
    return str(path)


def _errors(rep) -> list:  # noqa: ANN001
    return [f for f in rep.findings if f.severity.value == "error"]


def _no_unexplained(rep) -> None:  # noqa: ANN001
    assert not [f for f in _errors(rep) if f.code in ("UNKNOWN", "MISMATCH", "BAD_TOKENS")], \
        [(f.code, f.tensor) for f in rep.findings]


@pytest.mark.parametrize("fmt", FORMATS)
def test_benign_layouts_pass(world, tmp_path: Path, fmt: str) -> None:
    ref = _ref(world, tmp_path / f"ref.{fmt}")
    full = _cand(world, tmp_path / f"full.{fmt}")
    thin = _cand(world, tmp_path / f"thin.{fmt}", only=(names.aux(0), "draft_ids.0", "draft_ids.1", "draft_ids.2",
                                                         "recycle.1", "recycle.2"))
    con = _contract(world, tmp_path / "mtp.json")
    for cand in (full, thin):
        for c in (None, con):
            rep = run(ref, cand, contract=c)
            assert rep.verdict == "pass", (cand, c, rep.summary, [(f.code, f.tensor) for f in _errors(rep)])
    rep = run(ref, full, contract=con)
    aux0 = next(f for f in rep.findings if f.tensor == names.aux(0))
    assert aux0.code == "OK" and aux0.expected == names.FINAL_NORM  # the contract's slot is fnorm(s=N)
    assert {f.tensor for f in rep.findings if f.code == "OK"} >= {names.recycle(1), names.recycle(2), "draft_cat.2"}


FAULTS = {  # construction -> (code, first tensor it fires on, every tensor the construction makes it fire on)
    "pre-norm step 0": (dict(step0="HN"), "NORM_MISSING", names.aux(0), {names.aux(0)}),
    "d_raw recycle": (dict(recycle="d_raw"), "RECYCLE_NORM_MISSING", "recycle.1", {"recycle.1", "recycle.2"}),
    "target recycle": (dict(recycle="target"), "RECYCLE_TARGET", "recycle.1", {"recycle.1", "recycle.2"}),
    "swapped concat": (dict(swap=True), "CONCAT_ORDER", "draft_cat.0", {"draft_cat.0"}),
    "zeroed pos-0 embedding": (dict(zero_pos0=True), "POS0_EMBED", "draft_embed.0",
                               {"draft_embed.0", "draft_embed.1", "draft_embed.2"}),
    "unshifted ids": (dict(shift=0), "TOKEN_SHIFT", "draft_ids.0", {"draft_ids.0", "draft_ids.1", "draft_ids.2"}),
}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("fault", list(FAULTS))
def test_fault_fires_its_code_on_its_tensor(world, tmp_path: Path, fault: str, fmt: str) -> None:
    kw, code, first, where = FAULTS[fault]
    kw = dict(kw)
    if kw.get("step0") == "HN":
        kw["step0"] = world["HN"]
    ref = _ref(world, tmp_path / f"ref.{fmt}")
    cand = _cand(world, tmp_path / f"cand.{fmt}", **kw)
    rep = run(ref, cand)
    assert rep.verdict == "fail"
    assert (rep.findings[0].code, rep.findings[0].tensor) == (code, first), [(f.code, f.tensor) for f in rep.findings]
    assert {f.tensor for f in rep.findings if f.code == code} == where
    _no_unexplained(rep)  # every other difference is PROPAGATED from the root
    later = [f for f in rep.findings if f.code == "PROPAGATED"]
    assert later and all(f.evidence["root"] == first for f in later)


def test_reverse_faults(world, tmp_path: Path) -> None:
    """The other direction of each pair: the reference does it, the candidate does not."""
    cand = _cand(world, tmp_path / "cand.safetensors")
    ref = _ref(world, tmp_path / "draw.safetensors", recycle="d_raw")  # an EAGLE-1-style reference recycles d_raw
    rep = run(ref, cand)
    assert (rep.findings[0].code, rep.findings[0].tensor) == ("RECYCLE_NORM_APPLIED", "recycle.1")
    ref = _ref(world, tmp_path / "zero.safetensors", zero_pos0=True)
    rep = run(ref, cand)
    f = rep.findings[0]
    assert (f.code, f.tensor) == ("POS0_EMBED", "draft_embed.0") and f.evidence["zeroed_by"] == "reference"
    assert "training zeroes" in f.message and "vllm-deepseek-mtp" in f.message
    ref = _ref(world, tmp_path / "target.safetensors", recycle="target")  # non-chain reference, chain candidate
    assert run(ref, cand).findings[0].code == "RECYCLE_TARGET"


def test_step0_norm_under_a_contract(world, tmp_path: Path) -> None:
    con = _contract(world, tmp_path / "mtp.json")
    ref = _ref(world, tmp_path / "ref.safetensors")
    rep = run(ref, _cand(world, tmp_path / "pre.safetensors", step0=world["HN"]), contract=con)
    f = rep.findings[0]
    assert (f.code, f.tensor, f.expected) == ("NORM_MISSING", names.aux(0), names.FINAL_NORM)
    assert "serving fed stream 3 before the final norm" in f.message and "every runtime serves fnorm(s=N)" in f.message
    assert "speculators-mtp trains on stream N before the final norm" in f.message
    # training fed pre-norm (speculators' layer-N capture) and serving is right by the contract: still a failure
    pre_ref = _ref(world, tmp_path / "pre_ref.safetensors", step0=world["HN"])
    rep = run(pre_ref, _cand(world, tmp_path / "post.safetensors"), contract=con)
    assert rep.verdict == "fail"
    top = rep.findings[0]  # the reference's values outrank the contract: the conflict leads, naming both
    assert top.code == "CONTRACT_CONFLICT" and top.tensor is None and "aux.0" in top.message
    assert "fnorm(s=3)" in top.message and "stream 3" in top.message
    aux0 = next(f for f in rep.findings if f.tensor == names.aux(0))
    assert aux0.code == "NORM_APPLIED" and "training fed stream 3 before the final norm" in aux0.message
    _no_unexplained(rep)  # the draft's later tensors follow from what it was fed at step 0
    assert {f.evidence["root"] for f in rep.findings if f.code == "PROPAGATED"} == {"aux.0"}
    # the reference does not record final_norm: the slot is not verified, never OK
    bare = _ref(world, tmp_path / "bare.safetensors", aux=False, final_norm=False)
    rep = run(bare, _cand(world, tmp_path / "c.safetensors"), contract=con)
    aux0 = next(f for f in rep.findings if f.tensor == names.aux(0))
    assert aux0.code == "NOT_VERIFIED" and "fnorm(s=3)" in aux0.message and rep.verdict == "fail"


def test_consumer_from_reference_metadata(world, tmp_path: Path) -> None:
    """No contract: a reference that declares its consumer (metadata.extra["consumer"]) tells
    compare what aux.0 should be, and the story what the runtimes serve."""
    spec = consumers.lookup("mtp", "sglang", None, "deepseek_v3").spec(K).model_dump(mode="json")
    ref = _ref(world, tmp_path / "ref.safetensors", aux=False, consumer=spec)
    rep = run(ref, _cand(world, tmp_path / "pre.safetensors", step0=world["HN"]))
    f = rep.findings[0]
    assert (f.code, f.tensor, f.expected) == ("NORM_MISSING", names.aux(0), names.FINAL_NORM)
    assert "to mtp drafts" in f.message
    # speculators' MTP training fed the pre-norm stream: serving's post-norm state is NORM_APPLIED
    pre_ref = _ref(world, tmp_path / "pre_ref.safetensors", step0=world["HN"], consumer="mtp")
    rep = run(pre_ref, _cand(world, tmp_path / "post.safetensors"))
    f = next(f for f in rep.findings if f.tensor == names.aux(0))
    assert f.code == "NORM_APPLIED" and "training fed stream 3 before the final norm" in f.message
    assert "speculators-mtp" in f.message


def test_bf16_candidate_against_fp32_reference_passes(world, tmp_path: Path) -> None:
    ref = _ref(world, tmp_path / "ref.safetensors")
    cand = _cand(world, tmp_path / "bf16.safetensors", dtype=torch.bfloat16)
    rep = run(ref, cand)
    assert rep.verdict == "pass", [(f.code, f.tensor, f.message[:120]) for f in _errors(rep)]
    assert any(f.code == "OK" and f.tensor == "recycle.2" for f in rep.findings)


def test_absent_recycle_is_missing_never_ok(world, tmp_path: Path) -> None:
    ref = _ref(world, tmp_path / "ref.npz")
    for drop in (("recycle.2",), ("recycle.1", "recycle.2")):
        rep = run(ref, _cand(world, tmp_path / "cand.npz", drop=drop))
        assert rep.verdict == "fail"
        assert {f.expected for f in rep.findings if f.code == "MISSING"} >= set(drop)
        assert not [f for f in rep.findings if f.tensor in drop and f.code == "OK"]


def test_eagle1_contract_and_an_untrusted_consumer(world, tmp_path: Path) -> None:
    """An EAGLE-1 contract (post-norm step 0, d_raw recycled) judges a d_norm recycle by its own
    consumer when the reference has no recycle.k; a consumer entry that does not validate is ignored."""
    con = _contract(world, tmp_path / "eagle1.json", method="eagle1", runtime="vllm")
    ref = _ref(world, tmp_path / "ref.safetensors", recycle="d_raw")
    rep = run(ref, _cand(world, tmp_path / "cand.safetensors"), contract=con)
    f = rep.findings[0]
    # the reference's own recycle (its values: d_raw) outranks the contract's word (eagle1: d_raw); they agree
    assert (f.code, f.tensor) == ("RECYCLE_NORM_APPLIED", "recycle.1") and "(d_raw)" in f.message
    bad = _ref(world, tmp_path / "bad.safetensors", aux=False, consumer={"kind": "mtp", "recycle": "\x1b[31mnope"})
    rep = run(bad, _cand(world, tmp_path / "pre.safetensors", step0=world["HN"]))
    aux0 = next(f for f in rep.findings if f.tensor == names.aux(0))
    assert aux0.code != "OK" and aux0.expected is None and rep.verdict == "fail"  # identified as today
