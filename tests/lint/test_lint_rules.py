"""Every lint rule: a failing case and a passing case on real-format files, and its doc page.

Two baselines pass every rule (each rule evaluated, none skipped for lack of input): a
SpecForge-layout draft served by SGLang 0.5.23 and a speculators draft served by vLLM
0.33. Each failing case changes one thing; each passing case is the baseline, or a
variant that exercises the rule's positive path (e.g. fc_norm on, with its weights).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from consistency.lint.rules import REGISTRY, select
from tests.lint.test_lint_support import (ROOT, Scenario, codes, eagle3_tensors, sglang_config, speculators_config,
                               speculators_vllm, status)

SG = Scenario


def _cfg(**kw: object) -> dict:
    c = sglang_config()
    c.update(kw)
    return c


def _ids(ids: list[int] | None, top: list[int] | None = None, **eagle: object) -> dict:
    c = sglang_config(ids=ids)
    if ids is None and eagle:
        c["eagle_config"] = {}
    c.setdefault("eagle_config", {}).update(eagle) if eagle else None
    if top is not None:
        c["eagle_aux_hidden_state_layer_ids"] = top
    return c


def _t(**changes: object) -> dict:
    t = eagle3_tensors()
    for k, v in changes.items():
        name = k.replace("__", ".")
        if v is None:
            t.pop(name)
        else:
            t[name] = v
    return t


_SERVE = SG().serve or ""
_D2T, _T2D = eagle3_tensors()["d2t"], eagle3_tensors()["t2d"]
_ODD_T2D = np.roll(_T2D, 1)

FAIL: dict[str, Callable[[], Scenario]] = {
    "IDS001": lambda: SG(draft=_ids(None, top=[2, 16, 29])),
    "IDS002": lambda: SG(draft=_ids([2, 16, 29])),
    "IDS003": lambda: SG(draft=_ids([1, 15, 40])),
    "IDS004": lambda: SG(draft=_ids([1, 15, 15, 28])),
    "IDS005": lambda: SG(draft=_ids([28, 1, 15])),
    "IDS006": lambda: SG(draft=_ids([1, 15, 28], top=[5, 6, 7])),
    "IDS007": lambda: SG(draft=_ids([2, 16, 29]), runtime="sglang",
                         target=dict(SG().target, architectures=["DeepseekV3ForCausalLM"])),
    "IDS008": lambda: SG(draft=_ids([2, 16, 29])),
    "IDS009": lambda: SG(draft=_ids([1, 15, 28], use_aux_hidden_state=False)),
    "IDS010": lambda: SG(trained_with="stream:0,3,31"),
    "IDS011": lambda: SG(draft=_ids([2, 16, 29]), trained_with=None,
                         target=dict(SG().target, architectures=["DeepseekV3ForCausalLM"])),
    "SHP001": lambda: SG(tensors=_t(fc__weight=("bfloat16", (256, 1024)))),
    "SHP002": lambda: SG(draft=_cfg(target_hidden_size=512)),
    "SHP003": lambda: SG(draft=_cfg(draft_vocab_size=600)),
    "SHP004": lambda: SG(draft=_cfg(num_aux_hidden_states=4)),
    "VOC001": lambda: SG(tensors=_t(d2t=None)),
    "VOC002": lambda: SG(tensors=_t(d2t=np.zeros(512, np.int64))),
    "VOC003": lambda: SG(tensors=_t(d2t=np.arange(0, 1024, 2, dtype=np.int64))),
    "VOC004": lambda: SG(tensors=_t(t2d=np.ones(1024, np.bool_))),
    "VOC005": lambda: SG(tensors=_t(t2d=_ODD_T2D)),
    "NRM001": lambda: speculators_vllm().copy(draft={k: v for k, v in speculators_vllm().draft.items()
                                                       if k != "norm_before_residual"}),
    "NRM002": lambda: SG(draft=_cfg(norm_before_fc=True), runtime="sglang@0.5.16",
                         tensors=_t(input_norm__weight=("bfloat16", (768,)))),
    "NRM003": lambda: SG(draft=_ids([1, 15, 28], fc_norm=True)),
    "NRM004": lambda: SG(draft=_cfg(norm_output=True, transformers_version="5.8.1")),
    "SRV001": lambda: SG(serve=_SERVE.replace("--speculative-num-steps 3", "--speculative-num-steps 1")
                         .replace("--speculative-num-draft-tokens 4", "--speculative-num-draft-tokens 6")),
    "SRV002": lambda: SG(serve=_SERVE.replace("--speculative-num-steps 3", "")),
    "SRV003": lambda: SG(serve=_SERVE.replace("EAGLE3", "EAGLE")),
    "SRV004": lambda: speculators_vllm().copy(runtime="sglang@0.5.23", serve=_SERVE),
    "SRV005": lambda: SG(draft=_cfg(embed_requires_grad=True)),
    "SRV006": lambda: SG(serve=_SERVE.replace("{draft}", str(ROOT / "fixtures"))),
    "DTY001": lambda: SG(serve=_SERVE.replace("bfloat16", "float16")),
    "SRV007": lambda: SG(serve=_SERVE + " --tp-size 2 --pp-size 4"),
    "SRV008": lambda: SG(serve="CONSISTENCY_RECORD=/data/dumps " + _SERVE + " --tp-size 8 --dp-size 8 "
                         "--enable-dp-attention"),
    "IDS012": lambda: SG(trained_with="stream:2,16"),  # two training streams, three slots
    "IDS013": lambda: SG(runtime=None, serve=None, trained_with="stream:0,3,31"),
    "MTH001": lambda: SG(runtime="vllm@0.33.0", serve="vllm serve meta-llama/Llama-3.1-8B-Instruct "
                         "--speculative-config '{\"method\": \"medusa\", \"model\": \"{draft}\"}'"),
    "MTH002": lambda: SG(draft={}),
}

_FC_NORM = {f"fc_norm.{i}.weight": ("bfloat16", (256,)) for i in range(3)}
PASS: dict[str, Callable[[], Scenario]] = {
    "NRM001": speculators_vllm,
    "NRM002": lambda: SG(draft=_cfg(norm_before_fc=True), tensors=_t(input_norm__weight=("bfloat16", (768,)))),
    "NRM003": lambda: SG(draft=_cfg(fc_norm=True), tensors={**eagle3_tensors(), **_FC_NORM}),
    "SRV004": speculators_vllm,
    "IDS001": lambda: speculators_vllm(),
}

# MTP, EAGLE-1 and Medusa rules (issue 19): their cases live with their other tests.
from tests.lint.test_lint_mtp import FAIL as _MTP_FAIL, PASS as _MTP_PASS  # noqa: E402

FAIL.update(_MTP_FAIL)
PASS.update(_MTP_PASS)


def test_every_rule_has_a_failing_and_a_passing_case() -> None:
    assert set(FAIL) == set(REGISTRY)


@pytest.mark.parametrize("code", sorted(REGISTRY))
def test_rule_fails(code: str, tmp_path: Path) -> None:
    rep = FAIL[code]().run(tmp_path)
    assert code in codes(rep), [(f.code, f.message) for f in rep.findings]
    f = next(f for f in rep.findings if f.code == code)
    assert f.message and f.source == REGISTRY[code].source and f.doc == f"docs/rules/{code}.md"
    assert rep.verdict == ("fail" if any(x.severity.value == "error" for x in rep.findings) else "pass")


@pytest.mark.parametrize("code", sorted(REGISTRY))
def test_rule_passes(code: str, tmp_path: Path) -> None:
    rep = PASS.get(code, Scenario)().run(tmp_path)
    assert status(rep, code) == "pass", [(f.code, f.message) for f in rep.findings if f.code == code]
    assert code not in codes(rep, "info")


@pytest.mark.parametrize("code", sorted(REGISTRY))
def test_rule_doc_page(code: str) -> None:
    rule = REGISTRY[code]
    page = ROOT / "docs" / "rules" / f"{code}.md"
    assert page.is_file(), page
    text = page.read_text()
    from consistency.lint.rules_doc import fragments, render

    assert text == render(rule), f"{page} is stale: run python -m consistency.lint.rules_doc"
    head = text.split("\n## ", 1)[0]
    assert f"Default severity: **{rule.severity.value}**" in head and rule.title[1:] in " ".join(head.split())
    why, _read, example = fragments(code)
    assert why and example, f"{code}: the page explains why and shows an example"
    # the example runs the linter and shows this rule's own finding, not another rule's
    assert "consistency lint" in example and re.search(rf"\b{code}\b", example), code


def test_rule_metadata_is_one_line_and_codes_are_stable() -> None:
    for code, r in REGISTRY.items():
        assert re.fullmatch(r"[A-Z]{2}[A-Z1]\d{3}", code) and code == r.code
        assert "\n" not in r.title and "\n" not in r.fix and r.source


def test_select_and_ignore_work_like_ruff() -> None:
    assert {r.code for r in select(["IDS"])} == {c for c in REGISTRY if c.startswith("IDS")}
    assert "IDS005" not in {r.code for r in select(["IDS"], ["IDS005"])}
    assert [r.code for r in select(["ids-stream-mismatch"])] == ["IDS002"]
    from consistency.errors import UsageError

    with pytest.raises(UsageError, match="unknown rule selector"):
        select(["XYZ"])


def test_missing_inputs_are_reported_as_not_evaluated(tmp_path: Path) -> None:
    rep = Scenario(target=None, serve=None, runtime=None, trained_with=None, tensors=None).run(tmp_path)
    skipped = {r.code for r in rep.rules if r.status == "not_evaluated"}
    assert {"IDS002", "SHP001", "VOC001", "SRV001", "NRM002"} <= skipped
    for code in skipped:
        f = next(f for f in rep.findings if f.code == code)
        assert f.severity.value == "info" and f.message.startswith("not evaluated: ")


@pytest.mark.parametrize("runtime, refused", [("sglang@0.5.23", True), ("sglang@0.5.5", True),
                                              ("vllm@0.21.0", True), ("vllm@0.22.0", False), ("vllm@0.33.0", False)])
def test_a_p_eagle_draft_is_refused_where_no_release_has_it(tmp_path: Path, runtime: str, refused: bool) -> None:
    """speculators writes P-EAGLE drafts as ``speculators_model_type: peagle``. vLLM registers
    PEagleDraftModel from 0.22.0; no SGLang wheel 0.5.5-0.5.23 has P-EAGLE in spec_info.py's
    SpeculativeAlgorithm, nor a PEagle model file (read from each wheel)."""
    s = speculators_vllm().copy(draft=speculators_config(speculators_model_type="peagle"), serve=None,
                                runtime=runtime)
    rep = s.run(tmp_path)
    assert ("MTH001" in codes(rep, "error")) is refused, [(f.code, f.message) for f in rep.findings]
    if refused:
        msg = next(f.message for f in rep.findings if f.code == "MTH001")
        assert "P-EAGLE" in msg


def test_a_pass_without_a_runtime_says_the_serving_side_was_not_checked(tmp_path: Path) -> None:
    """Nothing unverified reads as a plain PASS: with no --runtime and no --serve, the verdict
    line says what a server feeds was not checked (a hand-written SGLang-layout config)."""
    s = Scenario(serve=None, runtime=None, trained_with="stream:2,16,29", target=None)
    rep = s.run(tmp_path)
    assert "what a server feeds was not checked" in rep.summary, rep.summary
    named = Scenario(serve=None, runtime="sglang@0.5.23", trained_with="stream:2,16,29", target=None).run(
        tmp_path / "named")
    assert "not checked: no runtime named" not in named.summary and "feeds streams" in named.summary


@pytest.mark.parametrize("narrow", [["--select", "NRM"], ["--ignore", "IDS"]])
def test_a_headline_naming_different_streams_says_no_selected_rule_judged_them(tmp_path: Path,
                                                                              narrow: list[str]) -> None:
    """``--select NRM`` printed ``PASS ... sglang@0.5.5 feeds streams [2, 6, 10]; training used
    [1, 5, 9]``: a pass whose own line names a mismatch, with nothing saying the rule that judges
    it (IDS002) did not run. The verdict stays the selected rules'; the line says the rest."""
    from tests.conftest import run_cli

    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text('{"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", '
                                       '"hidden_size": 64, "num_hidden_layers": 1, "vocab_size": 512, '
                                       '"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 5, 9]}}')
    target = tmp_path / "target.json"
    target.write_text('{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, '
                      '"num_hidden_layers": 12, "vocab_size": 512}')
    base = ["lint", "--draft", str(draft), "--target", str(target), "--runtime", "sglang@0.5.5", "--trained-with",
            "stream:1,5,9", "-q"]
    full = run_cli(*base)
    assert full.returncode == 1 and "IDS002" not in full.stdout and "[2, 6, 10]" in full.stdout, full.stdout
    r = run_cli(*base, *narrow)
    line = r.stdout.strip()
    assert r.returncode == 0 and "feeds streams [2, 6, 10]; training used [1, 5, 9]" in line, (r.returncode, line)
    assert "differ" in line and "IDS002" in line and "not run" in line, line
    same = run_cli(*base[:-2], "stream:2,6,10", "-q", *narrow)  # equal streams: nothing to add
    assert same.returncode == 0 and "IDS002" not in same.stdout, same.stdout
