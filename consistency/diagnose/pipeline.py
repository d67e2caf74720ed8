"""The compare pipeline as a library function: open both sides, compare, diagnose, report.

The CLI, the gate, the demo, the Python API and the pytest helper all call :func:`run`,
so every entry point reaches the same verdict on the same inputs (no command imports
another command).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from consistency.contract.ids import parse_ids  # noqa: F401 - re-exported for the CLI
from consistency.errors import UsageError

if TYPE_CHECKING:
    from consistency.contract.findings import CompareReport, Finding


def load_contract(path: str | None) -> Any:
    if path is None:
        return None
    from consistency.contract.io import read_contract

    return read_contract(path)


def run(reference: Any, candidate: Any, contract: str | None = None, rtol: float | None = None,
        atol: float | None = None, threshold: float | None = None, tolerance: Sequence[str] = (),
        progress: Callable[..., Any] | None = None, layer_ids: str | Sequence[int] | None = None,
        convention: str | None = None, ref_layer_ids: str | Sequence[int] | None = None,
        cand_layer_ids: str | Sequence[int] | None = None, tokenizer: Any = None) -> CompareReport:
    """Compare REFERENCE (what the draft was trained on) with CANDIDATE (what it is fed).

    ``layer_ids`` describe each side that does not record its own ids; ``ref_layer_ids`` /
    ``cand_layer_ids`` describe one side and win over what it records. Several captures of a
    name (chunked prefill, decode steps) are stitched and the two sides' tokens aligned by
    ``input_ids`` first; ``tokenizer`` (an object or a local path) only decodes unaligned spans. ``progress`` is a
    factory ``(label, total) -> tick`` (the CLI passes a rich progress bar); diagnosis sits
    below the report layer, so it never builds one itself."""
    from consistency.compare.engine import compare
    from consistency.compare.prepare import prepare, reconcile
    from consistency.contract.findings import Severity
    from consistency.compare.tolerance import ToleranceModel, parse_rules
    from consistency.diagnose.engine import explain
    from consistency.diagnose.report import build
    from consistency.dump.sets import open_side

    _check_number("--rtol", rtol)
    _check_number("--atol", atol)
    _check_number("--threshold", threshold)
    try:
        rules = parse_rules(list(tolerance))
    except (ValueError, Exception) as exc:  # re.error is an Exception
        raise UsageError(f"--tolerance: {exc}") from None
    for r in rules:
        _check_number(f"--tolerance {r.pattern}", r.floor)
    tol = ToleranceModel(rules=rules, floor_override=threshold, rtol=rtol, atol=atol)
    con = load_contract(contract)
    ids = parse_ids(layer_ids)
    ref_ids, cand_ids = parse_ids(ref_layer_ids), parse_ids(cand_layer_ids)
    notes: list[str] = []
    with open_side(reference, ref_ids if ref_ids is not None else ids, convention) as ref, \
            open_side(candidate, cand_ids if cand_ids is not None else ids, convention) as cand:
        notes += apply_ids(ref, ids, ref_ids, convention, "--ref-layer-ids")
        notes += apply_ids(cand, ids, cand_ids, convention, "--cand-layer-ids")
        drops = dropped(ref, "reference") + dropped(cand, "candidate")  # before stitching: the recorders' own words
        # stitch multi-capture names, align tokens by input_ids, compare only aligned rows
        ref, cand, alignment = prepare(ref, cand, tokenizer, same_context_only=True)
        cmp = compare(ref, cand, con, tol, progress=progress if callable(progress) else None)
        cmp.plan.notes[:0] = notes + list(alignment.notes)
        findings, summary = explain(cmp)
        findings = reconcile(findings, alignment) + drops
        token_errors = [f for f in alignment.findings if f.severity == Severity.error]
        if token_errors:  # the token story comes first: it changes what every state means
            demoted = alignment.context_differs and not alignment.only_same_context
            summary = f"{token_errors[0].code}: {token_errors[0].message}" + ("" if demoted else f" -- {summary}")
        if drops:  # an incomplete recording: said before any value story
            summary = f"{drops[0].code}: {drops[0].message} -- {summary}"
        rep = build(cmp, findings, summary)
        rep.alignment = alignment.summary()
        return rep


def _check_number(flag: str, v: float | None) -> None:
    if v is not None and (not math.isfinite(v) or v < 0):
        raise UsageError(f"{flag} must be a finite number >= 0, got {v!r}")


def apply_ids(d: Any, common: list[int] | None, own: list[int] | None, convention: str | None, flag: str) -> list[str]:
    """Give a dump of ours the stream claims ``--layer-ids`` describe (foreign readers
    already took them). Common ids fill a side that records none; per-file ids win."""
    from consistency.dump.formats.base import ForeignDump, resolve_claims

    ids = own if own is not None else common
    if ids is None or isinstance(d, ForeignDump):
        return []
    meta = d.metadata
    recorded = meta.aux.stream_ids if meta is not None and meta.aux is not None else None
    n_layers = meta.model.num_layers if meta is not None and meta.model is not None else None
    claims = resolve_claims(d.path, ids, convention, "stream", sorted_slots=False, num_layers=n_layers)
    streams = claims.streams
    if recorded and own is None:
        if list(recorded) != list(streams or []):
            return [f"{d.path.name} records streams {list(recorded)}; --layer-ids {ids} not applied to it "
                    f"(use {flag} to override)"]
        return []
    from consistency.contract.models import AuxInfo, DumpMetadata

    meta = meta.model_copy(deep=True) if meta is not None else DumpMetadata()
    meta.aux = (meta.aux or AuxInfo()).model_copy(update={"stream_ids": streams, "native_ids": ids,
                                                          "convention": claims.convention})
    d.metadata = meta
    what = f"{d.path.name}: streams {streams} from {flag if own is not None else '--layer-ids'} {ids}"
    return [what + (f" (it recorded {list(recorded)})" if recorded else "")] + list(claims.notes)


def dropped(d: Any, side: str) -> list[Finding]:
    """CAPTURES_DROPPED when a dump's metadata says its recorder left captures out (a full
    host ring, a graph-buffer budget, a host value inside a CUDA graph): those rows were not
    compared, so the verdict can never pass on them. Read defensively (a hostile file)."""
    from consistency.contract.findings import Finding

    meta = getattr(d, "metadata", None)
    extra = meta.extra if meta is not None and isinstance(meta.extra, dict) else {}
    counts: dict[str, int] = {}
    reasons: list[str] = []
    flat = extra.get("dropped_captures")
    graph = extra.get("cuda_graphs", {}).get("not_recorded") if isinstance(extra.get("cuda_graphs"), dict) else None
    for source in ([flat] if isinstance(flat, dict) else []) + (list(graph.values()) if isinstance(graph, dict) else []):
        for name, n in (source.items() if isinstance(source, dict) else ()):
            if isinstance(n, int) and not isinstance(n, bool) and n > 0:
                counts[str(name)[:80]] = max(counts.get(str(name)[:80], 0), n)
    if isinstance(graph, dict):
        reasons = [str(r)[:120] for r in list(graph)[:4]]
    if not counts:
        return []
    shown = ", ".join(f"{k} x{v}" for k, v in sorted(counts.items())[:8]) + (", ..." if len(counts) > 8 else "")
    why = f" ({'; '.join(reasons)})" if reasons else ""
    return [Finding.make("CAPTURES_DROPPED", f"the {side}'s recorder did not record {sum(counts.values())} "
                         f"capture(s){why}: {shown}; what they held was not compared",
                         metrics={"dropped": dict(sorted(counts.items())[:64]), "side": side})]
