"""One request per pipeline (issue 24): every entry point builds a CompareRequest or a
ReplayRequest, whose validation names the field and refuses an unknown option."""

from __future__ import annotations

import math
import re

import pytest

from consistency.compare.request import CompareRequest
from consistency.errors import UsageError
from consistency.replay.request import ReplayRequest


@pytest.mark.parametrize("options, needle", [
    ({"threshhold": 1e-3}, "unknown option threshhold"),
    ({"threshold": -1.0}, "threshold must be a finite number >= 0"),
    ({"rtol": math.nan}, "rtol must be a finite number >= 0"),
    ({"atol": "0.1"}, "atol must be a number"),
    ({"tolerance": ["aux.0"]}, "tolerance: "),
    ({"tolerance": {"aux.0": -2}}, "tolerance aux.0 must be a finite number >= 0"),
    ({"layer_ids": "2,x"}, "layer_ids: cannot parse"),
    ({"convention": "sglangg"}, "convention"),
])
def test_compare_request_names_the_field(options, needle):
    with pytest.raises(UsageError) as e:
        CompareRequest.build("a.safetensors", "b.safetensors", **options)
    assert needle in str(e.value) and "--" not in str(e.value).split(":")[0]


def test_compare_request_normalises_what_entry_points_spell_differently():
    req = CompareRequest.build("a", "b", tolerance={"aux\\.2": 1e-3}, layer_ids="2,30,58", progress=True)
    assert req.tolerance == ("aux\\.2=0.001",) and req.layer_ids == (2, 30, 58) and req.progress is None
    assert req.tolerance_model().rules[0].floor == 1e-3


@pytest.mark.parametrize("options, needle", [
    ({"maxdrop": 3}, "unknown option maxdrop"),
    ({"steps": 0}, "steps must be an integer between 1 and 64"),
    ({"max_drop_points": -1}, "max_drop_points must be a finite number >= 0"),
    ({"max_drop": 3, "max_drop_points": 4}, "give one (max_drop_points"),
    ({"min_acceptance": 1.5}, "min_acceptance is a fraction"),
    ({"feed": "greedy"}, "feed must be one of auto, own, teacher"),
    ({"method": "medusa"}, "method must be one of"),
    ({"overrides": {"norm_output": "yes"}}, "overrides must map"),
])
def test_replay_request_names_the_field(options, needle):
    with pytest.raises(UsageError) as e:
        ReplayRequest.build("draft", "a", "b", **options)
    assert needle in str(e.value)


def test_replay_request_takes_the_older_name_of_the_limit():
    assert ReplayRequest.build("d", "a", "b", max_drop=7).max_drop_points == 7.0
    assert ReplayRequest.build("d", "a", "b").max_drop_points == 5.0


def test_the_api_refuses_an_unknown_compare_option(tmp_path):
    import numpy as np

    import consistency

    with pytest.raises(UsageError, match="unknown option tolerence"):
        consistency.compare({"aux.0": np.ones((2, 4), np.float32)}, {"aux.0": np.ones((2, 4), np.float32)},
                            tolerence=["x=1"])


@pytest.mark.parametrize(("options", "needle"), [
    ({"fail_on": "warnings"}, "fail_on"),
    ({"fail_on": None}, "fail_on"),
    ({"draft": 3}, "draft"),
    ({"select": ["IDS", 7]}, "select"),
])
def test_lint_request_names_the_field(options, needle):
    """LintRequest validates its fields in one place; every door (CLI, gate, API) builds one."""
    from consistency.lint.engine import LintRequest

    with pytest.raises(UsageError, match=needle):
        LintRequest(runtime="sglang@0.5.23", **options)


def test_lint_request_is_frozen_and_normalised(tmp_path):
    import dataclasses

    from consistency import api
    from consistency.lint.engine import LintRequest

    req = LintRequest(draft=tmp_path, select="IDS", ignore=["IDS005"])
    assert (req.draft, req.select, req.ignore) == (str(tmp_path), ("IDS",), ("IDS005",))
    with pytest.raises(dataclasses.FrozenInstanceError):
        req.fail_on = "warning"  # type: ignore[misc]
    with pytest.raises(UsageError, match="fail_on"):  # the API's check is the request's
        api.lint(runtime="sglang@0.5.23", fail_on="warn")


@pytest.mark.parametrize("options, needle", [
    ({"tolerance": 5}, "tolerance: expected REGEX=FLOOR strings or a {regex: floor} table, got int"),
    ({"tolerance": 0.01}, "got float"),
    ({"contract": {"slots": []}}, "contract: expected a contract file (a path) or an AuxContract, got dict"),
    ({"contract": 3}, "got int"),
])
def test_an_option_of_the_wrong_type_is_a_usage_error_not_a_type_error(tmp_path, options, needle) -> None:
    """``consistency.compare(a, b, tolerance=5)`` and ``contract={...}`` raised a bare TypeError
    ('int' object is not iterable; os.fspath) from inside the request; both doors name the field."""
    import consistency

    a, b = tmp_path / "a.npz", tmp_path / "b.npz"
    with pytest.raises(UsageError, match=re.escape(needle)):
        CompareRequest.build(str(a), str(b), **options)
    with pytest.raises(UsageError, match=re.escape(needle)):
        consistency.compare(str(a), str(b), **options)


def test_replay_and_lint_options_of_the_wrong_type_are_usage_errors(tmp_path) -> None:
    """``consistency.replay(..., max_drop_points="5")`` compared a str with 0 (TypeError)
    before the request could name the field."""
    import consistency

    with pytest.raises(UsageError, match="max_drop_points must be a finite number >= 0, got '5'"):
        consistency.replay(str(tmp_path / "a.npz"), str(tmp_path / "b.npz"), draft="tiny-llama-eagle3",
                           max_drop_points="5")


@pytest.mark.parametrize("kw", ["select", "ignore"])
def test_lint_codes_of_the_wrong_type_are_a_usage_error(kw: str) -> None:
    """``consistency.lint(select=5)`` raised 'int' object is not iterable."""
    import consistency

    with pytest.raises(UsageError, match=f"{kw}: expected rule codes"):
        consistency.lint(runtime="sglang@0.5.5", **{kw: 5})
    assert consistency.lint(runtime="sglang@0.5.5", **{kw: ["IDS"]}).verdict in ("pass", "fail", "not_evaluated")
