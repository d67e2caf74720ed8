"""Builders for lint tests and bench/bench_lint.py: real-format configs and safetensors
checkpoints, optionally *sparse* (a valid header, data regions left as holes), so a test
can lint a multi-GB draft without writing or reading gigabytes.

The tests at the bottom check the builders themselves against the reference
``safetensors`` library, so the other lint tests rest on files that library accepts.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from consistency.dump.dtypes import BY_NAME
from consistency.dump.safetensors_io import serialize_header

ROOT = Path(__file__).resolve().parents[2]
FIX = ROOT / "fixtures" / "configs"

Spec = Any  # np.ndarray (written) or (dtype_name, shape) (a hole)


def write_checkpoint(path: Path, tensors: dict[str, Spec], metadata: dict[str, str] | None = None) -> Path:
    """A safetensors file: arrays are written, (dtype, shape) entries are sparse holes."""
    specs: dict[str, tuple[str, tuple[int, ...], int]] = {}
    arrays: list[np.ndarray | None] = []
    for name, spec in tensors.items():
        if isinstance(spec, np.ndarray):
            dt = "bool" if spec.dtype == np.bool_ else spec.dtype.name
            a = np.ascontiguousarray(spec)
            specs[name] = (dt, tuple(a.shape), a.nbytes)
            arrays.append(a)
        else:
            dt, shape = spec
            specs[name] = (dt, tuple(shape), math.prod(shape) * BY_NAME[dt].bits // 8)
            arrays.append(None)
    head = serialize_header(specs, metadata or {"format": "pt"})
    total = len(head) + sum(s[2] for s in specs.values())
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as fh:
        fh.write(head)
        pos = len(head)
        for (_n, (_dt, _shape, nbytes)), a in zip(specs.items(), arrays):
            if a is not None:
                fh.seek(pos)
                fh.write(a.tobytes())
            pos += nbytes
        fh.truncate(total)
    return path


def vocab_map(vt: int, vd: int) -> tuple[np.ndarray, np.ndarray]:
    """d2t offsets and t2d mask for a draft vocabulary of every other target token."""
    used = np.arange(0, 2 * vd, 2, dtype=np.int64)
    t2d = np.zeros(vt, dtype=np.bool_)
    t2d[used] = True
    return used - np.arange(vd, dtype=np.int64), t2d


def eagle3_tensors(h: int = 256, ht: int = 256, vt: int = 1024, vd: int = 512, slots: int = 3,
                   layout: str = "sglang", dtype: str = "bfloat16", inter: int = 512, heads: int = 4,
                   kv: int = 2) -> dict[str, Spec]:
    """Tensor names and shapes of an EAGLE-3 draft as SpecForge (midlayer.*) or speculators
    (layers.0.*, embed_tokens) save it; weights are holes, d2t/t2d are real."""
    hd = h // heads
    pre = "midlayer." if layout == "sglang" else "layers.0."
    d2t, t2d = vocab_map(vt, vd)
    t: dict[str, Spec] = {"d2t": d2t, "t2d": t2d}
    if layout == "speculators":
        t["embed_tokens.weight"] = (dtype, (vt, h))
    t.update({
        "fc.weight": (dtype, (h, slots * ht)),
        f"{pre}hidden_norm.weight": (dtype, (h,)), f"{pre}input_layernorm.weight": (dtype, (h,)),
        f"{pre}self_attn.q_proj.weight": (dtype, (heads * hd, 2 * h)),
        f"{pre}self_attn.k_proj.weight": (dtype, (kv * hd, 2 * h)),
        f"{pre}self_attn.v_proj.weight": (dtype, (kv * hd, 2 * h)),
        f"{pre}self_attn.o_proj.weight": (dtype, (h, heads * hd)),
        f"{pre}post_attention_layernorm.weight": (dtype, (h,)),
        f"{pre}mlp.gate_proj.weight": (dtype, (inter, h)), f"{pre}mlp.up_proj.weight": (dtype, (inter, h)),
        f"{pre}mlp.down_proj.weight": (dtype, (h, inter)),
        "norm.weight": (dtype, (h,)), "lm_head.weight": (dtype, (vd, h)),
    })
    return t


def sglang_config(h: int = 256, vt: int = 1024, vd: int = 512, ids: list[int] | None = (1, 15, 28),
                  dtype: str = "bfloat16") -> dict[str, Any]:
    """SpecForge/SGLang LlamaForCausalLMEagle3 layout (configs/llama3-8B-eagle3.json + eagle_config)."""
    cfg: dict[str, Any] = json.loads((FIX / "drafts" / "specforge" / "llama3-8B-eagle3.json").read_text())
    cfg.update(hidden_size=h, intermediate_size=2 * h, num_attention_heads=4, num_key_value_heads=2, vocab_size=vt,
               draft_vocab_size=vd, torch_dtype=dtype)
    if ids is not None:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(ids), "use_aux_hidden_state": True}
    return cfg


def speculators_config(h: int = 256, vt: int = 1024, vd: int = 512, ids: list[int] | None = (2, 16, 29),
                       **flags: Any) -> dict[str, Any]:
    """The layout speculators' save_pretrained writes (fixtures/configs/drafts/speculators/...)."""
    path = FIX / "drafts" / "speculators" / "llama3.1-8b-eagle3" / "config.json"
    cfg: dict[str, Any] = json.loads(path.read_text())
    cfg["transformer_layer_config"].update(hidden_size=h, intermediate_size=2 * h, num_attention_heads=4,
                                           num_key_value_heads=2, head_dim=h // 4, vocab_size=vt)
    cfg.update(draft_vocab_size=vd, eagle_aux_hidden_state_layer_ids=list(ids) if ids is not None else None, **flags)
    cfg["dtype"] = "bfloat16"
    return cfg


def llama_target(n: int = 32, h: int = 256, vt: int = 1024, arch: str = "LlamaForCausalLM",
                 **kw: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = json.loads((FIX / "targets" / "llama-3.1-8b-instruct.json").read_text())
    cfg.update(num_hidden_layers=n, hidden_size=h, vocab_size=vt, architectures=[arch], **kw)
    return cfg


@dataclass
class Scenario:
    """Inputs of one lint run, written to files under a temporary directory by :meth:`run`."""

    draft: dict[str, Any] | None = field(default_factory=sglang_config)
    tensors: dict[str, Spec] | None = field(default_factory=eagle3_tensors)
    target: dict[str, Any] | None = field(default_factory=llama_target)
    serve: str | None = ("python -m sglang.launch_server --model-path meta-llama/Llama-3.1-8B-Instruct "
                         "--speculative-algorithm EAGLE3 --speculative-draft-model-path {draft} "
                         "--speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4 "
                         "--dtype bfloat16")
    runtime: str | None = "sglang@0.5.23"
    trained_with: str | None = "specforge:1,15,28"
    select: tuple[str, ...] = ()

    def copy(self, **kw: Any) -> Scenario:
        s = copy.deepcopy(self)
        for k, v in kw.items():
            setattr(s, k, v)
        return s

    def write(self, tmp: Path) -> dict[str, str | None]:
        d = tmp / "draft"
        d.mkdir(parents=True, exist_ok=True)
        if self.draft is not None:
            (d / "config.json").write_text(json.dumps(self.draft, indent=2))
        if self.tensors is not None:
            write_checkpoint(d / "model.safetensors", self.tensors)
        tgt = None
        if self.target is not None:
            tgt = tmp / "target.json"
            tgt.write_text(json.dumps(self.target, indent=2))
        return {"draft": str(d), "target": str(tgt) if tgt else None,
                "serve": self.serve.replace("{draft}", str(d)) if self.serve else None}

    def run(self, tmp: Path):  # noqa: ANN201 - LintReport
        from consistency.lint.engine import LintRequest, run_lint

        p = self.write(tmp)
        return run_lint(LintRequest(draft=p["draft"], target=p["target"], serve=p["serve"], runtime=self.runtime,
                                    trained_with=self.trained_with, select=self.select))


def speculators_vllm() -> Scenario:
    """A speculators draft served by vLLM 0.33 with the right ids: every rule passes."""
    return Scenario(draft=speculators_config(), tensors=eagle3_tensors(layout="speculators"),
                    serve=("vllm serve meta-llama/Llama-3.1-8B-Instruct --dtype bfloat16 --speculative-config "
                           "'{\"method\": \"eagle3\", \"model\": \"{draft}\", \"num_speculative_tokens\": 3}'"),
                    runtime="vllm@0.33.0", trained_with="speculators:2,16,29")


def codes(rep: Any, at_least: str = "warning") -> set[str]:
    sev = {"error": 2, "warning": 1, "info": 0}
    return {f.code for f in rep.findings if sev[f.severity.value] >= sev[at_least]}


def status(rep: Any, code: str) -> str:
    return next(r.status for r in rep.rules if r.code == code)


# -- the builders themselves -------------------------------------------------------------

def test_sparse_checkpoint_is_valid_for_the_reference_library(tmp_path: Path) -> None:
    from safetensors import safe_open

    t = eagle3_tensors(h=1024, ht=1024, vt=4096, vd=2048)
    p = write_checkpoint(tmp_path / "model.safetensors", t)
    with safe_open(str(p), framework="numpy") as f:
        assert set(f.keys()) == set(t)
        assert f.get_slice("fc.weight").get_shape() == [1024, 3072]
        d2t = f.get_tensor("d2t")
    assert np.array_equal(d2t, vocab_map(4096, 2048)[0])
    st = p.stat()
    assert st.st_blocks * 512 < st.st_size  # data regions are holes: nothing was written there


def test_config_builders_match_the_committed_real_format_fixtures() -> None:
    spec = speculators_config()
    assert spec["speculators_config"]["verifier"]["architectures"] == ["LlamaForCausalLM"]
    assert spec["eagle_aux_hidden_state_layer_ids"] == [2, 16, 29]
    assert sglang_config()["architectures"] == ["LlamaForCausalLMEagle3"]
    assert llama_target(n=61)["num_hidden_layers"] == 61


# A 70B-shaped speculators draft (sparse multi-GB checkpoint): lint must read only headers.
BIG = dict(h=8192, ht=8192, vt=128256, vd=32000, inter=28672, heads=64, kv=8)


def big_draft(tmp: Path) -> tuple[Path, Path]:
    d = tmp / "draft-70b"
    d.mkdir()
    cfg = speculators_config(h=8192, vt=128256, vd=32000, ids=[2, 40, 77])
    cfg["transformer_layer_config"].update(intermediate_size=28672, num_attention_heads=64, num_key_value_heads=8,
                                           head_dim=128)
    (d / "config.json").write_text(json.dumps(cfg))
    write_checkpoint(d / "model.safetensors", eagle3_tensors(layout="speculators", **BIG))
    tgt = tmp / "target.json"
    tgt.write_text(json.dumps(llama_target(n=80, h=8192, vt=128256)))
    return d, tgt
