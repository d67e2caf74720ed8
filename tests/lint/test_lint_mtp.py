"""Lint rules for MTP, EAGLE-1/2 and Medusa drafts (issue 19): each rule fires on the field
bug it encodes, stays silent on the correct setup, and says "not evaluated" without its input.

Configs are real: targets from ``transformers`` config classes (``DeepseekV3Config`` and a
Kimi-K2 variant with ``num_nextn_predict_layers: 0``), the MTP draft from the installed
speculators package (``MTPSpeculatorConfig.save_pretrained``), EAGLE-1 drafts as SGLang's
``LlamaForCausalLMEagle`` layout and SafeAILab's checkpoint layout (fc [h, 2h]).
``FAIL``/``PASS`` are also run by tests/lint/test_lint_rules.py with every other rule.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import cli, run_cli
from tests.lint.test_lint_support import Scenario, codes, eagle3_tensors, status

MIMO, QWEN36, PP2 = "XiaomiMiMo/MiMo-7B-RL", "Qwen/Qwen3.6-27B", "--pipeline-parallel-size 2"
SG_NEXTN = ("python -m sglang.launch_server --model-path deepseek-ai/DeepSeek-V3 --tp 8 --speculative-algorithm NEXTN "
            "--speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4")


def vllm(method: str, k: int, model: str = "deepseek-ai/DeepSeek-V3", extra: str = "", draft: bool = False) -> str:
    spec = {"method": method, "num_speculative_tokens": k, **({"model": "{draft}"} if draft else {})}
    return f"vllm serve {model} {extra} --speculative-config '{json.dumps(spec)}'".replace("  ", " ")


def deepseek_target(nextn: int | None = 1, model_type: str | None = None) -> dict[str, Any]:
    from transformers import DeepseekV3Config

    cfg = DeepseekV3Config(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, vocab_size=256).to_dict()
    cfg["architectures"] = ["DeepseekV3ForCausalLM"]
    if nextn is None:
        cfg.pop("num_nextn_predict_layers")
    else:
        cfg["num_nextn_predict_layers"] = nextn
    if model_type:
        cfg["model_type"] = model_type
    return cfg


def kimi_target() -> dict[str, Any]:
    """Kimi-K2's config as published: DeepSeek-V3 architecture, no MTP layers."""
    return deepseek_target(0, "kimi_k2")


def qwen35_target() -> dict[str, Any]:
    """Qwen3.5/3.6 keep the MTP layer count as ``mtp_num_hidden_layers`` in ``text_config``."""
    return {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
            "text_config": {"model_type": "qwen3_5_moe_text", "num_hidden_layers": 4, "hidden_size": 64,
                            "vocab_size": 256, "mtp_num_hidden_layers": 1}}


def mimo_target() -> dict[str, Any]:
    from transformers import Qwen2Config

    cfg = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256).to_dict()
    cfg.update(architectures=["MiMoForCausalLM"], model_type="mimo", num_nextn_predict_layers=1)
    return cfg


@lru_cache(maxsize=1)
def _speculators_mtp_json() -> str:
    """What speculators 0.9.0 writes for an MTP draft of Qwen3-Next (built in memory, no download)."""
    import tempfile

    from speculators import SpeculatorsConfig, VerifierConfig
    from speculators.models.mtp import MTPSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import Qwen3Config

    tc = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=256)
    sc = SpeculatorsConfig(algorithm="mtp", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
                           default_proposal_method="greedy",
                           verifier=VerifierConfig(name_or_path="Qwen/Qwen3-Next-80B-A3B-Instruct",
                                                   architectures=["Qwen3NextForCausalLM"]))
    with tempfile.TemporaryDirectory() as d:
        MTPSpeculatorConfig(transformer_layer_config=tc, speculators_config=sc).save_pretrained(d)
        return (Path(d) / "config.json").read_text()


def speculators_mtp() -> dict[str, Any]:
    return json.loads(_speculators_mtp_json())


def mtp_tensors(h: int = 64) -> dict[str, Any]:
    """speculators' MTP layer names (model_definitions.py: input_proj, hidden/token_layernorm)."""
    t = {f"mtp_layers.0.{n}.weight": ("bfloat16", (h,)) for n in ("hidden_layernorm", "token_layernorm",
                                                                   "final_layernorm", "input_layernorm")}
    t["mtp_layers.0.input_proj.weight"] = ("bfloat16", (h, 2 * h))
    return t


def eagle1_config(arch: str | None = "LlamaForCausalLMEagle") -> dict[str, Any]:
    cfg = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
           "num_key_value_heads": 2, "num_hidden_layers": 1, "vocab_size": 1024, "torch_dtype": "bfloat16"}
    if arch:
        cfg["architectures"] = [arch]
    return cfg


def eagle1_tensors(h: int = 256) -> dict[str, Any]:
    """SafeAILab EAGLE-1 (cnets.py) names: fc over cat(embed, hidden), one layer whose attention reads h."""
    return {"fc.weight": ("bfloat16", (h, 2 * h)), "layers.0.self_attn.q_proj.weight": ("bfloat16", (h, h)),
            "layers.0.self_attn.k_proj.weight": ("bfloat16", (h // 2, h)),
            "layers.0.post_attention_layernorm.weight": ("bfloat16", (h,))}


@dataclass
class MTPScenario(Scenario):
    """A Scenario whose draft may be absent (NextN reads the target's own MTP layers)."""

    def run(self, tmp: Path):  # noqa: ANN201 - LintReport
        from consistency.lint.engine import LintRequest, run_lint

        p = self.write(tmp)
        has_draft = self.draft is not None or self.tensors is not None
        return run_lint(LintRequest(draft=p["draft"] if has_draft else None, target=p["target"], serve=p["serve"],
                                    runtime=self.runtime, trained_with=self.trained_with, select=self.select))


def S(**kw: Any) -> MTPScenario:  # noqa: N802 - a constructor
    base: dict[str, Any] = dict(draft=None, tensors=None, target=deepseek_target(), serve=SG_NEXTN,
                                runtime="sglang@0.5.23", trained_with=None)
    base.update(kw)
    return MTPScenario(**base)


def spec_mtp(**kw: Any) -> MTPScenario:
    return S(draft=speculators_mtp(), tensors=mtp_tensors(), target=None, runtime="vllm@0.33.0",
             serve=vllm("mtp", 3, "Qwen/Qwen3-Next-80B-A3B-Instruct", draft=True), **kw)


NEXTN_DRAFT = dict(deepseek_target(), architectures=["DeepseekV3ForCausalLMNextN"])  # an exported NextN head
SG_DRAFT = SG_NEXTN + " --speculative-draft-model-path {draft}"

FAIL: dict[str, Callable[[], Scenario]] = {
    "MTP001": lambda: S(target=kimi_target()),
    "MTP006": lambda: S(draft=NEXTN_DRAFT, serve=SG_DRAFT.replace("NEXTN", "EAGLE3")),
    "MTP002": spec_mtp,
    "MTP003": lambda: S(serve=vllm("mtp", 3), runtime="vllm@0.23.0"),
    "MTP004": lambda: S(target=mimo_target(), serve=vllm("mimo_mtp", 2, MIMO), runtime="vllm@0.33.0"),
    "MTP005": lambda: S(target=qwen35_target(), serve=vllm("qwen3_5_mtp", 2, QWEN36, PP2),
                        runtime="vllm@0.28.0"),
    "EG1001": lambda: Scenario(draft=eagle1_config(), tensors=eagle1_tensors(), trained_with=None),
    "MDS001": lambda: Scenario(draft={"medusa_num_heads": 4, "medusa_num_layers": 1}, tensors=None,
                               trained_with=None, serve=Scenario().serve.replace("EAGLE3", "EAGLE")),
}

PASS: dict[str, Callable[[], Scenario]] = {
    "MTP001": S,
    "MTP006": lambda: S(draft=NEXTN_DRAFT, serve=SG_DRAFT),
    "MTP003": lambda: S(serve=vllm("mtp", 3), runtime="vllm@0.24.0"),
    "MTP004": lambda: S(target=mimo_target(), serve=vllm("mimo_mtp", 1, MIMO), runtime="vllm@0.33.0"),
    "MTP005": lambda: S(target=qwen35_target(), serve=vllm("qwen3_5_mtp", 2, QWEN36), runtime="vllm@0.28.0"),
    "EG1001": lambda: Scenario(draft=eagle1_config(), tensors=eagle1_tensors(), trained_with=None,
                               serve=Scenario().serve.replace("EAGLE3", "EAGLE")),
    "MDS001": lambda: S(draft={"medusa_num_heads": 4, "medusa_num_layers": 1}, target=None, runtime="vllm@0.33.0",
                        serve=vllm("medusa", 4, "lmsys/vicuna-7b-v1.3", draft=True)),
}

# Each rule without the one input it needs: an info "not evaluated", never a pass.
MISSING: dict[str, Callable[[], Scenario]] = {
    "MTP001": lambda: S(target=None),
    "MTP006": lambda: S(draft={"model_type": "llama", "hidden_size": 64}, serve=SG_DRAFT),
    "MTP002": lambda: S(draft={"architectures": ["DeepSeekMTPModel"], "num_nextn_predict_layers": 1}),
    "MTP003": lambda: S(target=None, serve=vllm("mtp", 3), runtime="vllm@0.23.0"),
    "MTP004": lambda: S(target=None, serve=vllm("mtp", 2, MIMO), runtime="vllm@0.33.0"),
    "MTP005": lambda: S(target=None, serve=vllm("mtp", 2, QWEN36, PP2), runtime="vllm@0.28.0"),
    "EG1001": lambda: Scenario(draft={"model_type": "llama", "hidden_size": 256}, tensors=None, trained_with=None),
    "MDS001": lambda: S(serve=None, runtime="sglang@0.5.23"),
}


@pytest.mark.parametrize("code", sorted(FAIL))
def test_rule_fires_on_the_field_bug(code: str, tmp_path: Path) -> None:
    rep = FAIL[code]().run(tmp_path)
    assert code in codes(rep), [(f.code, f.severity.value, f.message) for f in rep.findings]


@pytest.mark.parametrize("code", sorted(PASS))
def test_rule_is_silent_on_the_correct_setup(code: str, tmp_path: Path) -> None:
    rep = PASS[code]().run(tmp_path)
    assert status(rep, code) == "pass", [(f.code, f.message) for f in rep.findings if f.code == code]
    assert code not in codes(rep, "info")


@pytest.mark.parametrize("code", sorted(MISSING))
def test_rule_without_its_input_is_not_evaluated(code: str, tmp_path: Path) -> None:
    rep = MISSING[code]().run(tmp_path)
    assert status(rep, code) == "not_evaluated", [(f.code, f.message) for f in rep.findings if f.code == code]
    f = next(f for f in rep.findings if f.code == code)
    assert f.severity.value == "info" and f.message.startswith("not evaluated: ")


def test_every_new_rule_has_all_three_cases() -> None:
    from consistency.lint.rules import REGISTRY

    new = {c for c in REGISTRY if c.startswith(("MTP", "EG1", "MDS"))}
    assert new == set(FAIL) == set(MISSING) and set(PASS) <= new
    assert new - set(PASS) == {"MTP002"}  # no released MTP trainer feeds the post-norm state: only the n/a pass


# -- detection ------------------------------------------------------------------------------

def test_kimi_nextn_is_an_error_naming_the_key(tmp_path: Path) -> None:
    rep = FAIL["MTP001"]().run(tmp_path)
    f = next(f for f in rep.findings if f.code == "MTP001")
    assert f.severity.value == "error" and "num_nextn_predict_layers = 0" in f.message
    assert f.location is not None and f.location.key == "num_nextn_predict_layers" and f.location.line
    assert rep.verdict == "fail"


def test_absent_mtp_layer_count_is_a_warning(tmp_path: Path) -> None:
    rep = S(target=deepseek_target(None)).run(tmp_path)
    f = next(f for f in rep.findings if f.code == "MTP001")
    assert f.severity.value == "warning" and "absent" in f.message


def test_qwen35_mtp_layers_are_read_from_text_config(tmp_path: Path) -> None:
    t = qwen35_target()
    ok = S(target=t, serve=vllm("qwen3_5_mtp", 2, QWEN36), runtime="vllm@0.33.0").run(tmp_path / "a")
    assert status(ok, "MTP001") == "pass"
    t["text_config"]["mtp_num_hidden_layers"] = 0
    bad = S(target=t, serve=vllm("qwen3_5_mtp", 2, QWEN36), runtime="vllm@0.33.0").run(tmp_path / "b")
    assert "MTP001" in codes(bad, "error")


def test_mtp_setup_makes_eagle3_rules_not_applicable(tmp_path: Path) -> None:
    rep = S().run(tmp_path)
    for code in ("IDS001", "IDS002", "SHP001", "SRV003", "VOC001", "NRM001"):
        assert status(rep, code) == "not_applicable", code
        r = next(r for r in rep.rules if r.code == code)
        assert r.reason and "EAGLE-3 aux-stream rule" in r.reason and "MTP" in r.reason
        assert not [f for f in rep.findings if f.code == code]  # not a pass, not a finding either
    assert rep.verdict == "pass" and status(rep, "MTP001") == "pass"
    assert rep.serving_streams is None and rep.slots == [] and "MTP draft" in rep.summary
    assert any("EAGLE-3 aux-stream rules do not apply" in a for a in rep.assumptions)


def test_speculators_mtp_config_is_detected_and_its_layer_count_read(tmp_path: Path) -> None:
    cfg = speculators_mtp()
    assert cfg["speculators_model_type"] == "mtp" and cfg["num_nextn_predict_layers"] == 1
    rep = spec_mtp().run(tmp_path)
    assert status(rep, "MTP001") == "pass"  # the draft's own num_nextn_predict_layers, not the (absent) target's
    f = next(f for f in rep.findings if f.code == "MTP002")
    assert f.severity.value == "warning" and "before the final norm" in f.message
    assert f.evidence["training"] == "speculators-mtp"
    broken = dict(cfg, num_nextn_predict_layers=0)
    assert "MTP001" in codes(spec_mtp().copy(draft=broken).run(tmp_path / "b"), "error")


def test_recycle_rule_follows_the_consumer_table_boundary(tmp_path: Path) -> None:
    from consistency.contract.consumers import VLLM_45895_VERSION, lookup

    assert VLLM_45895_VERSION == (0, 24, 0)
    assert lookup("mtp", "vllm", (0, 23, 1), "DeepseekV3ForCausalLM").recycle.value == "d_raw"
    one_step = S(serve=vllm("mtp", 1), runtime="vllm@0.23.0").run(tmp_path / "k1")
    assert status(one_step, "MTP003") == "pass"  # no step >= 1, nothing recycled
    glm = S(target=dict(deepseek_target(), architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe"),
            serve=vllm("mtp", 3, "zai-org/GLM-4.6"), runtime="vllm@0.23.0").run(tmp_path / "glm")
    assert "MTP003" in codes(glm)
    unpinned = S(serve=vllm("mtp", 3), runtime=None).run(tmp_path / "unpinned")
    f = next(f for f in unpinned.findings if f.code == "MTP003")
    assert f.severity.value == "warning" and "0.24.0" in f.message
    sglang = S().run(tmp_path / "sglang")  # SGLang deepseek_nextn.py always recycled d_norm
    assert status(sglang, "MTP003") == "pass"


def test_pipeline_rule_is_info_when_the_version_may_contain_the_fix(tmp_path: Path) -> None:
    rep = S(target=qwen35_target(), serve=vllm("qwen3_5_mtp", 2, QWEN36, PP2),
            runtime="vllm@0.30.0").run(tmp_path)
    f = next(f for f in rep.findings if f.code == "MTP005")
    assert f.severity.value == "info" and "not known" in f.message


def test_safeailab_eagle1_checkpoint_is_recognised_without_an_eagle_architecture(tmp_path: Path) -> None:
    rep = Scenario(draft=eagle1_config("LlamaForCausalLM"), tensors=eagle1_tensors(), trained_with=None).run(tmp_path)
    f = next(f for f in rep.findings if f.code == "EG1001")
    assert "SafeAILab" in f.message and "EAGLE3" in f.message
    assert status(rep, "SRV003") == "not_applicable"  # the EAGLE-3 twin rule steps aside
    e3 = Scenario(draft=eagle1_config("LlamaForCausalLM"), tensors=eagle3_tensors(), trained_with=None)
    assert status(e3.run(tmp_path / "e3"), "EG1001") == "pass"  # an EAGLE-3 checkpoint is not mistaken for one


def test_medusa_algorithm_name_on_sglang(tmp_path: Path) -> None:
    rep = S(serve=SG_NEXTN.replace("NEXTN", "MEDUSA")).run(tmp_path)
    assert "MDS001" in codes(rep, "error")


def test_cli_lints_an_mtp_command_line(tmp_path: Path) -> None:
    tgt = tmp_path / "kimi.json"
    tgt.write_text(json.dumps(kimi_target()))
    # a real process for the console-script path; the other lint runs here are in-process
    r = cli("lint", "--target", str(tgt), "--serve", SG_NEXTN, "--runtime", "sglang@0.5.23", "--format", "json")
    assert r.returncode == 1, r.stderr
    rep = json.loads(r.stdout)
    assert rep["verdict"] == "fail" and any(f["code"] == "MTP001" for f in rep["findings"])
    r2 = run_cli("lint", "--target", str(tgt), "--serve", SG_NEXTN, "--select", "MTP", "-q")
    assert r2.returncode == 1 and "FAIL" in r2.stdout


def test_explain_prints_the_rule_page_and_refuses_unknown_codes() -> None:
    r = run_cli("lint", "--explain", "mtp-recycle-prenorm")
    assert r.returncode == 0, r.stderr
    page = (Path(__file__).resolve().parents[2] / "docs" / "rules" / "MTP003.md").read_text(encoding="utf-8")
    assert r.stdout.strip() == page.strip()  # the whole generated page, rendered from the installed rows
    bad = run_cli("lint", "--explain", "MTP999")
    assert bad.returncode == 2 and "no such rule" in bad.stderr


def test_sglang_eagle_without_draft_path_on_deepseek_is_nextn(tmp_path: Path) -> None:
    """server_args.py: NEXTN becomes EAGLE, and DeepseekV3ForCausalLM gets the model path as its draft."""
    eagle = SG_NEXTN.replace("NEXTN", "EAGLE")
    rep = S(target=kimi_target(), serve=eagle).run(tmp_path / "kimi")
    assert "MTP001" in codes(rep, "error") and "NextN" in rep.summary
    llama = dict(deepseek_target(0), architectures=["LlamaForCausalLM"], model_type="llama")
    other = S(target=llama, serve=eagle).run(tmp_path / "llama")  # EAGLE-1 needs a draft: not MTP
    assert status(other, "MTP001") == "pass"


def test_malformed_mtp_layer_count_is_one_line_exit_2(tmp_path: Path) -> None:
    tgt = tmp_path / "target.json"
    tgt.write_text(json.dumps(dict(deepseek_target(), num_nextn_predict_layers="one")))
    r = run_cli("lint", "--target", str(tgt), "--serve", SG_NEXTN)
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert str(tgt) in r.stderr and "num_nextn_predict_layers must be a non-negative integer" in r.stderr
