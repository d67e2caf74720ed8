"""What a replay is asked to do, validated once: the CLI (``consistency replay``), the gate's
``[[replay]]`` and the Python API (``consistency.replay``) all build a :class:`ReplayRequest`
and hand it to :func:`run`, so each reaches the same verdict on the same inputs. An error
names the field (``max_drop_points``, ``steps``), never a flag one entry point spells it
with, and an unknown option is a usage error rather than something silently ignored.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from consistency.contract.ids import parse_ids
from consistency.errors import UsageError

FEEDS = ("auto", "own", "teacher")
LABELS = ("auto", "logits", "target", "input_ids")
METHODS = ("auto", "eagle3", "mtp", "eagle1")
DEFAULT_MAX_DROP = 5.0
ALIASES = {"max_drop": "max_drop_points"}  # older names a caller may still use (the gate's keys include them)
MAX_STEPS = 64


@dataclass(frozen=True)
class ReplayRequest:
    draft: str | Path
    reference: str | Path
    candidate: str | Path
    target: Any = None  # a built-in name, a local HF directory, or a loaded model
    steps: int | None = None
    max_drop_points: float = DEFAULT_MAX_DROP
    min_acceptance: float | None = None  # a fraction, 0..1
    feed: str = "auto"
    labels: str = "auto"
    overrides: Mapping[str, bool] | None = None  # draft config keys to force (True/False)
    method: str = "auto"
    layer_ids: tuple[int, ...] | None = None  # for a training file that does not record its streams
    convention: str | None = None

    @classmethod
    def build(cls, draft: Any, reference: Any, candidate: Any, **options: Any) -> ReplayRequest:
        """Validate the options; ``max_drop`` (the older name of ``max_drop_points``) is
        accepted, and giving both with different values is an error."""
        old = options.pop("max_drop", None)
        known = {f.name for f in fields(cls)} - {"draft", "reference", "candidate"}
        unknown = sorted(set(options) - known)
        if unknown:
            raise UsageError(f"replay: unknown option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} "
                             f"(known: {', '.join(sorted(known | {'max_drop'}))})")
        limit = options.get("max_drop_points")
        if old is not None and limit is not None and old != limit:
            raise UsageError(f"replay: max_drop = {old} and max_drop_points = {limit}: give one (max_drop_points; "
                             "max_drop is its older name)")
        limit = limit if limit is not None else (old if old is not None else DEFAULT_MAX_DROP)
        _number("max_drop_points", limit)
        options["max_drop_points"] = float(limit)
        acc = options.get("min_acceptance")
        if acc is not None and (isinstance(acc, bool) or not isinstance(acc, (int, float)) or not 0.0 <= acc <= 1.0):
            raise UsageError(f"min_acceptance is a fraction between 0 and 1, got {acc!r}")
        steps = options.get("steps")
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or
                                  not 1 <= steps <= MAX_STEPS):
            raise UsageError(f"steps must be an integer between 1 and {MAX_STEPS}, got {steps!r}")
        for name, choices in (("feed", FEEDS), ("labels", LABELS), ("method", METHODS)):
            v = options.get(name, getattr(cls, name))
            if v not in choices:
                raise UsageError(f"{name} must be one of {', '.join(choices)}, got {v!r}")
        ov = options.get("overrides")
        if ov is not None and (not isinstance(ov, Mapping) or not all(isinstance(v, bool) for v in ov.values())):
            raise UsageError("overrides must map draft config keys to true/false")
        ids = parse_ids(options.get("layer_ids"), "layer_ids")
        options["layer_ids"] = tuple(ids) if ids is not None else None
        conv = options.get("convention")
        if conv:
            from consistency.contract.resolve import check_spec

            check_spec(conv, "convention")
        return cls(draft, reference, candidate, **options)


def _number(name: str, v: Any) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise UsageError(f"{name} must be a finite number >= 0, got {v!r}")


def run(req: ReplayRequest) -> Any:
    """The replay report (a :class:`~consistency.replay.report.ReplayReport`). Inputs that name
    nothing are refused before the draft, torch and transformers load."""
    ids = list(req.layer_ids) if req.layer_ids is not None else None
    check_inputs(req.reference, req.candidate, layer_ids=ids, convention=req.convention)
    from consistency.replay.assets import resolve_draft  # torch: only once the inputs exist
    from consistency.replay.engine import run_replay

    return run_replay(resolve_draft(str(req.draft)), req.target, req.reference, req.candidate, req.steps,
                      req.max_drop_points, req.feed, req.labels, dict(req.overrides) if req.overrides else None,
                      req.min_acceptance, ids, req.convention, req.method)


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
