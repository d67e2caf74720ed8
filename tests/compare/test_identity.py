"""Identity carried, resolved once (issue 38 item 4): the plan parses each entry's names and
says what its expected tensor is by the reference's values; every result carries exactly
that (``r.identity``), and the report's words read it. Real in-memory dumps, a real compare."""

from __future__ import annotations

import numpy as np

from consistency.compare import plan as planner
from consistency.compare.engine import compare
from consistency.compare.types import Identity
from consistency.diagnose.engine import explain
from consistency.diagnose.report import build
from consistency.dump.memory import MemoryDump

RNG = np.random.default_rng(11)
T, H, N = 32, 16, 6
STREAMS = [RNG.standard_normal((T, H)).astype(np.float32) for _ in range(N + 1)]
FNORM = (STREAMS[N] / np.sqrt((STREAMS[N] ** 2).mean(-1, keepdims=True))).astype(np.float32)


def _dump(tensors: dict[str, np.ndarray]) -> MemoryDump:
    return MemoryDump({"input_ids": np.arange(T, dtype=np.int64), **tensors},
                      {"model": {"num_layers": N, "hidden_size": H}})


def _comparison():
    # the reference records every stream and its slots; its slots hold streams 2 and 4 and
    # fnorm(s=N) by their values (no claim says so). The candidate's slot 1 holds stream 5.
    ref = _dump({**{f"hidden.{s}": STREAMS[s] for s in range(N + 1)}, "final_norm": FNORM,
                 "aux.0": STREAMS[2], "aux.1": STREAMS[4], "aux.2": FNORM})
    cand = _dump({"aux.0": STREAMS[2], "aux.1": STREAMS[5], "aux.2": FNORM, "hidden.3": STREAMS[3]})
    return compare(ref, cand)


def test_every_result_carries_the_identity_the_plan_resolved():
    cmp = _comparison()
    assert {r.name for r in cmp.results} >= {"aux.0", "aux.1", "aux.2", "hidden.3"}
    for r in cmp.results:
        entry = cmp.plan.entry(r.name)
        assert entry is not None and r.identity is entry.identity  # carried, not recomputed
        assert r.identity == planner.identity(entry, cmp.plan.ref_slots)  # and it is what the plan resolves
    by = {r.name: r.identity for r in cmp.results}
    # each follows from the construction: slot i is aux.i; its reference slot holds what its values equal
    assert by["aux.0"] == Identity("aux.0", "aux", 0, "aux.0", "aux", 0, "hidden.2", "hidden", 2, 2, 2, False)
    assert by["aux.1"] == Identity("aux.1", "aux", 1, "aux.1", "aux", 1, "hidden.4", "hidden", 4, 4, 4, False)
    assert by["aux.2"].canonical == "final_norm" and by["aux.2"].post_norm and by["aux.2"].ref_stream is None
    assert by["hidden.3"] == Identity("hidden.3", "hidden", 3, "hidden.3", "hidden", 3, "hidden.3", "hidden", 3, 3, 3)


def test_the_report_reads_the_carried_identity():
    """The report's slot table and findings name the expected tensor by what it is (the
    identity the plan resolved), and the wrong slot is found holding stream 5."""
    cmp = _comparison()
    findings, st = explain(cmp)
    rep = build(cmp, findings, st)
    by = {r.name: r.identity for r in cmp.results}
    assert [(s.tensor, s.expected) for s in rep.slots] == [(n, by[n].canonical) for n in ("aux.0", "aux.1", "aux.2")]
    wrong = [f for f in rep.findings if f.tensor == "aux.1" and f.severity.value == "error"]
    assert wrong and all(f.expected == "hidden.4" for f in wrong) and wrong[0].identified_as == "hidden.5"
