"""The file-claims axes of the claims scenarios (issue 34): what the candidate's *file* claims
about its rows and its ranks, and the verdict that follows from the construction.

``anchors``: the candidate's ``tensors.*.token_index``: absent, true (each row's position),
``shifted`` (the draft was fed the next token's state beside the next token, ``draft_ids.0``,
and the file shifts every anchor by one so that pairing by it would meet the reference's next
row), ``repeat`` (one state at ``token_index=[0]*T``). ``ranks``: one file, or a two-rank set
(replicated) that is clean or whose rank 0 / rank 1 says its recorder dropped captures. A
refuted anchor (TOKEN_INDEX_FALSE) or a rank's losses (CAPTURES_DROPPED) is never PASS, whatever
the slots hold; true anchors and a clean set change nothing.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from tests.scenarios.expect import Expect

ANCHORS = ("absent", "true", "shifted", "repeat")
RANKS = ("one", "clean", "lossy0", "lossy1")


def with_file_claims(b: Any, c: Any, st: Any) -> Any:
    """The candidate file's anchors and ranks, and what they do to the verdict: a refuted
    anchor (TOKEN_INDEX_FALSE) or a rank's dropped captures (CAPTURES_DROPPED) is never PASS,
    whatever the slots hold; true anchors and a clean rank set change nothing."""
    t = c.tokens
    slots = sorted(k for k in b.cand if k.startswith("aux."))
    b.anchors = {}
    if c.anchors == "true":
        b.anchors = {k: list(range(t)) for k in slots}
    elif c.anchors == "shifted":  # row r holds token r+1's state beside token r+1, claimed as anchor r+1
        for k in slots:
            b.cand[k] = b.cand[k][1:]
        b.cand["draft_ids.0"] = st.ids[1:t].copy()
        b.anchors = {k: list(range(1, t)) for k in [*slots, "draft_ids.0"]}
    elif c.anchors == "repeat":
        for k in slots:
            b.cand[k] = np.repeat(b.cand[k][:1], t, axis=0)
        b.anchors = {k: [0] * t for k in slots}
    codes = ({"TOKEN_INDEX_FALSE"} if c.anchors in ("shifted", "repeat") else set()) | \
        ({"CAPTURES_DROPPED"} if c.ranks.startswith("lossy") else set())
    if codes:
        b.expect = Expect("fail", frozenset(codes))
    return b


def file_claims(arch: str = "llama") -> list[Any]:
    """The file-claims axes (issue 34: anchors, ranks) crossed with the faults and reference
    shapes of both methods; the other axes at their defaults (their own table covers them)."""
    from tests.scenarios.claims import FAULTS, LAST_FAULTS, REF_SHAPES, Case, valid

    out = []
    for method in ("eagle3", "last"):
        faults = FAULTS if method == "eagle3" else LAST_FAULTS
        for f, rs, an, rk in itertools.product(faults, REF_SHAPES, ANCHORS, RANKS):
            if rk in ("clean", "lossy0") and an not in ("absent", "shifted"):
                continue  # every anchor with one file and rank 1's losses; the rest of the ranks with two
            c = Case(arch, method, f, rs, anchors=an, ranks=rk)
            if valid(c):
                out.append(c)
    return out
