"""Training files from the upstream pipelines against what a speculative server captures.

The training side is built by speculators' ``build_speculator_training_dataset`` and
SpecForge's ``build_eagle3_dataset`` (tests/pipelines.py: their own code, multi-turn chats,
real chat templates, their loss masks); the serving side by a KV-cache loop running the
request as a server with a draft does (tests/serving.py: prefill, verify passes with
accepted and rejected drafts). Expected rows and verdicts follow from the construction.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from consistency.pipeline.compare import compare as run
from consistency.dump.reader import open_dump
from consistency.dump.sets import open_side
from tests import pipelines as PL
from tests.serving import verify_loop

speculators = pytest.importorskip("speculators")


def _codes(rep) -> set[str]:  # noqa: ANN001
    return {f.code for f in rep.findings}


def _errors(rep) -> list[str]:  # noqa: ANN001
    return [f"{f.code}: {f.message}" for f in rep.findings if f.severity.value == "error"]


# -- speculators: multi-turn rows, loss mask beside the files, replay where a server drafts -------

@pytest.fixture(scope="module")
def spec(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """Two-turn chats whose answers are the drift target's own greedy text (speculators
    regenerates responses with the target), through speculators' preprocessing."""
    from tests.serving import greedy
    from tests.replay.test_replay import _target

    t = _target()
    tok = PL.word_tokenizer(t.config.vocab_size)
    rng = np.random.default_rng(5)
    convs = []
    for _c in range(2):
        conv: list[dict] = []
        for _turn in range(2):
            conv.append({"role": "user", "content": PL.text(rng.integers(5, 512, 10))})
            prompt = np.asarray(tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)["input_ids"])
            conv.append({"role": "assistant", "content": PL.text(greedy(t, prompt, 40))})
        convs.append(conv)
    rows = PL.speculators_rows(convs, tok)
    root = tmp_path_factory.mktemp("spec") / "data"
    files = PL.speculators_files(root, rows, t, [0, 3, 7, 12])
    return t, tok, rows, files


def test_speculators_rows_fan_out_per_turn_and_the_loss_mask_is_read_beside(spec) -> None:
    _t, tok, rows, files = spec
    assert len(rows) == 4  # one row per assistant turn (speculators' boundary fan-out)
    for i, f in enumerate(files):
        mask = np.asarray(rows[i]["loss_mask"])
        with open_side(f, [0, 3, 7, 12], "stream") as d:
            assert d.format == "speculators" and d.metadata.aux.stream_ids == [0, 3, 7]
            assert np.array_equal(d["loss_mask"].read_all(), mask)
        boundary = int(np.flatnonzero(mask)[0])  # the render boundary: the generation prompt's end
        prompt = tok.apply_chat_template(_turns(rows, i, tok), add_generation_prompt=True, tokenize=True)
        assert boundary == len(prompt["input_ids"])


def _turns(rows, i: int, tok) -> list[dict]:  # noqa: ANN001
    """The conversation prefix before row i's supervised turn, rebuilt from its own ids."""
    ids = np.asarray(rows[i]["input_ids"])
    mask = np.asarray(rows[i]["loss_mask"])
    words = PL.text(ids[:int(np.flatnonzero(mask)[0])]).split(" <|im_end|> ")
    out = []
    for w in words:
        w = w.replace("<|im_start|> ", "").strip()
        if not w or w == "assistant":
            continue
        role, _, content = w.partition(" ")
        out.append({"role": role, "content": content})
    return out


def _serve_row(spec, i: int, streams: list[int], path: Path) -> tuple[np.ndarray, object]:  # noqa: ANN001
    t, _tok, rows, _files = spec
    ids = np.asarray(rows[i]["input_ids"], np.int64)
    mask = np.asarray(rows[i]["loss_mask"])
    p = int(np.flatnonzero(mask)[0])
    em = verify_loop(t, ids[:p], [2, 0, 3, 1, 3, 0, 2], 3, path, streams, chunks=2, continuation=ids[p:])
    return ids, em


@pytest.mark.slow
def test_a_verify_capture_of_the_second_turn_passes_against_speculators_data(spec, tmp_path: Path) -> None:
    _t, _tok, _rows, files = spec
    ids, em = _serve_row(spec, 1, [0, 3, 7], tmp_path / "serve.safetensors")
    rep = run(str(files[1]), str(em.path), ref_layer_ids="0,3,7,12", convention="stream")
    assert rep.verdict == "pass", _errors(rep)
    assert rep.alignment["compared"] == len(em.tokens) and np.array_equal(em.tokens, ids[:len(em.tokens)])
    assert {"VERIFY_PASSES"} <= _codes(rep) and rep.alignment["stitching"]["candidate"]["superseded"] == em.superseded


@pytest.mark.slow
def test_replay_scores_where_the_server_drafts_and_reports_both_figures(spec, tmp_path: Path) -> None:
    from consistency.replay.engine import run_replay
    from tests.replay.test_replay import _draft

    t, _tok, rows, files = spec
    _ids, bad = _serve_row(spec, 1, [3, 7, 10], tmp_path / "shifted.safetensors")  # the seed's +1
    rep = run_replay(_draft(), t, files[1], bad.path, steps=3, layer_ids=[0, 3, 7, 12], convention="stream")
    r, c = rep.reference, rep.candidate
    mask = np.asarray(rows[1]["loss_mask"])
    assert r.scored_on == c.scored_on == "loss_mask" and r.all_positions is not None
    assert r.all_positions.anchors > r.anchors  # the prompt's anchors are in the all-position figure only
    assert any("scored on the positions a server drafts (the reference's loss mask" in n for n in rep.notes)
    assert rep.drop.all_top1_points is not None and rep.verdict == "fail"
    assert rep.drop.top1_points != pytest.approx(rep.drop.all_top1_points)  # the prompt's share moves the figure
    n = len(bad.tokens)  # the tokens both sides hold: the prompt and the accepted answer
    assert f"the reference's loss mask: {int(mask[:n].sum())} of {n} tokens" in " ".join(rep.notes)
    _ids, good = _serve_row(spec, 1, [0, 3, 7], tmp_path / "good.safetensors")
    ok = run_replay(_draft(), t, files[1], good.path, steps=3, layer_ids=[0, 3, 7, 12], convention="stream",
                    max_drop_points=5.0)
    assert ok.verdict == "pass" and "over all" in ok.summary  # the pass says the drop and the limit (issue 26)
    assert ok.summary.startswith(("drop of", "no drop")) and "within 5" in ok.summary or "(limit 5)" in ok.summary


# -- speculators MTP files ----------------------------------------------------------------------

@pytest.mark.slow
def test_speculators_mtp_files_replay_as_mtp_training_data(tmp_path: Path) -> None:
    """speculators' MTP trainer reads a file's last slot; a file holding only that, or ids
    1,2,3,N with the last slot N, replays exactly as a dump whose aux.0 is that state."""
    import torch
    from safetensors.numpy import save_file

    from consistency.replay.engine import run_replay
    from tests.replay.test_replay_mtp import T, _dump, _save_mtp_checkpoint, self_consistent_text

    d = tmp_path / "ckpt"
    target = _save_mtp_checkpoint(d)
    from consistency.replay.mtp import load_mtp

    lo = load_mtp(d, target)
    full, hidden = self_consistent_text(lo.model, T + 1)
    ids, hidden = full[:T], hidden[:T]
    plain = tmp_path / "train.safetensors"
    from consistency.contract.models import DumpMetadata, ModelInfo
    from consistency.dump.writer import write_dump

    write_dump(plain, {"input_ids": ids.numpy(), "aux.0": hidden.numpy()},
               DumpMetadata(side="training", model=ModelInfo(num_layers=2, hidden_size=hidden.shape[1])))
    others = torch.randn(T, 3, hidden.shape[1], generator=torch.Generator().manual_seed(3))
    root = tmp_path / "hidden_states"
    root.mkdir()
    save_file({"hidden_states": np.ascontiguousarray(hidden.numpy()[:, None]), "token_ids": ids.numpy()},
              str(root / "hs_0.safetensors"))
    save_file({"hidden_states": np.ascontiguousarray(torch.cat([others, hidden[:, None]], 1).numpy()),
               "token_ids": ids.numpy()}, str(root / "hs_1.safetensors"))
    serve = _dump(tmp_path / "serve.safetensors", ids, hidden, "serving")
    base = run_replay(str(d), None, plain, serve, steps=3)
    for f in ("hs_0.safetensors", "hs_1.safetensors"):
        rep = run_replay(str(d), None, root / f, serve, steps=3)
        # an untrained MTP layer: the figures are the reading's proof, the verdict is base's (at chance: inconclusive)
        assert rep.method == "mtp" and rep.verdict == base.verdict, rep.summary
        assert rep.reference.top1 == base.reference.top1 and rep.reference.hits == base.reference.hits


# -- SpecForge: build_eagle3_dataset with a real chat template ---------------------------------

@pytest.fixture(scope="module")
def forge(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    if PL.specforge_tree() is None:
        pytest.skip("SpecForge 0.2.0's data pipeline is not unpacked (scripts/upstream_sources.py)")
    from tests.compare.test_stitch import _smol_tokenizer, _vocab_model

    tok = _smol_tokenizer()
    model = _vocab_model(len(tok))
    conv = [{"role": "user", "content": "Why do draft models need the target's hidden states?"},
            {"role": "assistant", "content": "Because the draft predicts the next tokens from them, layer by layer."},
            {"role": "user", "content": "Which layers does EAGLE-3 read?"},
            {"role": "assistant", "content": "A low, a middle and a high one, concatenated into one input."}]
    rows = PL.specforge_rows([conv], tok, "qwen")
    ids = np.asarray(rows[0]["input_ids"]).reshape(-1).astype(np.int64)
    mask = np.asarray(rows[0]["loss_mask"]).reshape(-1).astype(np.int64)
    d = tmp_path_factory.mktemp("forge")
    ckpt = PL.specforge_file(d / "data_0.ckpt", ids, mask, model, [2, 6, 9])
    return tok, model, conv, ids, mask, ckpt


def test_specforge_multi_turn_mask_and_a_verify_capture_of_the_last_turn(forge, tmp_path: Path) -> None:
    tok, model, conv, ids, mask, ckpt = forge
    spans = np.flatnonzero(np.diff(np.r_[0, mask, 0]))  # [start, stop) of each supervised span
    assert len(spans) == 4  # two assistant turns (SpecForge masks every assistant span)
    last = int(spans[2])  # the last assistant turn's first token
    em = verify_loop(model, ids[:last], [1, 3, 0, 2], 3, tmp_path / "serve.safetensors", [2, 6, 9],
                     continuation=ids[last:])
    rep = run(str(ckpt), str(em.path), layer_ids="2,6,9", convention="stream")
    assert rep.verdict == "pass", _errors(rep)
    assert rep.alignment["compared"] == len(em.tokens) and rep.alignment["missing"][0]["where"] == "end"
    with open_dump(em.path) as c:
        from consistency.dump.stitch import stitch

        _s, lay = stitch(c)
        assert lay.verify.superseded == em.superseded and lay.verify.unconfirmed == em.unconfirmed


def test_the_tokenizers_own_template_against_specforges_is_a_context_difference(forge, tmp_path: Path) -> None:
    """Serving applied SmolLM2's own template (its default system prompt) where SpecForge's
    'qwen' template put another: the two sides begin differently (SpecForge issue #296)."""
    tok, model, conv, ids, mask, ckpt = forge
    served = tok.apply_chat_template(conv[:3], add_generation_prompt=True, tokenize=True)
    served = np.asarray(served["input_ids"] if hasattr(served, "keys") else served, np.int64)
    last = int(np.flatnonzero(np.diff(np.r_[0, mask, 0]))[2])
    em = verify_loop(model, served, [2, 1, 3], 3, tmp_path / "serve.safetensors", [2, 6, 9], continuation=ids[last:])
    rep = run(str(ckpt), str(em.path), layer_ids="2,6,9", convention="stream")
    errors = [f.code for f in rep.findings if f.severity.value == "error"]
    assert rep.verdict == "fail" and errors == ["CONTEXT_DIFFERS"] and rep.summary.startswith("CONTEXT_DIFFERS")
    first = rep.alignment["replaced"][0]  # both begin "<|im_start|>system\n...", then each its own system prompt
    assert first["where"] == "middle" and 0 < first["reference"]["start"] < 12 and 0 < first["candidate"]["start"] < 12


@pytest.mark.slow
def test_replay_of_a_batch_reads_each_request_on_its_own(tmp_path: Path) -> None:
    """A reference holding two requests ([2, T], as compare reads batches) against a dump of
    the second: replay finds that request (never a run across the boundary), the target
    labels each request in its own context, and the figures equal the second's alone."""
    from consistency.record.api import record_reference
    from consistency.replay.engine import run_replay
    from tests.serving import greedy
    from tests.replay.test_replay import TD, _draft, _target

    t = _target()
    a = np.concatenate([[7, 9, 11, 13], greedy(t, np.array([7, 9, 11, 13]), 60)])
    b = np.concatenate([[20, 22, 24, 26], greedy(t, np.array([20, 22, 24, 26]), 60)])
    both = record_reference(t, np.stack([a, b]), tmp_path / "ref.safetensors", TD.TRAIN_STREAMS, components=False)
    one = record_reference(t, b, tmp_path / "b.safetensors", TD.TRAIN_STREAMS, components=False)
    rep = run_replay(_draft(), t, both, one, steps=3)
    alone = run_replay(_draft(), t, one, one, steps=3)
    assert rep.verdict == "pass" and rep.reference.top1 == alone.reference.top1
    assert rep.reference.hits == alone.reference.hits and rep.drop.top1_points == 0.0
