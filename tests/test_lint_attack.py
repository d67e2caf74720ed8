"""Lint on setups the tables did not write (review of issue 27): flags that run no draft at all,
and flags whose draft lint cannot identify, are never a silent PASS.

Targets come from ``transformers`` config classes; the serving lines are written as SGLang's
docs write them. What SGLang does with ``--speculative-algorithm EAGLE``/``NEXTN`` and no
draft path: it loads the target checkpoint itself as the draft (configs/model_config.py
``ModelConfig.from_server_args``: ``model_path or server_args.model_path``) and rewrites
its architecture only for the MTP classes of ``_config_draft_model`` (contract/sglang_drafts.py);
a dense Qwen3 has no such class, so neither an MTP head nor an EAGLE-3 draft is served.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import json

from consistency.lint.engine import LintRequest, run_lint
from test_lint_support import status

_SG = ("python -m sglang.launch_server --model-path Qwen/Qwen3-8B --speculative-algorithm {a} "
       "--speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4")


def lint(tmp: Path, target: dict[str, Any] | None, serve: str, runtime: str = "sglang@0.5.12"):  # noqa: ANN201
    t = None
    if target is not None:
        t = tmp / "target.json"
        t.write_text(json.dumps(target))
    return run_lint(LintRequest(target=str(t) if t else None, serve=serve, runtime=runtime))


def qwen3_target() -> dict[str, Any]:
    from transformers import Qwen3Config

    cfg = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256).to_dict()
    cfg["architectures"] = ["Qwen3ForCausalLM"]
    return cfg


@pytest.mark.parametrize("algo", ["EAGLE", "NEXTN"])
def test_sglang_eagle_on_a_target_without_an_mtp_class_fails(tmp_path: Path, algo: str) -> None:
    rep = lint(tmp_path, qwen3_target(), _SG.format(a=algo))
    assert rep.verdict == "fail", rep.summary
    assert status(rep, "SRV003") == "fail"
    assert "no MTP class" in rep.summary and "captures no aux hidden states" in rep.summary, rep.summary


def test_sglang_eagle_whose_draft_cannot_be_told_warns(tmp_path: Path) -> None:
    rep = lint(tmp_path, None, _SG.format(a="EAGLE"))
    f = next(f for f in rep.findings if f.code == "SRV003")
    assert f.severity.value == "warning" and "not known" in f.message, f.message
