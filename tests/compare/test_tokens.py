"""Token alignment by ids: exact offsets, then a diff; never an alignment of different prompts.

Expected answers come from the construction: a sequence is cut, padded or edited at known
places, and the alignment must pair exactly the tokens that were kept.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from consistency.compare.tokens import Side, align, match


def _pairs(blocks):
    return [(i + k, j + k) for i, j, n in blocks for k in range(n)]


def _side(name, ids, positions=None, bounds=None):
    ids = np.asarray(ids, np.int64)
    bounds = bounds or [(0, len(ids))]
    return Side(name, ids, None if positions is None else np.asarray(positions, np.int64), bounds,
                [f"request {i}" for i in range(len(bounds))])


RNG = np.random.default_rng(0)
A = RNG.integers(0, 50_000, 500)


def test_identical_and_exact_offsets():
    assert match(A, A.copy()) == ("identical", [(0, 0, 500)])
    assert match(A, A[120:]) == ("offset", [(120, 0, 380)])  # a suffix (prefix cache)
    assert match(A, A[:300]) == ("offset", [(0, 0, 300)])  # a prefix (reference continues)
    extra = np.concatenate([[7, 8, 9, 10, 11, 12], A])
    assert match(A, extra) == ("offset", [(0, 6, 500)])  # 6 template tokens in front


def test_offset_search_is_aligned_to_whole_ids():
    """A byte match straddling two ids must not count (ids are 8-byte words)."""
    a = np.array([0x0100000000000000, 0x01], np.int64)
    b = np.array([0x0101000000000000], np.int64)  # no such whole id in a
    assert match(a, b)[0] == "none"


def test_insertion_deletion_replacement_in_the_middle():
    b = np.concatenate([A[:200], [1, 2, 3], A[200:350], A[360:]])  # 3 inserted, 10 deleted
    method, blocks = match(A, b)
    assert method == "diff"
    assert blocks == [(0, 0, 200), (200, 203, 150), (360, 353, 140)]


def test_different_prompts_do_not_align_on_common_ngrams():
    other = RNG.integers(0, 50_000, 500)
    other[100:104] = A[300:304]  # one shared 4-gram (" of the model") is coincidence
    assert match(A, other) == ("none", [])
    assert match(A, np.array([], np.int64)) == ("none", [])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=300), st.data())
def test_every_aligned_pair_holds_the_same_id_in_order(base, data):
    a = np.asarray(base, np.int64)
    b = list(base)
    for _ in range(data.draw(st.integers(0, 6))):
        i = data.draw(st.integers(0, len(b)))
        op = data.draw(st.sampled_from(["ins", "del", "rep"]))
        if op == "ins":
            b[i:i] = data.draw(st.lists(st.integers(0, 40), min_size=1, max_size=5))
        elif b:
            j = min(len(b), i + data.draw(st.integers(1, 5)))
            b[i:j] = [] if op == "del" else [99] * (j - i)
    b_arr = np.asarray(b, np.int64)
    _method, blocks = match(a, b_arr)
    pairs = _pairs(blocks)
    assert all(a[i] == b_arr[j] for i, j in pairs)
    assert all(p[0] < q[0] and p[1] < q[1] for p, q in zip(pairs, pairs[1:], strict=False))  # monotone
    if b == base:
        assert len(pairs) == len(base)


def test_large_edited_sequences_align_exactly():
    a = RNG.integers(0, 50_000, 32_768)
    keep = np.ones(len(a), bool)
    keep[[1_000, 5_000, 5_001, 20_000]] = False  # deletions at known places
    b = a[keep]
    _m, blocks = match(a, b)
    pairs = _pairs(blocks)
    assert [i for i, _j in pairs] == np.flatnonzero(keep).tolist()


def test_context_flags_follow_positions_and_earlier_changes():
    ids = np.arange(100, 140)
    ref = _side("reference", ids)
    # suffix with positions continuing the reference's: a prefix-cache hit, same context
    al = align(ref, _side("candidate", ids[10:], positions=np.arange(10, 40)))
    assert al.compared == 30 and al.not_captured == 10 and not al.context_differs and not al.missing
    # the same suffix positioned from 0: the prefix is genuinely absent
    al = align(ref, _side("candidate", ids[10:]))
    assert al.compared == 30 and al.context_differs and al.missing[0].where == "start"
    assert al.unknown.all()  # no candidate positions: unproven, the values decide (compare.prepare)
    # a replacement in the middle: tokens before it keep their context, tokens after do not
    cand = ids.copy()
    cand[20:22] = [7, 8]
    al = align(ref, _side("candidate", cand))
    assert al.compared == 38 and al.context.tolist() == [False] * 20 + [True] * 18 and not al.unknown.any()
    assert not al.extra and not al.missing
    [(r, c)] = [(x.ref, x.cand) for x in al.replaced]  # both sides differ at one place: one replacement
    assert (r.start, r.stop, r.where, c.start, c.stop, c.where) == (20, 22, "middle", 20, 22, "middle")
    # a sampled continuation: both sides go on differently from token 30
    cand = np.concatenate([ids[:30], np.arange(900, 915)])
    al = align(ref, _side("candidate", cand))
    assert al.compared == 30 and not al.context_differs and not al.extra and not al.missing
    [(r, c)] = [(x.ref, x.cand) for x in al.replaced]
    assert (r.start, r.stop, c.start, c.stop, r.where) == (30, 40, 30, 45, "end")
    # a token the candidate's positions jump over (another DP rank's, a pass not captured): same context
    keep = np.r_[0:15, 16:40]
    al = align(ref, _side("candidate", ids[keep], positions=keep))
    assert al.compared == 39 and not al.context_differs and al.not_captured == 1 and not al.missing
    assert [(s.start, s.stop, s.where) for s in al.uncaptured] == [(15, 16, "middle")]
    # decode tokens after the reference's end change nothing before them
    al = align(ref, _side("candidate", np.concatenate([ids, [1, 2, 3]])))
    assert al.compared == 40 and not al.context_differs and al.extra[0].where == "end"


def test_each_candidate_request_finds_its_reference_request():
    r1, r2 = np.arange(0, 20), np.arange(500, 530)
    ref = _side("reference", np.concatenate([r1, r2]), bounds=[(0, 20), (20, 50)])
    cand = _side("candidate", np.concatenate([r2[:10], r1[:5]]), bounds=[(0, 10), (10, 15)])
    al = align(ref, cand)
    assert al.ref_rows.tolist() == list(range(20, 30)) + list(range(0, 5))
    assert al.cand_rows.tolist() == list(range(15))
