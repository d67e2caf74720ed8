"""The claims axis (issue 24): every combination of what each side claims, what the user
declares and which slots each side holds, on Llama for EAGLE-3 and last-state drafts, plus
a seeded sample on every other tiny family. The expected verdict follows from the evidence
model's precedence applied to the construction (tests/scenarios/claims.py), never from the
engine: a false PASS, a false FAIL, a crash or a wrong cause fails the chunk, and every miss
is printed with its one-line repro (``python -m tests.scenarios.claims KEY=VALUE ...``).
"""

from __future__ import annotations

import pytest

from tests.scenarios import claims

CASES = claims.table()
CHUNK = 100
CHUNKS = [CASES[i:i + CHUNK] for i in range(0, len(CASES), CHUNK)]


def test_the_table_is_thousands_of_cases_over_every_axis():
    assert len(CASES) >= 3000
    for axis, values in (("ref_meta", claims.META), ("cand_meta", claims.META), ("declare", claims.DECLARE),
                         ("ref_shape", claims.REF_SHAPES), ("cand_slots", claims.CAND_SLOTS),
                         ("consumer", claims.CONSUMER), ("how", claims.HOW)):
        assert {getattr(c, axis) for c in CASES} == set(values), axis
    verdicts = {c.args(): claims.build(claims.record(c.arch), c).expect.verdict for c in CASES[:400]}
    assert {"pass", "fail"} <= set(verdicts.values())  # the construction decides both ways


@pytest.mark.parametrize("chunk", range(len(CHUNKS)))
def test_claims_chunk(chunk: int, tmp_path) -> None:
    lines = []
    for i, c in enumerate(CHUNKS[chunk]):
        _r, _e, misses = claims.run(c, tmp_path / str(i % 4))
        lines += [f"{m.kind}: {m.detail[:200]}\n  repro: python -m tests.scenarios.claims {c.args()}" for m in misses]
    assert not lines, "\n".join(lines[:20])


def test_the_checker_sees_a_claim_deciding():
    """The construction really depends on claims: the same values with and without the
    reference's claim give different verdicts where the rule says they must."""
    st = claims.record("llama")
    with_claim = claims.build(st, claims.Case(ref_shape="streams", ref_meta="true"))
    without = claims.build(st, claims.Case(ref_shape="streams", ref_meta="absent"))
    lying_cand = claims.build(st, claims.Case(ref_shape="streams", ref_meta="absent", cand_meta="true"))
    assert with_claim.expect.verdict == "pass" and without.expect.verdict == "fail"
    assert lying_cand.expect.verdict == "fail"  # the candidate's own true claim certifies nothing


# -- claims inside the candidate's file (issue 34): anchors and every rank's recorder ---------------

FILE_CASES = claims.file_claims()
FILE_CHUNKS = [FILE_CASES[i:i + CHUNK] for i in range(0, len(FILE_CASES), CHUNK)]


def test_the_file_claims_table_covers_its_axes_both_ways():
    for axis, values in (("anchors", claims.ANCHORS), ("ranks", claims.RANKS), ("method", ("eagle3", "last")),
                         ("ref_shape", claims.REF_SHAPES)):
        assert {getattr(c, axis) for c in FILE_CASES} == set(values), axis
    st = claims.record("llama")
    verdicts = {c: claims.build(st, c).expect.verdict for c in FILE_CASES}
    assert {"pass", "fail"} <= set(verdicts.values())
    # the claim decides: the same values with true anchors / a clean set pass where a false one must not
    benign = claims.Case(ref_shape="full")
    assert verdicts[benign] == "pass" and verdicts[claims.Case(ref_shape="full", anchors="true")] == "pass"
    assert verdicts[claims.Case(ref_shape="full", ranks="clean")] == "pass"
    for bad in ({"anchors": "shifted"}, {"anchors": "repeat"}, {"ranks": "lossy1"}, {"ranks": "lossy0"}):
        assert verdicts[claims.Case(ref_shape="full", **bad)] == "fail", bad


@pytest.mark.parametrize("chunk", range(len(FILE_CHUNKS)))
def test_file_claims_chunk(chunk: int, tmp_path) -> None:
    lines = []
    for i, c in enumerate(FILE_CHUNKS[chunk]):
        _r, _e, misses = claims.run(c, tmp_path / str(i % 4))
        lines += [f"{m.kind}: {m.detail[:200]}\n  repro: python -m tests.scenarios.claims {c.args()}" for m in misses]
    assert not lines, "\n".join(lines[:20])
