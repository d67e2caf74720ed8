"""Identification and streaming stay linear in the number of tensors (issue 17).

``rank`` and ``neighbour_gap`` are checked against their definition written out plainly
here (sort every reference by (distance, name preference, name), merge references within
the same-tensor floor, keep six groups), on random fingerprints with exact duplicates,
near-duplicates, all-zero tensors and ties; the fast paths (a partial sort of the nearest,
pools given as positions) must give the same answer. Memory: the memo of distance rows is
bounded, so checking n same-name pairs never holds n rows of n distances.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from consistency.compare import identify, stream
from consistency.compare.metrics import PairAccumulator
from consistency.dump import names
from consistency.dump.reader import open_dump
from consistency.dump.writer import write_dump


class _View:
    """The part of TensorView that Fingerprints reads (real views are tested end to end below)."""

    def __init__(self, name: str, arr: np.ndarray) -> None:
        self.name, self.arr, self.dtype = name, arr, "float32"
        self.rows, self.cols = arr.shape

    def rows_float(self, a: int, b: int, out_dtype: type = np.float32) -> np.ndarray:
        return self.arr[a:b].astype(out_dtype)


def _plain_rank(cand: str, cfp, rfp, pool: list[str], same: float) -> list[tuple[str, list[str]]]:  # noqa: ANN001
    """rank() as specified: every reference sorted, merged greedily, six groups."""
    dist = sorted((cfp.distance(cand, r, rfp), names.preference(r), r) for r in pool)
    ranked: list[list] = []
    for d, _p, r in dist:
        for grp in ranked:
            if abs(math.sqrt(d) - math.sqrt(grp[0])) <= 2 * math.sqrt(same) and rfp.distance(grp[2][0], r) <= same:
                grp[2].append(r)
                if names.preference(r) < names.preference(grp[1]):
                    grp[0], grp[1] = d, r
                break
        else:
            if len(ranked) >= identify.MAX_GROUPS:
                break
            ranked.append([d, r, [r]])
    return [(g[1], sorted(g[2], key=names.sort_key)) for g in ranked]


def _random_set(rng: np.random.Generator, n: int, k: int, h: int) -> list[_View]:
    base = rng.standard_normal((n, k, h)).astype(np.float32)
    for i in range(1, n):
        u = rng.random()
        if u < 0.2:
            base[i] = base[rng.integers(0, i)]  # an exact copy (aux.i recorded beside hidden.s)
        elif u < 0.3:
            base[i] = base[rng.integers(0, i)] * np.float32(1 + 1e-4 * rng.standard_normal())
        elif u < 0.35:
            base[i] = 0
    kinds = ["hidden", "aux", "mlp_out", "attn_out", "resid_mid"]
    out = []
    for i in range(n):
        kind = kinds[int(rng.integers(0, len(kinds)))]
        out.append(_View(f"{kind}.{i}" if rng.random() < 0.9 else f"final_norm_{i}", base[i]))
    return out


@pytest.mark.parametrize("seed", range(12))
def test_rank_and_gap_match_their_definition(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 3 * identify._FIRST_PICK))  # both below and above the partial sort
    k, h = int(rng.integers(1, 5)), int(rng.integers(1, 9))
    refs = _random_set(rng, n, k, h)
    cands = [_View(f"c{i}", refs[int(rng.integers(0, n))].arr + rng.standard_normal((k, h)).astype(np.float32)
                   * np.float32(rng.choice([0.0, 1e-3, 0.3]))) for i in range(6)]
    idx = np.arange(k)
    rfp, cfp = identify.Fingerprints(refs, idx), identify.Fingerprints(cands, idx)
    same = float(rng.choice([1e-6, 1e-4, 1e-2]))
    hidden = [r.name for r in refs if r.name.startswith("hidden.")]
    for c in cands:
        want = _plain_rank(c.name, cfp, rfp, list(rfp.names), same)
        for pool in (None, list(rfp.names), np.arange(n)):
            got = identify.rank(c.name, cfp, rfp, pool, same)
            assert [(r.name, list(g)) for r, g in zip(got.ranking, got.groups)] == want
        sub = [r for r in rfp.names if rng.random() < 0.5] or rfp.names[:1]
        got = identify.rank(c.name, cfp, rfp, sub, same)
        assert [(r.name, list(g)) for r, g in zip(got.ranking, got.groups)] == _plain_rank(c.name, cfp, rfp, sub, same)
    for e in rfp.names[:8]:
        others = [rfp.distance(e, r) for r in hidden if r != e and rfp.distance(e, r) > same]
        want_gap = min(others) if others else None
        for pool in (hidden, rfp.of_kind(names.HIDDEN)):
            got_gap = identify.neighbour_gap(e, rfp, pool, same)
            assert (got_gap is None) == (want_gap is None)
            if want_gap is not None:
                assert got_gap == pytest.approx(want_gap, rel=1e-9, abs=1e-15)


def test_pair_distance_is_the_distance_row_entry() -> None:
    rng = np.random.default_rng(5)
    refs = [_View(f"hidden.{i}", rng.standard_normal((8, 16)).astype(np.float32)) for i in range(40)]
    fp = identify.Fingerprints(refs, np.arange(8))
    row = fp.distances("hidden.3")
    fresh = identify.Fingerprints(refs, np.arange(8))  # no memoized row: the one-pair path
    for j, r in enumerate(refs):
        assert fresh.distance("hidden.3", r.name) == pytest.approx(row[j], rel=1e-12, abs=1e-15)
        assert fresh.distance("hidden.3", r.name) == pytest.approx(
            identify.token_distance(refs[3].arr.astype(np.float64), r.arr.astype(np.float64)), rel=1e-9, abs=1e-12)


def test_memo_of_distance_rows_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """n candidates each asking for a row of n distances must not keep n² numbers."""
    monkeypatch.setattr(identify, "MEMO_BYTES", 64 * 1024)
    rng = np.random.default_rng(2)
    n = 3000
    views = [_View(f"hidden.{i}", x) for i, x in enumerate(rng.standard_normal((n, 2, 3)).astype(np.float32))]
    fp = identify.Fingerprints(views, np.arange(2))
    for v in views[:500]:
        fp.distances(v.name)
        assert fp.distance(v.name, v.name) < 1e-12
    held = sum(r.nbytes for r in fp._memo.values())
    assert 0 < held <= 64 * 1024 and len(fp._memo) == fp._memo_rows


def test_batches_cover_every_item_once_balanced_by_weight() -> None:
    items = list(range(1000))
    out = stream.batches(items, lambda i: 1 + (i % 7), 3)
    assert sorted(x for b in out for x in b) == items and len(out) == 3
    loads = [sum(1 + (i % 7) for i in b) for b in out]
    assert max(loads) - min(loads) <= 7
    assert stream.batches([], lambda i: 1, 2) == [] and stream.batches([4], lambda i: 1, 2) == [[4]]


def test_many_tiny_pairs_measure_like_one_pair_at_a_time(tmp_path) -> None:  # noqa: ANN001
    rng = np.random.default_rng(3)
    n = 400
    ref = {f"hidden.{i}": rng.standard_normal((3, 5)).astype(np.float32) for i in range(n)}
    cand = {k: v + np.float32(1e-3 * (i % 4)) * rng.standard_normal(v.shape).astype(np.float32)
            for i, (k, v) in enumerate(ref.items())}
    with open_dump(write_dump(tmp_path / "r.safetensors", ref)) as r, open_dump(write_dump(tmp_path / "c.npz", cand)) as c:
        pairs = [(r[k], c[k], 1e-5, 1e-6) for k in ref]
        together = stream.measure(pairs)
        for (rv, cv, rt, at), m in zip(pairs, together, strict=True):
            acc = PairAccumulator(cv.rows, cv.cols, rt, at)
            acc.add(0, rv.rows_float(0, rv.rows), cv.rows_float(0, cv.rows))
            one = acc.result()
            assert m.token_rel_diff == one.token_rel_diff and m.mismatched == one.mismatched
            assert m.max_abs_diff == one.max_abs_diff and m.cosine == one.cosine


@pytest.mark.slow
def test_thousands_of_tensors_compare_in_linear_memory(tmp_path) -> None:  # noqa: ANN001
    """3,000 hidden.{i}: identical pairs need no identification; a perturbed one and a
    swapped one are found, the swap identified as the tensor it really holds."""
    from consistency.compare.engine import compare

    rng = np.random.default_rng(4)
    n = 3000
    x = rng.standard_normal((n, 4, 5)).astype(np.float32)
    ref = {f"hidden.{i}": x[i] for i in range(n)}
    cand = dict(ref)
    cand["hidden.7"] = x[7] + np.float32(0.3) * rng.standard_normal((4, 5)).astype(np.float32)
    cand["hidden.10"] = x[2000]
    with open_dump(write_dump(tmp_path / "r.safetensors", ref)) as r, open_dump(write_dump(tmp_path / "c.safetensors", cand)) as c:
        cmp = compare(r, c)
        by = {res.name: res for res in cmp.results}
        bad = sorted(k for k, res in by.items() if res.status != "ok")
        assert bad == ["hidden.10", "hidden.7"]
        assert by["hidden.10"].identified == "hidden.2000" and by["hidden.10"].ident.best.distance < 1e-12
        assert by["hidden.7"].identified == "hidden.7"
        assert sum(res.ident is not None for res in by.values()) == 2  # agreeing pairs skip the ranking
        for fp in list(cmp.ref_fp.values()) + list(cmp.cand_fp.values()):
            assert sum(row.nbytes for row in fp._memo.values()) <= identify.MEMO_BYTES
