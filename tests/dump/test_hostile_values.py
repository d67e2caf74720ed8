"""Hostile *values* in well-formed dumps: NaN/Inf, empty and zero-norm tensors, extreme magnitudes.

None of these is a loader error: each must end in an explicit finding (NONFINITE with
counts and first positions, EMPTY, SHAPE_MISMATCH, ...), never in a crash and never in a
silent pass. Each case is a pair of real dumps compared by the real engine.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest

from consistency.pipeline.compare import compare as run_compare
from consistency.dump.dtypes import float32_to_bf16_bits
from consistency.dump.writer import write_dump
from tests.conftest import cli

X = np.random.default_rng(0).standard_normal((6, 8)).astype(np.float32)


def _compare(tmp: Path, ref: dict, cand: dict, strict_warnings: bool = False):  # noqa: ANN202 - CompareReport
    n = len(list(tmp.glob("ref*")))
    a = write_dump(tmp / f"ref{n}.safetensors", ref)
    b = write_dump(tmp / f"cand{n}.npz", cand)
    with warnings.catch_warnings():
        warnings.simplefilter("error" if strict_warnings else "ignore", RuntimeWarning)
        return run_compare(str(a), str(b))


def _codes(rep) -> list[str]:  # noqa: ANN001
    return [f.code for f in rep.findings]


def _nonfinite(rep):  # noqa: ANN001, ANN202
    (f,) = [f for f in rep.findings if f.code == "NONFINITE"]
    return f, json.loads(f.model_dump_json())


def test_all_nan_candidate_is_nonfinite_with_count_and_first_position(tmp_path):
    rep = _compare(tmp_path, {"hidden.1": X}, {"hidden.1": np.full_like(X, np.nan)})
    f, d = _nonfinite(rep)
    assert rep.verdict == "fail" and f.severity.value == "error"
    assert "48 in the candidate (first at [0, 0])" in f.message and "reference" not in f.message
    assert d["metrics"]["nonfinite_cand"] == 48 and d["metrics"]["first_nonfinite_cand"] == [0, 0]


def test_inf_in_the_reference_is_reported_at_its_position(tmp_path):
    ref = X.copy()
    ref[1, 5] = np.inf
    ref[4, 2] = -np.inf
    rep = _compare(tmp_path, {"hidden.1": ref}, {"hidden.1": X})
    f, d = _nonfinite(rep)
    assert "2 in the reference (first at [1, 5])" in f.message and "candidate" not in f.message
    assert d["metrics"]["nonfinite_ref"] == 2 and d["metrics"]["first_nonfinite_ref"] == [1, 5]


@pytest.mark.parametrize("dtype,nan_bits", [("bfloat16", 0x7FC1), ("float8_e4m3fn", 0x7F), ("float8_e5m2", 0xFE)])
def test_nan_bit_patterns_of_narrow_dtypes_are_seen(tmp_path, dtype, nan_bits):
    storage = np.uint16 if dtype == "bfloat16" else np.uint8
    one = {"bfloat16": 0x3F80, "float8_e4m3fn": 0x38, "float8_e5m2": 0x3C}[dtype]
    ref = np.full((4, 8), one, storage)
    cand = ref.copy()
    cand[2, 3] = nan_bits
    rep = _compare(tmp_path, {"hidden.1": (ref, dtype)}, {"hidden.1": (cand, dtype)})
    f, d = _nonfinite(rep)
    assert d["metrics"]["nonfinite_cand"] == 1 and d["metrics"]["first_nonfinite_cand"] == [2, 3]


def test_nan_in_an_aux_slot(tmp_path):
    cand = X.copy()
    cand[3, :] = np.nan
    rep = _compare(tmp_path, {"hidden.1": X, "aux.0": X}, {"aux.0": cand})
    f, d = _nonfinite(rep)
    assert "slot 0" in f.message and "8 in the candidate (first at [3, 0])" in f.message


def test_nan_on_both_sides_is_not_a_pass(tmp_path):
    nan = np.full_like(X, np.nan)
    rep = _compare(tmp_path, {"hidden.1": nan}, {"hidden.1": nan.copy()})
    f, _ = _nonfinite(rep)
    assert rep.verdict == "fail" and "48 in the candidate" in f.message and "48 in the reference" in f.message


def test_nonfinite_through_the_cli_exits_1_and_writes_positions_to_json(tmp_path):
    a = write_dump(tmp_path / "a.safetensors", {"hidden.1": X})
    cand = X.copy()
    cand[5, 7] = np.nan
    b = write_dump(tmp_path / "b.safetensors", {"hidden.1": cand})
    r = cli("compare", str(a), str(b), "--json", "-")
    assert r.returncode == 1, r.stderr
    rep = json.loads(r.stdout)
    (f,) = [f for f in rep["findings"] if f["code"] == "NONFINITE"]
    assert f["metrics"]["first_nonfinite_cand"] == [5, 7] and f["metrics"]["nonfinite_cand"] == 1


@pytest.mark.parametrize("shape", [(0, 8), (4, 0), (0,)])
def test_empty_tensors_are_an_explicit_finding(tmp_path, shape):
    e = np.zeros(shape, np.float32)
    rep = _compare(tmp_path, {"hidden.1": e}, {"hidden.1": e.copy()})
    assert "EMPTY" in _codes(rep), _codes(rep)


def test_empty_against_full_is_a_shape_mismatch(tmp_path):
    rep = _compare(tmp_path, {"hidden.1": X}, {"hidden.1": np.zeros((0, 8), np.float32)})
    assert rep.verdict == "fail" and "SHAPE_MISMATCH" in _codes(rep)


def test_zero_norm_on_both_sides_is_equal_not_nan(tmp_path):
    """rel_diff is 0/0 on all-zero rows: defined as 0 (equal), not NaN and not a warning."""
    z = np.zeros((6, 8), np.float32)
    rep = _compare(tmp_path, {"hidden.1": z, "aux.0": z}, {"hidden.1": z.copy(), "aux.0": z.copy()})
    assert rep.verdict == "pass" and set(_codes(rep)) == {"OK"}
    row = X.copy()
    row[2] = 0  # one zero row among normal ones
    rep = _compare(tmp_path, {"hidden.1": row}, {"hidden.1": row.copy()})
    assert rep.verdict == "pass"


def test_zero_against_nonzero_fails(tmp_path):
    rep = _compare(tmp_path, {"hidden.1": X}, {"hidden.1": np.zeros_like(X)})
    assert rep.verdict == "fail" and "OK" not in _codes(rep)


def test_signed_zero_and_subnormals_are_values_not_problems(tmp_path):
    tiny = np.full((6, 8), 1e-45, np.float32)  # the smallest subnormal
    rep = _compare(tmp_path, {"hidden.1": np.zeros((6, 8), np.float32), "hidden.2": tiny},
                   {"hidden.1": -np.zeros((6, 8), np.float32), "hidden.2": tiny.copy()})
    assert rep.verdict == "pass"


def test_bf16_dump_with_inf_rows(tmp_path):
    ref = float32_to_bf16_bits(X)
    cand = ref.copy()
    cand[0] = 0x7F80  # +inf in bf16
    rep = _compare(tmp_path, {"hidden.1": (ref, "bfloat16")}, {"hidden.1": (cand, "bfloat16")})
    _, d = _nonfinite(rep)
    assert d["metrics"]["nonfinite_cand"] == 8 and d["metrics"]["first_nonfinite_cand"] == [0, 0]


def test_integer_extremes_compare_exactly(tmp_path):
    lo, hi = np.iinfo(np.int64).min, np.iinfo(np.int64).max
    rep = _compare(tmp_path, {"input_ids": np.array([lo, hi, 0])}, {"input_ids": np.array([lo, hi, 1])})
    assert rep.verdict == "fail" and "MISMATCH" in _codes(rep)


def test_empty_and_zero_tensors_raise_no_runtime_warnings(tmp_path):
    """All-zero tensors (0/0 in a relative error) and empty ones (a mean of nothing) raise no
    RuntimeWarning, and the verdicts hold: equal zeros agree; empty tensors compare nothing,
    which is never a pass."""
    e, z = np.zeros((0, 8), np.float32), np.zeros((6, 8), np.float32)
    zeros = _compare(tmp_path, {"hidden.1": z, "aux.0": z}, {"hidden.1": z.copy(), "aux.0": z.copy()},
                     strict_warnings=True)
    assert zeros.verdict == "pass" and sorted((f.code, f.tensor) for f in zeros.findings) == \
        [("OK", "aux.0"), ("OK", "hidden.1")]
    empty = _compare(tmp_path, {"hidden.1": e, "aux.0": e}, {"aux.0": e.copy()}, strict_warnings=True)
    assert empty.verdict == "fail" and ("EMPTY", "aux.0") in {(f.code, f.tensor) for f in empty.findings}
    assert "NOTHING_COMPARED" in _codes(empty) and "OK" not in _codes(empty)


def test_a_dump_with_no_tensors_is_refused_not_passed(tmp_path):
    from consistency.dump.safetensors_io import serialize_header

    empty = tmp_path / "empty.safetensors"
    empty.write_bytes(serialize_header({}, {}))
    good = write_dump(tmp_path / "g.safetensors", {"hidden.1": X})
    r = cli("compare", str(good), str(empty))
    assert r.returncode == 2 and r.stderr.strip() == f"consistency: error: {empty}: holds no tensors (an empty safetensors file)"


def test_huge_finite_values_with_real_differences_do_not_pass(tmp_path):
    noise = np.random.default_rng(1).standard_normal(X.shape).astype(np.float32)
    rep = _compare(tmp_path, {"hidden.1": X * 1e20}, {"hidden.1": (X + 0.02 * noise) * 1e20})
    assert rep.verdict == "fail"


def test_finite_float64_beyond_float32_range_is_not_nonfinite(tmp_path):
    big = X.astype(np.float64) * 1e200
    rep = _compare(tmp_path, {"hidden.1": big}, {"hidden.1": big.copy()})
    assert "NONFINITE" not in _codes(rep) and rep.verdict == "pass"


def test_dumps_with_nothing_in_common_do_not_pass(tmp_path):
    rep = _compare(tmp_path, {"hidden.1": X}, {"something_else": X})
    assert rep.verdict == "fail"
