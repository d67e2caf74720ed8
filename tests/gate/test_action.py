"""The GitHub Action (action.yml) through its script, scripts/action.py, run directly (no `act`):
what it installs, the gate it runs on this repository's fixtures, fail-on, and its outputs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT

SCRIPT = ROOT / "scripts" / "action.py"
CONFIGS = ROOT / ".github" / "consistency"
FIX = ROOT / "fixtures" / "configs"


def action(*args: str | Path, tmp: Path) -> tuple[int, dict[str, str], str]:
    out = tmp / "github_output"
    out.write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GITHUB_", "CONSISTENCY_"))}
    env.update(GITHUB_OUTPUT=str(out), RUNNER_TEMP=str(tmp))
    r = subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, env=env,
                       cwd=tmp, timeout=600)
    outputs = dict(line.split("=", 1) for line in out.read_text().splitlines() if "=" in line)
    return r.returncode, outputs, r.stdout + r.stderr


def test_install_without_torch_unless_replay_is_declared(tmp_path: Path) -> None:
    """The decision is the installed gate's reading of the config (``gate --plan``), made in
    the environment the action installs into (here: this test's own, so nothing downloads)."""
    venv = Path(sys.prefix)
    py = venv / "bin" / "python"
    pip = f"+ {py} -I -m pip install -q --disable-pip-version-check"
    plain = tmp_path / "plain.toml"
    plain.write_text((CONFIGS / "pass.toml").read_text().replace("../../", f"{ROOT}/"))
    rc, out, log = action("install", "--dry-run", "--venv", venv, "--config", plain, "--source", ROOT, tmp=tmp_path)
    assert rc == 0 and out["replay"] == "false" and out["python"] == str(py) and out["needs"] == "", log
    assert log.strip().splitlines() == [f"{pip} {ROOT}"]
    replay = tmp_path / "replay.toml"
    replay.write_text(plain.read_text() + '\n[[replay]]\nname = "acceptance"\ndraft = "d"\n')
    rc, out, log = action("install", "--dry-run", "--venv", venv, "--config", replay, "--version", "v0.1.0",
                          tmp=tmp_path)
    assert rc == 0 and out["replay"] == "true" and out["needs"] == "torch,transformers", log
    assert log.strip().splitlines() == [f"{pip} specdec-consistency==0.1.0",
                                        f"{pip} torch --index-url https://download.pytorch.org/whl/cpu",
                                        f"{pip} specdec-consistency[hf]==0.1.0"]
    url = "git+https://example.invalid/consistency@main"
    rc, _out, log = action("install", "--dry-run", "--venv", venv, "--config", plain, "--version", url, tmp=tmp_path)
    assert log.strip() == f"{pip} {url}"


def test_install_creates_a_virtual_environment_never_the_system_python(tmp_path: Path) -> None:
    """A Debian/Ubuntu system Python refuses ``pip install`` (externally managed): the
    action always installs into a venv of its own, under RUNNER_TEMP by default."""
    rc, out, log = action("install", "--dry-run", "--config", CONFIGS / "pass.toml", "--source", ROOT, tmp=tmp_path)
    venv = tmp_path / "consistency-venv"
    assert rc == 0 and out["python"] == str(venv / "bin" / "python"), log
    lines = log.strip().splitlines()
    assert lines[0] == f"+ {sys.executable} -I -m venv {venv}"
    assert lines[1].startswith(f"+ {venv}/bin/python -I -m pip install")


def test_gate_on_the_repository_fixtures_writes_reports_and_outputs(tmp_path: Path) -> None:
    rc, out, log = action("gate", "--config", CONFIGS / "pass.toml", "--sarif", "out/c.sarif", "--junit",
                          "out/junit.xml", "--annotations", "true", tmp=tmp_path)
    assert rc == 0, log
    assert out["verdict"] == "pass" and out["exit-code"] == "0" and Path(out["json"]).is_file()
    cases = ET.parse(tmp_path / "out" / "junit.xml").getroot().iter("testcase")
    assert sum(1 for _ in cases) > 0
    assert '"version": "2.1.0"' in (tmp_path / "out" / "c.sarif").read_text()


def test_fail_on(tmp_path: Path) -> None:
    seed = CONFIGS / "fail.toml"
    rc, out, log = action("gate", "--config", seed, tmp=tmp_path)
    assert (rc, out["verdict"], out["exit-code"]) == (1, "fail", "1"), log
    rc, out, log = action("gate", "--config", seed, "--fail-on", "never", tmp=tmp_path)
    assert (rc, out["verdict"], out["exit-code"]) == (0, "fail", "0"), log
    # the seed draft on vllm 0.33.0 with pinned training ids: no error, one warning (by the lint rules); without
    # them the SpecForge readings of its Kimi ids disagree, which is an error (issue 27)
    warn = tmp_path / "warn.toml"
    warn.write_text(f'[[lint]]\nname = "w"\ndraft = "{FIX / "drafts/sglang/kimi-k2.5-eagle3-seed.json"}"\n'
                    f'target = "{FIX / "targets/kimi-k2.5.json"}"\nruntime = "vllm@0.33.0"\n'
                    'trained_with = "specforge@sglang-0.5.14:2,30,58"\n')
    rc, out, log = action("gate", "--config", warn, tmp=tmp_path)
    assert (rc, out["verdict"]) == (0, "pass"), log
    rc, out, log = action("gate", "--config", warn, "--fail-on", "warning", tmp=tmp_path)
    assert (rc, out["verdict"], out["exit-code"]) == (1, "fail", "1"), log  # verdict and exit code agree
    rc, _out, log = action("gate", "--config", warn, "--fail-on", "sometimes", tmp=tmp_path)
    assert rc == 2 and "fail-on" in log


def test_unreadable_config_fails_even_report_only(tmp_path: Path) -> None:
    rc, out, log = action("gate", "--config", tmp_path / "missing.toml", "--fail-on", "never", tmp=tmp_path)
    assert rc == 2 and out["verdict"] == "error" and out["exit-code"] == "2", log


def test_action_yml_passes_inputs_as_environment_only() -> None:
    """Every input is used, and none is pasted into a shell script (script injection)."""
    spec = yaml.safe_load((ROOT / "action.yml").read_text())
    assert spec["runs"]["using"] == "composite"
    steps = spec["runs"]["steps"]
    runs = [s["run"] for s in steps if "run" in s]
    assert runs and not any("${{" in r for r in runs)
    used = set(re.findall(r"inputs\.([\w-]+)", (ROOT / "action.yml").read_text()))
    assert used == set(spec["inputs"]), set(spec["inputs"]) ^ used
    gate = next(s for s in steps if s.get("id") == "gate")
    flags = set(re.findall(r"--([\w-]+)", gate["run"]))
    assert flags >= {"config", "fail-on", "annotations", "sarif", "junit", "json"}
    uses = {s["uses"].split("@")[0] for s in steps if "uses" in s}
    assert uses == {"actions/setup-python", "github/codeql-action/upload-sarif", "actions/upload-artifact"}


@pytest.mark.parametrize("name", ["pass", "fail"])
def test_workflow_configs_exist_and_are_used(name: str) -> None:
    wf = (ROOT / ".github" / "workflows" / "action.yml").read_text()
    assert f".github/consistency/{name}.toml" in wf
    assert yaml.safe_load(wf)["jobs"]["action"]["steps"][1]["uses"] == "./"


def _hooks() -> dict[str, dict]:
    return {h["id"]: h for h in yaml.safe_load((ROOT / ".pre-commit-hooks.yaml").read_text())}


def _entry(hook: dict, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    """The hook's entry as pre-commit runs it (``language: python``: the package's console script)."""
    import shlex

    argv = shlex.split(hook["entry"])
    assert argv[0] == "consistency"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GITHUB_", "CONSISTENCY_"))}
    return subprocess.run([sys.executable, "-m", "consistency", *argv[1:], *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=300)


def _project(tmp: Path, draft: str, runtime: str) -> Path:
    (tmp / "drafts" / "kimi").mkdir(parents=True)
    (tmp / "drafts" / "kimi" / "config.json").write_text((FIX / "drafts" / "sglang" / draft).read_text())
    (tmp / "kimi.json").write_text((FIX / "targets" / "kimi-k2.5.json").read_text())
    (tmp / "consistency.toml").write_text(
        '[[lint]]\nname = "kimi"\ndraft = "drafts/kimi/config.json"\n'
        f'target = "kimi.json"\nruntime = "{runtime}"\ntrained_with = "stream:0,3,31"\n'
        '[[compare]]\nname = "not run by the hook"\n'
        'reference = "missing.safetensors"\ncandidate = "missing.safetensors"\n')
    return tmp


FILE_SUFFIXES = {".json", ".yaml", ".yml", ".toml", ".safetensors", ".npz", ".pt", ".pth", ".ckpt", ".gz"}


def _documented_inputs() -> set[str]:
    """Every input file a documented consistency.toml names (docs/ci.md, the tutorial), as a
    repository path; a draft directory stands for its config.json and its weights."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    found: set[str] = set()
    for doc in ("docs/ci.md", "docs/tutorial-low-acceptance.md"):
        text = (ROOT / doc).read_text()  # ```toml blocks, and configs a console block writes with a heredoc
        for block in re.findall(r"```toml\n(.*?)```", text, re.S) + \
                re.findall(r"cat > \S*\.toml <<'EOF'\n(.*?)^EOF$", text, re.S | re.M):
            cfg = tomllib.loads(block)
            for entry in (e for kind in ("lint", "compare", "replay") for e in cfg.get(kind, [])):
                for key in ("draft", "target", "trained_with", "reference", "candidate", "contract"):
                    v = entry.get(key)
                    if not isinstance(v, str) or ":" in v or v.startswith("tiny-"):
                        continue  # "specforge:1,29,57" and built-in names are not files
                    is_file = Path(v).suffix in FILE_SUFFIXES  # "models/kimi-k2.5" is a directory, not a ".5" file
                    found |= {v} if is_file else {f"{v}/config.json", f"{v}/model.safetensors"}
    return found


def test_precommit_hook_files_pattern() -> None:
    """Each hook fires on every input the documented configs name (configs/kimi-k2.5.json is not
    config.json), on the gate config wherever it lives, and not on unrelated files."""
    docs = _documented_inputs()
    assert {"configs/kimi-k2.5.json", "target-config.json", "dumps/train.safetensors"} <= docs, docs
    for hook in ("consistency-lint", "consistency-lint-draft"):
        pat = re.compile(_hooks()[hook]["files"])
        for f in sorted(docs) + ["drafts/kimi/config.json", "config.json", "drafts/kimi/model.safetensors",
                                 "drafts/kimi/model.safetensors.index.json", "contract.yaml"]:
            assert pat.search(f), (hook, f)
        for f in ("README.md", "consistency.toml.bak", "src/train.py", "my_config.json.orig", "model.bin"):
            assert not pat.search(f), (hook, f)
    pat = re.compile(_hooks()["consistency-lint"]["files"])
    assert all(pat.search(f) for f in ("consistency.toml", "ci/consistency.toml", "ci/gate.toml"))


def test_precommit_hook_entry_on_real_files(tmp_path: Path) -> None:
    hook = _hooks()["consistency-lint"]
    assert hook["language"] == "python" and hook["pass_filenames"] is False
    good = _entry(hook, cwd=_project(tmp_path / "good", "kimi-k2.5-eagle3-fixed.json", "sglang@0.5.23"))
    assert good.returncode == 0, good.stdout + good.stderr  # only the lint ran: the missing dumps are not read
    assert "compare/" not in good.stdout and "::" not in good.stdout  # no workflow annotations in a terminal
    bad = _entry(hook, cwd=_project(tmp_path / "bad", "kimi-k2.5-eagle3-seed.json", "sglang@0.5.12"))
    assert bad.returncode == 1 and "[3, 31, 59]" in bad.stdout, bad.stdout + bad.stderr
    elsewhere = _entry(hook, "--config", str(tmp_path / "bad" / "consistency.toml"), cwd=tmp_path)
    assert elsewhere.returncode == 1  # args: [--config, PATH] for a config off the root


def test_precommit_single_draft_hook(tmp_path: Path) -> None:
    hook = _hooks()["consistency-lint-draft"]
    p = _project(tmp_path, "kimi-k2.5-eagle3-seed.json", "sglang@0.5.12")
    r = _entry(hook, "--draft", "drafts/kimi/config.json", "--target", "kimi.json", "--runtime", "sglang@0.5.12",
               "--trained-with", "stream:0,3,31", cwd=p)
    assert r.returncode == 1 and len(r.stdout.strip().splitlines()) == 1, r.stdout  # -q: the verdict line only
