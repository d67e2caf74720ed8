"""Lint on setups the tables did not write (review of issue 27): flags that run no draft at all,
and flags whose draft lint cannot identify, are never a silent PASS.

Targets come from ``transformers`` config classes; the serving lines are written as SGLang's
docs write them. What SGLang does with ``--speculative-algorithm EAGLE``/``NEXTN`` and no
draft path: it loads the target checkpoint itself as the draft (configs/model_config.py
``ModelConfig.from_server_args``: ``model_path or server_args.model_path``) and rewrites
its architecture only for the MTP classes of ``_config_draft_model`` (contract/sglang_drafts.py);
a dense Qwen3 has no such class, so neither an MTP head nor an EAGLE-3 draft is served.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import json

from consistency.lint.engine import LintRequest, run_lint
from tests.lint.test_lint_support import status

_SG = ("python -m sglang.launch_server --model-path Qwen/Qwen3-8B --speculative-algorithm {a} "
       "--speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4")


def lint(tmp: Path, target: dict[str, Any] | None, serve: str, runtime: str = "sglang@0.5.12"):  # noqa: ANN201
    t = None
    if target is not None:
        t = tmp / "target.json"
        t.write_text(json.dumps(target))
    return run_lint(LintRequest(target=str(t) if t else None, serve=serve, runtime=runtime))


def qwen3_target() -> dict[str, Any]:
    from transformers import Qwen3Config

    cfg = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256).to_dict()
    cfg["architectures"] = ["Qwen3ForCausalLM"]
    return cfg


@pytest.mark.parametrize("algo", ["EAGLE", "NEXTN"])
def test_sglang_eagle_on_a_target_without_an_mtp_class_fails(tmp_path: Path, algo: str) -> None:
    rep = lint(tmp_path, qwen3_target(), _SG.format(a=algo))
    assert rep.verdict == "fail", rep.summary
    assert status(rep, "SRV003") == "fail"
    assert "no MTP class" in rep.summary and "captures no aux hidden states" in rep.summary, rep.summary


def test_sglang_eagle_whose_draft_cannot_be_told_warns(tmp_path: Path) -> None:
    rep = lint(tmp_path, None, _SG.format(a="EAGLE"))
    f = next(f for f in rep.findings if f.code == "SRV003")
    assert f.severity.value == "warning" and "not known" in f.message, f.message


# -- wrong kind of file where a config belongs (issue 28) ----------------------------------------

def _files(tmp: Path) -> dict[str, tuple[Path, str]]:
    import os

    import numpy as np

    npy = tmp / "a.npy"
    np.save(npy, np.zeros(3))
    gguf = tmp / "m.gguf"
    gguf.write_bytes(b"GGUF\x03\x00\x00\x00" + bytes(64))
    rnd = tmp / "r.bin"
    rnd.write_bytes(b"\xf4\x2d\xdf\xaa" + os.urandom(60))
    empty = tmp / "empty"
    empty.write_bytes(b"")
    return {"npy": (npy, "numpy .npy"), "gguf": (gguf, "GGUF"), "random": (rnd, "unrecognised bytes"),
            "empty": (empty, "empty file")}


@pytest.mark.parametrize("flag", ["--draft", "--target"])
def test_a_non_json_file_as_a_config_is_named_for_what_it_is(tmp_path: Path, flag: str) -> None:
    from tests.conftest import run_cli

    for name, (path, said) in _files(tmp_path).items():
        r = run_cli("lint", flag, str(path), "--runtime", "sglang@0.5.12", "-q")
        assert r.returncode == 2, (name, r.stderr)
        assert said in r.stderr and "not a JSON" in r.stderr and "UTF-8" not in r.stderr, (name, r.stderr)


def test_random_bytes_named_safetensors_are_not_called_text(tmp_path: Path) -> None:
    from consistency.dump.safetensors_io import read_header
    from consistency.errors import InputError

    p = tmp_path / "r.safetensors"
    p.write_bytes(bytes([0xB0, 0x78, 0xB0, 0xB8, 0x20, 0xBD, 0xD8, 0x9F]) + bytes(range(200, 255)))
    with pytest.raises(InputError) as e:
        read_header(p)
    assert "binary data" in str(e.value) and "b0 78" not in str(e.value) and "text" not in str(e.value), str(e.value)


def test_a_stamp_that_narrows_nothing_is_not_said_to_choose_the_reading(tmp_path: Path) -> None:
    """A Qwen3 target: every SpecForge capture backend reads the ids alike, and a transformers
    stamp no SGLang release pins chose nothing (it must not read "chosen by")."""
    t = qwen3_target()
    draft = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 64, "num_hidden_layers": 1, "vocab_size": 256,
             "draft_vocab_size": 128, "transformers_version": "4.51.3",
             "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 5]}}
    (tmp_path / "t.json").write_text(json.dumps(t))
    (tmp_path / "d.json").write_text(json.dumps(draft))
    rep = run_lint(LintRequest(draft=str(tmp_path / "d.json"), target=str(tmp_path / "t.json"),
                               runtime="sglang@0.5.12"))
    said = " ".join(rep.assumptions)
    assert "chosen by" not in said and "every capture backend gives these streams" in said, said


def test_tokenizer_without_transformers_names_our_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The core install has no transformers: --tokenizer says which pip line brings it."""
    import sys

    from consistency import DIST
    from consistency.compare.tokenizer import load_tokenizer
    from consistency.errors import UsageError

    monkeypatch.setitem(sys.modules, "transformers", None)  # as in a venv without it: import raises
    with pytest.raises(UsageError) as e:
        load_tokenizer(str(tmp_path))
    assert f"pip install '{DIST}[hf]'" in str(e.value) and "--tokenizer needs transformers" in str(e.value)


@pytest.mark.parametrize(("method", "refused"), [("eagle3", True), ("eagle", True), ("medusa", True), (None, True),
                                                 ("mtp", False), ("deepseek_mtp", False), ("ngram", False)])
def test_vllm_spec_config_without_a_model_is_refused_at_start_up(method: str | None, refused: bool) -> None:
    """vllm config/speculative.py __post_init__: model None with num_speculative_tokens is a
    ValueError unless the method runs the target's own MTP layers or a model-free proposer."""
    spec = {"num_speculative_tokens": 3, **({"method": method} if method else {})}
    rep = run_lint(LintRequest(serve=f"vllm serve meta-llama/Llama-3.1-8B-Instruct --speculative-config "
                                     f"'{json.dumps(spec)}'", runtime="vllm@0.33.0", select=("SRV002",)))
    said = [f.message for f in rep.findings if f.code == "SRV002" and 'no "model"' in f.message]
    assert bool(said) is refused, [f.message for f in rep.findings]
    if refused:
        assert rep.verdict == "fail"


@pytest.mark.parametrize("algo", ["NEXTN", "EAGLE3"])
def test_a_speculators_mtp_draft_on_sglang_is_refused_whatever_the_flag(tmp_path: Path, algo: str) -> None:
    """SGLang has no reader for the speculators format (nor a class for MTPDraftModel): an MTP
    draft in that format fails there as an EAGLE-3 one does (SRV004 is not an EAGLE-3-only rule)."""
    from tests.lint.test_lint_mtp import deepseek_target, mtp_tensors, speculators_mtp
    from tests.lint.test_lint_support import Scenario

    serve = ("python -m sglang.launch_server --model-path deepseek-ai/DeepSeek-V3 --speculative-algorithm "
             f"{algo} --speculative-draft-model-path {{draft}} --speculative-num-steps 1 --speculative-eagle-topk 1 "
             "--speculative-num-draft-tokens 2")
    rep = Scenario(draft=speculators_mtp(), tensors=mtp_tensors(), target=deepseek_target(), serve=serve,
                   runtime="sglang@0.5.23", trained_with=None).run(tmp_path)
    assert rep.verdict == "fail" and status(rep, "SRV004") == "fail", rep.summary


@pytest.mark.parametrize(("method", "fails"), [("eagle3", True), ("eagle", True), ("mtp", True), ("medusa", False)])
def test_a_medusa_draft_under_another_vllm_method_fails(tmp_path: Path, method: str, fails: bool) -> None:
    from tests.lint.test_lint_mtp import S, vllm

    cfg = {"medusa_num_heads": 4, "medusa_num_layers": 1, "hidden_size": 64, "vocab_size": 256}
    rep = S(draft=cfg, target=None, runtime="vllm@0.32.0",  # the last release with Medusa (MTH001 on 0.33.0)
            serve=vllm(method, 4, "lmsys/vicuna-7b-v1.3", draft=True)).run(tmp_path)
    assert (status(rep, "MDS001") == "fail") is fails and (rep.verdict == "fail") is fails, rep.summary


def test_an_eagle1_draft_under_vllm_medusa_fails(tmp_path: Path) -> None:
    from tests.lint.test_lint_mtp import S, eagle1_config, eagle1_tensors, vllm

    rep = S(draft=eagle1_config(), tensors=eagle1_tensors(), target=None, runtime="vllm@0.33.0",
            serve=vllm("medusa", 3, "meta-llama/Llama-2-7b-chat-hf", draft=True)).run(tmp_path)
    assert status(rep, "EG1001") == "fail" and rep.verdict == "fail", rep.summary


def test_trained_with_an_empty_id_list_is_a_usage_error() -> None:
    """`--trained-with stream:$IDS` with IDS unset: not silently "training used the default ids"."""
    from consistency.errors import UsageError

    with pytest.raises(UsageError, match="no ids after"):
        run_lint(LintRequest(trained_with="stream:", runtime="sglang@0.5.12"))
    rep = run_lint(LintRequest(trained_with="modelopt:default", runtime="sglang@0.5.12"))  # the documented spelling
    assert rep.verdict in ("pass", "fail", "not_evaluated")


@pytest.mark.parametrize("algo", ["NEXTN", "EAGLE"])
def test_a_draft_path_lint_cannot_read_is_not_guessed_to_be_eagle1(tmp_path: Path, algo: str) -> None:
    """`--speculative-draft-model-path lmsys/DeepSeek-R1-NextN` (a hub id, not read): MTP or EAGLE-1
    cannot be told apart, so the kind is undecided and said so as a warning, never a silent PASS."""
    from tests.lint.test_lint_mtp import deepseek_target

    serve = (f"python -m sglang.launch_server --model-path deepseek-ai/DeepSeek-R1 --speculative-algorithm {algo} "
             "--speculative-draft-model-path lmsys/DeepSeek-R1-NextN --speculative-num-steps 1 "
             "--speculative-eagle-topk 1 --speculative-num-draft-tokens 2")
    rep = lint(tmp_path, deepseek_target(), serve, "sglang@0.5.12")
    f = next(f for f in rep.findings if f.code == "SRV003")
    assert f.severity.value == "warning" and "cannot be told apart" in f.message, f.message
    assert "EAGLE-1/2 draft" not in rep.summary, rep.summary
