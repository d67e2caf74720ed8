"""Issue 35: replay's accept length is what a chain server measures.

The measurement is a real speculative decoding loop (tests/spec_loop.py: EAGLE-3 chain,
greedy verify of [root, d1..dK], accepted prefix + bonus, draft extend after decode, both KV
caches rolled back, written from SGLang's eagle_worker.py). The prediction is replay's, from
three kinds of dump of the text that loop generated: the whole text recorded as one prompt
(the README flow), the text with a loss mask on the generated tokens (a training file), and
the loop's own captured verify passes. Right streams on the reference, the seed's shifted
streams on the candidate (the loop run with each); the expected figure is the loop's, never
replay's hit matrix.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
import torch

from consistency.dump.reader import open_dump
from consistency.dump.writer import write_dump
from consistency.record import Recorder
from consistency.record.api import record_reference
from consistency.record.models import build_builtin
from consistency.replay.assets import builtin_dir
from consistency.replay.engine import run_replay
from consistency.replay.load import TargetParts, load_draft
from consistency.replay.train import fingerprint
from tests.spec_loop import spec_loop

DRAFT = builtin_dir("tiny-llama-eagle3")
RIGHT, SHIFTED = [0, 3, 7], [3, 7, 10]  # what the draft was trained on; SGLang 0.5.5's +1 reading (the seed)
NEW = 40  # generated tokens per loop
TOL = 0.05  # tokens per verify pass (issue 35)


@lru_cache(maxsize=None)
def _builtin():  # noqa: ANN202
    t = build_builtin("tiny-llama", 0)
    meta = json.loads((DRAFT / "config.json").read_text()).get("consistency_fixture", {})
    if meta.get("target_fingerprint") != fingerprint(t):
        pytest.skip("the built-in draft was trained for another build of tiny-llama (transformers changed its init)")
    return t, DRAFT


@lru_cache(maxsize=None)
def _drift():  # noqa: ANN202
    """The model the tests build (fixtures/train_draft.py's drift target) and its draft."""
    from tests.replay.test_replay import _draft, _target

    return _target(), _draft()


def _module(target, draft_dir: Path):  # noqa: ANN001, ANN202
    return load_draft(draft_dir, TargetParts.from_model(target, "target")).model


def _with_mask(path: Path, prompt: int) -> Path:
    """The same dump with SpecForge's loss_mask: 1 on the generated tokens."""
    with open_dump(path) as d:
        arrs = {n: (d[n].read_all(), d[n].dtype) for n in d.tensors}
        meta = d.metadata.model_copy(deep=True) if d.metadata else None
    t = len(arrs["input_ids"][0].reshape(-1))
    mask = np.zeros(t, np.int64)
    mask[prompt:] = 1
    out = path.with_name(path.stem + ".masked.safetensors")
    write_dump(out, {**arrs, "loss_mask": (mask, "int64")}, meta, force=True)
    return out


def _predict_and_measure(target, draft_dir: Path, k: int, kind: str, tmp: Path, seed: int = 0):  # noqa: ANN001, ANN202
    """(predicted, measured) accept length for the reference (right streams) and the candidate
    (shifted streams), from one kind of dump of the text the loop generated."""
    draft = _module(target, draft_dir)
    vocab = target.config.vocab_size
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, vocab, 1 if kind == "prompt" else 8)  # the README flow: the whole text is "the prompt"
    paths, loops = [], []
    for tag, streams in (("ref", RIGHT), ("cand", SHIFTED)):
        rec = Recorder(tmp / f"{kind}-{tag}-capture.safetensors", force=True) if kind == "capture" else None
        loop = spec_loop(target, draft, prompt, NEW, k, streams, rec=rec)
        loops.append(loop)
        if rec is not None:
            paths.append(rec.save())
            continue
        p = record_reference(target, loop.tokens, tmp / f"{kind}-{tag}.safetensors", streams, components=False,
                             force=True)
        paths.append(_with_mask(p, len(prompt)) if kind == "mask" else p)
    assert np.array_equal(loops[0].tokens[:len(loops[1].tokens)], loops[1].tokens[:len(loops[0].tokens)])  # lossless
    rep = run_replay(draft_dir, target, paths[0], paths[1], steps=k)
    shared = min(len(loops[0].tokens), len(loops[1].tokens)) if kind != "capture" else None
    if kind == "capture":  # stitched: the prompt, every confirmed row, the last pass's root (its drafts unconfirmed)
        shared = min(rep.reference.tokens, rep.candidate.tokens)
        for loop in loops:
            last = loop.passes[-1][0] + 1  # the last verify pass's root position
            assert last + 1 >= shared
    assert rep.reference.scored_on == {"prompt": "all", "mask": "loss_mask", "capture": "response"}[kind]
    last_anchor = shared - 1 - k  # the last anchor whose K drafts the dump's labels judge
    measured = [loop.accept_length(last_anchor) for loop in loops]
    return (rep.reference.accept_length, rep.candidate.accept_length), tuple(measured), rep


@pytest.mark.parametrize("kind", ["prompt", "mask", "capture"])
def test_predicted_accept_length_is_the_loops_at_k3(kind: str, tmp_path: Path) -> None:
    target, draft_dir = _builtin()
    torch.manual_seed(0)
    pred, meas, rep = _predict_and_measure(target, draft_dir, 3, kind, tmp_path)
    assert abs(pred[0] - meas[0]) <= TOL and abs(pred[1] - meas[1]) <= TOL, (pred, meas, rep.summary)
    assert meas[0] > meas[1]  # the shifted streams cost acceptance in the loop too
    every = rep.reference.every_anchor
    assert every is not None and every.anchors > rep.reference.anchors  # the walk verifies at fewer anchors


@pytest.mark.slow
@pytest.mark.parametrize("model", ["builtin", "drift"])
@pytest.mark.parametrize("kind", ["prompt", "mask", "capture"])
def test_predicted_accept_length_is_the_loops_at_every_k(model: str, kind: str, tmp_path: Path) -> None:
    target, draft_dir = _builtin() if model == "builtin" else _drift()
    for k in range(1, 6):
        for seed in (0, 1):
            pred, meas, rep = _predict_and_measure(target, draft_dir, k, kind, tmp_path, seed)
            assert abs(pred[0] - meas[0]) <= TOL and abs(pred[1] - meas[1]) <= TOL, (model, kind, k, seed, pred, meas)


def test_verify_passes_that_accept_every_draft_read_as_generation(tmp_path: Path) -> None:
    """A capture whose verify passes each accepted every draft rewinds nothing; its passes of
    K+1 rows still are generation (the server drafted there), and the last pass's drafts are
    unconfirmed. Built with tests/serving.py's verify loop: every pass accepts all k drafts."""
    from consistency.dump.sets import open_side
    from consistency.dump.stitch import stitch
    from tests.serving import verify_loop

    target, _ = _builtin()
    prompt = np.random.default_rng(5).integers(0, target.config.vocab_size, 12)
    k, passes = 3, 4
    em = verify_loop(target, prompt, [k] * passes, k, tmp_path / "cap.safetensors", RIGHT)
    assert em.rewinds == 0  # nothing in the positions says "verify"
    with open_side(em.path) as raw:
        d, layout = stitch(raw)
        response = layout.response()
        n = d["input_ids"].rows
    generated = len(prompt) + passes * (k + 1) - k  # every verified token: the drafts of the last pass are not
    assert n == len(prompt) + passes * (k + 1) - k, n
    assert response is not None and response.tolist() == [False] * len(prompt) + [True] * (generated - len(prompt))
    assert layout.verify.unconfirmed == k


def test_a_bf16_capture_is_labelled_by_the_target_in_bf16(tmp_path: Path) -> None:
    """A bf16 server verifies with the bf16 target's argmax: the candidate's labels are that,
    and the report says how many differ from float32's (counted here on the model itself)."""
    import copy

    from consistency.record.api import record_serving
    from consistency.record.models import DEMO_PROMPT, tokenize
    from consistency.replay.sides import read_side

    target, _ = _builtin()
    ids = tokenize(target, "tiny-llama", DEMO_PROMPT)
    train = record_reference(target, ids, tmp_path / "train.safetensors", RIGHT, components=False)
    serve = record_serving(copy.deepcopy(target), ids, tmp_path / "serve.safetensors", RIGHT, dtype="bfloat16")
    x = torch.as_tensor(np.asarray(ids).reshape(-1))[None]
    with torch.no_grad():
        fp32 = target(input_ids=x).logits[0].argmax(-1)
        bf16 = copy.deepcopy(target).to(torch.bfloat16)(input_ids=x).logits[0].float().argmax(-1)
    changed = int((fp32 != bf16).sum())
    assert changed > 0  # this construction has positions where the dtypes disagree
    width = target.config.hidden_size
    ref, cand = (read_side(p, 3, width, target, "auto", {}) for p in (train, serve))
    assert (ref.label_dtype, ref.label_changed) == ("float32", None) and torch.equal(ref.labels, fp32)
    assert (cand.label_dtype, cand.label_changed) == ("bfloat16", changed) and torch.equal(cand.labels, bf16)
    rep = run_replay(DRAFT, target, train, serve, steps=3)
    assert rep.candidate.label_dtype == "bfloat16" and rep.candidate.label_changed == changed
    assert any(f"{changed} of {len(fp32)} differ from float32's" in n for n in rep.notes), rep.notes


def test_replays_that_score_nothing_never_pass_cli_or_gate(tmp_path: Path) -> None:
    """Issue 34: no --target and no logits is exit 2 naming what could not be scored (also with
    --labels input_ids); the same file on both sides is SAME_INPUT; a gate [[replay]] without a
    target is an error, never a pass."""
    import copy

    from consistency.record.api import record_serving
    from consistency.record.models import DEMO_PROMPT, tokenize
    from tests.conftest import run_cli

    target, _ = _builtin()
    ids = tokenize(target, "tiny-llama", DEMO_PROMPT)
    train = record_reference(target, ids, tmp_path / "train.safetensors", RIGHT, components=False)
    serve = record_serving(copy.deepcopy(target), ids, tmp_path / "serve.safetensors", SHIFTED, dtype="bfloat16")
    for extra in ((), ("--labels", "input_ids")):
        r = run_cli("replay", "--draft", "tiny-llama-eagle3", str(train), str(serve), *extra)
        assert r.returncode == 2 and "PASS" not in r.stdout, (r.stdout, r.stderr)
        want = "could not be scored" if not extra else "--labels input_ids: the recorded next tokens are not"
        assert len(r.stderr.strip().splitlines()) == 1 and want in r.stderr, r.stderr
    copy_of_train = tmp_path / "copy.safetensors"
    copy_of_train.write_bytes(train.read_bytes())
    for other in (train, copy_of_train):
        rep = run_replay(DRAFT, target, train, other, steps=3)
        assert rep.verdict == "fail" and [f.code for f in rep.findings][0] == "SAME_INPUT", rep.summary
    (tmp_path / "consistency.toml").write_text(
        '[[replay]]\nname = "no-target"\ndraft = "tiny-llama-eagle3"\nreference = "train.safetensors"\n'
        'candidate = "serve.safetensors"\n\n[[replay]]\nname = "same"\ndraft = "tiny-llama-eagle3"\n'
        'target = "tiny-llama"\nreference = "train.safetensors"\ncandidate = "train.safetensors"\n')
    r = run_cli("gate", "--config", str(tmp_path / "consistency.toml"), "--json", str(tmp_path / "gate.json"))
    gate = json.loads((tmp_path / "gate.json").read_text())
    assert r.returncode != 0 and gate["verdict"] == "error", gate["summary"]
    checks = {c["name"]: c for c in gate["checks"]}
    assert checks["no-target"]["verdict"] == "error" and "could not be scored" in checks["no-target"]["summary"]
    assert checks["same"]["verdict"] == "fail" and "same input" in checks["same"]["summary"]


def test_a_reference_at_chance_or_nothing_scored_is_inconclusive(tmp_path: Path) -> None:
    """Aux states of seeded noise: the draft predicts nothing on either side, so 'no drop' is
    no evidence (before issue 34 it passed). Three tokens at K = 3: no chain is verifiable."""
    from consistency.record.models import DEMO_PROMPT, tokenize

    target, _ = _builtin()
    ids = np.asarray(tokenize(target, "tiny-llama", DEMO_PROMPT)).reshape(-1)
    width = target.config.hidden_size
    paths = []
    for seed in (1, 2):
        noise = np.random.default_rng(seed).standard_normal((3, len(ids), width)).astype(np.float32)
        p = tmp_path / f"noise{seed}.safetensors"
        write_dump(p, {"input_ids": ids, **{f"aux.{i}": noise[i] for i in range(3)}}, force=True)
        paths.append(p)
    rep = run_replay(DRAFT, target, paths[0], paths[1], steps=3)
    every = rep.reference.every_anchor
    assert rep.verdict == "fail" and [f.code for f in rep.findings][0] == "REPLAY_INCONCLUSIVE", rep.summary
    assert rep.summary.startswith("inconclusive: the draft scores at chance") and every is not None
    assert sum(rep.reference.hits) <= 3  # seeded noise: at most a few step-1 hits by luck
    with open_dump(paths[0]) as d:
        short = {n: d[n].read_all()[:3] for n in d.tensors}
    write_dump(tmp_path / "short.safetensors", short, force=True)
    rep = run_replay(DRAFT, target, tmp_path / "short.safetensors", paths[1], steps=3)
    assert [f.code for f in rep.findings][0] == "REPLAY_INCONCLUSIVE" and "nothing was scored" in rep.summary
    assert rep.verdict == "fail"
