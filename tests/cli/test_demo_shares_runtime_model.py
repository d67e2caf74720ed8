"""Issue 15, demo: the simulated server and the linter share one runtime model, and
``demo --out`` keeps what is already there."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from consistency.cli import demo_cmd as demo
from consistency.contract.runtime_model import served_streams
from consistency.errors import UsageError
from consistency.lint.engine import LintRequest, run_lint
from consistency.record.models import builtin_config
from tests.lint.test_lint_support import eagle3_tensors, sglang_config, status, write_checkpoint
from tests.conftest import run_cli


def _lint(tmp: Path, ids: list[int], runtime: str):  # noqa: ANN202 - LintReport
    """The demo's draft config (SGLang layout, the demo's ids) and its real built-in target."""
    tgt = builtin_config(demo.MODEL)
    d = tmp / "draft"
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(sglang_config(h=64, vt=512, vd=256, ids=ids)))
    write_checkpoint(d / "model.safetensors", eagle3_tensors(h=64, ht=64, vt=512, vd=256, inter=128))
    (tmp / "target.json").write_text(json.dumps(tgt))
    return run_lint(LintRequest(draft=str(d), target=str(tmp / "target.json"), runtime=runtime,
                                trained_with="stream:" + ",".join(map(str, demo.TRAIN_STREAMS))))


@pytest.mark.parametrize("fixed", [False, True])
def test_demo_serves_what_lint_says_that_release_feeds(tmp_path: Path, fixed: bool) -> None:
    cfg = builtin_config(demo.MODEL)
    runtime, sv = demo.serving_plan(fixed, cfg["num_hidden_layers"], cfg["architectures"][0])
    rep = _lint(tmp_path, demo.FIXED_IDS if fixed else demo.SERVE_IDS, runtime)
    assert rep.serving_streams == sv.streams
    assert status(rep, "IDS003") == "pass", [f.message for f in rep.findings if f.code == "IDS003"]
    assert (status(rep, "IDS002") == "pass") is fixed  # the fixed run feeds the training streams
    assert (rep.verdict == "pass") is fixed


def test_the_old_fixed_run_was_one_lint_rejects(tmp_path: Path) -> None:
    """Before: demo --fixed served [-1, 2, 6] on sglang@0.5.5, whose llama.py cannot capture stream 0."""
    rep = _lint(tmp_path, demo.FIXED_IDS, demo.RUNTIME)
    assert status(rep, "IDS003") == "fail"
    assert served_streams(demo.RUNTIME, demo.FIXED_IDS, 12, "LlamaForCausalLM").crashes
    orig = demo.FIXED_RUNTIME
    demo.FIXED_RUNTIME = demo.RUNTIME
    try:
        with pytest.raises(UsageError, match="cannot serve these ids"):
            demo.serving_plan(True, 12, "LlamaForCausalLM")
    finally:
        demo.FIXED_RUNTIME = orig


@pytest.mark.slow
def test_demo_out_follows_the_no_clobber_rule(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    out.mkdir()
    (out / "train.safetensors").write_bytes(b"someone's recording")
    r = run_cli("demo", "--out", str(out), "--no-replay")
    assert r.returncode == 2 and "exists" in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert (out / "train.safetensors").read_bytes() == b"someone's recording"
    (out / "replay.json").write_text("notes, not a report")
    r = run_cli("demo", "--out", str(out), "--no-replay", "--force", "--json", str(out / "report.json"))
    assert r.returncode == 0, r.stderr
    assert (out / "train.safetensors").read_bytes()[:8] != b"someone'"
    assert json.loads((out / "report.json").read_text())["verdict"] == "fail"
    (out / "mine.json").write_text("{}")
    r = run_cli("demo", "--out", str(tmp_path / "fresh"), "--no-replay", "--fixed", "--json", str(out / "mine.json"))
    assert r.returncode == 2 and (out / "mine.json").read_text() == "{}"  # not a report: kept
