"""Tolerance patterns: the same language as ``re``, matched in time linear in the name.

Agreement with ``re.fullmatch`` is checked on random patterns built from every construct
the matcher takes (literals, classes, categories, anchors, groups, alternation, greedy and
lazy repeats, counted repeats, inline flags) against random names, on both engines (the
bounded ``re`` path and the NFA); the catastrophic patterns finish at once through the CLI.
"""

from __future__ import annotations

import random
import re
import time

import numpy as np
import pytest

from tests.conftest import run_cli
from consistency.compare.pattern import PatternError, SafePattern
from consistency.compare.tolerance import Rule, parse_rules
from consistency.dump.writer import write_dump

ALPHABET = "ab.1_Z "
ATOMS = ["a", "b", r"\.", "1", ".", "[ab]", "[^a]", r"\d", r"\w", r"\s", "[a-c1]", "Z"]


def _pattern(rng: random.Random, depth: int = 0) -> str:
    parts = []
    for _ in range(rng.randint(1, 3 if depth == 0 else 2)):
        r = rng.random()
        if r < 0.5 or depth >= 2:
            p = rng.choice(ATOMS)
        elif r < 0.75:
            p = "(" + "|".join(_pattern(rng, depth + 1) for _ in range(rng.randint(1, 2))) + ")"
        else:
            p = "(?:" + _pattern(rng, depth + 1) + ")"
        q = rng.choice(["", "", "*", "+", "?", "*?", "+?", "{2}", "{0,2}", "{1,}"])
        parts.append(p + q)
    s = "".join(parts)
    if depth == 0 and rng.random() < 0.15:
        s = rng.choice(["^", r"\A", r"\b"]) + s + rng.choice(["$", r"\Z", r"\b", ""])
    if depth == 0 and rng.random() < 0.1:
        s = "(?i)" + s
    return s


def test_the_matcher_agrees_with_re_on_random_patterns_and_names() -> None:
    rng = random.Random(1234)
    checked = nfa_used = 0
    for _ in range(400):
        pat = _pattern(rng)
        sp = SafePattern(pat)
        nfa_used += not sp.backtrack_safe
        for _ in range(40):
            name = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 6)))
            want = re.fullmatch(pat, name) is not None
            assert sp.fullmatch(name) == want == sp._pike(name), (pat, name)
            checked += 1
    assert checked == 16000 and 50 < nfa_used < 350, nfa_used  # both engines really ran


@pytest.mark.parametrize("pat", [r"(a+)+$", r"(a|a)*b", r"(a*)*b", r".*a.*a.*a.*a.*a.*a$", r"(\w+\s?)+$"])
def test_catastrophic_patterns_take_linear_time(pat: str) -> None:
    sp = SafePattern(pat)
    assert not sp.backtrack_safe  # these run on the NFA
    t0 = time.perf_counter()
    for n in (35, 200, 1024):
        sp.fullmatch("a" * n + "!")
    assert time.perf_counter() - t0 < 5  # re takes longer than a CI job lives on the first of them


@pytest.mark.parametrize("pat,why", [(r"(a)\1", "backreference"), (r"(?=a)a", "lookaround"), (r"(?<!a)b", "lookaround"),
                                     ("a" * 1025, "1024-character"), ("(", "not a regular expression"),
                                     (r"(a{1000}){100}", "states")])
def test_what_a_linear_matcher_cannot_do_is_refused_in_one_line(pat: str, why: str) -> None:
    with pytest.raises(PatternError, match=why):
        SafePattern(pat)
    with pytest.raises(ValueError, match=why):
        parse_rules([f"{pat}=0.1"])


def test_a_redos_tolerance_through_the_cli_finishes(tmp_path) -> None:  # noqa: ANN001
    name = "a" * 35 + "!"
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 8)).astype(np.float32)
    write_dump(tmp_path / "r.safetensors", {name: x})
    write_dump(tmp_path / "c.safetensors", {name: x * 1.5})
    t0 = time.perf_counter()
    r = run_cli("compare", str(tmp_path / "r.safetensors"), str(tmp_path / "c.safetensors"), "-q",
                "--tolerance", "(a+)+$=0.1")
    assert r.returncode == 1 and "SCALE_MISMATCH" in r.stdout, r.stdout + r.stderr
    assert time.perf_counter() - t0 < 60
    assert Rule("(a+)+$", 0.1).matches(name) is False and Rule("a+!", 0.1).matches(name) is True
