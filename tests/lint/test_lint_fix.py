"""Issue 40: ``lint --diff`` / ``--fix``: the fix as data, written safely, and the fixed setup passes.

Scenarios are generated across every (runtime, version range) boundary in the convention
tables and every architecture family: a broken setup is built, ``--fix`` applied, and the
fixed setup linted again; the expected ids come from the construction (the training streams)
and are checked against the runtime model the demo's server shares (``served_streams``),
not against the fix code's own computation.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from consistency.contract.conventions import FIRST_EAGLE3, NESTED_IDS, TOP_IDS
from consistency.contract.fixes import get_key
from consistency.contract.runtime_model import capture_limit, served_streams, version_points
from consistency.contract.versions import vtext
from consistency.errors import InputError
from consistency.lint.engine import LintRequest, run_lint
from consistency.lint.fix import plan, write
from tests.lint.test_lint_mtp import NEXTN_DRAFT, SG_DRAFT, S, eagle1_config, eagle1_tensors
from tests.lint.test_lint_support import Scenario, llama_target, sglang_config
from tests.conftest import run_cli

N = 32
TRAINED = [3, 14, 27]  # streams training fed the draft: inside 1..N-1, capturable by every release
ARCHS = {"LlamaForCausalLM": "llama", "DeepseekV3ForCausalLM": "deepseek", "GptOssForCausalLM": "gpt-oss"}


def _versions(runtime: str) -> list[str]:
    """One concrete release per range between the boundaries the tables know."""
    out = []
    for lo, _hi, _rep in version_points(runtime):
        out.append(vtext(lo) if lo else vtext(FIRST_EAGLE3[runtime][0]))
    return out


POINTS = [(rt, v, a) for rt in ("sglang", "vllm") for v in _versions(rt) for a in ARCHS]


def _req(p: dict[str, Any], s: Scenario) -> LintRequest:
    return LintRequest(draft=p["draft"], target=p["target"], serve=p["serve"], runtime=s.runtime,
                       trained_with=s.trained_with)


def _fix(tmp: Path, s: Scenario) -> tuple[Any, Any, Any]:
    """(report before, plan, report after --fix) for scenario ``s``."""
    from dataclasses import replace

    p = s.write(tmp)
    req = _req(p, s)
    before = run_lint(req)
    fp = plan(before)
    write(fp, Path(p["draft"]), force=False)
    after = run_lint(replace(req, serve=fp.command) if fp.command else req)
    return before, fp, after


@pytest.mark.parametrize("runtime,version,arch", POINTS, ids=[f"{r}@{v}-{ARCHS[a]}" for r, v, a in POINTS])
@pytest.mark.parametrize("broken", ["IDS002", "IDS001", "IDS003"])
def test_broken_ids_fixed_at_every_boundary(tmp_path: Path, runtime: str, version: str, arch: str,
                                            broken: str) -> None:
    wrong = {"IDS002": [5, 10, 20], "IDS001": None, "IDS003": [3, 17, N + 5]}[broken]
    draft = sglang_config(ids=wrong if runtime == "sglang" else None)
    if runtime == "vllm" and wrong is not None:
        draft[TOP_IDS] = wrong  # where every vLLM release reads first
    s = Scenario(draft=draft, target=llama_target(n=N, arch=arch), serve=None,
                 runtime=f"{runtime}@{version}", trained_with=f"stream:{','.join(map(str, TRAINED))}")
    before, fp, after = _fix(tmp_path, s)
    assert broken in {f.code for f in before.findings}, before.summary
    assert after.verdict == "pass", (after.summary, [f.message for f in after.findings if f.severity.value != "info"])
    cfg = json.loads((tmp_path / "draft" / "config.json").read_text())
    key = NESTED_IDS if runtime == "sglang" else TOP_IDS  # the key each runtime reads (its source, cited in docs)
    ids = get_key(cfg, key)
    # independent check: the runtime model (shared with the demo's server) feeds training's streams
    assert served_streams(f"{runtime}@{version}", ids, N, arch).streams == TRAINED, (key, ids)
    assert json.loads((tmp_path / "draft" / "config.json.orig").read_text()) == s.draft  # the backup


@pytest.mark.parametrize("runtime,version,arch", POINTS, ids=[f"{r}@{v}-{ARCHS[a]}" for r, v, a in POINTS])
def test_embedding_fixed_where_the_release_captures_it_else_named(tmp_path: Path, runtime: str, version: str,
                                                                 arch: str) -> None:
    trained = [0, 16, 29]
    s = Scenario(draft=sglang_config(ids=[5, 10, 20]), target=llama_target(n=N, arch=arch), serve=None,
                 runtime=f"{runtime}@{version}", trained_with="stream:0,16,29")
    p = s.write(tmp_path)
    rep = run_lint(_req(p, s))
    fx = next(f.autofix for f in rep.findings if f.code == "IDS002")
    lim = capture_limit(runtime, tuple(int(x) for x in version.split(".")), arch)
    if lim is not None and lim.first != "ok":
        assert fx.status == "impossible" and "embedding" in fx.summary and not fx.edits
        assert plan(rep).empty
        up = fx.summary.split(f"use {runtime} >= ")[1].split(" ")[0] if ">=" in fx.summary else None
        if up is not None:  # the release it names does capture it: re-lint there and the fix applies
            s2 = s.copy(runtime=f"{runtime}@{up}")
            _b, _fp, after = _fix(tmp_path / "up", s2)
            assert after.verdict == "pass", after.summary
    else:
        _b, _fp, after = _fix(tmp_path / "ok", s)
        assert after.verdict == "pass", after.summary
        ids = get_key(json.loads((tmp_path / "ok" / "draft" / "config.json").read_text()),
                      NESTED_IDS if runtime == "sglang" else TOP_IDS)
        assert served_streams(f"{runtime}@{version}", ids, N, arch).streams == trained


def test_unpinned_version_is_not_applied_and_names_the_input(tmp_path: Path) -> None:
    s = Scenario(draft=sglang_config(ids=[5, 10, 20]), target=llama_target(n=N, arch="DeepseekV3ForCausalLM"),
                 serve=None, runtime="sglang", trained_with="stream:1,16,29")  # [1,..]: PR #25454 reads it otherwise
    rep = s.run(tmp_path)
    fx = next(f.autofix for f in rep.findings if f.code == "IDS002")
    assert fx.status == "ambiguous" and fx.decided_by.startswith("--runtime sglang@") and "<0.5.13" in fx.summary
    assert plan(rep).empty


def test_unknown_training_is_not_applied(tmp_path: Path) -> None:
    s = Scenario(draft=sglang_config(ids=[5, 10, 20]), serve=None, runtime="sglang@0.5.23", trained_with=None,
                 target=llama_target(n=N))
    rep = s.run(tmp_path)
    held = [f.autofix for f in rep.findings if f.autofix is not None]
    assert all(h.status != "determined" for h in held)
    assert plan(rep).empty


@pytest.mark.parametrize("case", ["SRV001", "SRV003", "MTP006", "EG1001", "IDS009", "vllm-method", "IDS008"])
def test_command_and_flag_fixes(tmp_path: Path, case: str) -> None:
    base = Scenario(target=llama_target(n=N), trained_with="specforge:1,15,28")
    s = {"SRV001": base.copy(serve=base.serve.replace("--speculative-num-steps 3", "--speculative-num-steps 1")
                             .replace("--speculative-num-draft-tokens 4", "--speculative-num-draft-tokens 6")),
         "SRV003": base.copy(serve=base.serve.replace("EAGLE3", "EAGLE")),
         "MTP006": S(draft=NEXTN_DRAFT, serve=SG_DRAFT.replace("NEXTN", "EAGLE3")),
         "EG1001": Scenario(draft=eagle1_config(), tensors=eagle1_tensors(), trained_with=None),
         "IDS009": base.copy(draft=dict(sglang_config(), eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 15, 28],
                                                                       "use_aux_hidden_state": False})),
         # vLLM-style stream ids [2, 16, 29] (its default) written for SGLang, which adds 1: the default moved by +1
         "IDS008": base.copy(draft=sglang_config(ids=[2, 16, 29]), trained_with="stream:3,14,27", serve=None),
         "vllm-method": base.copy(runtime="vllm@0.33.0", serve=(
             "vllm serve meta-llama/Llama-3.1-8B-Instruct --dtype bfloat16 --speculative-config "
             "'{\"method\": \"eagle\", \"model\": \"{draft}\", \"num_speculative_tokens\": 3}'"))}[case]
    before, fp, after = _fix(tmp_path, s)
    code = "SRV003" if case == "vllm-method" else case
    assert code in {f.code for f in before.findings if f.severity.value != "info"}
    assert after.verdict == "pass", (after.summary, [f.message for f in after.findings if f.severity.value != "info"])
    assert code not in {f.code for f in after.findings}
    if case == "SRV001":
        assert "--speculative-num-steps 5" in fp.command and "--speculative-num-draft-tokens 6" in fp.command
    if case == "MTP006":
        assert "--speculative-algorithm NEXTN" in fp.command
    if case == "vllm-method":
        assert '"method":"eagle3"' in fp.command
    if case == "IDS009":
        cfg = json.loads((tmp_path / "draft" / "config.json").read_text())
        assert "use_aux_hidden_state" not in cfg["eagle_config"]


def test_seed_story_cli_fix_then_pass(tmp_path: Path) -> None:
    """The seed: ids [2, 30, 58] on Kimi-K2.5, training fed [0, 3, 31]; sglang 0.5.23 reads them as they are."""
    root = Path(__file__).resolve().parents[2] / "fixtures" / "configs"
    d = tmp_path / "seed"
    d.mkdir()
    (d / "config.json").write_text((root / "drafts" / "sglang" / "kimi-k2.5-eagle3-seed.json").read_text())
    args = ("lint", "--draft", str(d), "--target", str(root / "targets" / "kimi-k2.5.json"),
            "--trained-with", "stream:0,3,31")
    r = run_cli(*args, "--runtime", "sglang@0.5.12", "--diff")
    assert r.returncode == 1 and "cannot capture the embedding" in r.stdout and ">= 0.5.14" in r.stdout
    assert not (d / "config.json.orig").exists()
    r = run_cli(*args, "--runtime", "sglang@0.5.23", "--diff")
    assert r.returncode == 1 and "-      2," in r.stdout and "+      0," in r.stdout
    assert not (d / "config.json.orig").exists()  # --diff writes nothing
    r = run_cli(*args, "--runtime", "sglang@0.5.23", "--fix")
    assert r.returncode == 0 and "after the fix: PASS" in r.stdout, r.stdout + r.stderr
    assert json.loads((d / "config.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 3, 31]
    (d / "config.json").write_text((d / "config.json.orig").read_text())  # broken again: the backup blocks a 2nd fix
    r = run_cli(*args, "--runtime", "sglang@0.5.23", "--fix")
    assert r.returncode == 2 and "config.json.orig" in r.stderr and r.stderr.count("\n") == 1
    assert r.stdout.count("+      0,") == 1  # the diff was shown; nothing was written
    assert json.loads((d / "config.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 30, 58]
    r = run_cli(*args, "--runtime", "sglang@0.5.23", "--fix", "--force")
    assert r.returncode == 0, r.stderr


def test_never_writes_through_a_symlink(tmp_path: Path) -> None:
    s = Scenario(draft=sglang_config(ids=[5, 10, 20]), serve=None, runtime="sglang@0.5.23",
                 trained_with="stream:2,16,29", target=llama_target(n=N))
    p = s.write(tmp_path)
    outside = tmp_path / "elsewhere.json"
    cfg = tmp_path / "draft" / "config.json"
    outside.write_text(cfg.read_text())
    cfg.unlink()
    os.symlink(outside, cfg)
    before = outside.read_text()
    rep = run_lint(_req(p, s))
    with pytest.raises(InputError, match="symbolic link"):
        write(plan(rep), Path(p["draft"]), force=True)
    assert outside.read_text() == before and not (tmp_path / "draft" / "config.json.orig").exists()


def test_sarif_fixes_and_step_summary_show_the_diff_never_apply_it(tmp_path: Path) -> None:
    from consistency.contract.fixtext import apply_edits
    from consistency.report.ci_formats import markdown_summary
    from consistency.report.sarif import lint_sarif

    hostile = sglang_config(ids=[5, 10, 20])
    hostile["eagle_config"]["note"] = "::error::pwned ##[set-output x] <b>`x`</b>"  # a PR's bytes, in the diff's context
    s = Scenario(draft=hostile, serve=Scenario().serve.replace("EAGLE3", "EAGLE"), runtime="sglang@0.5.23",
                 trained_with="stream:3,14,27", target=llama_target(n=N))
    rep = s.run(tmp_path).model_dump(mode="json")
    cfg = tmp_path / "draft" / "config.json"
    old = cfg.read_text()
    sarif = lint_sarif(rep, base=tmp_path)
    fixed = [r for r in sarif["runs"][0]["results"] if "fixes" in r]
    assert [r["ruleId"] for r in fixed] == ["IDS002"]
    text = old
    for rp in sorted(fixed[0]["fixes"][0]["artifactChanges"][0]["replacements"],
                     key=lambda x: -x["deletedRegion"]["charOffset"]):  # applied as a SARIF viewer would
        o, n = rp["deletedRegion"]["charOffset"], rp["deletedRegion"]["charLength"]
        text = text[:o] + rp["insertedContent"]["text"] + text[o + n:]
    edit = next(f["autofix"] for f in rep["findings"] if f["code"] == "IDS002")["edits"]
    assert text == apply_edits(old, [__import__("consistency.contract.fixes", fromlist=["Edit"]).Edit(**e)
                                     for e in edit], str(cfg))
    assert json.loads(text)["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 13, 26]  # sglang: +1
    md = markdown_summary({"verdict": "fail", "summary": "", "checks": [
        {"kind": "lint", "name": "d", "verdict": "fail", "cases": [], "summary": "", "report": rep}]})
    assert "<pre>" in md and "+      2," in md and "--speculative-algorithm EAGLE3" in md
    assert "pwned" in md and "::error::" not in md and "<b>" not in md and "`x`" not in md  # shown inert
    assert cfg.read_text() == old  # never applied


def test_seed_loop_closed_record_compare_replay(tmp_path: Path) -> None:
    """tiny-llama, the seed scaled (training streams [0, 3, 7], served by SGLang 0.5.5 as [3, 7, 10]): compare's
    fix names why 0.5.5 cannot serve it and the release that can; the ids it names there, recorded as that
    server feeds them, compare PASS against training and replay shows the acceptance restored."""
    from consistency.contract.fixes import served_fix

    prompt = "Speculative decoding drafts several tokens with a small model and verifies them with the target."
    train, broken, fixed = (str(tmp_path / f"{n}.safetensors") for n in ("train", "serve", "fixed"))
    assert run_cli("record", "--model", "tiny-llama", "--prompt", prompt, "--aux-layers", "0,3,7", "-o",
                   train).returncode == 0
    assert run_cli("record", "--model", "tiny-llama", "--prompt", prompt, "--style", "serving", "--aux-layers",
                   "2,6,9", "--convention", "sglang@0.5.5", "-o", broken).returncode == 0
    r = run_cli("compare", train, broken, "--json", str(tmp_path / "r.json"))
    assert r.returncode == 1
    rep = json.loads((tmp_path / "r.json").read_text())
    fx = next(f["autofix"] for f in rep["findings"] if f["code"] == "LAYER_MISMATCH")
    assert fx["status"] == "impossible" and "use sglang >= 0.5.22" in fx["summary"]
    good = served_fix("sglang@0.5.22", 12, "LlamaForCausalLM", [0, 3, 7])
    assert good is not None and good.status == "determined"
    ids = good.edits[0].new
    assert good.edits[0].key == NESTED_IDS and ids == [-1, 2, 6]
    assert run_cli("record", "--model", "tiny-llama", "--prompt", prompt, "--style", "serving",
                   f"--aux-layers={','.join(map(str, ids))}", "--convention", "sglang@0.5.22", "-o",
                   fixed).returncode == 0
    assert run_cli("compare", train, fixed, "-q").returncode == 0
    before = run_cli("replay", "--draft", "tiny-llama-eagle3", "--target", "tiny-llama", train, broken, "-q",
                     "--json", str(tmp_path / "rp.json"))
    after = run_cli("replay", "--draft", "tiny-llama-eagle3", "--target", "tiny-llama", train, fixed, "-q")
    assert before.returncode == 1 and after.returncode == 0, after.stdout + after.stderr
    drop = next(f for f in json.loads((tmp_path / "rp.json").read_text())["findings"] if f["code"] == "ACCEPTANCE_DROP")
    assert drop["autofix"]["status"] == "impossible" and "sglang >= 0.5.22" in drop["fix"]  # replay names it too


@pytest.mark.parametrize("runtime,ids,fixed", [("sglang@0.5.22", "2,6,9", [-1, 2, 6]),
                                               ("vllm@0.33.0", "2,6,9", [0, 3, 7])])
def test_compare_names_the_concrete_ids_for_the_candidates_runtime(tmp_path: Path, runtime: str, ids: str,
                                                                   fixed: list[int]) -> None:
    prompt = "The draft must see exactly the hidden states it was trained on."
    train, serve = str(tmp_path / "t.safetensors"), str(tmp_path / "s.safetensors")
    assert run_cli("record", "--model", "tiny-llama", "--prompt", prompt, "--aux-layers", "0,3,7", "-o",
                   train).returncode == 0
    assert run_cli("record", "--model", "tiny-llama", "--prompt", prompt, "--style", "serving", "--aux-layers", ids,
                   "--convention", runtime, "-o", serve).returncode == 0
    assert run_cli("compare", train, serve, "--json", str(tmp_path / "r.json")).returncode == 1
    rep = json.loads((tmp_path / "r.json").read_text())
    f = next(f for f in rep["findings"] if f["code"] == "LAYER_MISMATCH")
    key = NESTED_IDS if runtime.startswith("sglang") else TOP_IDS
    assert f["autofix"]["status"] == "determined" and f["autofix"]["edits"][0]["key"] == key
    assert f["autofix"]["edits"][0]["new"] == fixed and f"set `{key}: {fixed}`" in f["fix"]
    # the construction's check: that runtime, given those ids, feeds the training streams
    assert served_streams(runtime, fixed, 12, "LlamaForCausalLM").streams == [0, 3, 7]


def test_fix_refuses_a_symlinked_directory_and_a_builtin_draft_but_fixes_a_named_config(tmp_path: Path) -> None:
    s = Scenario(draft=sglang_config(ids=[5, 10, 20]), serve=None, runtime="sglang@0.5.23",
                 trained_with="stream:3,14,27", target=llama_target(n=N))
    p = s.write(tmp_path / "real")
    link = tmp_path / "link"
    os.symlink(p["draft"], link)
    before = (Path(p["draft"]) / "config.json").read_text()
    r = run_cli("lint", "--draft", str(link), "--target", p["target"], "--runtime", "sglang@0.5.23",
                "--trained-with", "stream:3,14,27", "--fix")
    assert r.returncode == 2 and "symbolic link" in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert (Path(p["draft"]) / "config.json").read_text() == before
    r = run_cli("lint", "--draft", "tiny-llama-eagle3", "--target", "tiny-llama", "--runtime", "sglang@0.5.23",
                "--trained-with", "stream:1,2,3", "--fix")
    assert r.returncode == 2 and "built-in draft" in r.stderr, r.stderr  # never a write into the package
    named = tmp_path / "kimi-seed.json"  # a config given as a file: that file, and only it, is fixed
    named.write_text(before)
    r = run_cli("lint", "--draft", str(named), "--target", p["target"], "--runtime", "sglang@0.5.23",
                "--trained-with", "stream:3,14,27", "--fix")
    assert r.returncode == 0, r.stdout + r.stderr
    assert get_key(json.loads(named.read_text()), NESTED_IDS) == [2, 13, 26]
    assert (tmp_path / "kimi-seed.json.orig").read_text() == before


def test_a_non_object_parent_is_never_overwritten(tmp_path: Path) -> None:
    draft = dict(sglang_config(ids=None), eagle_config="a string, not an object")
    draft[TOP_IDS] = [5, 10, 20]
    s = Scenario(draft=draft, serve=None, runtime="sglang@0.5.23", trained_with="stream:3,14,27",
                 target=llama_target(n=N))
    rep = s.run(tmp_path)
    held = [f.autofix for f in rep.findings if f.autofix is not None]
    assert held and all(h.status == "impossible" and "not a JSON object" in h.summary for h in held)
    assert plan(rep).empty
