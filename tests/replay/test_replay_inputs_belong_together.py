"""Issue 15, replay: no verdict on inputs that do not belong together, and training files
read as compare reads them.

The built-in draft ``tiny-llama-eagle3`` was trained on streams [0, 3, 7] of the built-in
``tiny-llama`` (seed 0); the dumps are recorded here from that very model, in memory.
"""

from __future__ import annotations

import copy
import json
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
import torch

from consistency.errors import InputError, UsageError
from consistency.record.api import record_reference, record_serving
from consistency.record.models import DEMO_PROMPT, build_builtin, tokenize
from consistency.replay.assets import builtin_dir
from consistency.replay.engine import run_replay
from consistency.replay.train import fingerprint

DRAFT = builtin_dir("tiny-llama-eagle3")
TRAIN = [0, 3, 7]


@lru_cache(maxsize=None)
def _target(seed: int = 0):  # noqa: ANN202
    m = build_builtin("tiny-llama", seed)
    meta = json.loads((DRAFT / "config.json").read_text()).get("consistency_fixture", {})
    if seed == 0 and meta.get("target_fingerprint") != fingerprint(m):
        pytest.skip("the built-in draft was trained for another build of tiny-llama (transformers changed its init)")
    return m


@pytest.fixture(scope="module")
def dumps(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("truth-replay")
    t = _target()
    ids = tokenize(t, "tiny-llama", DEMO_PROMPT)
    other = tokenize(t, "tiny-llama", DEMO_PROMPT[::-1])
    out = {k: d / f"{k}.safetensors" for k in ("train", "serve", "other", "short")}
    record_reference(t, ids, out["train"], TRAIN)
    record_serving(copy.deepcopy(t), ids, out["serve"], TRAIN, runtime="sglang@0.5.23", dtype="bfloat16")
    record_serving(copy.deepcopy(t), other, out["other"], TRAIN, runtime="sglang@0.5.23", dtype="bfloat16")
    record_serving(copy.deepcopy(t), ids[:60], out["short"], TRAIN, runtime="sglang@0.5.23", dtype="bfloat16")
    return out


def test_the_right_inputs_still_replay(dumps: dict[str, Path]) -> None:
    rep = run_replay(DRAFT, _target(), dumps["train"], dumps["serve"], steps=3)
    assert rep.verdict == "pass" and rep.reference.top1 > 0.3


def test_a_target_of_another_architecture_is_refused(dumps: dict[str, Path]) -> None:
    with pytest.raises(UsageError, match=r"--target tiny-qwen2 is not the model .*train.safetensors.*architecture "
                                         r"'LlamaForCausalLM' vs 'Qwen2ForCausalLM'"):
        run_replay(DRAFT, "tiny-qwen2", dumps["train"], dumps["serve"], steps=3)


def test_a_target_with_other_weights_is_refused(dumps: dict[str, Path]) -> None:
    """Same name, same shape, another seed: only the recorded streams can tell, and they do."""
    with pytest.raises(UsageError, match=r"not the model .*train.safetensors.*stream \d+ differs"):
        run_replay(DRAFT, _target(1), dumps["train"], dumps["serve"], steps=3)


def test_swapped_reference_and_candidate_are_refused(dumps: dict[str, Path]) -> None:
    with pytest.raises(UsageError, match="recorded as the serving side .* training side: swapped"):
        run_replay(DRAFT, _target(), dumps["serve"], dumps["train"], steps=3)


def test_dumps_of_different_prompts_are_refused(dumps: dict[str, Path]) -> None:
    with pytest.raises(UsageError, match="hold different tokens .*first difference at position 0"):
        run_replay(DRAFT, _target(), dumps["train"], dumps["other"], steps=3)


def test_a_prefix_is_replayed_on_the_shared_tokens(dumps: dict[str, Path]) -> None:
    rep = run_replay(DRAFT, _target(), dumps["train"], dumps["short"], steps=3)
    assert rep.reference.tokens == rep.candidate.tokens == 60
    assert any("replayed on the 60 both dumps share" in n for n in rep.notes)


def test_bad_numbers_are_usage_errors(dumps: dict[str, Path]) -> None:
    for kw in ({"max_drop_points": float("nan")}, {"max_drop_points": -1.0}, {"steps": 0}, {"min_acceptance": 1.5}):
        with pytest.raises(UsageError):
            run_replay(DRAFT, _target(), dumps["train"], dumps["serve"], **{"steps": 3, **kw})


def _speculators_file(train: Path, out: Path) -> Path:
    """What speculators' data generation writes: hs_{i}.safetensors, [T, n+1, H] with stream N last."""
    from safetensors.numpy import save_file

    from consistency.dump.reader import open_dump

    with open_dump(train) as d:
        ids = d["input_ids"].read_all()
        slots = [d[f"aux.{i}"].read_all() for i in range(3)] + [d["hidden.12"].read_all()]
    save_file({"hidden_states": np.stack(slots, axis=1), "token_ids": ids}, str(out))
    return out


def test_layer_ids_of_a_training_file_are_read_as_compare_reads_them(dumps: dict[str, Path], tmp_path: Path) -> None:
    from consistency.pipeline.compare import compare as run_compare

    hs = _speculators_file(dumps["train"], tmp_path / "hs_0.safetensors")
    rep = run_replay(DRAFT, _target(), hs, dumps["serve"], steps=3, layer_ids=[0, 3, 7], convention="stream")
    cmp = run_compare(str(hs), str(dumps["serve"]), layer_ids="0,3,7", convention="stream")
    assert rep.reference.claimed_streams == [0, 3, 7] == [s.expected_stream for s in cmp.slots]
    assert rep.verdict == "pass" and cmp.verdict == "pass"
    with pytest.raises(UsageError, match="--layer-ids"):  # the same validation compare applies
        run_replay(DRAFT, _target(), hs, dumps["serve"], steps=3, layer_ids=[3, 3, 7], convention="stream")


def test_lint_reads_a_specforge_ckpt_as_compare_does(tmp_path: Path) -> None:
    """A SpecForge data_0.ckpt.gz is opened (not parsed as a contract); it does not record its
    ids, so the one line says what to pass instead."""
    import gzip

    from consistency.lint.engine import LintRequest, run_lint

    rec = {"input_ids": torch.arange(8), "loss_mask": torch.ones(8, dtype=torch.long),
           "hidden_state": torch.randn(1, 8, 64, dtype=torch.bfloat16),
           "aux_hidden_state": torch.randn(1, 8, 3 * 64, dtype=torch.bfloat16)}
    p = tmp_path / "data_0.ckpt.gz"
    with gzip.open(p, "wb") as fh:
        torch.save(rec, fh)
    with pytest.raises(InputError, match="specforge training data, which does not record its layer ids.*"
                                         "FRAMEWORK\\[@VER\\]:IDS"):
        run_lint(LintRequest(trained_with=str(p), runtime="sglang@0.5.23"))
