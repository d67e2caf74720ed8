"""What other commands call. The CI gate (``[[replay]]`` in consistency.toml, docs/ci.md)
passes each entry's keys to :func:`replay_check` and reads the report's ``verdict``,
``summary`` and ``findings`` (the shared :class:`~consistency.contract.findings.Finding`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from consistency.errors import UsageError


def replay_check(draft: str | Path, reference: str | Path, candidate: str | Path, target: str | Path | Any | None = None,
                 steps: int | None = None, max_drop_points: float | None = None, min_acceptance: float | None = None,
                 feed: str = "auto", labels: str = "auto", overrides: dict[str, bool] | None = None,
                 max_drop: float | None = None, **unknown: Any) -> Any:
    """The replay report (a :class:`~consistency.replay.report.ReplayReport`): verdict ``fail``
    with ``ACCEPTANCE_DROP`` when the candidate's top-1 accuracy or acceptance rate falls more
    than ``max_drop_points`` (default 5) below the reference's, ``ACCEPTANCE_LOW`` when its
    acceptance rate is under ``min_acceptance`` (0..1); ``report.findings`` is the list of
    findings. Bad input raises :class:`consistency.errors.InputError` as everywhere else."""
    from consistency.replay.assets import resolve_draft
    from consistency.replay.engine import run_replay

    if unknown:
        raise UsageError(f"replay: unknown option(s) {sorted(unknown)}; known: draft, reference, candidate, target, "
                         "steps, max_drop_points, min_acceptance, feed, labels, overrides")
    limit = max_drop_points if max_drop_points is not None else (max_drop if max_drop is not None else 5.0)
    return run_replay(resolve_draft(str(draft)), target, reference, candidate, steps, limit, feed, labels,
                      overrides, min_acceptance)
