"""What a comparison is asked to do, validated once: the CLI, the gate, the Python API, the
pytest helper and the demo all build a :class:`CompareRequest` and hand it to
``consistency.pipeline.compare.run``; an error names the field (``threshold``,
``tolerance``), never a flag one entry point happens to spell it with, and an unknown
option is a usage error rather than something silently ignored.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from consistency.compare.tolerance import Rule, ToleranceModel, parse_rules
from consistency.contract.ids import parse_ids
from consistency.errors import UsageError

Ids = tuple[int, ...] | None


@dataclass(frozen=True)
class CompareRequest:
    reference: Any  # a path, a Dump, or a mapping of arrays (consistency.dump.memory.as_side)
    candidate: Any
    contract: Any = None  # a contract path or an AuxContract: the user's declaration of the slots
    rtol: float | None = None
    atol: float | None = None
    threshold: float | None = None
    tolerance: tuple[str, ...] = ()  # REGEX=FLOOR rules
    layer_ids: Ids = None  # ids describing each side that records none
    ref_layer_ids: Ids = None  # ids describing the reference (declared; its own claims outrank them)
    cand_layer_ids: Ids = None  # ids describing the candidate (compared with its values, never trusted)
    convention: str | None = None  # the convention the ids are written in
    consumer: str | None = None  # the draft the user declares (eagle3, mtp, eagle1, medusa): how it reads its input
    tokenizer: Any = None  # a tokenizer or a local path: only decodes unaligned spans
    progress: Callable[..., Any] | None = None  # (label, total) -> tick

    @classmethod
    def build(cls, reference: Any, candidate: Any, **options: Any) -> CompareRequest:
        """Validate and normalise the options (``tolerance`` may be a {regex: floor} mapping;
        ids may be '2,30,58' or a list)."""
        known = {f.name for f in fields(cls)} - {"reference", "candidate"}
        unknown = sorted(set(options) - known)
        if unknown:
            raise UsageError(f"compare: unknown option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} "
                             f"(known: {', '.join(sorted(known))})")
        for name in ("rtol", "atol", "threshold"):
            _number(name, options.get(name))
        tol = options.get("tolerance")
        if tol is None:
            tol = ()
        elif isinstance(tol, str):
            tol = (tol,)
        elif isinstance(tol, Mapping):
            tol = tuple(f"{k}={v}" for k, v in tol.items())
        elif isinstance(tol, (list, tuple)):
            tol = tuple(str(t) for t in tol)
        else:
            raise UsageError(f"tolerance: expected REGEX=FLOOR strings or a {{regex: floor}} table, got "
                             f"{type(tol).__name__}")
        options["tolerance"] = tol
        rules_of(tol)  # validated now: a bad rule is the request's error, not a crash later
        options["contract"] = _contract(options.get("contract"))
        for name in ("layer_ids", "ref_layer_ids", "cand_layer_ids"):
            ids = parse_ids(options.get(name), name)
            options[name] = tuple(ids) if ids is not None else None
        conv = options.get("convention")
        if conv is not None and not isinstance(conv, str):
            raise UsageError(f"convention: expected a convention name, got {type(conv).__name__}")
        if conv:  # an unknown name is a usage error even when no ids use it
            from consistency.contract.resolve import check_spec

            check_spec(conv, "convention")
        consumer = options.get("consumer")
        if consumer is not None:
            from consistency.contract.models import Consumer

            kinds = {"eagle3": Consumer.eagle3_aux.value} | {c.value: c.value for c in Consumer}
            if not isinstance(consumer, str) or consumer not in kinds:
                raise UsageError(f"consumer: expected one of {', '.join(sorted(kinds))}, got {consumer!r}")
            options["consumer"] = kinds[consumer]
        progress = options.get("progress")
        options["progress"] = progress if callable(progress) else None
        return cls(reference, candidate, **options)

    def tolerance_model(self) -> ToleranceModel:
        return ToleranceModel(rules=rules_of(self.tolerance), floor_override=self.threshold, rtol=self.rtol,
                              atol=self.atol)


def rules_of(specs: Sequence[str]) -> list[Rule]:
    try:
        rules = parse_rules(list(specs))
    except (ValueError, Exception) as exc:  # re.error is an Exception
        raise UsageError(f"tolerance: {exc}, in {', '.join(map(str, specs))[:200]!r} (expected REGEX=FLOOR, e.g. "
                         f"'aux\\..*=0.01')") from None
    for r in rules:
        _number(f"tolerance {r.pattern}", r.floor)
    return rules


def _contract(value: Any) -> Any:
    """A path (as a string) or an AuxContract; anything else is the field's error, not a
    TypeError from deep inside the reader."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    from consistency.contract.models import AuxContract

    if isinstance(value, AuxContract):
        return value
    raise UsageError(f"contract: expected a contract file (a path) or an AuxContract, got {type(value).__name__}")


def _number(name: str, v: Any) -> None:
    if v is None:
        return
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise UsageError(f"{name} must be a number, got {v!r}")
    if not math.isfinite(v) or v < 0:
        raise UsageError(f"{name} must be a finite number >= 0, got {v!r}")
