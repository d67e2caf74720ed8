"""``consistency gate``: declared lints, compares and replays in one CI step, reported as
exit code, JSON, JUnit XML, GitHub annotations and a Markdown step summary."""

from __future__ import annotations

import json
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import cli, run_cli
from consistency.contract.models import AuxInfo, DumpMetadata, ModelInfo
from consistency.dump.writer import write_dump
from consistency.gate.config import load
from consistency.gate.runner import Runners, run_gate
from tests.lint.test_lint_support import FIX

SEED = """
[gate]
fail_on = "error"

[[lint]]
name = "kimi-seed"
draft = "drafts/seed.json"
target = "kimi.json"
runtime = "sglang@0.5.12"
trained_with = "stream:0,3,31"
serve = "python -m sglang.launch_server --speculative-algorithm EAGLE3 --speculative-num-steps 1 --speculative-eagle-topk 1 --speculative-num-draft-tokens 6"

[[lint]]
name = "kimi-fixed"
draft = "drafts/fixed.json"
target = "kimi.json"
runtime = "sglang@0.5.23"
trained_with = "stream:0,3,31"
"""

COMPARE = """
[[compare]]
name = "{name}"
reference = "dumps/train.safetensors"
candidate = "dumps/{cand}.safetensors"
"""


def _dumps(d: Path) -> None:
    rng = np.random.default_rng(0)
    h = [rng.standard_normal((16, 32)).astype(np.float32) for _ in range(9)]
    meta = DumpMetadata(model=ModelInfo(num_layers=8, hidden_size=32), aux=AuxInfo(stream_ids=[0, 3, 6]))
    train = {f"hidden.{i}": h[i] for i in range(9)} | {f"aux.{k}": h[s] for k, s in enumerate([0, 3, 6])}
    write_dump(d / "train.safetensors", train, meta)
    write_dump(d / "same.safetensors", {f"aux.{k}": h[s] for k, s in enumerate([0, 3, 6])},
               DumpMetadata(aux=AuxInfo(stream_ids=[0, 3, 6])))
    write_dump(d / "shifted.safetensors", {f"aux.{k}": h[s] for k, s in enumerate([3, 6, 8])},
               DumpMetadata(aux=AuxInfo(stream_ids=[3, 6, 8])))


def project(tmp: Path, *extra: str) -> Path:
    (tmp / "drafts").mkdir()
    (tmp / "dumps").mkdir()
    shutil.copy(FIX / "drafts" / "sglang" / "kimi-k2.5-eagle3-seed.json", tmp / "drafts" / "seed.json")
    shutil.copy(FIX / "drafts" / "sglang" / "kimi-k2.5-eagle3-fixed.json", tmp / "drafts" / "fixed.json")
    shutil.copy(FIX / "targets" / "kimi-k2.5.json", tmp / "kimi.json")
    _dumps(tmp / "dumps")
    cfg = tmp / "consistency.toml"
    cfg.write_text(SEED + "".join(extra))
    return cfg


def test_gate_reports_every_format(tmp_path: Path) -> None:
    cfg = project(tmp_path, COMPARE.format(name="same", cand="same"), COMPARE.format(name="shifted", cand="shifted"))
    summary = tmp_path / "summary.md"
    summary.write_text("earlier step\n")
    r = cli("gate", "--config", str(cfg), "--json", str(tmp_path / "gate.json"), "--junit", str(tmp_path / "j.xml"),
            "--sarif", str(tmp_path / "g.sarif"), "--annotations", env={"GITHUB_STEP_SUMMARY": str(summary)})
    assert r.returncode == 1, r.stderr
    rep = json.loads((tmp_path / "gate.json").read_text())
    verdicts = {(c["kind"], c["name"]): c["verdict"] for c in rep["checks"]}
    assert verdicts == {("lint", "kimi-seed"): "fail", ("lint", "kimi-fixed"): "pass", ("compare", "same"): "pass",
                        ("compare", "shifted"): "fail"}
    seed = next(c for c in rep["checks"] if c["name"] == "kimi-seed")
    assert seed["report"]["serving_streams"] == [3, 31, 59]
    # JUnit: a suite per check, a case per rule / tensor
    root = ET.parse(tmp_path / "j.xml").getroot()
    suites = {s.get("name"): s for s in root.iter("testsuite")}
    lint_suite = suites["lint: kimi-seed"]
    cases = {c.get("name"): c for c in lint_suite.iter("testcase")}
    assert len(cases) == len(seed["report"]["rules"])
    assert cases["IDS002 ids-stream-mismatch"].find("failure") is not None
    assert cases["IDS002 ids-stream-mismatch"].get("file", "").endswith("seed.json")
    assert cases["VOC001 d2t-missing"].find("skipped") is not None
    shifted = {c.get("name"): c for c in suites["compare: shifted"].iter("testcase")}
    assert {"aux.0", "aux.1", "aux.2"} <= set(shifted) and shifted["aux.0"].find("failure") is not None
    assert all(c.find("failure") is None for c in suites["compare: same"].iter("testcase"))
    assert int(root.get("failures")) == sum(int(s.get("failures")) for s in suites.values())
    # annotations on stdout, on the config line
    ann = [line for line in r.stdout.splitlines() if line.startswith("::error ")]
    ids = next(a for a in ann if "IDS002" in a)
    assert "file=" in ids and ",line=" in ids and "%0Afix%3A" not in ids and "%0Afix: " in ids
    assert any(line.startswith("::warning ") and "SRV001" in line for line in r.stdout.splitlines())
    # step summary appended, with the slot table
    md = summary.read_text()
    assert md.startswith("earlier step\n") and "## consistency gate: " in md and "FAIL" in md
    assert "| 0 | 0 | 3 ❌ | 2 |" in md
    # SARIF: one run per lint check
    sarif = json.loads((tmp_path / "g.sarif").read_text())
    assert [run["automationDetails"]["id"] for run in sarif["runs"]] == ["consistency/lint/kimi-seed",
                                                                         "consistency/lint/kimi-fixed"]


def test_gate_passes_with_exit_0_and_runs_from_any_directory(tmp_path: Path) -> None:
    cfg = project(tmp_path, COMPARE.format(name="same", cand="same"))
    r = run_cli("gate", "--config", str(cfg), "--only", "kimi-fixed", "--only", "compare/same", "--json", "-",
            cwd=Path("/"))
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads(r.stdout)
    assert rep["verdict"] == "pass" and [c["name"] for c in rep["checks"]] == ["kimi-fixed", "same"]


def test_unreadable_input_is_an_error_check_and_the_rest_still_runs(tmp_path: Path) -> None:
    cfg = project(tmp_path, COMPARE.format(name="gone", cand="missing"))
    r = run_cli("gate", "--config", str(cfg), "--json", "-")
    assert r.returncode == 2
    rep = json.loads(r.stdout)
    gone = next(c for c in rep["checks"] if c["name"] == "gone")
    assert gone["verdict"] == "error" and "missing.safetensors" in gone["summary"]
    assert {c["name"] for c in rep["checks"]} == {"kimi-seed", "kimi-fixed", "gone"}


@pytest.mark.parametrize("text,needle", [
    ("[[lint]]\nname='x'\ntrained-with='stream:0'\n", "unknown key(s) ['trained-with']"),
    ("[[lint]\n", "not valid TOML"),
    ("[gate]\nfail_on='error'\n", "declares no checks"),
    ("[[lint]]\nname='a'\n[[lint]]\nname='a'\n", "check names must be unique"),
    ("[lints]\n", "unknown section"),
])
def test_bad_config_exits_2_with_one_line(tmp_path: Path, text: str, needle: str) -> None:
    (tmp_path / "consistency.toml").write_text(text)
    r = run_cli("gate", "--config", str(tmp_path / "consistency.toml"))
    assert r.returncode == 2 and needle in r.stderr and r.stderr.count("\n") == 1, r.stderr


def test_outputs_are_not_clobbered_without_force(tmp_path: Path) -> None:
    cfg = project(tmp_path)
    (tmp_path / "j.xml").write_text("keep")
    r = run_cli("gate", "--config", str(cfg), "--junit", str(tmp_path / "j.xml"))
    assert r.returncode == 2 and (tmp_path / "j.xml").read_text() == "keep"


def test_replay_that_cannot_run_is_an_error_unless_optional(tmp_path: Path) -> None:
    """An install without replay (its module blocked in the subprocess): the declared replay
    is an error, not a skip (a CI job without torch must not turn it into a green gate);
    ``optional = true`` makes it an info skip that the summary names as not checked."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['consistency.replay.api'] = None\n"
            "from consistency.cli import run; run(sys.argv[1:])")
    for optional, rc, verdict in (("", 2, "error"), ("optional = true\n", 0, "skipped")):
        d = tmp_path / f"opt{bool(optional)}"
        d.mkdir()
        cfg = project(d, f'\n[[replay]]\nname = "acceptance"\ndraft = "drafts/seed.json"\n{optional}')
        r = subprocess.run([sys.executable, "-c", code, "gate", "--config", str(cfg), "--only", "kimi-fixed", "--only",
                            "acceptance", "--json", "-", "--junit", str(d / "j.xml")], capture_output=True, text=True)
        assert r.returncode == rc, r.stderr
        rep = json.loads(r.stdout)
        replay = next(c for c in rep["checks"] if c["kind"] == "replay")
        assert replay["verdict"] == verdict and "replay is not available" in replay["summary"]
        suite = next(s for s in ET.parse(d / "j.xml").getroot().iter("testsuite")
                     if s.get("name") == "replay: acceptance")
        if optional:
            assert replay["cases"][0]["severity"] == "info" and suite.get("skipped") == "1"
            assert rep["verdict"] == "pass" and rep["summary"].endswith("; not checked: replay/acceptance")
        else:
            assert replay["cases"][0]["status"] == "error" and suite.get("errors") == "1"
            assert rep["verdict"] == "error" and "optional = true" in replay["summary"]


def test_replay_hook_contract(tmp_path: Path) -> None:
    """What the gate expects from consistency.replay.api.replay_check once it exists."""
    cfg = load(project(tmp_path, '\n[[replay]]\nname = "acc"\ndraft = "drafts/seed.json"\nmin_acceptance = 0.6\n'))
    seen: list[dict] = []

    def replay_check(opts: dict) -> dict:
        seen.append(opts)
        return {"verdict": "fail", "summary": "predicted acceptance 0.31 < 0.6",
                "findings": [{"code": "ACCEPTANCE_DROP", "severity": "error", "message": "0.31 < 0.6",
                              "tensor": "aux"}]}

    def lint(opts: dict) -> dict:
        return {"verdict": "pass", "summary": "", "rules": [], "findings": []}

    rep = run_gate(cfg, Runners(lint, lint, replay_check), only=("acc",))
    assert seen == [{"draft": str(tmp_path / "drafts" / "seed.json"), "min_acceptance": 0.6}]
    chk = rep.checks[0]
    assert chk.verdict == "fail" and [c.status for c in chk.cases] == ["failed", "failed"]
    assert rep.exit_code == 1


def test_github_actions_environment_turns_on_annotations_and_summary(tmp_path: Path) -> None:
    cfg = project(tmp_path, COMPARE.format(name="shifted", cand="shifted"))
    summary = tmp_path / "step-summary.md"
    r = run_cli("gate", "--config", "consistency.toml", "--kind", "lint", cwd=tmp_path,
            env={"GITHUB_ACTIONS": "true", "GITHUB_STEP_SUMMARY": str(summary)})
    assert r.returncode == 1
    errors = [line for line in r.stdout.splitlines() if line.startswith("::error ")]
    assert errors and all("file=drafts/seed.json,line=" in line for line in errors)  # repository-relative
    assert "compare" not in summary.read_text()  # --kind lint ran the lints only
    assert cfg.is_file()


# --- a config is someone else's file: containment, types, force (issue 15) ---

@pytest.mark.parametrize("text,needle", [
    ('json = "../escaped.json"', "points outside the config's directory"),
    ('junit = "/tmp/consistency-gate-escape.xml"', "points outside the config's directory"),
    ('sarif = "sub/../../escaped.sarif"', "points outside the config's directory"),
    ('summary = "../summary.md"', "points outside the config's directory"),
    ("force = true", "pass --force on the command line"),
    ('fail_on = "warnings"', "fail_on = 'warnings': expected \"error\" or \"warning\""),
    ('annotations = "no"', "annotations = 'no': expected true or false"),
    ("json = 3", "json = 3: expected a string"),
])
def test_gate_section_from_the_config_is_validated(tmp_path: Path, text: str, needle: str) -> None:
    proj = tmp_path / "proj"
    proj.mkdir()
    cfg = project(proj)
    cfg.write_text(cfg.read_text().replace('[gate]\nfail_on = "error"\n', f"[gate]\n{text}\n"))
    r = run_cli("gate", "--config", str(cfg))
    assert r.returncode == 2 and needle in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert "Traceback" not in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["proj"]  # nothing written outside


@pytest.mark.parametrize("entry,needle", [
    ('rtol = "big"', "rtol = 'big': expected a number"),
    ("layer_ids = [0, 3.5]", "expected a list of integers"),
    ("convention = 3", "convention = 3: expected a string"),
    ("contract = true", "contract = True: expected a string"),
])
def test_wrong_value_types_in_checks_are_one_line_errors(tmp_path: Path, entry: str, needle: str) -> None:
    cfg = project(tmp_path, COMPARE.format(name="same", cand="same") + entry + "\n")
    r = run_cli("gate", "--config", str(cfg))
    assert r.returncode == 2 and needle in r.stderr and r.stderr.count("\n") == 1, r.stderr


def test_a_symlinked_directory_does_not_carry_outputs_outside(tmp_path: Path) -> None:
    proj, outside = tmp_path / "proj", tmp_path / "outside"
    proj.mkdir()
    outside.mkdir()
    (proj / "reports").symlink_to(outside, target_is_directory=True)
    cfg = project(proj)
    cfg.write_text(cfg.read_text().replace("[gate]\n", '[gate]\njson = "reports/gate.json"\n'))
    r = run_cli("gate", "--config", str(cfg))
    assert r.returncode == 2 and "outside the config's directory" in r.stderr
    assert not list(outside.iterdir())
    # the command line is the runner's own choice: it may write anywhere
    cfg.write_text(cfg.read_text().replace('json = "reports/gate.json"\n', ""))
    r = run_cli("gate", "--config", str(cfg), "--json", str(outside / "gate.json"), "--only", "kimi-fixed")
    assert r.returncode == 0, r.stderr
    assert json.loads((outside / "gate.json").read_text())["verdict"] == "pass"


def test_outputs_inside_the_config_tree_are_written_there(tmp_path: Path) -> None:
    cfg = project(tmp_path)
    (tmp_path / "reports").mkdir()
    cfg.write_text(cfg.read_text().replace("[gate]\n", '[gate]\njson = "reports/gate.json"\njunit = "j.xml"\n'))
    r = run_cli("gate", "--config", "consistency.toml", "--only", "kimi-fixed", cwd=Path("/"))
    assert r.returncode == 2, r.stderr  # relative to the config, not the cwd: / holds no consistency.toml
    r = run_cli("gate", "--config", str(cfg), "--only", "kimi-fixed", cwd=Path("/"))
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "reports" / "gate.json").read_text())["verdict"] == "pass"
    ET.parse(tmp_path / "j.xml")


@pytest.mark.parametrize("option", ["--json", "--junit", "--sarif", "--summary"])
def test_a_fifo_or_device_is_refused_as_an_output(tmp_path: Path, option: str) -> None:
    import os

    cfg = project(tmp_path)
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    for target in (fifo, Path("/dev/null")):
        r = run_cli("gate", "--config", str(cfg), option, str(target), "--only", "kimi-fixed", "--force")
        assert r.returncode == 2 and "not a regular file" in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert fifo.exists() and not fifo.is_file()


def test_reports_are_rewritten_in_a_loop_but_a_dump_never(tmp_path: Path) -> None:
    cfg = project(tmp_path)
    for _ in range(2):  # a previous report of ours is an output, not data
        r = run_cli("gate", "--config", str(cfg), "--only", "kimi-fixed", "--json", str(tmp_path / "g.json"),
                "--junit", str(tmp_path / "g.xml"), "--sarif", str(tmp_path / "g.sarif"))
        assert r.returncode == 0, r.stderr
    dump = tmp_path / "dumps" / "same.safetensors"
    before = dump.read_bytes()
    r = run_cli("gate", "--config", str(cfg), "--only", "kimi-fixed", "--json", str(dump))
    assert r.returncode == 2 and "output exists" in r.stderr and dump.read_bytes() == before


def test_builtin_names_in_a_config_resolve_wherever_it_sits(tmp_path: Path) -> None:
    from consistency.cli.gate_cmd import builtin_names

    cfg = project(tmp_path, '\n[[replay]]\nname = "acc"\ndraft = "tiny-llama-eagle3"\ntarget = "tiny-llama"\n'
                            'reference = "dumps/train.safetensors"\ncandidate = "dumps/same.safetensors"\n')
    opts = next(c for c in load(cfg, builtin_names()).checks if c.kind == "replay").options
    assert opts["draft"] == "tiny-llama-eagle3" and opts["target"] == "tiny-llama"
    assert opts["reference"] == str(tmp_path / "dumps" / "train.safetensors")
    (tmp_path / "tiny-llama").mkdir()  # a directory of that name next to the config wins
    opts = next(c for c in load(cfg, builtin_names()).checks if c.kind == "replay").options
    assert opts["target"] == str(tmp_path / "tiny-llama")


BLOCK_TORCH = """
import sys
class _Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers", "accelerate"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, _Blocker())
from consistency.cli import run
run(sys.argv[1:])
"""


def test_gate_without_torch_runs_lint_and_compare_and_errs_on_replay_with_the_install_line(tmp_path: Path) -> None:
    import subprocess
    import sys

    cfg = project(tmp_path, COMPARE.format(name="same", cand="same"),
                  '\n[[replay]]\nname = "acc"\ndraft = "tiny-llama-eagle3"\ntarget = "tiny-llama"\n'
                  'reference = "dumps/train.safetensors"\ncandidate = "dumps/same.safetensors"\n')
    r = subprocess.run([sys.executable, "-c", BLOCK_TORCH, "gate", "--config", str(cfg), "--only", "kimi-fixed",
                        "--only", "same", "--only", "acc", "--json", str(tmp_path / "g.json"),
                        "--junit", str(tmp_path / "g.xml")], capture_output=True, text=True, timeout=600)
    assert "Traceback" not in r.stderr and "ModuleNotFoundError" not in r.stdout + r.stderr
    rep = json.loads((tmp_path / "g.json").read_text())
    verdicts = {c["name"]: c["verdict"] for c in rep["checks"]}
    assert verdicts == {"kimi-fixed": "pass", "same": "pass", "acc": "error"}
    acc = next(c for c in rep["checks"] if c["name"] == "acc")
    assert "pip install 'specdec-consistency[hf]'" in acc["summary"] and "cannot run here" in acc["summary"]
    assert all(c["status"] == "error" for c in acc["cases"])  # never counted as passed, nor as skipped
    assert rep["summary"].startswith("3 checks: 2 passed, 0 failed, 1 errored, 0 skipped (replay/acc)")
    assert r.returncode == 2 and "pip install 'specdec-consistency[hf]'" in r.stdout
    suite = next(s for s in ET.parse(tmp_path / "g.xml").getroot().iter("testsuite") if s.get("name") == "replay: acc")
    assert suite.get("errors") == "1" and suite.get("failures") == "0"


def test_a_gate_where_everything_was_skipped_is_not_a_pass(tmp_path: Path) -> None:
    cfg = load(project(tmp_path, '\n[[replay]]\nname = "acc"\ndraft = "drafts/seed.json"\noptional = true\n'))
    rep = run_gate(cfg, Runners(lambda o: {}, lambda o: {}, None, "replay needs torch"), only=("acc",))
    assert rep.verdict == "error" and "nothing was checked" in rep.summary and rep.exit_code == 2
    assert rep.checks[0].verdict == "skipped"


def test_quiet_prints_the_verdict_line_only_and_counts_read_as_english(tmp_path: Path) -> None:
    cfg = project(tmp_path)
    r = run_cli("gate", "--config", str(cfg), "--only", "kimi-fixed", "-q")
    assert r.returncode == 0 and r.stdout.splitlines() == ["PASS  1 check: 1 passed, 0 failed, 0 errored, 0 skipped"]
    r = run_cli("gate", "--config", str(cfg), "--quiet")
    assert r.returncode == 1 and len(r.stdout.splitlines()) == 1 and r.stdout.startswith("FAIL  2 checks: ")


def test_a_kind_with_zero_checks_is_nothing_to_check(tmp_path):
    """--kind replay on a config without [[replay]]: exit 2, never a pass of zero checks (issue 24)."""
    from tests.conftest import run_cli

    cfg = tmp_path / "consistency.toml"
    cfg.write_text('[[lint]]\nname = "l"\ntarget = "tiny-llama"\n')
    r = run_cli("gate", "--config", str(cfg), "--kind", "replay", cwd=tmp_path)
    assert r.returncode == 2 and "nothing to check" in r.stderr, r.stderr


def _unclaimed_dumps(d: Path) -> None:
    """A reference recording every stream and claiming no aux ids, and two candidates whose aux
    slots claim nothing either: only a declaration says which stream each slot should hold."""
    rng = np.random.default_rng(1)
    h = [rng.standard_normal((16, 32)).astype(np.float32) for _ in range(9)]
    write_dump(d / "ref.safetensors", {f"hidden.{i}": h[i] for i in range(9)},
               DumpMetadata(model=ModelInfo(num_layers=8, hidden_size=32)))
    for name, streams in (("good", [0, 3, 6]), ("bad", [3, 6, 8])):
        write_dump(d / f"{name}.safetensors", {f"aux.{k}": h[s] for k, s in enumerate(streams)}, DumpMetadata())


@pytest.mark.parametrize("cand", ["good", "bad"])
@pytest.mark.parametrize("entry", [{"ref_layer_ids": [0, 3, 6]}, {"ref_layer_ids": "0,3,6", "consumer": "eagle3"},
                                   {"cand_layer_ids": [0, 3, 6]}, {"consumer": "mtp"}, {}])
def test_every_compare_request_field_can_be_set_from_a_gate_config(tmp_path: Path, cand: str,
                                                                   entry: dict[str, object]) -> None:
    """The gate's [[compare]] keys are CompareRequest's fields (issue 38): ``ref_layer_ids``,
    ``cand_layer_ids`` and ``consumer`` reach the comparison, and a real gate run finds what
    the Python API finds with the same request."""
    from consistency import api

    _unclaimed_dumps(tmp_path)
    toml = "".join(f"{k} = {json.dumps(v)}\n" for k, v in entry.items())
    cfg = tmp_path / "consistency.toml"
    cfg.write_text(f'[[compare]]\nname = "c"\nreference = "ref.safetensors"\ncandidate = "{cand}.safetensors"\n{toml}')
    r = run_cli("gate", "--config", str(cfg), "--json", "-", cwd=Path("/"))
    assert r.returncode in (0, 1), r.stdout + r.stderr
    got = json.loads(r.stdout)["checks"][0]["report"]
    want = api.compare(tmp_path / "ref.safetensors", tmp_path / f"{cand}.safetensors", **entry)
    assert (got["verdict"], sorted(f["code"] for f in got["findings"])) == \
        (want.verdict, sorted(f.code for f in want.findings))
    # the declaration is what decides here: with the reference's ids declared the right slots pass
    assert (want.verdict == "pass") == (cand == "good" and "ref_layer_ids" in entry)
