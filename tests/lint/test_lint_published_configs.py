"""Issue 15, lint: verdicts that claim no more than was checked.

Real inputs throughout: the committed config.json files of published drafts and targets
(fixtures/configs/), real command lines, and the CLI in a subprocess where the exit code is
the point.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from consistency.contract import resolve as rs
from consistency.contract.resolve import resolve_specforge
from consistency.contract.runtime_model import served_streams
from consistency.errors import InputError, UsageError
from consistency.lint.engine import LintRequest, run_lint
from consistency.lint.rules.parallel import pp_partition
from consistency.lint.serve import parse_serve
from tests.lint.test_lint_support import FIX, Scenario, eagle3_tensors, llama_target, speculators_config, status, \
    write_checkpoint
from tests.conftest import run_cli

KIMI = FIX / "targets" / "kimi-k2.5.json"
LLAMA = FIX / "targets" / "llama-3.1-8b-instruct.json"
SPECULATORS = FIX / "drafts" / "speculators" / "llama3.1-8b-eagle3"


# -- 1. nothing evaluated is not a pass; swapped inputs are recognised ---------------------

def test_target_alone_is_not_evaluated_and_exits_1() -> None:
    r = run_cli("lint", "--target", str(KIMI), "--format", "json")
    rep = json.loads(r.stdout)
    assert r.returncode == 1 and rep["verdict"] == "not_evaluated", r.stderr
    assert {x["status"] for x in rep["rules"]} == {"not_evaluated"}
    assert "nothing was checked" in rep["summary"]
    r = run_cli("lint", "--target", str(KIMI), "-q")
    assert r.returncode == 1 and r.stdout.startswith("NOT_EVALUATED")


def test_select_of_rules_that_cannot_run_is_not_a_pass(tmp_path: Path) -> None:
    rep = Scenario(serve=None, runtime=None, trained_with=None, select=("IDS002", "SRV")).run(tmp_path)
    assert rep.verdict == "not_evaluated"
    rep = Scenario(serve=None, runtime=None, trained_with=None, select=("IDS004",)).run(tmp_path / "b")
    assert rep.verdict == "pass" and status(rep, "IDS004") == "pass"  # one rule ran and passed: a pass


def test_draft_given_as_target_is_named(tmp_path: Path) -> None:
    p = Scenario().write(tmp_path)
    with pytest.raises(UsageError, match="--target .* is an EAGLE-3 draft config .*swap --draft and --target"):
        run_lint(LintRequest(draft=p["draft"], target=p["draft"]))
    with pytest.raises(UsageError, match="swap --draft and --target"):  # both the wrong way round
        run_lint(LintRequest(draft=str(LLAMA), target=p["draft"]))
    with pytest.raises(UsageError, match="speculators_config"):
        run_lint(LintRequest(target=str(SPECULATORS)))
    r = run_cli("lint", "--draft", str(LLAMA), "--target", p["draft"])
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "swap" in r.stderr, r.stderr


def test_target_given_as_draft_is_named(tmp_path: Path) -> None:
    d = tmp_path / "kimi"
    d.mkdir()
    (d / "config.json").write_text(KIMI.read_text())
    with pytest.raises(UsageError, match="looks like a target model .*61 decoder layers.*swap"):
        run_lint(LintRequest(draft=str(d), runtime="sglang@0.5.23"))
    # a real draft (one layer, fc weight) in an unknown layout is not mistaken for a target
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "config.json").write_text(json.dumps({"architectures": ["MyDraft"], "num_hidden_layers": 2}))
    write_checkpoint(odd / "model.safetensors", eagle3_tensors())
    assert run_lint(LintRequest(draft=str(odd), target=str(LLAMA))).verdict in ("pass", "fail")


# -- 2. vllm serve <speculators dir> turns EAGLE-3 on --------------------------------------

def _speculators_draft(tmp: Path, ids: list[int] = (2, 16, 29)) -> Path:
    d = tmp / "llama3.1-8b-speculator"
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(speculators_config(ids=list(ids))))
    write_checkpoint(d / "model.safetensors", eagle3_tensors(layout="speculators"))
    return d


def test_vllm_serve_of_a_speculators_dir_enables_eagle3(tmp_path: Path) -> None:
    d = _speculators_draft(tmp_path)
    info = parse_serve(f"vllm serve {d} --dtype bfloat16")
    assert info.speculators_model and info.draft_model == str(d)
    assert info.target_model == "meta-llama/Llama-3.1-8B-Instruct"  # the verifier, not the positional path
    assert info.spec_config == {"model": str(d), "method": "eagle3", "num_speculative_tokens": 3}
    tgt = tmp_path / "target.json"
    tgt.write_text(json.dumps(llama_target()))
    rep = run_lint(LintRequest(target=str(tgt), serve=f"vllm serve {d} --dtype bfloat16", runtime="vllm@0.33.0",
                               trained_with="speculators:2,16,29"))
    assert status(rep, "SRV003") == "pass" and status(rep, "SRV002") == "pass", rep.findings
    assert status(rep, "SRV006") == "pass" and rep.serving_streams == [2, 16, 29]
    assert rep.inputs.draft == str(d) and rep.verdict == "pass", [(f.code, f.message) for f in rep.findings]


def test_vllm_serve_of_a_plain_target_still_has_speculation_off(tmp_path: Path) -> None:
    t = tmp_path / "llama"
    t.mkdir()
    (t / "config.json").write_text(json.dumps(llama_target()))
    d = _speculators_draft(tmp_path)
    rep = run_lint(LintRequest(draft=str(d), serve=f"vllm serve {t}", runtime="vllm@0.33.0"))
    f = next(f for f in rep.findings if f.code == "SRV003")
    assert "speculative decoding is off" in f.message and "speculators draft" not in f.message
    rep = run_lint(LintRequest(draft=str(d), serve="vllm serve RedHatAI/some-speculator.eagle3", runtime="vllm@0.33.0"))
    f = next(f for f in rep.findings if f.code == "SRV003")
    assert "unless RedHatAI/some-speculator.eagle3 is a speculators draft" in f.message


# -- 3. SpecForge is version-aware ---------------------------------------------------------

KIMI_ARCH = "KimiK25ForConditionalGeneration"


@pytest.mark.parametrize(("spec", "arch", "streams"), [
    ("specforge@hf", KIMI_ARCH, [3, 31, 59]),  # HF backend hooks layers[j]: j+1
    ("specforge@0.1.1", KIMI_ARCH, [3, 31, 59]),
    ("specforge@sglang-0.5.12", KIMI_ARCH, [3, 31, 59]),  # deepseek_v2.py before PR #25454: +1
    ("specforge@sglang-0.5.13", KIMI_ARCH, [2, 30, 58]),  # first id is not 1: used as-is
    ("specforge@sglang-0.5.14", "LlamaForCausalLM", [3, 31, 59]),  # llama.py always adds 1
    ("specforge@0.2.0", KIMI_ARCH, [2, 30, 58]),
])
def test_specforge_ids_follow_the_sglang_it_captured_with(spec: str, arch: str, streams: list[int]) -> None:
    assert rs.resolve(spec, arch).convention.to_streams([2, 30, 58], 61) == streams


def test_specforge_without_a_version_says_what_it_assumed(tmp_path: Path) -> None:
    r = resolve_specforge("", KIMI_ARCH)
    assert "no specforge version given" in r.assumed and "0.5.14" in r.assumed
    assert r.convention.to_streams([1, 29, 57], 61) == [2, 30, 58]  # first id 1: +1 (PR #25454)
    seed = KIMI.parents[1] / "drafts" / "sglang" / "kimi-k2.5-eagle3-seed.json"  # ids [2, 30, 58], read as they are
    rep = run_lint(LintRequest(draft=str(seed), target=str(KIMI), trained_with="specforge:2,30,58",
                               runtime="sglang@0.5.23"))
    # unpinned SpecForge on a Kimi target: two readings, one of them a mismatch -> an error listing both (issue 27)
    assert [(r.streams, r.matches_serving) for r in rep.training_readings] == [([3, 31, 59], False),
                                                                               ([2, 30, 58], True)]
    assert not rep.training_checked and rep.verdict == "fail"
    ids2 = next(f for f in rep.findings if f.code == "IDS002")
    assert "[3, 31, 59]" in ids2.message and "equal" in ids2.message and "differs" in ids2.message
    with pytest.raises(UsageError, match="specforge@sglang-0.5.14"):
        run_lint(LintRequest(target=str(KIMI), trained_with="specforge@0.5.14:2,30,58"))


# -- 4. pipeline parallelism and DP attention ----------------------------------------------

def test_pp_partition_matches_get_pp_indices() -> None:
    assert pp_partition(32, 4) == [8, 8, 8, 8]
    assert pp_partition(61, 4) == [15, 15, 16, 15]  # vLLM docs' 61-layer example
    assert pp_partition(22, 4) == [5, 6, 6, 5] and pp_partition(7, 3) == [2, 3, 2]


def test_pipeline_names_the_missing_slots_and_honours_the_partition(tmp_path: Path) -> None:
    base = Scenario().serve
    rep = Scenario(serve=base + " --pp-size 2").run(tmp_path / "a")  # streams [2, 16, 29]; last stage 16..31
    f = next(f for f in rep.findings if f.code == "SRV007")
    assert f.evidence["missing_slots"] == [0] and "slot 0 (stream 2)" in f.message and rep.verdict == "fail"
    late = Scenario(serve="SGLANG_PP_LAYER_PARTITION=30,2 " + base + " --pp-size 2").run(tmp_path / "b")
    f = next(f for f in late.findings if f.code == "SRV007")
    assert f.evidence["missing_slots"] == [0, 1, 2] and "[30, 2]" in f.message  # stream 29 < 30: on stage 0
    fine = Scenario(serve="SGLANG_PP_LAYER_PARTITION=1,31 " + base + " --pp-size 2").run(tmp_path / "c")
    assert status(fine, "SRV007") == "pass"
    bad = Scenario(serve="SGLANG_PP_LAYER_PARTITION=4,4 " + base + " --pp-size 2").run(tmp_path / "d")
    assert "refuses to start" in next(f for f in bad.findings if f.code == "SRV007").message
    v = Scenario(draft=speculators_config(), tensors=eagle3_tensors(layout="speculators"), runtime="vllm@0.33.0",
                 trained_with="speculators:2,16,29",
                 serve="vllm serve meta-llama/Llama-3.1-8B-Instruct --pipeline-parallel-size 4 --speculative-config "
                       "'{\"method\": \"eagle3\", \"model\": \"{draft}\", \"num_speculative_tokens\": 3}'").run(tmp_path / "e")
    assert next(f for f in v.findings if f.code == "SRV007").evidence["missing_slots"] == [0, 1]


def test_dp_attention_is_a_note_unless_recording(tmp_path: Path) -> None:
    rep = Scenario(serve=Scenario().serve + " --tp-size 8 --dp-size 8 --enable-dp-attention").run(tmp_path)
    f = next(f for f in rep.findings if f.code == "SRV008")
    assert f.severity.value == "info" and "subset" in f.message and rep.verdict == "pass"


# -- 8. versions and flags are validated ---------------------------------------------------

@pytest.mark.parametrize(("runtime", "msg"), [("sglang@0.5.12@1", "malformed version"),
                                               ("vllm@0.1.0", "predates EAGLE-3"), ("sglang@latest", "malformed")])
def test_bad_runtime_versions_are_usage_errors(runtime: str, msg: str) -> None:
    with pytest.raises(UsageError, match=msg):
        run_lint(LintRequest(target=str(LLAMA), runtime=runtime))
    r = run_cli("lint", "--target", str(LLAMA), "--runtime", runtime)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr


def test_a_newer_version_names_the_release_assumed(tmp_path: Path) -> None:
    rep = Scenario(runtime="sglang@9.9.9").run(tmp_path)
    assert any("newer than any release" in a and "0.5.23" in a for a in rep.assumptions), rep.assumptions
    assert rs.parse_version("0.5.12.post1") == (0, 5, 12)


@pytest.mark.parametrize("flag", ["--speculative-num-steps -1", "--speculative-eagle-topk 0",
                                  "--speculative-num-draft-tokens -4", "--tp-size 0", "--pp-size -2"])
def test_negative_speculative_flags_are_bad_input(flag: str) -> None:
    cmd = ("python -m sglang.launch_server --model-path m --speculative-algorithm EAGLE3 "
           f"--speculative-draft-model-path d {flag}")
    with pytest.raises(InputError, match="must be at least"):
        parse_serve(cmd)


def test_served_streams_is_the_one_runtime_model() -> None:
    s = served_streams("sglang@0.5.5", [-1, 2, 6], 12, "LlamaForCausalLM")
    assert s.streams == [0, 3, 7] and s.crashes and "embedding" in s.crashes[0]
    s = served_streams("sglang@0.5.23", [-1, 2, 6], 12, "LlamaForCausalLM")
    assert s.streams == [0, 3, 7] and not s.crashes
    s = served_streams("sglang@0.5.5", [2, 6, 11], 12, "LlamaForCausalLM")
    assert s.missing == [12] and s.streams == [3, 7]  # stream N is never captured by llama.py
