"""What other commands call. The CI gate (``[[replay]]`` in consistency.toml, docs/ci.md)
passes each entry's keys to :func:`replay_check` and reads the report's ``verdict``,
``summary`` and ``findings`` (the shared :class:`~consistency.contract.findings.Finding`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def replay_check(draft: str | Path, reference: str | Path, candidate: str | Path, target: str | Path | Any | None = None,
                 **options: Any) -> Any:
    """The replay report (a :class:`~consistency.replay.report.ReplayReport`): verdict ``fail``
    with ``ACCEPTANCE_DROP`` when the candidate's top-1 accuracy or acceptance rate falls more
    than ``max_drop_points`` (default 5) below the reference's, ``ACCEPTANCE_LOW`` when its
    acceptance rate is under ``min_acceptance`` (0..1); ``report.findings`` is the list of
    findings. ``options`` are :class:`~consistency.replay.request.ReplayRequest`'s fields
    (``method``: auto, eagle3, mtp or eagle1, docs/replay.md); an unknown one is a usage
    error. Bad input raises :class:`consistency.errors.InputError` as everywhere else."""
    from consistency.replay.request import ReplayRequest, run

    return run(ReplayRequest.build(draft, reference, candidate, target=target, **options))
