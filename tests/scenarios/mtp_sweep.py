"""The MTP misses table: every CI-table case plus hypothesis draws, one line per miss.

``python -m tests.scenarios.mtp --sweep 300`` (what tests/compare/test_scenarios_mtp.py's KNOWN
tables are built from).
"""

from __future__ import annotations

from pathlib import Path

from tests.scenarios.mtp import MtpScenario, run, strategy, table


def sweep(n_random: int = 0) -> int:
    """Every CI-table case (and ``n_random`` hypothesis draws): one line per miss, then the
    misses grouped by (fault, consumer, kind) -- what goes into the test's KNOWN list."""
    import tempfile
    from collections import Counter

    cases = table()
    if n_random:
        from hypothesis import HealthCheck, given, seed, settings

        @seed(19)
        @settings(max_examples=n_random, derandomize=True, database=None, deadline=None,
                  suppress_health_check=list(HealthCheck))
        @given(strategy())
        def draw(sc: MtpScenario) -> None:
            cases.append(sc)

        draw()
    groups: Counter[tuple[str, str, str]] = Counter()
    with tempfile.TemporaryDirectory() as tmp:
        for i, sc in enumerate(cases):
            _r, _e, misses, _b = run(sc, Path(tmp) / str(i))
            for m in misses:
                print(f"{m.kind:10} {sc.args()}: {m.detail[:300]}", flush=True)
                groups[(sc.fault, sc.consumer, m.kind)] += 1
    print(f"\n{len(cases)} cases")
    for (fault, consumer, kind), n in sorted(groups.items()):
        print(f"{n:4}  {kind:10} {fault:16} {consumer}")
    return 1 if groups else 0
