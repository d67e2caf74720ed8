"""Drafts written by speculators' own ``save_pretrained`` (the real format, not a copy).

Slow: importing speculators takes several seconds. Skipped when the test-only reference
package is not installed (scripts/install-test-references installs it).
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

from tests.lint.test_lint_support import FIX, codes, status

pytestmark = [pytest.mark.slow]
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _maker():  # noqa: ANN202 - the fixtures/configs/make_speculators.py module
    pytest.importorskip("speculators")
    spec = importlib.util.spec_from_file_location("make_speculators", FIX / "make_speculators.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def test_committed_speculators_fixture_is_what_speculators_writes(tmp_path: Path) -> None:
    written = json.loads(_maker().config(tmp_path / "cfg").read_text())
    committed = json.loads((FIX / "drafts" / "speculators" / "llama3.1-8b-eagle3" / "config.json").read_text())
    for d in (written, committed):
        d.pop("transformers_version", None)
        d.pop("speculators_version", None)
    assert written == committed


def test_speculators_draft_served_by_sglang_and_by_vllm(tmp_path: Path) -> None:
    from consistency.lint.engine import LintRequest, run_lint

    draft = _maker().tiny_draft(tmp_path / "draft", tmp_path / "verifier", ids=[2, 4, 5])
    cfg = json.loads((draft / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3" and (draft / "model.safetensors").is_file()
    sglang = ("python -m sglang.launch_server --model-path {v} --speculative-algorithm EAGLE3 "
              "--speculative-draft-model-path {d} --speculative-num-steps 3 --speculative-eagle-topk 1 "
              "--speculative-num-draft-tokens 4").format(v=tmp_path / "verifier", d=draft)
    rep = run_lint(LintRequest(draft=str(draft), serve=sglang, runtime="sglang@0.5.23"))
    # the target came from the command line's local model path; training from the speculators config
    assert rep.training_streams == [2, 4, 5]
    assert rep.serving_streams == [2, 4, 5]  # SGLang's default [2, N//2, N-3] for N = 8: right by coincidence
    assert {"SRV004", "NRM001"} <= codes(rep, "error")
    assert "IDS001" in codes(rep)
    assert status(rep, "VOC003") == "pass" and status(rep, "SHP001") == "pass"  # real d2t and fc from the file

    vllm = (f"vllm serve {tmp_path / 'verifier'} --speculative-config "
            f"'{{\"method\": \"eagle3\", \"model\": \"{draft}\", \"num_speculative_tokens\": 3}}'")
    rep = run_lint(LintRequest(draft=str(draft), serve=vllm, runtime="vllm@0.33.0"))
    assert rep.verdict == "pass" and rep.serving_streams == [2, 4, 5]
    assert not codes(rep), [(f.code, f.message) for f in rep.findings if f.severity.value != "info"]

    odd = _maker().tiny_draft(tmp_path / "draft2", tmp_path / "verifier2", ids=[1, 3, 4])  # SpecForge-style copied
    rep = run_lint(LintRequest(draft=str(odd), runtime="vllm@0.33.0"))
    assert "IDS008" in codes(rep) and rep.serving_streams == [1, 3, 4]
