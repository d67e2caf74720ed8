"""Issue 34 items 2-3: lint without a runtime, methods x releases, hub ids, impossible readings,
the appended verifier state, and vLLM's default runner per release (read from each wheel).

Each expected verdict is derived from the construction: the readings a server could give are
recomputed here from the id tables case by case, never copied from a run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from consistency.contract import methods as M
from consistency.contract import runtime_model as rm
from consistency.contract.ids import split_appended
from consistency.lint.engine import LintRequest, run_lint
from tests.lint.test_lint_support import FIX, ROOT, Scenario, codes, eagle3_tensors, llama_target, sglang_config, \
    speculators_config

SEED = FIX / "drafts" / "sglang" / "kimi-k2.5-eagle3-seed.json"
KIMI = FIX / "targets" / "kimi-k2.5.json"


def _errors(rep) -> set[str]:  # noqa: ANN001
    return codes(rep, "error")


def test_seed_config_with_training_streams_and_no_runtime_fails() -> None:
    """The seed's own config ([2, 30, 58] nested), trained on [0, 3, 31]: no SGLang/vLLM release
    reads those ids as [0, 3, 31] (every reading contains stream 58 or 59), so the lint fails."""
    rep = run_lint(LintRequest(draft=str(SEED), target=str(KIMI), trained_with="stream:0,3,31"))
    assert rep.verdict == "fail" and "IDS013" in _errors(rep), rep.summary
    f = next(f for f in rep.findings if f.code == "IDS013")
    assert all(0 not in s for s in f.evidence["readings"].values())  # stream 0 is never what these ids name


def test_seed_config_fails_even_without_the_target() -> None:
    """Without --target the runtimes' default ids cannot be turned into streams, but a default
    is [2, N//2, N-3] (SGLang's [1, N//2-1, N-4] + 1) for every N: never [0, 3, 31]."""
    rep = run_lint(LintRequest(draft=str(SEED), trained_with="stream:0,3,31"))
    assert rep.verdict == "fail" and "IDS013" in _errors(rep), rep.summary
    ok = run_lint(LintRequest(draft=str(SEED), trained_with="stream:2,30,58"))
    f = next(f for f in ok.findings if f.code == "IDS013")  # a default reading could be it: not checked, said
    assert ok.verdict == "pass" and f.severity.value == "warning" and f.evidence["unknown"]


def test_an_id_past_n_fails_without_a_runtime(tmp_path: Path) -> None:
    n = 32
    rep = Scenario(draft=sglang_config(ids=[1, 15, n + 1]), target=llama_target(n=n), serve=None, runtime=None,
                   trained_with=None).run(tmp_path)
    assert "IDS003" in _errors(rep) and rep.verdict == "fail", rep.summary
    ok = Scenario(draft=sglang_config(ids=[1, 15, 28]), target=llama_target(n=n), serve=None, runtime=None,
                  trained_with=None).run(tmp_path / "ok")
    assert next(r.status for r in ok.rules if r.code == "IDS003") == "pass"


def test_two_training_streams_for_a_three_slot_draft_fail_without_a_runtime(tmp_path: Path) -> None:
    rep = Scenario(runtime=None, serve=None, trained_with="stream:2,16").run(tmp_path)
    assert rep.verdict == "fail" and "IDS012" in _errors(rep), rep.summary
    assert "3 slot" in next(f.message for f in rep.findings if f.code == "IDS012")


def test_slot_count_counts_the_config_ids_when_there_is_no_checkpoint() -> None:
    rep = run_lint(LintRequest(draft=str(SEED), target=str(KIMI), trained_with="stream:3,31"))
    assert "IDS012" in _errors(rep)


def test_reading_dependent_mismatch_is_a_warning_not_an_error() -> None:
    """Training [3, 31, 59] is what SGLang < 0.5.13 reads from the seed's ids, and no other
    release: a mismatch that depends on the reading is a warning."""
    rep = run_lint(LintRequest(draft=str(SEED), target=str(KIMI), trained_with="stream:3,31,59"))
    f = next(f for f in rep.findings if f.code == "IDS013")
    assert f.severity.value == "warning" and rep.verdict == "pass"
    readings = f.evidence["readings"]
    assert [3, 31, 59] in readings.values() and any(s != [3, 31, 59] for s in readings.values())


def test_a_named_runtime_leaves_the_comparison_to_ids002(tmp_path: Path) -> None:
    rep = Scenario(trained_with="stream:0,3,31").run(tmp_path)  # sglang@0.5.23 named: it feeds [2, 16, 29]
    assert next(r.status for r in rep.rules if r.code == "IDS013") == "pass"
    assert "IDS002" in _errors(rep)


@pytest.mark.parametrize("version,accepted", [("0.32.0", True), ("0.33.0", False), ("0.25.0", True)])
def test_medusa_is_accepted_by_the_releases_that_have_it(tmp_path: Path, version: str, accepted: bool) -> None:
    cfg = {"medusa_num_heads": 4, "medusa_num_layers": 1, "hidden_size": 64, "vocab_size": 256,
           "architectures": ["MedusaModel"]}
    serve = ("vllm serve lmsys/vicuna-7b-v1.3 --speculative-config "
             "'{\"method\": \"medusa\", \"model\": \"{draft}\", \"num_speculative_tokens\": 4}'")
    rep = Scenario(draft=cfg, tensors=None, target=None, serve=serve, runtime=f"vllm@{version}",
                   trained_with=None).run(tmp_path)
    assert ("MTH001" in _errors(rep)) is (not accepted), rep.summary
    assert M.support("vllm", M.MEDUSA, tuple(int(x) for x in version.split("."))).accepted is accepted


def test_method_table_matches_what_the_wheels_say() -> None:
    assert M.support("vllm", M.MEDUSA, (0, 33)).accepted is False
    assert M.support("vllm", M.MEDUSA, None).accepted is False  # the newest release read is 0.33.0
    assert M.support("vllm", M.MLP, (0, 25)).accepted is False  # registry entry commented out
    assert M.support("vllm", M.DFLASH, (0, 19)).accepted is False and M.support("vllm", M.DFLASH, (0, 20)).accepted
    assert M.support("vllm", M.EAGLE3, (0, 10)).accepted is None  # older than the releases read: not known
    assert M.support("sglang", M.MEDUSA, (0, 5, 23)).accepted is False
    # sglang spec_info.py: DFLASH absent in the 0.5.9 wheel, present in 0.5.12; 0.5.10-0.5.11 were not read
    assert M.support("sglang", M.DFLASH, (0, 5, 9)).accepted is False
    assert M.support("sglang", M.DFLASH, (0, 5, 11)).accepted is None
    assert M.support("sglang", M.DFLASH, (0, 5, 12)).accepted is True
    assert M.support("sglang", M.NGRAM, (0, 5, 5)).accepted is True
    assert M.accepted_anywhere(M.MLP) is False and M.accepted_anywhere(M.EAGLE3) is True
    assert set(M.METHODS) <= set(M.LABEL)


def test_mlp_speculator_fails_even_without_a_runtime(tmp_path: Path) -> None:
    cfg = {"architectures": ["MLPSpeculatorPreTrainedModel"], "model_type": "mlp_speculator", "n_predict": 3}
    rep = Scenario(draft=cfg, tensors=None, target=None, serve=None, runtime=None, trained_with=None).run(tmp_path)
    assert "MTH001" in _errors(rep) and rep.verdict == "fail"


def test_hub_id_draft_serving_streams_cannot_be_known() -> None:
    serve = ("vllm serve meta-llama/Llama-3.1-8B-Instruct --speculative-config "
             "'{\"method\": \"eagle3\", \"model\": \"org/hub-eagle3\", \"num_speculative_tokens\": 3}'")
    rep = run_lint(LintRequest(target=str(FIX / "targets" / "llama-3.1-8b-instruct.json"), serve=serve,
                               trained_with="stream:2,16,29"))
    assert rep.serving_streams is None  # never the runtime's defaults for a config nobody read
    f = next(f for f in rep.findings if f.code == "IDS002")
    assert f.severity.value == "warning" and "cannot be known" in f.message
    assert "org/hub-eagle3" in " ".join(rep.assumptions)


def test_empty_draft_config_does_not_pass(tmp_path: Path) -> None:
    for runtime in (None, "vllm@0.33.0"):
        rep = Scenario(draft={}, tensors=None, serve=None, runtime=runtime, trained_with=None).run(tmp_path / str(runtime))
        assert rep.verdict == "fail" and "MTH002" in _errors(rep), rep.summary


def test_modelopt_plus_one_past_n_is_no_reading(tmp_path: Path) -> None:
    """ModelOpt's +1 on ids that already reach N gives a stream past N: no training fed that,
    so the training side is unknown (not an IDS002 error built on an impossible reading)."""
    cfg = json.loads((FIX / "drafts" / "modelopt" / "llama3.1-8b-eagle3.json").read_text())
    n = 32
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 16, n]
    assert max(cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]) + 1 > n  # the construction: impossible
    rep = Scenario(draft=cfg, tensors=None, target=llama_target(n=n), serve=None, runtime="vllm@0.33.0",
                   trained_with=None).run(tmp_path)
    assert rep.training_streams is None and "training unknown" in rep.summary
    assert "IDS002" not in _errors(rep)


@pytest.mark.parametrize("n,ids,slots,aux,appended", [
    (30, [2, 15, 27, 30], None, [2, 15, 27], 30),
    (30, [2, 15, 27, 30], 3, [2, 15, 27], 30),
    (30, [2, 15, 30], 3, [2, 15, 30], None),  # three slots, three ids: 30 is a real aux id
    (31, [2, 15, 27, 30], None, [2, 15, 27, 30], None),  # 30 is not N
    (None, [2, 5, 8, 10], 3, [2, 5, 8], 10),  # N unknown: one id more than the slots
    (None, [2, 5, 8, 10], None, [2, 5, 8, 10], None),
])
def test_split_appended_rule(n: int | None, ids: list[int], slots: int | None, aux: list[int],
                             appended: int | None) -> None:
    got, last, why = split_appended(ids, n, "speculators", slots)
    assert (got, last) == (aux, appended) and bool(why) is (appended is not None)
    assert split_appended(ids, n, "stream", slots)[1] is None  # only data-generation conventions append


def test_trained_with_speculators_data_generation_ids_drop_the_verifier_state(tmp_path: Path) -> None:
    n = 30
    dflt = [2, n // 2, n - 3]  # speculators' default ids for N = 30
    rep = Scenario(draft=speculators_config(ids=dflt), tensors=eagle3_tensors(layout="speculators"),
                   target=llama_target(n=n), serve=None, runtime="vllm@0.33.0",
                   trained_with=f"speculators:{','.join(map(str, dflt + [n]))}").run(tmp_path)
    assert rep.training_streams == dflt and rep.verdict == "pass", rep.summary
    assert not {"IDS010", "IDS012", "SHP001"} & codes(rep)  # no "four streams", no "write four ids"
    assert any("verifier's last state" in a for a in rep.assumptions)


def test_vllm_022_defaults_qwen3_to_the_v2_runner_which_reads_only_top_level_ids(tmp_path: Path) -> None:
    """vllm 0.22.0 config/vllm.py: DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES = {Qwen3ForCausalLM}
    (dense, unquantized); the V2 runner reads only the top-level ids, so nested-only ids fall
    back to the default. Llama stays on V1 in 0.22, which reads the nested key."""
    assert rm.vllm_runner((0, 22), "Qwen3ForCausalLM", False)[0] == "v2"
    assert rm.vllm_runner((0, 22), "LlamaForCausalLM", False)[0] == "v1"
    serve = ("vllm serve Qwen/Qwen3-8B --speculative-config "
             "'{\"method\": \"eagle3\", \"model\": \"{draft}\", \"num_speculative_tokens\": 3}'")
    base = dict(draft=sglang_config(ids=[1, 15, 28]), serve=serve, runtime="vllm@0.22.0", trained_with=None)
    q = Scenario(target=llama_target(arch="Qwen3ForCausalLM"), **base).run(tmp_path / "q")
    assert q.serving.runner.startswith("v2") and "IDS001" in codes(q)
    ll = Scenario(target=llama_target(), **base).run(tmp_path / "l")
    assert ll.serving.runner.startswith("v1") and ll.serving_streams == [1, 15, 28]
    # 0.22.0/0.23.0 keep a quantized target on V1 (_is_default_v2_model_runner_model: `not is_quantized`)
    quant = llama_target(arch="Qwen3ForCausalLM", quantization_config={"quant_method": "fp8"})
    qq = Scenario(target=quant, **base).run(tmp_path / "qq")
    assert qq.serving.runner.startswith("v1") and "quantized" in qq.serving.runner


def _vllm_file(path: Path, streams: list[int]) -> torch.Tensor:
    from consistency.record.fused import FusedDecoder
    from tests.conftest import prompt_ids, tiny

    ids = torch.as_tensor(prompt_ids(tiny("tiny-llama"), 32))
    _final, aux = FusedDecoder(tiny("tiny-llama").eval(), streams)(ids[None])
    save_file({"hidden_states": torch.stack([a[0] for a in aux], dim=1).contiguous(), "token_ids": ids.clone()},
              str(path))
    return ids


def test_vllm_data_generation_file_reads_its_last_id_as_the_verifier_state(tmp_path: Path) -> None:
    from consistency.pipeline.compare import compare as run_compare
    from consistency.dump.sets import open_side
    from consistency.record.api import record_reference
    from tests.conftest import tiny

    n = tiny("tiny-llama").config.num_hidden_layers
    aux = [2, 6, 9]
    f = tmp_path / "0-a1b2c3d4.safetensors"  # a vLLM request id
    tok = _vllm_file(f, aux + [n])
    with open_side(f, aux + [n], "speculators") as d:
        assert d.metadata.aux.stream_ids == aux and f"hidden.{n}" in d.tensors and "aux.3" not in d.tensors
        assert any("verifier's last state" in x for x in d.metadata.extra["notes"])
    ref = record_reference(tiny("tiny-llama"), tok.numpy(), tmp_path / "train.safetensors", aux, force=True)
    for conv in ("speculators", "vllm"):  # vLLM's own convention: the reference records N, the last id is it
        rep = run_compare(str(ref), str(f), cand_layer_ids=",".join(map(str, aux + [n])), convention=conv)
        assert rep.verdict == "pass", (conv, rep.summary)
        assert "EXTRA" not in {x.code for x in rep.findings}


def test_compare_layer_ids_with_the_appended_n_declare_only_the_aux_slots(tmp_path: Path) -> None:
    """Two dumps with three aux slots that record no ids; ``--layer-ids 2,5,8,10 --convention
    speculators`` is a data-generation list: one id more than the slots, the last the verifier's
    last state. It declares streams [2, 5, 8] and no aux.3."""
    import numpy as np

    from consistency.pipeline.compare import compare as run_compare
    from consistency.dump.writer import write_dump

    rng = np.random.default_rng(0)
    t = {f"aux.{i}": rng.standard_normal((16, 32)).astype(np.float32) for i in range(3)}
    t["input_ids"] = np.arange(16, dtype=np.int64)
    a, b = write_dump(tmp_path / "a.safetensors", t), write_dump(tmp_path / "b.safetensors", t)
    rep = run_compare(str(a), str(b), layer_ids="2,5,8,10", convention="speculators")
    assert rep.verdict == "pass", rep.summary
    text = json.dumps(rep.model_dump(mode="json"))
    assert "aux.3" not in text and "verifier's last state" in text


def test_docs_name_the_new_rules() -> None:
    for code in ("IDS012", "IDS013", "MTH001", "MTH002"):
        assert (ROOT / "docs" / "rules" / f"{code}.md").is_file()


@pytest.mark.parametrize("convention", ["vllm", "speculators"])
@pytest.mark.parametrize("aux", [[2, 6, 9], [1, 4]])
@pytest.mark.parametrize("appended", [True, False])
def test_vllm_reader_axes_appended_n(tmp_path: Path, convention: str, aux: list[int], appended: bool) -> None:
    """vLLM extract_hidden_states files: aux ids with or without N appended, read under vLLM's own
    convention (every slot a draft slot) or speculators' data generation (the last slot is the
    verifier's last state). Expected names come from the construction."""
    import numpy as np

    from consistency.dump.sets import open_side

    n = 12
    ids = aux + [n] if appended else list(aux)
    t = 8
    hs = np.random.default_rng(len(ids)).standard_normal((t, len(ids), 16)).astype(np.float32)
    f = tmp_path / "cmpl-1a2b3c.safetensors"
    save_file({"hidden_states": torch.from_numpy(hs), "token_ids": torch.arange(t)}, str(f))
    split = convention == "speculators"  # the file is data generation: its last slot is the verifier's state
    with open_side(f, ids, convention) as d:
        want_aux = len(ids) - 1 if split else len(ids)
        assert sorted(k for k in d.tensors if k.startswith("aux.")) == [f"aux.{i}" for i in range(want_aux)]
        assert d.metadata.aux.stream_ids == ids[:want_aux]
        if split:
            assert f"hidden.{ids[-1]}" in d.tensors
            np.testing.assert_array_equal(np.asarray(d.tensors[f"hidden.{ids[-1]}"].read_all()), hs[:, -1])
