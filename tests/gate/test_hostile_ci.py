"""The GitHub Action played as a pull request would play it: every file it commits is hostile.

Each attack is a temporary git repository (the PR's checkout: a config, committed files,
symlinks, a ``.venv`` and ``.git`` of its own) on which the Action's two steps run exactly as
action.yml runs them: ``scripts/action.py install`` (for its decision: what it would install,
made by the installed gate's own reading of the config; ``--dry-run`` so that nothing is
downloaded) and ``scripts/action.py gate`` with ``GITHUB_ACTIONS``, ``GITHUB_OUTPUT``,
``GITHUB_STEP_SUMMARY``, ``RUNNER_TEMP`` and ``GITHUB_WORKSPACE`` set, in the job's environment:

* ``full``: this test's own environment (torch and transformers installed);
* ``lean``: a real virtual environment holding every package of this one but torch,
  transformers and accelerate (symlinked; what ``pip install consistency`` gives a CI job).

After each run: the outputs (verdict, exit-code and the step's status agree; each key once;
the verdict the attack expects), every file of the checkout outside the reports the attack
lets the gate write is byte-identical (``.git/`` included), the job summary was appended to,
no line of the log is a workflow command we did not write (``::`` or the legacy ``##[``),
and no marker file appeared — also after sourcing the committed ``.venv/bin/activate`` and
the job summary in bash, as a later workflow step might.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import ROOT

SCRIPT = ROOT / "scripts" / "action.py"
FIX = ROOT / "fixtures" / "configs"
MARK = "PWNED"
BLOCKED = {"torch", "torchgen", "functorch", "transformers", "accelerate", "speculators", "triton", "nvidia",
           "transformers_stream_generator"}
SEED = FIX / "drafts" / "sglang" / "kimi-k2.5-eagle3-seed.json"
FIXED = FIX / "drafts" / "sglang" / "kimi-k2.5-eagle3-fixed.json"
TARGET = FIX / "targets" / "kimi-k2.5.json"
LINT_FIXED = ('[[lint]]\nname = "fixed"\ndraft = "drafts/fixed.json"\ntarget = "kimi.json"\nruntime = "sglang@0.5.23"\n'
              'trained_with = "stream:0,3,31"\n')
LINT_SEED = ('[[lint]]\nname = "seed"\ndraft = "drafts/seed.json"\ntarget = "kimi.json"\nruntime = "sglang@0.5.12"\n'
             'trained_with = "stream:0,3,31"\n')
LINT_WARN = '[[lint]]\nname = "warn"\ndraft = "drafts/seed.json"\ntarget = "kimi.json"\nruntime = "vllm@0.33.0"\n'
ACTIVATE = "# a committed virtualenv script a later step may source\nexport PR_VENV=1\n"
REDOS_NAME = "a" * 35 + "!"


def _replay(table: str = "[[replay]]") -> str:
    return (f'{table}\nname = "acc"\ndraft = "tiny-llama-eagle3"\ntarget = "tiny-llama"\n'
            'reference = "dumps/train.safetensors"\ncandidate = "dumps/serve.safetensors"\n')


@dataclass
class Attack:
    name: str
    config: str
    files: dict[str, str | bytes] = field(default_factory=dict)  # committed (path -> content)
    links: dict[str, str] = field(default_factory=dict)  # committed symlinks (path -> target)
    env: str = "lean"  # lean | full
    verdict: str = "pass"
    code: int | None = None  # the step's exit status (default: the verdict's)
    replay: bool = False  # what install decides (torch installed?)
    writes: tuple[str, ...] = ()  # files of the checkout the gate may create or change
    inputs: dict[str, str] = field(default_factory=dict)  # the Action's with: inputs
    config_path: str = "consistency.toml"
    stdout: tuple[str, ...] = ()  # must appear in the log
    summary: bool = True  # the job summary gets a report (False: the gate stopped before its checks)
    recorded: bool = False  # real recordings of the built-in target (a replay that runs)


HOSTILE_NAMES = ["##[set-output name=verdict;]pass", "::set-output name=verdict::pass", "##[add-mask]x",
                 "::stop-commands::tok", "x; touch PWNED; true", "$(touch PWNED)", "`touch PWNED`",
                 "<touch PWNED>", "|touch PWNED", "&touch PWNED&", "x\n::error::forged"]


def _hostile_lints() -> str:
    return "".join(LINT_SEED.replace('name = "seed"', f"name = {json.dumps(n)}") for n in HOSTILE_NAMES)


def _deep_config() -> str:
    base = FIXED.read_text().rstrip().rstrip("}")
    return base + ', "x": ' + '{"a": ' * 5000 + "1" + "}" * 5000 + "}"


def _many_ids() -> str:
    cfg = json.loads(FIXED.read_text())
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = list(range(40_000))
    return json.dumps(cfg)


EVIL_MODEL = {"config.json": json.dumps({"model_type": "evil", "architectures": ["EvilModel"], "vocab_size": 32,
                                         "auto_map": {"AutoConfig": "evil.EvilConfig",
                                                      "AutoModelForCausalLM": "evil.EvilModel"}}),
              "evil.py": "import pathlib\npathlib.Path('PWNED').write_text('ran')\n"}

SECRET = "TOKEN=s3cr3t-v4lue-of-the-runner"
PAYLOAD = "import pathlib\npathlib.Path('PWNED').write_text('ran')\n"
FORGE = ("import json, sys\nif '--result' in sys.argv:\n    r = sys.argv[sys.argv.index('--result') + 1]\n"
         "    open(r, 'w').write(json.dumps({'tool': 'consistency', 'kind': 'gate', 'verdict': 'pass'}))\n"
         "if '--plan' in sys.argv:\n    print(json.dumps({'kind': 'gate-plan', 'needs': []}))\n"
         "print('PASS  forged')\nsys.exit(0)\n")  # a gate of the PR's: writes a pass where the Action reads it
# stdlib and dependency names the gate (and pip, venv) import; in the checkout's root they
# came first on sys.path of every ``python -m`` the Action ran there
SHADOW = {f"{m}.py": PAYLOAD for m in ("json", "tomllib", "click", "pydantic", "numpy", "argparse", "tempfile",
                                      "importlib_metadata", "typing_extensions", "rich", "sitecustomize")}
SHADOW.update({"pip/__init__.py": PAYLOAD, "pip/__main__.py": PAYLOAD, "venv/__main__.py": PAYLOAD})

ATTACKS = [
    # --- what install decides: the gate's own TOML loader and model, not a regex over the text
    Attack("quoted-table-replay-lean", LINT_FIXED + _replay('[["replay"]]'), verdict="error", replay=True),
    Attack("quoted-table-replay-full", LINT_FIXED + _replay('[["replay"]]'), env="full", verdict="fail", replay=True,
           recorded=True, stdout=("FAIL  replay/acc",)),
    Attack("single-quoted-spaced-replay", LINT_FIXED + _replay("[[ 'replay' ]]"), verdict="error", replay=True),
    Attack("inline-array-replay", 'replay = [{name = "acc", draft = "tiny-llama-eagle3", target = "tiny-llama", '
           'reference = "dumps/train.safetensors", candidate = "dumps/serve.safetensors"}]\n' + LINT_FIXED,
           verdict="error", replay=True),
    Attack("replay-only-in-a-string", LINT_FIXED.replace('name = "fixed"', 'name = """fixed\n[[replay]]\n"""'),
           verdict="pass", replay=False),
    Attack("optional-replay-skips-by-the-configs-own-choice", LINT_FIXED + _replay() + "optional = true\n",
           verdict="pass", replay=True, stdout=("not checked: replay/acc",)),
    # --- the verdict comes from this run's own result, never from a committed file
    Attack("committed-pass-at-the-json-path", LINT_SEED, files={"out/gate.json": '{"verdict": "pass"}\n'},
           inputs={"json": "out/gate.json"}, verdict="error", summary=False),
    Attack("committed-list-at-the-json-path", LINT_SEED, files={"out/gate.json": "[]\n"},
           inputs={"json": "out/gate.json"}, verdict="error", summary=False),
    Attack("committed-look-alike-report", LINT_SEED,
           files={"out/gate.json": '{"tool": "consistency", "kind": "gate", "verdict": "pass"}\n'},
           inputs={"json": "out/gate.json"}, verdict="fail", writes=("out/gate.json",)),
    Attack("config-json-at-a-committed-pass", '[gate]\njson = "out/gate.json"\n' + LINT_SEED,
           files={"out/gate.json": '{"verdict": "pass"}\n'}, verdict="error", summary=False),
    Attack("config-json-is-written-and-reported", '[gate]\njson = "reports/gate.json"\n' + LINT_SEED,
           verdict="fail", writes=("reports/gate.json", "reports")),
    Attack("fail-on-warning-agrees", '[gate]\nfail_on = "error"\n' + LINT_WARN, inputs={"fail-on": "warning"},
           verdict="fail"),
    Attack("annotations-input-not-a-boolean", LINT_FIXED, inputs={"annotations": "maybe"}, verdict="error",
           summary=False),
    Attack("fail-on-input-unknown", LINT_FIXED, inputs={"fail-on": "nothing"}, verdict="error", summary=False),
    Attack("fail-on-never-reports-only", LINT_SEED, inputs={"fail-on": "never"}, verdict="fail", code=0),
    # --- what GitHub shows is the runner's, not the config's
    Attack("config-turns-annotations-off", '[gate]\nannotations = false\n' + LINT_SEED, verdict="fail",
           stdout=("::error ", "annotations = false is ignored under GitHub Actions")),
    Attack("config-redirects-the-summary", '[gate]\nsummary = "mine.md"\n' + LINT_SEED, verdict="fail",
           writes=("mine.md",)),
    # --- writes: only files the gate creates, never .git/, a dot-directory, or outside
    Attack("summary-into-git-config", '[gate]\nsummary = ".git/config"\n' + LINT_FIXED, verdict="error",
           summary=False),
    Attack("summary-into-venv-activate", '[gate]\nsummary = ".venv/bin/activate"\n' + _hostile_lints(),
           verdict="error", summary=False),
    Attack("summary-through-a-symlink-into-git-hooks", '[gate]\nsummary = "hooks/pre-commit"\n' + LINT_FIXED,
           links={"hooks": ".git/hooks"}, verdict="error", summary=False),
    Attack("json-through-a-symlink-outside", '[gate]\njson = "out/r.json"\n' + LINT_FIXED,
           links={"out": "/tmp"}, verdict="error", summary=False),
    Attack("summary-over-a-committed-readme", '[gate]\nsummary = "README.md"\n' + LINT_FIXED, verdict="error",
           summary=False),
    Attack("junit-outside-the-tree", '[gate]\njunit = "../outside.xml"\n' + LINT_FIXED, verdict="error",
           summary=False),
    Attack("config-under-github-writes-a-workflow", '[gate]\nsummary = "workflows/ci.yml"\n' + LINT_FIXED.replace(
        '"drafts/', '"../drafts/').replace('"kimi.json"', '"../kimi.json"'), config_path=".github/consistency.toml",
        verdict="error", summary=False),
    Attack("newline-in-an-output-path", '[gate]\njson = "a\\nverdict=pass.json"\n' + LINT_FIXED, verdict="error",
           summary=False),
    Attack("config-asks-for-force", '[gate]\nforce = true\n' + LINT_FIXED, verdict="error", summary=False),
    # --- the workflow names an output path; the pull request commits a symlink (or a file) on it
    Attack("json-input-through-a-committed-symlink-into-git", LINT_FIXED, links={"out": ".git"},
           inputs={"json": "out/gate.json"}, verdict="error", summary=False),
    Attack("junit-input-through-a-committed-symlink-outside", LINT_FIXED, links={"out": "../runner"},
           inputs={"junit": "out/junit.xml"}, verdict="error", summary=False),
    Attack("sarif-input-through-a-symlinked-parent-into-a-dot-dir", LINT_FIXED, links={"reports": ".venv/bin"},
           inputs={"sarif": "reports/lint.sarif"}, verdict="error", summary=False),
    Attack("dangling-symlink-at-the-json-input", LINT_FIXED, links={"out/gate.json": "../.git/gate.json"},
           inputs={"json": "out/gate.json"}, verdict="error", summary=False),
    Attack("json-input-under-a-committed-file", LINT_FIXED, files={"out": "a file, not a directory\n"},
           inputs={"json": "out/gate.json"}, verdict="error", summary=False),
    Attack("json-input-under-a-dangling-symlink", LINT_FIXED, links={"out": "nowhere"},
           inputs={"json": "out/sub/gate.json"}, verdict="error", summary=False),
    Attack("json-input-through-a-symlink-that-stays-in-the-tree", LINT_FIXED, files={"real/keep.txt": "x\n"},
           links={"out": "real"}, inputs={"json": "out/gate.json"}, writes=("real/gate.json",)),
    # --- strings the log, the outputs, the summary and a shell must not obey
    Attack("workflow-commands-and-shell-in-check-names", _hostile_lints(), verdict="fail"),
    # --- inputs that used to hang, crash or run code
    Attack("redos-tolerance", '[[compare]]\nname = "redos"\nreference = "dumps/redos.safetensors"\n'
           'candidate = "dumps/redos-copy.safetensors"\ntolerance = { "(a+)+$" = 0.1 }\n', verdict="pass"),
    Attack("5000-deep-draft-config", LINT_FIXED.replace("drafts/fixed.json", "drafts/deep.json"),
           files={"drafts/deep.json": _deep_config()}, verdict="error"),
    Attack("40000-aux-ids", LINT_FIXED.replace("drafts/fixed.json", "drafts/many.json"),
           files={"drafts/many.json": _many_ids()}, verdict="error"),
    # --- modules the checkout commits where ``python -m`` would look first (the working directory)
    Attack("committed-modules-shadow-what-the-gate-imports", LINT_SEED, files=SHADOW, verdict="fail"),
    Attack("committed-consistency-package-shadows-the-installed-one", LINT_SEED,
           files={"consistency/__init__.py": PAYLOAD, "consistency/__main__.py": PAYLOAD + FORGE}, verdict="fail"),
    # --- files outside the checkout a committed symlink points at: named, never echoed
    Attack("symlinked-dumps-into-a-secret-file", '[[compare]]\nname = "leak"\nreference = "dumps/leak.safetensors"\n'
           'candidate = "dumps/train.safetensors"\n[[compare]]\nname = "leak2"\nreference = "dumps/leak.npz"\n'
           'candidate = "dumps/train.safetensors"\n',
           links={"dumps/leak.safetensors": "../../secret.env", "dumps/leak.npz": "../../secret.env"}, verdict="error"),
    Attack("replay-target-with-its-own-code", _replay().replace('target = "tiny-llama"', 'target = "evil"'),
           files={f"evil/{k}": v for k, v in EVIL_MODEL.items()}, env="full", verdict="error", replay=True,
           stdout=("never runs code from a model or tokenizer directory",)),
]


# ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dumps(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """Plain dumps (numpy, no torch): a training/serving pair and the ReDoS tensor name."""
    from consistency.contract.models import AuxInfo, DumpMetadata
    from consistency.dump.writer import write_dump

    d = tmp_path_factory.mktemp("dumps")
    rng = np.random.default_rng(0)
    ids = np.arange(12, dtype=np.int64)
    aux = {f"aux.{k}": rng.standard_normal((12, 16)).astype(np.float32) for k in range(3)}
    for side in ("train", "serve"):
        write_dump(d / f"{side}.safetensors", {"input_ids": ids, **aux},
                   DumpMetadata(aux=AuxInfo(stream_ids=[0, 3, 7])))
    redos = {REDOS_NAME: rng.standard_normal((4, 8)).astype(np.float32)}
    write_dump(d / "redos.safetensors", redos)
    write_dump(d / "redos-copy.safetensors", redos)  # a file compared with itself is SAME_INPUT, never a pass
    return {p.name: p.read_bytes() for p in d.iterdir()}


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """A real training/serving pair recorded on the built-in target, the serving side shifted
    by one layer (so a real replay fails), for the attack that runs a replay with torch."""
    from tests.conftest import run_cli

    d = tmp_path_factory.mktemp("recorded")
    for out, extra in (("train", ["--aux-layers", "0,3,7"]),
                       ("serve", ["--aux-layers", "2,6,9", "--style", "serving", "--convention", "sglang@0.5.5"])):
        r = run_cli("record", "--model", "tiny-llama", "--prompt", "a pull request is hostile input", *extra,
                    "-o", str(d / f"{out}.safetensors"))
        assert r.returncode == 0, r.stderr
    return {p.name: p.read_bytes() for p in d.iterdir()}


@pytest.fixture(scope="module")
def lean(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real venv with every package of this one but torch, transformers and accelerate."""
    venv = tmp_path_factory.mktemp("lean") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    src = Path(sysconfig.get_paths()["purelib"])
    dst = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    for entry in src.iterdir():
        if entry.name.split("-")[0].split(".")[0].lower() not in BLOCKED:
            (dst / entry.name).symlink_to(entry)
    py = venv / "bin" / "python"
    probe = subprocess.run([str(py), "-c", "import importlib.util as u, consistency, numpy, pydantic; "
                            "print(u.find_spec('torch'), u.find_spec('transformers'))"],
                           capture_output=True, text=True, timeout=120)
    assert probe.stdout.split() == ["None", "None"], probe.stdout + probe.stderr
    return venv


def _repo(root: Path, attack: Attack, dumps: dict[str, bytes]) -> Path:
    repo = root / "repo"
    files: dict[str, str | bytes] = {"drafts/seed.json": SEED.read_text(), "drafts/fixed.json": FIXED.read_text(),
                                     "kimi.json": TARGET.read_text(), "README.md": "# a project\n",
                                     ".venv/bin/activate": ACTIVATE, attack.config_path: attack.config,
                                     **{f"dumps/{k}": v for k, v in dumps.items()}, **attack.files}
    for rel, content in files.items():
        p = repo / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        (p.write_bytes if isinstance(content, bytes) else p.write_text)(content)  # type: ignore[operator]
    git = ["git", "-c", "user.name=pr", "-c", "user.email=pr@example.invalid", "-c", "init.defaultBranch=main"]
    subprocess.run([*git, "init", "-q", str(repo)], check=True)
    for rel, target in attack.links.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).symlink_to(target)
    subprocess.run([*git, "-C", str(repo), "add", "-A"], check=True)
    subprocess.run([*git, "-C", str(repo), "commit", "-qm", "the pull request"], check=True)
    return repo


def _tree(repo: Path) -> dict[str, tuple]:
    """Every entry of the checkout (``.git/`` included): symlink target, or file hash and mode."""
    out: dict[str, tuple] = {}
    for dirpath, dirnames, filenames in os.walk(repo):
        for n in dirnames + filenames:
            p = Path(dirpath) / n
            rel = str(p.relative_to(repo))
            if p.is_symlink():
                out[rel] = ("link", os.readlink(p))
            elif p.is_dir():
                out[rel] = ("dir",)
            else:
                out[rel] = ("file", hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mode)
    return out


def _outside(tmp: Path) -> dict[str, tuple]:
    """What the job may not touch outside the checkout: all of ``tmp`` but the checkout, the
    runner's two files and the Action's own fresh result directories."""
    tree = _tree(tmp)
    return {k: v for k, v in tree.items() if not k.startswith(("repo/", "runner/consistency-action-"))
            and k not in ("repo", "runner/github_output", "runner/step_summary.md")}


@dataclass
class Job:
    install: subprocess.CompletedProcess
    gate: subprocess.CompletedProcess
    outputs: dict[str, str]
    summary: str
    repo: Path


def _job(tmp: Path, attack: Attack, dumps: dict[str, bytes], lean: Path) -> tuple[Job, dict, dict]:
    repo = _repo(tmp, attack, dumps)
    runner = tmp / "runner"
    runner.mkdir()
    gh_output, step_summary = runner / "github_output", runner / "step_summary.md"
    gh_output.write_text("")
    step_summary.write_text("earlier step\n")
    venv = Path(sys.prefix) if attack.env == "full" else lean
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GITHUB_", "CONSISTENCY_", "RUNNER_"))}
    env.update(GITHUB_ACTIONS="true", GITHUB_OUTPUT=str(gh_output), GITHUB_STEP_SUMMARY=str(step_summary),
               RUNNER_TEMP=str(runner), GITHUB_WORKSPACE=str(repo), HF_HUB_OFFLINE="1")
    (tmp / "secret.env").write_text(f"{SECRET}\nMORE=1\n")  # outside the checkout: never in any output
    before, outside = _tree(repo), _outside(tmp)
    install = subprocess.run([sys.executable, str(SCRIPT), "install", "--dry-run", "--config", attack.config_path,
                              "--venv", str(venv), "--source", str(ROOT)], capture_output=True, text=True, env=env,
                             cwd=repo, timeout=300, stdin=subprocess.DEVNULL)
    inputs = {"fail-on": "", "annotations": "", "sarif": "", "junit": "", "json": "", **attack.inputs}
    gate = subprocess.run([sys.executable, str(SCRIPT), "gate", "--python", str(venv / "bin" / "python"),
                           "--config", attack.config_path, *[x for k, v in inputs.items() for x in (f"--{k}", v)]],
                          capture_output=True, text=True, env=env, cwd=repo, timeout=600, stdin=subprocess.DEVNULL)
    lines = [line for line in gh_output.read_text().splitlines() if line]
    keys = [line.split("=", 1)[0] for line in lines]
    assert len(keys) == len(set(keys)), f"an output key written twice (injected?): {lines}"
    outputs = dict(line.split("=", 1) for line in lines)
    assert _outside(tmp) == outside, "a file outside the checkout changed or appeared"
    return Job(install, gate, outputs, step_summary.read_text(), repo), before, _tree(repo)


def _no_marker(*roots: Path) -> None:
    for root in roots:
        found = [str(p) for p in root.rglob(MARK)] if root.is_dir() else []
        assert not found, f"a payload ran: {found}"


@pytest.mark.parametrize("attack", ATTACKS, ids=[a.name for a in ATTACKS])
def test_the_action_under_attack(attack: Attack, tmp_path: Path, dumps: dict[str, bytes], lean: Path,
                                 request: pytest.FixtureRequest) -> None:
    if attack.recorded:
        dumps = {**dumps, **request.getfixturevalue("recorded")}
    job, before, after = _job(tmp_path, attack, dumps, lean)
    log = job.install.stdout + job.install.stderr + job.gate.stdout + job.gate.stderr
    # install: its decision is the gate's reading of the config; torch only when a check needs it
    assert job.install.returncode == 0, log
    assert job.outputs["replay"] == ("true" if attack.replay else "false"), log
    assert ("--index-url https://download.pytorch.org/whl/cpu" in job.install.stdout) == attack.replay, log
    # gate: verdict, exit-code and the step's status agree, and are what the attack deserves
    code = attack.code if attack.code is not None else {"pass": 0, "fail": 1, "error": 2}[attack.verdict]
    assert (job.outputs["verdict"], job.outputs["exit-code"], job.gate.returncode) == (attack.verdict, str(code),
                                                                                       code), log
    assert "Traceback" not in log
    for needle in attack.stdout:
        assert needle in job.gate.stdout, (needle, log)
    # the log: no workflow command we did not write, in either syntax
    for line in job.gate.stdout.splitlines() + job.gate.stderr.splitlines():
        assert "##[" not in line, line
        if line.lstrip().startswith("::"):
            assert line.startswith(("::error file=", "::error title=", "::warning file=", "::warning title=")), line
    # the checkout: byte-identical outside the reports this attack lets the gate write; .git untouched
    allowed = set(attack.writes)
    changed = {p for p in set(before) | set(after) if before.get(p) != after.get(p)}
    assert changed <= allowed, sorted(changed - allowed)
    if job.outputs.get("json"):
        report = json.loads((job.repo / job.outputs["json"]).read_text())  # relative to the workspace
        assert report["verdict"] == attack.verdict and report["kind"] == "gate"
    for key in ("sarif", "junit"):  # the upload steps get only what this run wrote
        assert job.outputs.get(key, "") == "" or Path(job.outputs[key]).is_file()
    # the job summary is the runner's: appended to, whatever the config says
    assert job.summary.startswith("earlier step\n")
    assert job.summary.count("## consistency gate: ") == (1 if attack.summary else 0), job.summary
    # nothing ran: not during the job, not when a later step sources what is there
    for script in (job.repo / ".venv" / "bin" / "activate", tmp_path / "runner" / "step_summary.md",
                   *[job.repo / w for w in attack.writes if w.endswith(".md")]):
        subprocess.run(["bash", "-c", '. "$0"', str(script)], cwd=job.repo, capture_output=True, timeout=60)
    _no_marker(tmp_path)
    assert not (ROOT / MARK).exists()
    reports = [p.read_text(errors="replace") for w in attack.writes if (p := job.repo / w).is_file()]
    for text in (log, job.summary, "\n".join(f"{k}={v}" for k, v in job.outputs.items()), *reports):
        assert SECRET[:6] not in text and "s3cr3t" not in text, "a file outside the checkout was echoed"


def test_the_attack_corpus_covers_every_item_of_the_threat_model() -> None:
    """Each way a pull request can steer CI (docs/security.md, "CI") has an attack here."""
    names = {a.name for a in ATTACKS}
    for needed in ("quoted-table-replay-lean", "committed-pass-at-the-json-path", "committed-list-at-the-json-path",
                   "fail-on-warning-agrees", "config-turns-annotations-off", "config-redirects-the-summary",
                   "summary-into-git-config", "summary-into-venv-activate",
                   "workflow-commands-and-shell-in-check-names",
                   "redos-tolerance", "5000-deep-draft-config", "40000-aux-ids", "replay-target-with-its-own-code"):
        assert needed in names
    assert {a.env for a in ATTACKS} == {"lean", "full"}


def test_a_positive_control_sourcing_an_unescaped_summary_runs_the_payload(tmp_path: Path) -> None:
    """The sourcing check can fail: the same check names written raw (no Markdown escaping)
    into a file that bash sources do run the payload."""
    raw = tmp_path / "raw.md"
    raw.write_text("\n".join(f"- **failed** {n}: x" for n in HOSTILE_NAMES) + "\n")
    subprocess.run(["bash", "-c", '. "$0"', str(raw)], cwd=tmp_path, capture_output=True, timeout=60)
    assert (tmp_path / MARK).exists()



def test_a_config_reached_through_a_symlinked_directory_writes_nothing_into_a_dot_directory(tmp_path: Path) -> None:
    """Outside GitHub Actions (no ``GITHUB_WORKSPACE``; a hook, another CI), run from outside
    the checkout: the config's directory is a committed symlink into a dot-directory
    (``ci -> .hooks``), so its ``summary = "pre-commit"`` resolves into ``.hooks/``. Refused,
    nothing written; the same config through a plain directory (positive control) writes."""
    from tests.conftest import run_cli

    repo = tmp_path / "repo"
    for d in (".hooks", "plain"):
        (repo / d).mkdir(parents=True)
        (repo / d / "consistency.toml").write_text('[gate]\nsummary = "pre-commit"\n' + LINT_FIXED.replace(
            '"drafts/', '"../drafts/').replace('"kimi.json"', '"../kimi.json"'))
    (repo / "drafts").mkdir()
    (repo / "drafts" / "fixed.json").write_text(FIXED.read_text())
    (repo / "kimi.json").write_text(TARGET.read_text())
    (repo / "ci").symlink_to(".hooks")
    before = _tree(repo)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GITHUB_", "CONSISTENCY_"))}
    r = run_cli("gate", "--config", str(repo / "ci" / "consistency.toml"), env=env, cwd=tmp_path)
    assert r.returncode == 2 and "resolves through a symlink into '.hooks'" in r.stderr, r.stdout + r.stderr
    assert _tree(repo) == before
    ok = run_cli("gate", "--config", str(repo / "plain" / "consistency.toml"), env=env, cwd=tmp_path)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert (repo / "plain" / "pre-commit").read_text().startswith("## consistency gate: ")


def test_the_pre_commit_hooks_never_take_file_names_as_options(tmp_path: Path) -> None:
    """pre-commit appends the staged file names matching ``files`` to the entry unless
    ``pass_filenames: false``; a committed file named ``--config=evil.toml`` or
    ``--junit=x.json`` matches and would be parsed as an option (the control below shows it
    would). Every hook takes no file names, and its entry, run by its console script as
    pre-commit runs it in a checkout holding those names and a shadowing ``click.py``, runs
    the declared lint and writes nothing."""
    import re
    import shlex

    import yaml

    repo = tmp_path / "repo"
    (repo / "drafts").mkdir(parents=True)
    (repo / "drafts" / "seed.json").write_text(SEED.read_text())
    (repo / "kimi.json").write_text(TARGET.read_text())
    (repo / "consistency.toml").write_text(LINT_SEED)
    (repo / "evil.toml").write_text(LINT_FIXED.replace("drafts/fixed.json", "drafts/seed.json")
                                    .replace("0.5.23", "0.5.12").replace("stream:0,3,31", "stream:3,31,59"))
    names = ["--config=evil.toml", "--junit=x.json", "-q.json", "--force.yaml"]
    for n in names:
        (repo / n).write_text("{}\n")
    (repo / "click.py").write_text(PAYLOAD)
    hooks = yaml.safe_load((ROOT / ".pre-commit-hooks.yaml").read_text())
    script = Path(sys.prefix) / "bin" / "consistency"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GITHUB_", "CONSISTENCY_"))}
    before = _tree(repo)
    for hook in hooks:
        assert hook["pass_filenames"] is False, hook["id"]
        assert any(re.search(hook["files"], n) for n in names), hook["id"]  # pre-commit would have passed them
    gate = next(h for h in hooks if h["id"] == "consistency-lint")
    r = subprocess.run([str(script), *shlex.split(gate["entry"])[1:]], cwd=repo, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 1 and "FAIL  lint/seed" in r.stdout, r.stdout + r.stderr  # the declared config ran
    assert _tree(repo) == before
    _no_marker(tmp_path)
    # control: had the names been passed, the PR's config would have replaced the declared one
    c = subprocess.run([str(script), *shlex.split(gate["entry"])[1:], *names[:2]], cwd=repo, env=env,
                       capture_output=True, text=True, timeout=300)
    assert "lint/seed" not in c.stdout and (repo / "x.json").exists(), c.stdout + c.stderr


GLOBBED = ["x\n::error::forged-by-a-file-name.safetensors", "##[set-output name=verdict;]pass.safetensors",
           "y\r##[add-mask]z.safetensors"]


@pytest.mark.parametrize("argv", [
    ["compare", "a.safetensors", "b.safetensors", *GLOBBED],  # `compare dumps/*` over the PR's files
    ["compare", "--rtol", GLOBBED[1], "a.safetensors", "b.safetensors"],
    [GLOBBED[0]],  # as the command name
    ["gate", "--kind", GLOBBED[1]],
], ids=["extra-arguments", "option-value", "command-name", "choice-value"])
def test_click_usage_errors_echo_no_workflow_command(argv: list[str], tmp_path: Path) -> None:
    """A workflow that globs the checkout (``consistency compare dumps/*``) passes the PR's
    file names as arguments; click's own usage errors echoed them raw, so a name with a
    newline and ``::error::``, or ``##[`` anywhere, became a workflow command in the log."""
    from tests.conftest import cli

    r = cli(*argv, cwd=tmp_path)
    assert r.returncode == 2 and "consistency: error:" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    for line in (r.stdout + r.stderr).splitlines():
        assert not line.lstrip().startswith("::") and "##[" not in line, line
    assert any(c in r.stderr for c in ("\\x3a", "\\x23")), r.stderr  # shown, escaped (the control: it was there)


def test_a_positive_control_python_m_imports_a_shadowing_module_from_the_checkout(tmp_path: Path) -> None:
    """The shadowing attacks can fail: plain ``python -m consistency`` in a directory holding a
    ``click.py`` runs it (the marker appears); ``python -I -m`` (what the Action runs) does not."""
    (tmp_path / "click.py").write_text(PAYLOAD)
    subprocess.run([sys.executable, "-I", "-m", "consistency", "--version"], cwd=tmp_path, capture_output=True,
                   timeout=120)
    assert not (tmp_path / MARK).exists()
    subprocess.run([sys.executable, "-m", "consistency", "--version"], cwd=tmp_path, capture_output=True, timeout=120)
    assert (tmp_path / MARK).exists()
