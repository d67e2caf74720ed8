"""Replay reads serving captures as compare does (issue 14): stitched passes, aligned tokens.

A chunked prefill + decode steps on a prefix-cache hit replays on the shared run and
matches the reference's acceptance; a prompt the reference never saw is refused.
"""

from __future__ import annotations

import copy

import pytest

from consistency.errors import UsageError
from consistency.record.api import record_reference
from consistency.record.models import DEMO_PROMPT, tokenize
from consistency.replay.engine import run_replay
from tests.compare.test_stitch import _serve as serve_passes
from tests.replay.test_replay_inputs_belong_together import DRAFT, TRAIN, _target


def _serve(model, path, passes, prefix=None):  # noqa: ANN001, ANN202
    return serve_passes(model, path, passes, slots=TRAIN, prefix=prefix)


def test_chunked_suffix_capture_replays_on_the_shared_run(tmp_path):
    t = _target()
    ids = tokenize(t, "tiny-llama", DEMO_PROMPT)
    train = record_reference(t, ids, tmp_path / "train.safetensors", TRAIN)
    k = 16
    chunks = [ids[k:k + 40], ids[k + 40:-2], ids[-2:-1], ids[-1:]]  # two prefill chunks, two decode steps
    serve = _serve(copy.deepcopy(t), tmp_path / "serve.safetensors", chunks, prefix=ids[:k])
    rep = run_replay(DRAFT, t, train, serve, steps=3)
    assert rep.verdict == "pass", rep.summary
    assert any(f"[{k}, {len(ids)})" in n for n in rep.notes), rep.notes
    assert rep.reference.top1 > 0.3 and abs(rep.candidate.top1 - rep.reference.top1) < 0.05


def test_different_prompts_are_refused_even_when_chunked(tmp_path):
    t = _target()
    ids = tokenize(t, "tiny-llama", DEMO_PROMPT)
    other = tokenize(t, "tiny-llama", DEMO_PROMPT[::-1])
    train = record_reference(t, ids, tmp_path / "train.safetensors", TRAIN)
    serve = _serve(copy.deepcopy(t), tmp_path / "other.safetensors", [other[:30], other[30:]])
    with pytest.raises(UsageError, match="hold different tokens"):
        run_replay(DRAFT, t, train, serve, steps=3)
