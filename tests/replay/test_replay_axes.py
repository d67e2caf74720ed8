"""Replay's front door across its axes (tests/scenarios/replay_axes.py): labels source, target
given or not, logits in the dump or not, right / shifted / same candidate. Each expected
verdict comes from the construction; through the CLI (exit codes, one line) and the gate
(a refused replay is an error there, never a pass)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from tests.conftest import run_cli
from tests.scenarios import replay_axes as RA

CASES = RA.cases()


@pytest.fixture(scope="module")
def dumps(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from consistency.record.api import record_reference, record_serving
    from consistency.record.models import DEMO_PROMPT, build_builtin, tokenize

    d = tmp_path_factory.mktemp("replay_axes")
    t = build_builtin("tiny-llama", 0)
    ids = tokenize(t, "tiny-llama", DEMO_PROMPT)
    return {
        "ref_logits": record_reference(t, ids, d / "ref_logits.safetensors", RA.RIGHT, components=False, logits=True),
        "ref": record_reference(t, ids, d / "ref.safetensors", RA.RIGHT, components=False),
        "right": record_serving(copy.deepcopy(t), ids, d / "right.safetensors", RA.RIGHT, dtype="bfloat16"),
        "shifted": record_serving(copy.deepcopy(t), ids, d / "shifted.safetensors", RA.SHIFTED, dtype="bfloat16"),
    }


def _paths(case: RA.Case, dumps: dict[str, Path]) -> tuple[Path, Path]:
    ref = dumps["ref_logits" if case.ref_logits else "ref"]
    return ref, ref if case.candidate == "same" else dumps[case.candidate]


def test_the_axes_cover_every_answer() -> None:
    assert {c.expected() for c in CASES} == {"refused", "SAME_INPUT", "pass", "ACCEPTANCE_DROP"}
    assert len(CASES) == 48


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_replay_cli_verdict_follows_the_construction(case: RA.Case, dumps: dict[str, Path], tmp_path: Path) -> None:
    ref, cand = _paths(case, dumps)
    args = ["replay", "--draft", "tiny-llama-eagle3", str(ref), str(cand), "--labels", case.labels, "-k", "3",
            "--json", str(tmp_path / "r.json")]
    if case.target:
        args += ["--target", "tiny-llama"]
    r = run_cli(*args)
    want = case.expected()
    if want == "refused":
        err = r.stderr.strip()
        assert r.returncode == 2 and len(err.splitlines()) == 1 and "PASS" not in r.stdout, (r.stdout, err)
        assert not (tmp_path / "r.json").exists()
        return
    rep = json.loads((tmp_path / "r.json").read_text())
    codes = [f["code"] for f in rep["findings"]]
    if want == "pass":
        assert r.returncode == 0 and rep["verdict"] == "pass", rep["summary"]
    else:
        assert r.returncode == 1 and rep["verdict"] == "fail" and codes[0] == want, (codes, rep["summary"])


@pytest.mark.slow
def test_the_gate_reads_every_case_as_the_cli_does(dumps: dict[str, Path], tmp_path: Path) -> None:
    checks = []
    for case in CASES:
        ref, cand = _paths(case, dumps)
        target = '\ntarget = "tiny-llama"' if case.target else ""
        checks.append(f'[[replay]]\nname = "{case.id}"\ndraft = "tiny-llama-eagle3"{target}\nreference = "{ref}"\n'
                      f'candidate = "{cand}"\nlabels = "{case.labels}"\nsteps = 3\n')
    (tmp_path / "consistency.toml").write_text("\n".join(checks))
    r = run_cli("gate", "--config", str(tmp_path / "consistency.toml"), "--json", str(tmp_path / "gate.json"))
    gate = json.loads((tmp_path / "gate.json").read_text())
    assert r.returncode != 0 and gate["verdict"] != "pass"
    got = {c["name"]: c["verdict"] for c in gate["checks"]}
    want = {c.id: {"refused": "error", "SAME_INPUT": "fail", "ACCEPTANCE_DROP": "fail", "pass": "pass"}[c.expected()]
            for c in CASES}
    assert got == want, {k: (got.get(k), v) for k, v in want.items() if got.get(k) != v}
