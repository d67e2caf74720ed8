"""Serving captures as a speculative server writes them (issue 26), on a real tiny model.

Every capture comes from a KV-cache decode loop (tests/serving.py): verify passes with
accepted and rejected drafts, prefix-cache hits recorded with and without positions, a
sampled continuation, data-parallel ranks. What must be kept, superseded, aligned and
reported follows from the construction; every row a finding names is checked against
the files themselves.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from consistency.compare.prepare import prepare
from consistency.pipeline.compare import compare as run
from consistency.dump.reader import open_dump
from consistency.dump.stitch import stitch
from consistency.record import Recorder
from consistency.record.api import record_reference
from consistency.record.hf import record_pass
from tests.conftest import prompt_ids, tiny
from tests.serving import decode, drop_layout, greedy, verify_loop

SLOTS = [2, 6, 9]
ATOL = 2e-5


@pytest.fixture(scope="module")
def model():
    return tiny("tiny-llama")


def _ref(model, ids, path: Path, slots=SLOTS) -> Path:  # noqa: ANN001
    return record_reference(model, ids, path, slots, components=False, force=True)


def _codes(rep) -> dict[str, list]:  # noqa: ANN001
    out: dict[str, list] = {}
    for f in rep.findings:
        out.setdefault(f.code, []).append(f)
    return out


def _errors(rep) -> list[str]:  # noqa: ANN001
    return [f"{f.code}: {f.message}" for f in rep.findings if f.severity.value == "error"]


# -- verify passes ----------------------------------------------------------------------------

@pytest.mark.parametrize("accept, k, chunks", [([1, 3, 0, 2, 3], 3, 2), ([0, 0, 4, 1], 4, 1), ([2], 2, 1)])
def test_verify_passes_keep_the_accepted_rows(model, tmp_path, accept, k, chunks):
    prompt = prompt_ids(model, 20, seed=3)
    em = verify_loop(model, prompt, accept, k, tmp_path / "serve.safetensors", SLOTS, chunks=chunks)
    ref = _ref(model, em.tokens, tmp_path / "ref.safetensors")
    with open_dump(em.path) as c, open_dump(ref) as r:
        s, lay = stitch(c)
        v = lay.verify
        assert (v.rewinds, v.superseded, v.unconfirmed) == (em.rewinds, em.superseded, em.unconfirmed)
        kept = len(em.tokens) if em.rewinds else len(em.tokens) + k  # no rewind: nothing says a draft failed
        assert lay.positions.tolist() == list(range(kept))
        rv, cv, al = prepare(r, c)
        assert al.compared == len(em.tokens) and not al.context_differs
        for name in ("aux.0", "aux.1", "aux.2"):  # the kept rows are the accepted tokens', as a plain forward has them
            np.testing.assert_allclose(cv[name].rows_float(0, cv[name].rows), rv[name].rows_float(0, rv[name].rows),
                                       atol=ATOL, rtol=0)
    rep = run(str(ref), str(em.path))
    assert rep.verdict == "pass", _errors(rep)
    if em.rewinds:
        (f,) = _codes(rep)["VERIFY_PASSES"]
        assert f.severity.value == "info" and f.metrics["superseded"] == em.superseded
        assert f"superseding {em.superseded} row" in f.message
        assert rep.alignment["stitching"]["candidate"]["rewinds"] == em.rewinds


def test_verify_passes_of_two_requests_by_request_id_and_by_positions(model, tmp_path):
    """Two requests whose passes interleave (the scheduler alternates them): with request
    ids, and with positions only (vLLM records no request ids)."""
    a, b = prompt_ids(model, 14, seed=5), prompt_ids(model, 17, seed=6)
    path = tmp_path / "two.safetensors"
    with Recorder(path, force=True) as rec:
        ea = verify_loop(model, a, [1, 0, 2], 2, path, SLOTS, request=0, rec=rec)
        eb = verify_loop(model, b, [0, 2, 1], 2, path, SLOTS, request=1, rec=rec)
    with open_dump(path) as c:
        _s, lay = stitch(c)
        assert lay.source == "request_ids" and [len(s.rows) for s in lay.segments] == [len(ea.tokens), len(eb.tokens)]
        assert lay.verify.superseded == ea.superseded + eb.superseded and lay.verify.requests == 2
    nopos = drop_layout(path, ("request_ids",))
    with open_dump(nopos) as c:
        _s, lay = stitch(c)
        assert lay.source == "positions" and lay.verify.superseded == ea.superseded + eb.superseded
    both = np.stack([ea.tokens[:14], eb.tokens[:14]])
    ref = _ref(model, both, tmp_path / "ref.safetensors")
    for cand in (path, nopos):
        rep = run(str(ref), str(cand))
        assert rep.verdict == "pass", _errors(rep)
        assert rep.alignment["compared"] == 28


def test_a_tree_pass_is_ambiguous_and_a_rewind_into_the_prompt_is_refused(model, tmp_path):
    from consistency.errors import InputError

    prompt = prompt_ids(model, 12, seed=7)
    path = tmp_path / "tree.safetensors"
    with Recorder(path, force=True) as rec:
        cache = record_pass(model, prompt, rec, SLOTS)
        record_pass(model, np.asarray([5, 6, 7, 8]), rec, SLOTS, cache=cache)
        rec.tensors["positions#2"] = (np.asarray([12, 13, 13, 14]), "int64")  # two drafts at 13: a tree
    with open_dump(path) as c:
        _s, lay = stitch(c)
        assert lay.positions.tolist() == list(range(13)) and lay.verify.ambiguous == 3
    with Recorder(tmp_path / "back.safetensors", force=True) as rec:
        cache = record_pass(model, prompt, rec, SLOTS)
        record_pass(model, np.asarray([5, 6]), rec, SLOTS, cache=cache)
        rec.tensors["positions#2"] = (np.asarray([10, 11]), "int64")  # prompt rows are never recomputed
    with open_dump(tmp_path / "back.safetensors") as c, pytest.raises(InputError, match="rewinds only into"):
        stitch(c)


# -- prefix-cache hits -------------------------------------------------------------------------

def _suffix(model, ids, cut: int, path: Path) -> Path:  # noqa: ANN001
    """The prefix run on the cache without recording (a hit), the rest captured in passes."""
    with Recorder(path.with_suffix(".warm.safetensors")) as warm:
        cache = record_pass(model, ids[:cut], warm, SLOTS)
        warm.discard()
    with Recorder(path, force=True) as rec:
        for part in np.array_split(np.arange(cut, len(ids)), 3):
            cache = record_pass(model, ids[part], rec, SLOTS, cache=cache)
    return path


@pytest.mark.parametrize("with_positions", [True, False])
def test_a_prefix_cache_hit_passes_with_or_without_positions(model, tmp_path, with_positions):
    ids = prompt_ids(model, 48, seed=8)
    ref = _ref(model, ids, tmp_path / "ref.safetensors")
    cand = _suffix(model, ids, 30, tmp_path / "hit.safetensors")
    if not with_positions:
        cand = drop_layout(cand)
    rep = run(str(ref), str(cand))
    assert rep.verdict == "pass", _errors(rep)
    assert "CONTEXT_DIFFERS" not in _codes(rep) and "TOKENS_MISSING" not in _codes(rep)
    (f,) = _codes(rep)["NOT_CAPTURED"]
    assert f.severity.value == "info" and "a prefix-cache hit: the first 30 tokens were not recomputed" in f.message
    assert f.metrics["by_values"] is (not with_positions)
    assert rep.alignment["not_captured"] == 30 and rep.alignment["cached_by_values"] == (0 if with_positions else 30)


@pytest.mark.parametrize("with_positions", [True, False])
def test_a_prefix_cache_hit_given_as_the_reference_passes_too(model, tmp_path, with_positions):
    """Arguments swapped: the serving capture (a prefix-cache hit) is the reference, training
    the candidate. The candidate's first 30 tokens were in the reference's context (its
    positions start after them, or its values equal training's): the same verdict as the
    other way round, never CONTEXT_DIFFERS; a prompt really cut short still is one."""
    ids = prompt_ids(model, 48, seed=8)
    train = _ref(model, ids, tmp_path / "train.safetensors")
    hit = _suffix(model, ids, 30, tmp_path / "hit.safetensors")
    cut = _ref(model, ids[30:], tmp_path / "cut.safetensors")
    if not with_positions:
        hit = drop_layout(hit)
    rep = run(str(hit), str(train))
    assert rep.verdict == "pass", _errors(rep)
    (f,) = _codes(rep)["NOT_CAPTURED"]
    assert f.severity.value == "info" and "a prefix-cache hit: the first 30 tokens were not recomputed" in f.message
    assert [(s["start"], s["stop"]) for s in rep.alignment["reference_not_captured_spans"]] == [(0, 30)]
    assert "TOKENS_EXTRA" not in _codes(rep)
    rep = run(str(cut), str(train))
    assert rep.verdict == "fail" and rep.summary.startswith("CONTEXT_DIFFERS"), _errors(rep)


def test_a_prompt_cut_short_without_positions_is_a_context_difference(model, tmp_path):
    """The same suffix computed without its prefix: the values differ as a different context
    makes them (every state moved), so it is not a prefix-cache hit."""
    ids = prompt_ids(model, 48, seed=8)
    ref = _ref(model, ids, tmp_path / "ref.safetensors")
    cand = _ref(model, ids[30:], tmp_path / "cut.safetensors")
    rep = run(str(ref), str(cand))
    assert rep.verdict == "fail" and rep.summary.startswith("CONTEXT_DIFFERS")
    assert [f.code for f in rep.findings if f.severity.value == "error"] == ["CONTEXT_DIFFERS"]
    (miss,) = _codes(rep)["TOKENS_MISSING"]
    assert "not read from a prefix cache" in miss.message and "NOT_CAPTURED" not in _codes(rep)


def test_the_text_report_shows_the_tokens_not_captured(model, tmp_path):
    import io

    from consistency.report import text

    ids = prompt_ids(model, 40, seed=9)
    ref = _ref(model, ids, tmp_path / "ref.safetensors")
    rep = run(str(ref), str(drop_layout(_suffix(model, ids, 12, tmp_path / "hit.safetensors"))))
    buf = io.StringIO()
    text.render(rep, text.console(buf))
    out = " ".join(buf.getvalue().split())  # the terminal wraps at 140 columns
    assert "12 reference tokens not captured (in the candidate's context, by their values: [0, 12))" in out
    assert "NOT_CAPTURED" in out and "a prefix-cache hit" in out


# -- a sampled continuation ----------------------------------------------------------------------

def test_a_sampled_continuation_is_one_replacement_with_both_spans(model, tmp_path):
    prompt = prompt_ids(model, 24, seed=10)
    answer = greedy(model, prompt, 18)
    ref = _ref(model, np.concatenate([prompt, answer]), tmp_path / "ref.safetensors")  # training: the greedy answer
    sampled = np.concatenate([answer[:6], (answer[6:14] + 3) % model.config.vocab_size])  # another answer from 30
    cand = decode(model, prompt, sampled, tmp_path / "sampled.safetensors", SLOTS, chunks=2)
    rep = run(str(ref), str(cand))
    assert rep.verdict == "pass", _errors(rep)
    codes = _codes(rep)
    assert "TOKENS_EXTRA" not in codes and "TOKENS_MISSING" not in codes
    (f,) = codes["TOKENS_REPLACED"]
    assert f.severity.value == "info" and "went on differently from training row 30 (position 30)" in f.message
    assert f.metrics["reference"] == [30, 42] and f.metrics["candidate"] == [30, 38]
    assert rep.alignment["compared"] == 30


# -- bad tokens named as the files name them -----------------------------------------------------

def test_bad_tokens_are_named_by_each_files_rows_and_positions(model, tmp_path):
    """A suffix capture (a prefix-cache hit, captured in three passes) with two corrupted rows:
    the finding names each side's own capture, row and position, and those rows are the ones
    that differ in the files."""
    from consistency.dump.writer import write_dump

    ids = prompt_ids(model, 40, seed=11)
    ref = _ref(model, ids, tmp_path / "ref.safetensors")
    cand = _suffix(model, ids, 20, tmp_path / "hit.safetensors")
    with open_dump(cand) as d:
        arrs = {n: (d[n].read_all().copy(), d[n].dtype) for n in d.tensors}
        meta = d.metadata
    second = arrs["aux.1#2"][0]  # pass 2 holds positions 27..33: rows 1 and 2 are positions 28, 29
    second[1:3] += 3.0
    write_dump(tmp_path / "bad.safetensors", arrs, meta, force=True)
    rep = run(str(ref), str(tmp_path / "bad.safetensors"))
    (f,) = _codes(rep)["BAD_TOKENS"]
    assert f.severity.value == "error" and "position 0 is among them" not in f.message
    assert "aux.1#2 rows 1..2 (positions 28..29)" in f.message and "aux.1 rows 28..29" in f.message
    files = f.evidence["rows_in_files"]
    assert [(o["tensor"], o["row"], o["position"]) for o in files["candidate"]] == [("aux.1#2", 1, 28), ("aux.1#2", 2, 29)]
    assert [(o["tensor"], o["row"]) for o in files["reference"]] == [("aux.1", 28), ("aux.1", 29)]
    with open_dump(tmp_path / "bad.safetensors") as c, open_dump(ref) as r:  # the named rows are the ones that differ
        for o_c, o_r in zip(files["candidate"], files["reference"], strict=True):
            a, b = c[o_c["tensor"]].rows_float(o_c["row"], o_c["row"] + 1), r[o_r["tensor"]].rows_float(o_r["row"],
                                                                                                          o_r["row"] + 1)
            assert np.abs(a - b).max() > 1.0
    worst = f.metrics["worst_token_at"]
    assert worst["candidate"]["tensor"] == "aux.1#2" and worst["reference"]["row"] == worst["candidate"]["position"]


def test_bad_tokens_follow_the_context_demotion(model, tmp_path):
    from consistency.dump.writer import write_dump

    ids = prompt_ids(model, 40, seed=12)
    ref = _ref(model, ids, tmp_path / "ref.safetensors")
    cand = _ref(model, np.concatenate([[5, 6, 7], ids]), tmp_path / "tmpl.safetensors")  # a preamble in front
    with open_dump(cand) as d:
        arrs = {n: (d[n].read_all().copy(), d[n].dtype) for n in d.tensors}
        meta = d.metadata
    arrs["aux.0"][0][4:6] += 5.0
    write_dump(tmp_path / "bad.safetensors", arrs, meta, force=True)
    rep = run(str(ref), str(tmp_path / "bad.safetensors"))
    assert [f.code for f in rep.findings if f.severity.value == "error"] == ["CONTEXT_DIFFERS"]
    for f in _codes(rep).get("BAD_TOKENS", []):
        assert f.severity.value == "info" and f.message.startswith("not evaluated, the tokens' context differs")


# -- data-parallel ranks -------------------------------------------------------------------------

@pytest.mark.parametrize("positions", [True, False])
def test_a_token_no_dp_rank_holds_leads_and_is_no_context_difference(model, tmp_path, positions):
    """DP attention: rank 0 runs request A, rank 1 request B; rank 1's file lacks B's token 6
    (a pass it did not capture). The merged dump lacks it: TOKEN_UNOWNED leads, and the tokens
    after it kept their context (the ranks' declared positions jump over it)."""
    import torch

    from consistency.contract.models import DumpMetadata
    from consistency.record import parallel
    from consistency.record.hf import capture_streams

    reqs = [prompt_ids(model, 16, seed=13), prompt_ids(model, 16, seed=14)]
    ref = _ref(model, np.stack(reqs), tmp_path / "ref.safetensors")
    for r, ids in enumerate(reqs):
        keep = [p for p in range(16) if not (r == 1 and p == 6)]
        got, _ = capture_streams(model, torch.as_tensor(ids)[None], components=False)
        with Recorder(tmp_path / f"dp.rank{r}-of2.safetensors", DumpMetadata(rank=r, world_size=2), force=True) as rec:
            parallel.declare(dp=(r, 2), requests=[r] * len(keep), positions=keep, recorder=rec)
            rec.capture("input_ids", torch.as_tensor(ids[keep]), shard="t[dp]")
            if positions:
                rec.capture("positions", torch.as_tensor(keep), shard="t[dp]")
            for i, s in enumerate(SLOTS):
                rec.capture(f"aux.{i}", got[f"hidden.{s}"][0][keep], shard="t[dp]")
    rep = run(str(ref), str(tmp_path / "dp.safetensors"))
    errors = [f.code for f in rep.findings if f.severity.value == "error"]
    assert rep.verdict == "fail" and errors == ["TOKEN_UNOWNED"] and rep.summary.startswith("TOKEN_UNOWNED")
    (nc,) = _codes(rep)["NOT_CAPTURED"]
    assert nc.metrics["where"] == "middle" and nc.metrics["tokens"] == 1
    assert rep.alignment["compared"] == 31 and not rep.alignment["context_differs"]


def test_dp_ranks_declaring_requests_without_positions_stay_apart(model, tmp_path):
    """Rank 0 holds request A, rank 1 request B (each declared by request + position, no
    positions tensor, every token owned): the merged rows are two requests, never one
    sequence; a fault in B's rows is found, not left out as 'decode steps' after A."""
    import torch

    from consistency.contract.models import DumpMetadata
    from consistency.record import parallel
    from consistency.record.hf import capture_streams

    reqs = [prompt_ids(model, 16, seed=13), prompt_ids(model, 16, seed=14)]
    ref = _ref(model, np.stack(reqs), tmp_path / "ref.safetensors")
    for r, ids in enumerate(reqs):
        got, _ = capture_streams(model, torch.as_tensor(ids)[None], components=False)
        with Recorder(tmp_path / f"dp.rank{r}-of2.safetensors", DumpMetadata(rank=r, world_size=2), force=True) as rec:
            parallel.declare(dp=(r, 2), requests=[r] * 16, positions=list(range(16)), recorder=rec)
            rec.capture("input_ids", torch.as_tensor(ids), shard="t[dp]")
            for i, s in enumerate(SLOTS):
                x = got[f"hidden.{s}"][0].clone()
                if r == 1 and i == 2:
                    x[3] = x[3] * 3 + 1  # request B, position 3
                rec.capture(f"aux.{i}", x, shard="t[dp]")
    rep = run(str(ref), str(tmp_path / "dp.safetensors"))
    assert rep.alignment["compared"] == 32 and not rep.alignment["extra"], rep.alignment
    (bad,) = _codes(rep)["BAD_TOKENS"]
    assert rep.verdict == "fail" and bad.severity.value == "error"
    assert "dp.rank1-of2.safetensors aux.2 row 3" in bad.message, bad.message


@pytest.mark.parametrize("passes", [1, 2])
def test_requests_recorded_back_to_back_without_layout_are_each_compared(model, tmp_path, passes):
    """A capture of two requests with neither request ids nor positions (one pass of A+B, or
    a pass each): the reference holds them as two requests. B's tokens are B's, not 'decode
    steps' after A: a fault in B is found. The same tokens run as ONE sequence (B saw A)
    are a context difference for B's 16 tokens, never a PASS."""
    import torch

    from consistency.record.hf import capture_streams

    reqs = [prompt_ids(model, 16, seed=13), prompt_ids(model, 16, seed=14)]
    ref = _ref(model, np.stack(reqs), tmp_path / "ref.safetensors")
    got = [capture_streams(model, torch.as_tensor(ids)[None], components=False)[0] for ids in reqs]
    with Recorder(tmp_path / "cand.safetensors", force=True) as rec:
        parts = [[0, 1]] if passes == 1 else [[0], [1]]
        for qs in parts:
            rec.capture("input_ids", torch.as_tensor(np.concatenate([reqs[q] for q in qs])))
            for i, s in enumerate(SLOTS):
                x = torch.cat([got[q][f"hidden.{s}"][0] for q in qs]).clone()
                if i == 2:
                    x[-13] = x[-13] * 3 + 1  # request B, position 3
                rec.capture(f"aux.{i}", x)
    rep = run(str(ref), str(tmp_path / "cand.safetensors"))
    assert rep.alignment["compared"] == 32 and not rep.alignment["extra"], rep.alignment
    assert _errors(rep) and _errors(rep)[0].startswith("BAD_TOKENS"), _errors(rep)
    joined = capture_streams(model, torch.as_tensor(np.concatenate(reqs))[None], components=False)[0]
    with Recorder(tmp_path / "joined.safetensors", force=True) as rec:
        rec.capture("input_ids", torch.as_tensor(np.concatenate(reqs)))
        for i, s in enumerate(SLOTS):
            rec.capture(f"aux.{i}", joined[f"hidden.{s}"][0])
    rep = run(str(ref), str(tmp_path / "joined.safetensors"))
    assert rep.verdict == "fail" and [e.split(":")[0] for e in _errors(rep)] == ["CONTEXT_DIFFERS"], _errors(rep)
    assert rep.alignment["same_context"] == 16, rep.alignment
