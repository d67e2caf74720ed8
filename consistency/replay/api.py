"""What other commands call. The CI gate (``[[replay]]`` in consistency.toml, docs/ci.md)
passes each entry's keys to :func:`replay_check` and reads the report's ``verdict``,
``summary`` and ``findings`` (the shared :class:`~consistency.contract.findings.Finding`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any



def check_inputs(*specs: str | Path | Any, layer_ids: Any = None, convention: str | None = None) -> None:
    """Refuse a REFERENCE/CANDIDATE that names nothing before the draft, torch and
    transformers load (6-9 CPU-s): a missing input is then a one-line exit 2 at once.

    A path that does not exist may still name a rank set (``NAME.rank*-of*.EXT``) or a
    glob, so it is resolved by the loader's own :func:`~consistency.dump.sets.open_side`
    (headers only; it raises the same error the replay would). Existing paths are left to
    the replay, which opens them anyway (a SpecForge checkpoint is not decompressed twice).
    """
    import os

    from consistency.dump.sets import open_side

    for spec in specs:
        if isinstance(spec, (str, Path)) and not os.path.lexists(spec):
            with open_side(spec, layer_ids, convention):
                pass


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
