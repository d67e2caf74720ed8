"""The fast paths of issue 17 give the answers of the plain ones.

Fused block metrics against fp64 sums computed here; a pair split between workers against
the same pair folded on one thread (the metadata diff against DeepDiff: test_metadiff.py); the
numpy.ma-free median/percentiles against numpy; the direct open of a plain dump against
the content check it must still run.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from consistency.compare import stream
from consistency.compare.metrics import PairAccumulator, median, percentiles
from consistency.dump.dtypes import float32_to_bf16_bits, to_float
from consistency.dump.reader import Dump, open_dump
from consistency.dump.sets import open_side
from consistency.dump.writer import write_dump
from consistency.errors import InputError


def _exact(x: np.ndarray, y: np.ndarray) -> tuple[float, float, float]:
    """(token rel_diff, cosine, max |x - y|) from fp64 sums, the definitions in metrics.py."""
    x, y = x.astype(np.float64), y.astype(np.float64)
    d = x - y
    per_row = (d * d).sum(1) / ((x * x).sum(1) + (y * y).sum(1))
    cos = (x * y).sum() / math.sqrt((x * x).sum() * (y * y).sum())
    return float(per_row.mean()), float(cos), float(np.abs(d).max())


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float16"])
def test_block_metrics_match_fp64_sums(tmp_path: Path, dtype: str) -> None:
    from consistency.compare.metrics import block_rows

    rng = np.random.default_rng(0)
    rows = 2 * block_rows(700) + 13  # three blocks, the last one short, whatever BLOCK_ELEMS is
    x = rng.standard_normal((rows, 700)).astype(np.float32)
    x[0] *= 50  # a sink row
    y = x + 0.02 * rng.standard_normal(x.shape).astype(np.float32)

    def stored(a: np.ndarray) -> object:
        return (float32_to_bf16_bits(a), "bfloat16") if dtype == "bfloat16" else a.astype(dtype)

    r = write_dump(tmp_path / "r.safetensors", {"hidden.1": stored(x)})
    c = write_dump(tmp_path / "c.npz", {"hidden.1": stored(y)})
    with open_dump(r) as rd, open_dump(c) as cd:
        rv, cv = rd["hidden.1"], cd["hidden.1"]
        m = stream.measure([(rv, cv, 1e-2, 1e-5)])[0]
        xs, ys = rv.rows_float(0, rv.rows), cv.rows_float(0, cv.rows)
    trd, cos, top = _exact(xs, ys)
    assert m.token_rel_diff == pytest.approx(trd, rel=1e-5)
    assert m.cosine == pytest.approx(cos, rel=1e-6)
    assert m.max_abs_diff == top  # exact: |d| of fp32 values
    bound = np.abs(xs) * np.float32(1e-2) + np.float32(1e-5)
    assert m.mismatched == int(np.count_nonzero(np.abs(xs - ys) > bound))
    flat = int(np.argmax(np.abs(xs - ys)))
    assert m.max_abs_at == flat and m.max_ref == float(xs.flat[flat])


def test_a_pair_split_between_workers_equals_one_thread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((1500, 1024)).astype(np.float32)
    y = x.copy()
    y[7, 3], y[900, 5], x[1200, 1] = np.nan, np.inf, -np.inf  # non-finite values in different workers' rows
    y[1400] *= 3.0
    r = write_dump(tmp_path / "r.safetensors", {"hidden.2": (float32_to_bf16_bits(x), "bfloat16")})
    c = write_dump(tmp_path / "c.safetensors", {"hidden.2": (float32_to_bf16_bits(y), "bfloat16")})
    with open_dump(r) as rd, open_dump(c) as cd:
        pair = (rd["hidden.2"], cd["hidden.2"], 1.6e-2, 1e-5)
        monkeypatch.setattr(stream, "workers", lambda: 2)
        split = stream.measure([pair], chunk_bytes=1 << 20)
        one = PairAccumulator(1500, 1024, 1.6e-2, 1e-5)
        one.add(0, pair[0].rows_float(0, 1500), pair[1].rows_float(0, 1500))
    a, b = split[0], one.result()
    assert a.nonfinite_ref == b.nonfinite_ref == 1 and a.nonfinite_cand == b.nonfinite_cand == 2
    assert (a.first_nonfinite_ref, a.first_nonfinite_cand) == (1200 * 1024 + 1, 7 * 1024 + 3)
    assert (a.first_nonfinite_ref, a.first_nonfinite_cand) == (b.first_nonfinite_ref, b.first_nonfinite_cand)
    assert np.array_equal(a.per_row, b.per_row) and a.worst_row == b.worst_row == 1400
    for f in ("token_rel_diff", "rel_diff", "cosine", "max_abs_diff", "max_abs_at", "mismatched", "numel"):
        assert getattr(a, f) == getattr(b, f), f


def test_squares_past_fp32_range_are_redone_in_fp64(tmp_path: Path) -> None:
    x = np.full((4, 64), 3e19, dtype=np.float32)  # x² overflows fp32
    y = x * np.float32(1.5)
    r = write_dump(tmp_path / "r.npz", {"hidden.0": x})
    c = write_dump(tmp_path / "c.npz", {"hidden.0": y})
    with open_dump(r) as rd, open_dump(c) as cd:
        m = stream.measure([(rd["hidden.0"], cd["hidden.0"], 1e-5, 1e-5)])[0]
    assert m.nonfinite_ref == m.nonfinite_cand == 0
    assert m.token_rel_diff == pytest.approx(0.25 / 3.25)  # (1-1.5)^2 / (1 + 1.5^2)
    assert m.cosine == pytest.approx(1.0)


def test_median_and_percentiles_are_numpys() -> None:
    rng = np.random.default_rng(2)
    for n in [1, 2, 3, 4, 5, 17, 100, 101]:
        x = rng.standard_normal(n) * 10
        assert median(x) == float(np.median(x))
        assert percentiles(x, [10, 50, 90]) == [float(v) for v in np.percentile(x, [10, 50, 90])]
    assert math.isnan(median(np.array([1.0, np.nan])))


def test_a_plain_dump_opens_directly_and_a_mislabelled_file_is_still_refused(tmp_path: Path) -> None:
    p = write_dump(tmp_path / "d.npz", {"hidden.0": np.ones((2, 3), np.float32)})
    with open_side(str(p)) as d:
        assert type(d) is Dump and d.names == ["hidden.0"]
    s = write_dump(tmp_path / "d.safetensors", {"hidden.0": np.ones((2, 3), np.float32)})
    with open_side(str(s)) as d:
        assert type(d) is Dump and d.metadata is not None
    fake = tmp_path / "gz.npz"
    fake.write_bytes(b"\x1f\x8b" + bytes(64))
    with pytest.raises(InputError, match="gzip"):
        open_side(str(fake))


def test_bf16_widening_is_exact() -> None:
    bits = np.arange(0, 1 << 16, 7, dtype=np.uint16).reshape(-1, 1)
    from consistency.dump.reader import TensorView

    v = TensorView("x", "bfloat16", bits.shape, np.dtype("<u2"), None, 0, Path("m"), array=bits)
    got = stream._widen(v, bits, stream.scratch(), "t")
    want = to_float(bits, "bfloat16")
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_one_scan_gives_each_pairs_own_distance_row(tmp_path: Path) -> None:
    """identify.scan (one pass over the reference sample for every wanted row, from two
    Fingerprints at once) memoizes exactly the rows computed pair by pair from fp64 sums."""
    from consistency.compare import identify

    rng = np.random.default_rng(3)
    x = [rng.standard_normal((40, 96)).astype(np.float32)]
    for _ in range(6):
        x.append(x[-1] + 0.3 * rng.standard_normal((40, 96)).astype(np.float32))
    r = write_dump(tmp_path / "r.safetensors", {f"hidden.{i}": a for i, a in enumerate(x)})
    c = write_dump(tmp_path / "c.safetensors", {"aux.0": x[2] + 1e-3, "aux.1": x[5]})
    with open_dump(r) as rd, open_dump(c) as cd:
        idx = identify.sample_index(40, 24)
        rfp = identify.Fingerprints(list(rd.tensors.values()), idx)
        cfp = identify.Fingerprints(list(cd.tensors.values()), idx)
        identify.scan(rfp, [(cfp, "aux.0"), (cfp, "aux.1"), (rfp, "hidden.2"), (rfp, "hidden.0")])
        assert len(cfp._memo) == 2 and len(rfp._memo) == 2
        for fp, name in ((cfp, "aux.0"), (cfp, "aux.1"), (rfp, "hidden.2"), (rfp, "hidden.0")):
            a = fp.rows(name)
            want = []
            for ref in rfp.names:
                b = rfp.rows(ref)
                d = a - b
                want.append(np.mean((d * d).sum(1) / ((a * a).sum(1) + (b * b).sum(1))))
            np.testing.assert_allclose(fp.distances(name, rfp), want, rtol=1e-9, atol=1e-15)
