"""Issue 27: lint says what it knows and what it does not.

- Published configurations (fields copied from the files named; *reconstructed* where the
  file itself was not read here) with the expected streams written down from the upstream
  rule *before* the linter runs: the comment on each row names the rule it applies.
- A walk over every (runtime, version range) of the convention table on one draft: the
  served streams change exactly where the table's own boundaries say.
- SpecForge readings by the SGLang it captured with; the SGLang draft-rewrite table
  (GLM/MiMo/Qwen3-Next as MTP) against what was extracted from every release's source.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

import pytest

from consistency.contract import conventions as cv
from consistency.contract import sglang_drafts as SD
from consistency.contract.resolve import specforge_readings, streams_of
from consistency.contract.runtime_model import (capture_limit, id_source, served_streams, sglang_draft_class,
                                                version_points)
from consistency.contract.versions import VersionRange
from consistency.errors import UsageError
from consistency.lint.engine import LintRequest, run_lint
from tests.lint.test_lint_mtp import S, deepseek_target, mimo_target, mtp_tensors, speculators_mtp
from tests.lint.test_lint_support import FIX, ROOT, Scenario, codes, llama_target, sglang_config, status

KIMI = FIX / "targets" / "kimi-k2.5.json"
SEED = FIX / "drafts" / "sglang" / "kimi-k2.5-eagle3-seed.json"


def _kimi_draft(tmp: Path, stamp: str | None, ids: list[int] = (2, 30, 58)) -> Path:  # type: ignore[assignment]
    cfg = json.loads(SEED.read_text())  # copied from the seed write-up's draft (lightseekorg kimi-k2.5-eagle3 layout)
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = list(ids)
    if stamp is None:
        cfg.pop("transformers_version", None)
    else:
        cfg["transformers_version"] = stamp
    d = tmp / f"draft-{stamp}"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return d


# -- a guess never becomes a PASS ------------------------------------------------------------

@pytest.mark.parametrize(("runtime", "stamp", "verdict", "reading"), [
    # no evidence: sglang <0.5.13 adds 1 ([3, 31, 59]); 0.5.14 keeps Kimi ids not starting at 1 ([2, 30, 58])
    ("sglang@0.5.23", None, "fail", None),
    ("sglang@0.5.12", None, "fail", None),
    # transformers 4.57.1 is the exact pin of sglang 0.5.4-0.5.9: SpecForge trained beside 0.5.6/0.5.9 (+1)
    ("sglang@0.5.23", "4.57.1", "fail", [3, 31, 59]),
    ("sglang@0.5.12", "4.57.1", "pass", [3, 31, 59]),
    # transformers 5.8.1 is the pin of sglang 0.5.13-0.5.14 (and SpecForge 0.2.0): the first-id rule
    ("sglang@0.5.23", "5.8.1", "pass", [2, 30, 58]),
    ("sglang@0.5.12", "5.8.1", "fail", [2, 30, 58]),
])
def test_kimi_specforge_draft_lists_its_readings(tmp_path: Path, runtime: str, stamp: str | None, verdict: str,
                                                 reading: list[int] | None) -> None:
    rep = run_lint(LintRequest(draft=str(_kimi_draft(tmp_path, stamp)), target=str(KIMI), runtime=runtime,
                               select=("IDS",)))
    assert rep.verdict == verdict, rep.summary
    assert not rep.training_checked and "was not checked" in rep.summary
    if reading is None:
        assert [r.streams for r in rep.training_readings] == [[3, 31, 59], [2, 30, 58]]
        assert "IDS011" in codes(rep, "warning") and "IDS002" in codes(rep, "error")
        assert "equal" in rep.summary and "differs" in rep.summary
    else:
        assert rep.training_streams == reading and len(rep.training_readings) == 1
        assert f"transformers_version {stamp}" in rep.training_evidence
        assert status(rep, "IDS011") == "pass"


def test_an_unmatched_stamp_narrows_nothing_and_says_so() -> None:
    readings, why = specforge_readings([2, 30, 58], 61, "KimiK25ForConditionalGeneration", "4.56.2")
    assert len(readings) == 2 and "pinned by no SGLang release" in why


def test_the_seed_draft_without_training_evidence_says_the_contract_was_not_checked(tmp_path: Path) -> None:
    # the tutorial's broken draft: ids the config and the server agree on, training fed other streams
    rep = run_lint(LintRequest(draft=str(ROOT / "consistency" / "replay" / "assets" / "tiny-llama-eagle3"),
                               target="tiny-llama", runtime="sglang@0.5.23"))
    assert "what training really fed the draft was not checked" in rep.summary and "--trained-with" in rep.summary
    assert not rep.training_checked


# -- published configurations, expected streams from upstream source -------------------------

PUBLISHED: list[tuple[str, dict[str, Any], str, str, list[int]]] = [
    # (what, draft fields, target arch, runtime, expected served streams)
    # fixtures/configs/drafts/sglang/kimi-k2.5-eagle3-seed.json (copied): ids [2,30,58] nested.
    # sglang deepseek_v2.py before PR #25454: set_eagle3_layers_to_capture adds 1 -> [3,31,59]
    ("kimi seed @0.5.12", json.loads(SEED.read_text()), "KimiK25ForConditionalGeneration", "sglang@0.5.12",
     [3, 31, 59]),
    # since PR #25454 (0.5.13): +1 only when the first id is 1 -> [2,30,58]
    ("kimi seed @0.5.23", json.loads(SEED.read_text()), "KimiK25ForConditionalGeneration", "sglang@0.5.23",
     [2, 30, 58]),
    # fixtures/configs/drafts/sglang/kimi-k2.5-eagle3-fixed.json (copied): [0,3,31]; first id 0, not 1: as-is
    ("kimi fixed @0.5.23", json.loads((FIX / "drafts" / "sglang" / "kimi-k2.5-eagle3-fixed.json").read_text()),
     "KimiK25ForConditionalGeneration", "sglang@0.5.23", [0, 3, 31]),
    # fixtures/configs/drafts/modelopt/llama3.1-8b-eagle3.json (copied): llama.py always +1
    ("modelopt llama @0.5.23", json.loads((FIX / "drafts" / "modelopt" / "llama3.1-8b-eagle3.json").read_text()),
     "LlamaForCausalLM", "sglang@0.5.23", [2, 16, 29]),
    # reconstructed (AQ-MedAI/nm-testing style SpecForge export for DeepSeek-V3, ids [1,29,57]): first id 1 -> +1
    ("deepseek [1,29,57] @0.5.23", sglang_config(ids=[1, 29, 57]), "DeepseekV3ForCausalLM", "sglang@0.5.23",
     [2, 30, 58]),
    # reconstructed (RedHatAI speculators layout: top-level stream ids), vLLM reads the top level as streams
    ("speculators llama @vllm", {**sglang_config(ids=None), "eagle_aux_hidden_state_layer_ids": [2, 16, 29]},
     "LlamaForCausalLM", "vllm@0.33.0", [2, 16, 29]),
    # reconstructed (gpt-oss Eagle3 v3, sglang issue #32226): [24,30,36] on 36 layers; PR #32334 (0.5.17): max == N
    ("gpt-oss @0.5.16", sglang_config(ids=[24, 30, 36]), "GptOssForCausalLM", "sglang@0.5.16", [25, 31]),
    ("gpt-oss @0.5.17", sglang_config(ids=[24, 30, 36]), "GptOssForCausalLM", "sglang@0.5.17", [24, 30, 36]),
]


@pytest.mark.parametrize(("what", "draft", "arch", "runtime", "expected"), PUBLISHED, ids=[p[0] for p in PUBLISHED])
def test_published_configs_are_served_as_upstream_says(tmp_path: Path, what: str, draft: dict[str, Any], arch: str,
                                                       runtime: str, expected: list[int]) -> None:
    n = 36 if "GptOss" in arch else 61 if arch != "LlamaForCausalLM" else 32
    rep = Scenario(draft=draft, tensors=None, target=llama_target(n=n, arch=arch), serve=None, runtime=runtime,
                   trained_with=None).run(tmp_path)
    assert rep.serving_streams == expected, (what, rep.serving_streams)


# -- every (runtime, version) pair of the table, on one draft --------------------------------

@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "DeepseekV3ForCausalLM", "GptOssForCausalLM"])
@pytest.mark.parametrize("runtime", ["sglang", "vllm"])
def test_walk_every_version_range(tmp_path: Path, runtime: str, arch: str) -> None:
    """One draft, every version range the tables know: lint's streams are the runtime model's
    answer for the rows in force there, and they change only where one of those rows changes."""
    n, ids = 36, [2, 18, 36]
    cfg = sglang_config(ids=ids)
    cfg["eagle_aux_hidden_state_layer_ids"] = ids  # both keys: each runtime reads its own
    prev: tuple[list[int] | None, tuple[Any, ...]] | None = None
    changed_rows = changed_streams = 0
    for i, (lo, hi, rep_v) in enumerate(version_points(runtime)):
        ver = ".".join(map(str, rep_v)) if rep_v else cv.LATEST_KNOWN[runtime]
        spec = f"{runtime}@{ver}"
        rep = Scenario(draft=cfg, tensors=None, target=llama_target(n=n, arch=arch), serve=None, runtime=spec,
                       trained_with=None, select=("IDS002",)).run(tmp_path / str(i))
        runner = (rep.serving.runner or "").split(":")[0]
        src = id_source(runtime, rep_v, runner)
        rows = (streams_of(ids, spec, n, arch).convention.code, src.keys if src else None,
                capture_limit(runtime, rep_v, arch), runner)
        assert rep.serving_streams == served_streams(spec, ids, n, arch).streams, (spec, rep.serving_streams)
        if prev is not None:
            changed_rows += prev[1] != rows
            changed_streams += prev[0] != rep.serving_streams
            assert prev[0] == rep.serving_streams or prev[1] != rows, (spec, "streams changed, no row did")
        prev = (rep.serving_streams, rows)
    assert changed_streams <= changed_rows


def test_walk_changes_exactly_at_the_tables_boundaries(tmp_path: Path) -> None:
    """SGLang on a DeepSeek target, ids [2, 30, 58]: the only id-rule change is PR #25454 (0.5.13)."""
    seen = []
    for i, (lo, hi, rep_v) in enumerate(version_points("sglang")):
        ver = ".".join(map(str, rep_v)) if rep_v else "0.5.23"
        rep = Scenario(draft=sglang_config(ids=[2, 30, 58]), tensors=None,
                       target=llama_target(n=61, arch="DeepseekV3ForCausalLM"), serve=None, runtime=f"sglang@{ver}",
                       trained_with=None).run(tmp_path / str(i))
        seen.append((VersionRange(lo, hi).label(), rep.serving_streams))
    changes = [seen[i][0] for i in range(1, len(seen)) if seen[i][1] != seen[i - 1][1]]
    assert changes == [">=0.5.13,<0.5.14"], seen
    assert seen[0][1] == [3, 31, 59] and seen[-1][1] == [2, 30, 58]


# -- which draft SGLang runs ---------------------------------------------------------------------

def test_rewrite_table_matches_every_release_read() -> None:
    """tests/data/sglang_draft_rewrites.json was extracted from each sglang wheel's
    configs/model_config.py (scripts/extract_sglang_rewrites.py); the table says the same."""
    data = json.loads((ROOT / "tests" / "data" / "sglang_draft_rewrites.json").read_text())
    for ver, mapping in data["releases"].items():
        v = tuple(int(x) for x in ver.replace(".post1", "").split("."))
        ours = {r.arch: r.served for r in SD.REWRITES if r.versions.covers(v)}
        assert ours == mapping, ver


GLM = dict(deepseek_target(), architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe")
_SG = "python -m sglang.launch_server --model-path {m} --tp 8 --speculative-algorithm {a} --speculative-num-steps 3 " \
      "--speculative-eagle-topk 1 --speculative-num-draft-tokens 4"


@pytest.mark.parametrize("algo", ["EAGLE", "NEXTN"])
@pytest.mark.parametrize(("target", "model", "extra"), [
    (GLM, "zai-org/GLM-4.6", ""),
    (mimo_target(), "XiaomiMiMo/MiMo-7B-RL", " --speculative-draft-model-path XiaomiMiMo/MiMo-7B-RL"),
    (dict(deepseek_target(), architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next"),
     "Qwen/Qwen3-Next-80B-A3B-Instruct", ""),
])
def test_eagle_and_nextn_run_the_rewritten_mtp_class(tmp_path: Path, algo: str, target: dict[str, Any], model: str,
                                                     extra: str) -> None:
    rep = S(target=target, serve=_SG.format(m=model, a=algo) + extra).run(tmp_path)
    assert "MTP draft" in rep.summary and "loads" in rep.summary, rep.summary
    assert status(rep, "EG1001") != "fail" and rep.serving_streams is None
    assert status(rep, "SRV003") == "not_applicable"


def test_rewrite_is_per_release() -> None:
    assert sglang_draft_class("Qwen3MoeForCausalLM", (0, 5, 12)).served is None
    assert sglang_draft_class("Qwen3MoeForCausalLM", (0, 5, 13)).served == "Qwen3MoeForCausalLMMTP"
    assert sglang_draft_class("Glm4MoeLiteForCausalLM", (0, 5, 12)).served == "Glm4MoeForCausalLMNextN"
    assert not sglang_draft_class("DeepseekV3ForCausalLM", (0, 4, 6)).known


def test_speculators_mtp_checkpoint_is_not_an_eagle3_checkpoint(tmp_path: Path) -> None:
    rep = Scenario(draft=speculators_mtp(), tensors=mtp_tensors(), target=None, serve=None, runtime="vllm@0.33.0",
                   trained_with=None).run(tmp_path)
    assert "SHP002" not in codes(rep, "error"), [f.message for f in rep.findings if f.code == "SHP002"]


def test_mtp002_on_a_family_without_serving_rows_is_not_evaluated(tmp_path: Path) -> None:
    cfg = speculators_mtp()
    cfg["speculators_config"]["verifier"]["architectures"] = ["Qwen3ForCausalLM"]
    rep = Scenario(draft=cfg, tensors=mtp_tensors(), target=None, serve=None, runtime="vllm@0.33.0",
                   trained_with=None).run(tmp_path)
    assert status(rep, "MTP002") == "not_evaluated"
    assert "no MTP serving row" in next(f.message for f in rep.findings if f.code == "MTP002")


def test_vllm_serve_of_the_linted_speculators_draft_turns_eagle3_on(tmp_path: Path) -> None:
    from tests.lint.test_lint_support import speculators_vllm

    base = speculators_vllm()
    rep = base.copy(serve="vllm serve RedHatAI/draft").run(tmp_path)  # Scenario writes the draft to .../draft
    assert status(rep, "SRV003") != "fail" and "linted speculators draft" in " ".join(rep.assumptions)
    rep = base.copy(serve="vllm serve RedHatAI/other-speculator").run(tmp_path / "o")
    f = next(f for f in rep.findings if f.code == "SRV003")
    assert f.severity.value == "warning" and "cannot tell" in f.message


# -- smaller: usage errors in the shared parser ---------------------------------------------------

def test_trained_with_ids_outside_the_target_are_a_usage_error() -> None:
    with pytest.raises(UsageError, match=r"valid streams \(0..12 for a 12-layer target\)"):
        run_lint(LintRequest(target="tiny-llama", trained_with="stream:1,4,70", runtime="sglang@0.5.23"))
    with pytest.raises(UsageError, match="unknown convention 'bogus'"):
        run_lint(LintRequest(target="tiny-llama", trained_with="bogus:1,4,7"))


def test_compare_checks_layer_ids_and_convention_names(tmp_path: Path) -> None:
    from consistency.api import record
    from consistency.pipeline.compare import compare as run

    ref, cand = tmp_path / "ref.safetensors", tmp_path / "cand.safetensors"
    record("tiny-llama", output=str(ref), prompt="hello world")
    record("tiny-llama", output=str(cand), prompt="hello world", style="serving", aux_layers="2,6,9",
           convention="sglang")
    with pytest.raises(UsageError, match=r"^--cand-layer-ids \[1, 4, 70\].*ids \[70\] fall outside the valid streams \(0..12"):
        run(str(ref), str(cand), cand_layer_ids="1,4,70")
    with pytest.raises(UsageError, match=r"^--ref-layer-ids \[1, 4, 70\].*ids \[70\] fall outside"):
        run(str(ref), str(cand), ref_layer_ids="1,4,70")  # the message names the flag the user gave
    with pytest.raises(UsageError, match=r"^--layer-ids \[1, 4, 70\].*ids \[70\] fall outside"):
        run(str(ref), str(cand), layer_ids="1,4,70")
    with pytest.raises(UsageError, match="2 id\\(s\\) for 3 aux slot"):
        run(str(ref), str(cand), cand_layer_ids="1,4")
    with pytest.raises(UsageError, match="unknown convention 'nosuch'"):
        run(str(ref), str(cand), convention="nosuch")
    with pytest.raises(Exception, match="--draft is a consistency dump"):
        run_lint(LintRequest(draft=str(cand), runtime="sglang@0.5.23"))
    with pytest.raises(Exception, match="--target is a consistency dump"):
        run_lint(LintRequest(target=str(ref), runtime="sglang@0.5.23"))


def test_own_sglang_export_does_not_trip_nrm004(tmp_path: Path) -> None:
    from fixtures.train_draft import export_sglang

    out = export_sglang("tiny-llama-eagle3", tmp_path / "sg", [2, 6, 9])
    rep = run_lint(LintRequest(draft=str(out), target="tiny-llama", runtime="sglang@0.5.23"))
    assert status(rep, "NRM004") == "pass"
    cfg = json.loads((out / "config.json").read_text())
    cfg["transformers_version"] = "5.8.1"  # as a SpecForge export would carry
    (out / "config.json").write_text(json.dumps(cfg))
    rep = run_lint(LintRequest(draft=str(out), target="tiny-llama", runtime="sglang@0.5.23"))
    f = next(f for f in rep.findings if f.code == "NRM004")
    assert "norm_output = false" in f.message and "un-normed" in f.fix and "set norm_output to false" not in f.fix


def test_contract_has_no_file_level_import_circle() -> None:
    pkg = ROOT / "consistency" / "contract"
    edges: dict[str, set[str]] = {}
    for f in pkg.glob("*.py"):
        mods = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("consistency.contract"):
                mods.add(node.module.split(".")[2] if node.module.count(".") >= 2 else "")
                mods |= {a.name for a in node.names if node.module == "consistency.contract"}
        edges[f.stem] = {m for m in mods if m and m != f.stem}

    def reach(a: str, seen: set[str]) -> set[str]:
        for b in edges.get(a, ()):
            if b not in seen:
                seen.add(b)
                reach(b, seen)
        return seen

    circles = [m for m in edges if m in reach(m, set())]
    assert not circles, circles
    assert "resolve" not in "".join(Path(pkg / "conventions.py").read_text().split("import")[1:3])
