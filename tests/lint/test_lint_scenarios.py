"""End-to-end lint scenarios on real-format files: the seed story, a SpecForge draft moved
to vLLM, a ModelOpt export, gpt-oss boundary ids, the --trained-with forms, sharded
checkpoints, output formats and bad input (exit 2, one line)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import cli, run_cli
from consistency.contract.models import AuxContract, AuxInfo, DumpMetadata, ModelInfo, SlotSpec
from consistency.dump.writer import write_dump
from tests.lint.test_lint_support import FIX, Scenario, codes, eagle3_tensors, sglang_config, status, write_checkpoint

KIMI = FIX / "targets" / "kimi-k2.5.json"
LLAMA8B = FIX / "targets" / "llama-3.1-8b-instruct.json"


def training_dump(path: Path, streams: list[int], n: int = 61, h: int = 16) -> Path:
    """A training-side dump whose metadata records the aux streams (what `record` writes)."""
    rng = np.random.default_rng(0)
    aux = {f"aux.{k}": rng.standard_normal((4, h)).astype(np.float32) for k in range(len(streams))}
    meta = DumpMetadata(side="training", model=ModelInfo(num_layers=n, hidden_size=7168, vocab_size=163840),
                        aux=AuxInfo(stream_ids=streams, convention="stream"))
    return write_dump(path, aux, meta)


def kimi_draft(tmp: Path, fixture: str) -> Path:
    """The seed's draft: SGLang-layout config + a sparse checkpoint of Kimi-K2.5 size (7168 wide)."""
    d = tmp / fixture.replace(".json", "")
    d.mkdir()
    shutil.copy(FIX / "drafts" / "sglang" / fixture, d / "config.json")
    write_checkpoint(d / "model.safetensors",
                     eagle3_tensors(h=7168, ht=7168, vt=163840, vd=32000, inter=18432, heads=64, kv=8))
    return d


def _json(*args: str) -> tuple[int, dict]:
    r = run_cli("lint", *args, "--format", "json")
    assert r.returncode in (0, 1), r.stderr
    return r.returncode, json.loads(r.stdout)


# -- the seed story ------------------------------------------------------------------------

def test_seed_setup_is_flagged_with_the_streams_the_server_feeds(tmp_path: Path) -> None:
    dump = training_dump(tmp_path / "train.safetensors", [0, 3, 31])
    rc, rep = _json("--draft", str(kimi_draft(tmp_path, "kimi-k2.5-eagle3-seed.json")), "--target", str(KIMI),
                    "--runtime", "sglang@0.5.12", "--trained-with", str(dump),
                    "--serve", "python -m sglang.launch_server --model-path moonshotai/Kimi-K2.5 "
                    "--speculative-algorithm EAGLE3 --speculative-num-steps 1 --speculative-eagle-topk 1 "
                    "--speculative-num-draft-tokens 6 --tp 8")
    assert rc == 1 and rep["verdict"] == "fail"
    assert rep["training_streams"] == [0, 3, 31]
    assert rep["serving_streams"] == [3, 31, 59]
    assert [(s["slot"], s["training_stream"], s["serving_stream"], s["serving_id"]) for s in rep["slots"]] == [
        (0, 0, 3, 2), (1, 3, 31, 30), (2, 31, 59, 58)]
    ids002 = next(f for f in rep["findings"] if f["code"] == "IDS002")
    assert ids002["severity"] == "error" and "slot 0: 3 instead of 0" in ids002["message"]
    assert ids002["location"]["key"] == "eagle_config.eagle_aux_hidden_state_layer_ids"
    assert ids002["location"]["line"] is not None
    # the fix names ids, and that sglang 0.5.12's deepseek_v2.py cannot capture the embedding
    assert "[-1, 2, 30]" in ids002["fix"] and "cannot capture stream 0" in ids002["fix"]
    budget = next(f for f in rep["findings"] if f["code"] == "SRV001")
    assert budget["evidence"] == {"requested": 6, "effective": 2}
    assert {f["code"] for f in rep["findings"] if f["severity"] != "info"} >= {"IDS002", "SRV001", "IDS010"}


def test_seed_fixed_config_passes(tmp_path: Path) -> None:
    dump = training_dump(tmp_path / "train.safetensors", [0, 3, 31])
    rc, rep = _json("--draft", str(kimi_draft(tmp_path, "kimi-k2.5-eagle3-fixed.json")), "--target", str(KIMI),
                    "--runtime", "sglang@0.5.23", "--trained-with", str(dump),
                    "--serve", "python -m sglang.launch_server --model-path moonshotai/Kimi-K2.5 "
                    "--speculative-algorithm EAGLE3 --speculative-num-steps 5 --speculative-eagle-topk 1 "
                    "--speculative-num-draft-tokens 6 --dtype bfloat16")
    assert rc == 0 and rep["verdict"] == "pass", [f for f in rep["findings"] if f["severity"] != "info"]
    assert rep["serving_streams"] == rep["training_streams"] == [0, 3, 31]
    assert not [f for f in rep["findings"] if f["severity"] != "info"]


def test_seed_story_fix_on_the_old_runtime_is_caught(tmp_path: Path) -> None:
    """The seed's own fix ([-1, 2, 30] + 1 = [0, 3, 31]) crashes unpatched sglang 0.5.12 DeepSeek."""
    cfg = json.loads((FIX / "drafts" / "sglang" / "kimi-k2.5-eagle3-seed.json").read_text())
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [-1, 2, 30]
    rep = Scenario(draft=cfg, tensors=None, target=json.loads(KIMI.read_text()), serve=None,
                   runtime="sglang@0.5.12", trained_with="stream:0,3,31").run(tmp_path)
    assert rep.serving_streams == [0, 3, 31]
    f = next(f for f in rep.findings if f.code == "IDS003")
    assert f.severity.value == "error" and "stream 0" in f.message


def test_unpinned_sglang_version_states_both_rules(tmp_path: Path) -> None:
    rc, rep = _json("--draft", str(FIX / "drafts" / "sglang" / "kimi-k2.5-eagle3-seed.json"), "--target", str(KIMI),
                    "--runtime", "sglang", "--trained-with", "stream:0,3,31")
    f = next(f for f in rep["findings"] if f["code"] == "IDS007")
    assert "sglang<0.5.13 -> [3, 31, 59]" in f["message"] and "sglang>=0.5.13 -> [2, 30, 58]" in f["message"]
    assert any("assumed sglang@0.5.23" in a for a in rep["assumptions"])


# -- SpecForge draft moved to vLLM -----------------------------------------------------------

def _specforge(ids: list[int] | None) -> dict:
    cfg = json.loads((FIX / "drafts" / "specforge" / "llama3-8B-eagle3.json").read_text())
    cfg["torch_dtype"] = "bfloat16"
    if ids is not None:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": ids}
    return cfg


def _vllm(runtime: str, cfg: dict, tmp: Path, target: Path = LLAMA8B) -> object:
    return Scenario(draft=cfg, tensors=None, target=json.loads(target.read_text()), runtime=runtime,
                    serve=None, trained_with=None).run(tmp)


def test_specforge_draft_on_vllm_v2_ignores_nested_ids(tmp_path: Path) -> None:
    rep = _vllm("vllm@0.33.0", _specforge([1, 15, 28]), tmp_path)
    assert rep.training_streams == [2, 16, 29] and rep.serving_streams == [2, 16, 29]
    f = next(f for f in rep.findings if f.code == "IDS001")
    assert f.severity.value == "warning" and "right only because the defaults happen to agree" in f.message
    assert "eagle_config.eagle_aux_hidden_state_layer_ids = [1, 15, 28]" in f.message
    assert rep.serving.runner.startswith("v2")


def test_specforge_draft_with_custom_ids_on_vllm_gets_the_default(tmp_path: Path) -> None:
    rep = _vllm("vllm@0.33.0", _specforge([3, 16, 28]), tmp_path)
    assert rep.serving_streams == [2, 16, 29] and rep.training_streams == [4, 17, 29]
    assert next(f for f in rep.findings if f.code == "IDS001").severity.value == "error"
    assert "IDS002" in codes(rep, "error")


def test_specforge_draft_on_vllm_v1_reads_nested_ids_one_layer_early(tmp_path: Path) -> None:
    # 0.22.0: V1 reads the nested key, and LlamaForCausalLM is not on 0.22.0's default-V2 list (Qwen3 only)
    rep = _vllm("vllm@0.22.0", _specforge([1, 15, 28]), tmp_path)
    assert rep.serving.runner.startswith("v1") and rep.serving.key == "eagle_config.eagle_aux_hidden_state_layer_ids"
    assert rep.serving_streams == [1, 15, 28] and rep.verdict == "fail"
    assert {"IDS002", "IDS008"} <= codes(rep)


def test_moe_target_on_vllm_026_uses_the_v1_runner(tmp_path: Path) -> None:
    cfg = _specforge([1, 23, 43])
    cfg.update(hidden_size=2048, vocab_size=151936)
    rep = _vllm("vllm@0.26.0", cfg, tmp_path, FIX / "targets" / "qwen3-30b-a3b.json")
    assert rep.serving.runner.startswith("v1") and rep.serving_streams == [1, 23, 43]
    rep2 = _vllm("vllm@0.29.0", cfg, tmp_path / "b", FIX / "targets" / "qwen3-30b-a3b.json")
    assert rep2.serving.runner.startswith("v2") and rep2.serving_streams == [2, 24, 45]


def test_runner_forced_by_the_command_line_environment(tmp_path: Path) -> None:
    rep = Scenario(draft=_specforge([1, 15, 28]), tensors=None, target=json.loads(LLAMA8B.read_text()),
                   runtime="vllm@0.33.0", trained_with=None,
                   serve="VLLM_USE_V2_MODEL_RUNNER=0 vllm serve meta-llama/Llama-3.1-8B-Instruct "
                         "--speculative-config '{\"method\": \"eagle3\", \"model\": \"x/eagle3\", "
                         "\"num_speculative_tokens\": 3}'").run(tmp_path)
    assert rep.serving.runner.startswith("v1") and rep.serving_streams == [1, 15, 28]


# -- other formats and models ---------------------------------------------------------------

def test_modelopt_export_on_sglang_and_vllm(tmp_path: Path) -> None:
    cfg = json.loads((FIX / "drafts" / "modelopt" / "llama3.1-8b-eagle3.json").read_text())
    sg = Scenario(draft=cfg, tensors=None, target=json.loads(LLAMA8B.read_text()), serve=None,
                  runtime="sglang@0.5.23", trained_with=None).run(tmp_path)
    assert sg.inputs.draft_format == "modelopt"
    assert sg.training_streams == sg.serving_streams == [2, 16, 29] and sg.verdict == "pass"
    vl = Scenario(draft=cfg, tensors=None, target=json.loads(LLAMA8B.read_text()), serve=None,
                  runtime="vllm@0.33.0", trained_with=None).run(tmp_path / "v")
    assert vl.serving.default_used and "IDS001" in codes(vl)


def test_gpt_oss_boundary_ids_depend_on_pr_32334(tmp_path: Path) -> None:
    target = json.loads((FIX / "targets" / "gpt-oss-120b.json").read_text())
    cfg = sglang_config(h=2880, vt=201088, vd=32000, ids=[24, 30, 36])
    old = Scenario(draft=cfg, tensors=None, target=target, serve=None, runtime="sglang@0.5.16",
                   trained_with="stream:24,30,36").run(tmp_path)
    assert old.serving_streams == [25, 31]  # id 36 -> stream 37 > N: the layer loop never captures it
    assert any("[37] are never captured" in a for a in old.assumptions)
    assert "IDS003" in codes(old, "error") and "IDS002" in codes(old, "error")
    new = Scenario(draft=cfg, tensors=None, target=target, serve=None, runtime="sglang@0.5.17",
                   trained_with="stream:24,30,36").run(tmp_path / "n")
    assert new.serving_streams == [24, 30, 36] and status(new, "IDS003") == "pass"


def test_specforge_eagle31_fixture_flags_norm_output(tmp_path: Path) -> None:
    cfg = json.loads((FIX / "drafts" / "specforge" / "qwen3-30B-A3B-eagle3.1.json").read_text())
    rep = Scenario(draft=cfg, tensors=None, target=json.loads((FIX / "targets" / "qwen3-30b-a3b.json").read_text()),
                   serve=None, runtime="vllm@0.21.0", trained_with=None).run(tmp_path)
    assert "NRM004" in codes(rep)
    assert next(f for f in rep.findings if f.code == "NRM003").message.startswith("fc_norm is true but vllm@0.21.0")


# -- --trained-with forms --------------------------------------------------------------------

def test_trained_with_contract_file(tmp_path: Path) -> None:
    c = AuxContract(target=ModelInfo(num_layers=61, hidden_size=7168), slots=[SlotSpec(stream=s) for s in (0, 3, 31)])
    (tmp_path / "contract.json").write_text(c.model_dump_json())
    rc, rep = _json("--draft", str(FIX / "drafts" / "sglang" / "kimi-k2.5-eagle3-seed.json"),
                    "--runtime", "sglang@0.5.12", "--trained-with", str(tmp_path / "contract.json"))
    assert rep["training_streams"] == [0, 3, 31] and rep["serving_streams"] == [3, 31, 59] and rc == 1


@pytest.mark.parametrize("spec,streams", [("specforge:1,29,57", [2, 30, 58]), ("speculators:2,30,58", [2, 30, 58]),
                                          ("stream:0,3,31", [0, 3, 31]), ("specforge:default", [2, 30, 58]),
                                          ("sglang@0.5.5:2,30,58", [3, 31, 59])])
def test_trained_with_framework_ids(spec: str, streams: list[int]) -> None:
    rc, rep = _json("--target", str(KIMI), "--trained-with", spec)
    assert rep["training_streams"] == streams and rep["serving_streams"] is None


@pytest.mark.parametrize("args,needle", [
    (["--trained-with", "nosuch:1,2"], "unknown convention"),
    (["--trained-with", "specforge:1,x"], "cannot parse ids"),
    (["--trained-with", "missing.safetensors"], "no such file"),
    (["--runtime", "tgi@1.0"], "expected sglang@VERSION or vllm@VERSION"),
    (["--serve", "python -m sglang.launch_server --speculative-num-steps 'x"], "cannot split"),
    (["--serve", "vllm serve m --speculative-config '{bad'"], "not valid JSON"),
    ([], "nothing to lint"),
])
def test_bad_usage_exits_2_with_one_line(args: list[str], needle: str) -> None:
    r = run_cli("lint", *args)
    assert r.returncode == 2 and needle in r.stderr and r.stderr.count("\n") == 1, r.stderr


def test_corrupt_inputs_exit_2_naming_the_file(tmp_path: Path) -> None:
    d = tmp_path / "d"
    d.mkdir()
    (d / "config.json").write_text("{not json")
    r = run_cli("lint", "--draft", str(d))
    assert r.returncode == 2 and str(d / "config.json") in r.stderr and "not valid JSON" in r.stderr
    (d / "config.json").write_text(json.dumps(sglang_config(ids=None) | {"eagle_config": {
        "eagle_aux_hidden_state_layer_ids": "2,30,58"}}))
    r = run_cli("lint", "--draft", str(d))
    assert r.returncode == 2 and "must be a list of integers" in r.stderr
    (d / "config.json").write_text(json.dumps(sglang_config()))
    (d / "model.safetensors").write_bytes(b"\xff" * 8 + b"{}")
    r = run_cli("lint", "--draft", str(d))
    assert r.returncode == 2 and "model.safetensors" in r.stderr and r.stderr.count("\n") == 1


def test_sharded_checkpoint_and_index(tmp_path: Path) -> None:
    t = eagle3_tensors()
    names = list(t)
    half = len(names) // 2
    d = tmp_path / "d"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(sglang_config()))
    write_checkpoint(d / "model-00001-of-00002.safetensors", {n: t[n] for n in names[:half]})
    write_checkpoint(d / "model-00002-of-00002.safetensors", {n: t[n] for n in names[half:]})
    wm = {n: f"model-0000{1 if i < half else 2}-of-00002.safetensors" for i, n in enumerate(names)}
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    from consistency.lint.engine import LintRequest, run_lint

    rep = run_lint(LintRequest(draft=str(d), target=None, runtime="sglang@0.5.23", trained_with="specforge:1,15,28"))
    assert status(rep, "VOC003") == "pass" and status(rep, "SHP002") == "pass"
    wm["ghost.weight"] = wm[names[0]]
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    r = run_cli("lint", "--draft", str(d))
    assert r.returncode == 2 and "ghost.weight" in r.stderr


def test_pickle_only_checkpoint_is_never_unpickled(tmp_path: Path) -> None:
    d = tmp_path / "d"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(sglang_config()))
    (d / "pytorch_model.bin").write_bytes(b"\x80\x04not-a-real-pickle")
    rc, rep = _json("--draft", str(d))
    f = next(f for f in rep["findings"] if f["code"] == "VOC001")
    assert f["severity"] == "info" and "never unpickled" in f["message"]


# -- output formats --------------------------------------------------------------------------

def test_sarif_output_points_at_the_config_line(tmp_path: Path) -> None:
    r = run_cli("lint", "--draft", str(FIX / "drafts" / "sglang" / "kimi-k2.5-eagle3-seed.json"), "--target", str(KIMI),
            "--runtime", "sglang@0.5.12", "--trained-with", "stream:0,3,31", "--format", "sarif")
    assert r.returncode == 1
    log = json.loads(r.stdout)
    assert log["version"] == "2.1.0"
    run = log["runs"][0]
    assert {x["id"] for x in run["tool"]["driver"]["rules"]} >= {"IDS002", "SHP001"}
    res = next(x for x in run["results"] if x["ruleId"] == "IDS002")
    assert res["level"] == "error"
    loc = res["locations"][0]["physicalLocation"]
    assert loc["artifactLocation"]["uri"].endswith("kimi-k2.5-eagle3-seed.json")
    lines = (FIX / "drafts" / "sglang" / "kimi-k2.5-eagle3-seed.json").read_text().splitlines()
    assert "eagle_aux_hidden_state_layer_ids" in lines[loc["region"]["startLine"] - 1]
    assert all(x["level"] != "note" for x in run["results"])


def test_output_file_is_not_clobbered_without_force(tmp_path: Path) -> None:
    out = tmp_path / "lint.json"
    out.write_text("keep")
    args = ["lint", "--target", str(KIMI), "--trained-with", "stream:0,3,31", "--format", "json", "-o", str(out)]
    r = run_cli(*args)
    assert r.returncode == 2 and out.read_text() == "keep"
    r = run_cli(*args, "--force")
    rep = json.loads(out.read_text())  # nothing but a target and training ids: no rule can run
    assert r.returncode == 1 and rep["kind"] == "lint" and rep["verdict"] == "not_evaluated"


def test_text_report_shows_slots_and_fix(tmp_path: Path) -> None:
    """Through the console script in a real process (the other lint runs here are in-process)."""
    r = cli("lint", "--draft", str(FIX / "drafts" / "sglang" / "kimi-k2.5-eagle3-seed.json"), "--target", str(KIMI),
            "--runtime", "sglang@0.5.12", "--trained-with", "stream:0,3,31")
    assert r.returncode == 1
    assert "FAIL" in r.stdout and "DIFFERS" in r.stdout and "fix: write" in r.stdout
    assert "0 (the embedding)" in r.stdout and "3 (layer 2's output)" in r.stdout


def test_lint_schema_is_exported(tmp_path: Path) -> None:
    from consistency.contract.schema import all_schemas

    s = all_schemas()
    assert "lint-report.schema.json" in s and "gate-report.schema.json" in s
    assert "serving_streams" in json.loads(s["lint-report.schema.json"])["properties"]


def test_last_stream_is_silently_dropped_by_sglang_llama(tmp_path: Path) -> None:
    """ids [1, 15, 31] on a 32-layer Llama: +1 gives stream 32 = N, which SGLang's loop never reaches."""
    rep = Scenario(draft=sglang_config(ids=[1, 15, 31]), trained_with="stream:2,16,32").run(tmp_path)
    assert rep.serving_streams == [2, 16]
    assert "never captures it: the draft gets one slot fewer" in next(f.message for f in rep.findings
                                                                      if f.code == "IDS003")
    shp = next(f for f in rep.findings if f.code == "SHP001")
    assert "feeds 2 slot(s)" in shp.message and shp.severity.value == "error"
    fix = next(f.fix for f in rep.findings if f.code == "IDS002")
    assert "cannot capture stream 32" in fix


# -- issue 34: generated axes (tests/scenarios/lint_axes.py) ------------------------------------
# ids layout x training x runtime named or not (slot counts, the appended N), and methods x vLLM
# releases; each expected verdict comes from the construction and the facts typed in lint_axes.

from tests.scenarios import lint_axes as LA  # noqa: E402


@pytest.mark.parametrize("case", LA.ids_cases(), ids=lambda c: c.name)
def test_generated_ids_axes(case: LA.IdsCase, tmp_path: Path) -> None:
    from tests.lint.test_lint_support import llama_target

    spec, _fed = LA.training(case.train)
    rep = Scenario(draft=case.config(), target=llama_target(n=LA.N), serve=None, runtime=case.runtime,
                   trained_with=spec).run(tmp_path)
    verdict, code = case.expect()
    errors = codes(rep, "error")
    assert rep.verdict == verdict, (case.name, rep.summary, sorted(errors))
    if code is not None:
        assert code in errors, (case.name, sorted(errors))
    if case.runtime is None and verdict == "pass":
        f = next((f for f in rep.findings if f.code == "IDS013"), None)
        assert (f is not None and f.severity.value == "warning") is case.reading_dependent(), (case.name, f)
    if case.train == "S+N":  # the appended verifier state is read as that, and said
        assert rep.training_streams == LA.S and any("verifier's last state" in a for a in rep.assumptions)


@pytest.mark.parametrize("case", LA.method_cases(), ids=lambda c: c.name)
def test_generated_methods_by_vllm_release(case: LA.MethodCase) -> None:
    from consistency.lint.engine import LintRequest, run_lint

    rep = run_lint(LintRequest(serve=case.serve(), runtime=f"vllm@{case.release}" if case.release else "vllm",
                               target=str(LLAMA8B)))
    got = {f.severity.value for f in rep.findings if f.code == "MTH001"}
    want = case.expect()
    assert got == ({want} if want else set()), (case.name, [f.message for f in rep.findings if f.code == "MTH001"])
    if want == "error":
        assert rep.verdict == "fail"


@pytest.mark.parametrize("case", LA.sglang_method_cases(), ids=lambda c: c.name)
def test_generated_methods_by_sglang_release(case: LA.SglangMethodCase) -> None:
    from consistency.lint.engine import LintRequest, run_lint

    rep = run_lint(LintRequest(serve=case.serve(), runtime=f"sglang@{case.release}", target=str(LLAMA8B)))
    want = case.expect()
    refusals = codes(rep, "error") & {"MTH001", "MDS001"}
    assert refusals == ({want} if want else set()), (case.name, sorted(codes(rep, "error")))
