"""The compare pipeline as a library function: open both sides, compare, diagnose, report.

The CLI, the gate, the demo, the Python API and the pytest helper all call :func:`run`,
so every entry point reaches the same verdict on the same inputs (no command imports
another command).
"""

from __future__ import annotations

import os
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

from consistency.contract.ids import parse_ids  # noqa: F401 - re-exported for the CLI

if TYPE_CHECKING:
    from consistency.compare.request import CompareRequest
    from consistency.contract.findings import CompareReport, Finding


def load_contract(path: str | None) -> Any:
    if path is None:
        return None
    from consistency.contract.io import read_contract

    return read_contract(path)


def run(reference: Any, candidate: Any, **options: Any) -> CompareReport:
    """Compare REFERENCE (what the draft was trained on) with CANDIDATE (what it is fed);
    ``options`` are :class:`~consistency.compare.request.CompareRequest`'s fields (an
    unknown one is a usage error)."""
    from consistency.compare.request import CompareRequest

    return run_request(CompareRequest.build(reference, candidate, **options))


def run_request(req: CompareRequest) -> CompareReport:
    """The pipeline. ``layer_ids`` describe each side that does not record its own ids;
    ``ref_layer_ids`` declare what the reference holds (its own values and claims outrank
    them: a disagreement is CONTRACT_CONFLICT); ``cand_layer_ids`` say what the candidate
    claims (compared with its values, never trusted). Several captures of a name (chunked
    prefill, decode steps) are stitched and the two sides' tokens aligned by ``input_ids``
    first; ``tokenizer`` (an object or a local path) only decodes unaligned spans."""
    from consistency.compare.engine import compare
    from consistency.compare.prepare import context_by_values, prepare
    from consistency.diagnose import tokens as token_words
    from consistency.diagnose.engine import explain
    from consistency.diagnose.report import build
    from consistency.dump.sets import open_side

    tol = req.tolerance_model()
    con = load_contract(req.contract) if isinstance(req.contract, (str, os.PathLike)) else req.contract
    ids = list(req.layer_ids) if req.layer_ids is not None else None
    ref_ids = list(req.ref_layer_ids) if req.ref_layer_ids is not None else None
    cand_ids = list(req.cand_layer_ids) if req.cand_layer_ids is not None else None
    conv = req.convention
    notes: list[str] = []
    with ExitStack() as stack:
        ref = stack.enter_context(open_side(req.reference, ref_ids if ref_ids is not None else ids, conv))
        cand = stack.enter_context(open_side(req.candidate, cand_ids if cand_ids is not None else ids, conv))
        declared, dnotes = declare_ids(ref, ids, ref_ids, conv)
        notes += dnotes + apply_ids(cand, ids, cand_ids, conv, "--cand-layer-ids")
        if con is not None:
            from consistency.compare.plan import declared_from_contract

            declared = declared_from_contract(con)[0]
        declared = with_consumer(declared, req.consumer)
        ref, note = read_for(ref, declared, stack)
        notes += note
        # stitch multi-capture names, align tokens by input_ids, compare only aligned rows
        tokenizer = req.tokenizer
        if isinstance(tokenizer, str):
            from consistency.compare.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(tokenizer)
        labels = (token_words.side_label(ref, "reference"), token_words.side_label(cand, "candidate"))
        raw = (ref, cand)
        ref, cand, alignment = prepare(ref, cand, tokenizer, same_context_only=True)
        # the recorders' own words (read before stitching), with what stitching could not pair
        drops = dropped(raw[0], "reference", ref) + dropped(raw[1], "candidate", cand)
        cmp = compare(ref, cand, con, tol, progress=req.progress, declared=declared)
        alignment = context_by_values(alignment, cmp.results)  # a capture without positions: the values decide
        tok = token_words.findings(alignment, labels[0], labels[1], tokenizer)
        findings, st = explain(cmp)
        findings = drops + token_words.reconcile(findings, alignment, tok)  # an incomplete recording leads
        notes += mtp_hint(cmp, declared)
        return build(cmp, findings, st, alignment, notes)


def with_consumer(declared: Any, kind: str | None) -> Any:
    """``--consumer KIND``: the draft the user declares, as that method's majority serving
    behaviour (a contract's own consumer, when it names one, is kept)."""
    if kind is None or declared.consumer is not None:
        return declared
    from dataclasses import replace

    from consistency.compare.sides import declared_consumer_of

    return replace(declared, consumer=declared_consumer_of(kind), origin=declared.origin or f"--consumer {kind}")


def read_for(ref: Any, declared: Any, stack: ExitStack) -> tuple[Any, list[str]]:
    """A training file two drafts read differently (speculators: EAGLE-3 the first slots, MTP
    the last) is read the way the declared draft reads it."""
    from consistency.compare.expect import LAST_STATE

    c = declared.consumer
    if c is None or c.kind not in LAST_STATE:
        return ref, []
    from consistency.dump.formats.speculators import as_mtp  # only for a declared last-state draft

    out = as_mtp(ref)
    if out is ref:
        return ref, []
    stack.callback(out.close)
    return out, [f"{ref.path.name}: read as speculators MTP training data ({declared.origin or 'the contract'} "
                 "declares an MTP draft): its last slot is the draft's input"]


def mtp_hint(cmp: Any, declared: Any) -> list[str]:
    """A speculators file of several slots read the EAGLE-3 way against a candidate whose one
    slot holds the file's last slot: what speculators' MTP trainer feeds. The candidate
    cannot decide that (its claims are never trusted); the user can, so say how."""
    ref = cmp.ref
    if getattr(ref, "format", None) != "speculators" or getattr(ref, "mtp_reading", True) or declared.consumer:
        return []
    slots = [r for r in cmp.results if r.slot is not None]
    last = next((n for n in ref.tensors if n.startswith("hidden.") or n == "verifier_last_hidden_states"), None)
    if len(slots) != 1 or last is None or slots[0].holds is None or slots[0].holds != cmp.canonical(last):
        return []
    return [f"{ref.path.name} is speculators training data read as EAGLE-3 (its first slots feed the draft); the "
            f"candidate's one slot holds its last slot ({last}), which speculators' MTP trainer feeds an MTP draft: "
            "if this draft is MTP, declare it (--consumer mtp) to verify it as one"]


def declare_ids(d: Any, common: list[int] | None, own: list[int] | None, convention: str | None) -> tuple[Any, list[str]]:
    """The user's ids for the reference as a declaration (compare.types.Declared), never
    written into the file's metadata: its own claims outrank them. Common ids declare only
    for a reference that records none; ``--ref-layer-ids`` always (a disagreement with what
    the reference records is then a conflict). Foreign readers already took the ids."""
    from consistency.compare.types import Declared, Meaning
    from consistency.dump.formats.base import ForeignDump, resolve_claims

    ids = own if own is not None else common
    if ids is None or isinstance(d, ForeignDump):
        return Declared(), []
    meta = d.metadata
    recorded = meta.aux.stream_ids if meta is not None and meta.aux is not None else None
    n_layers = meta.model.num_layers if meta is not None and meta.model is not None else None
    flag = "--ref-layer-ids" if own is not None else "--layer-ids"
    claims = resolve_claims(d.path, ids, convention, "stream", sorted_slots=False, num_layers=n_layers,
                            slots=sum(x[:4] == "aux." and x[4:].isdigit() for x in d.tensors) or None, what=flag)
    streams = claims.streams or []
    if recorded and own is None:
        if list(recorded) != list(streams):
            return Declared(), [f"{d.path.name} records streams {list(recorded)}; --layer-ids {ids} not applied to "
                                f"it (use --ref-layer-ids to declare them, which its own record outranks)"]
        return Declared(), []
    return Declared(tuple(Meaning(s) for s in streams), None, f"{flag} {ids}"), \
        [f"{d.path.name}: streams {streams} declared by {flag} {ids}"] + list(claims.notes)


def apply_ids(d: Any, common: list[int] | None, own: list[int] | None, convention: str | None, flag: str) -> list[str]:
    """The candidate's claims as the user states them (``--cand-layer-ids``, or common ids
    for a candidate that records none): claims are only ever compared with the candidate's
    values, so writing them into its metadata decides nothing (foreign readers already took
    them)."""
    from consistency.dump.formats.base import ForeignDump, resolve_claims

    ids = own if own is not None else common
    if ids is None or isinstance(d, ForeignDump):
        return []
    meta = d.metadata
    recorded = meta.aux.stream_ids if meta is not None and meta.aux is not None else None
    n_layers = meta.model.num_layers if meta is not None and meta.model is not None else None
    claims = resolve_claims(d.path, ids, convention, "stream", sorted_slots=False, num_layers=n_layers,
                            slots=sum(x[:4] == "aux." and x[4:].isdigit() for x in d.tensors) or None,
                            what=flag if own is not None else "--layer-ids")
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


def dropped(d: Any, side: str, stitched: Any = None) -> list[Finding]:
    """CAPTURES_DROPPED when a dump's metadata says its recorder left captures out (a full
    host ring, a graph-buffer budget, a host value inside a CUDA graph): those rows were not
    compared, so the verdict can never pass on them. Read defensively (a hostile file).
    ``stitched`` (the dump as compared) says which forward passes pairing by graph tags left
    out (dump.passes): every name of a pass some name lacks."""
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
    left = _left_out(stitched)
    return [Finding.make("CAPTURES_DROPPED", f"the {side}'s recorder did not record {sum(counts.values())} "
                         f"capture(s){why}: {shown}; what they held was not compared{_left_words(left)}",
                         metrics={"dropped": dict(sorted(counts.items())[:64]), "side": side,
                                  **({"left_out": left} if left else {})})]


def _left_out(stitched: Any) -> dict | None:
    meta = getattr(stitched, "metadata", None)
    st = meta.extra.get("stitched") if meta is not None and isinstance(meta.extra, dict) else None
    got = st.get("left_out") if isinstance(st, dict) else None
    return got if isinstance(got, dict) else None


def _left_words(left: dict | None) -> str:
    """Which passes pairing by graph tags left out, and which names fit no pass."""
    if not left:
        return ""
    out = ""
    if left.get("passes"):
        where = ", ".join(f"{g} x{n}" for g, n in left.get("graphs", {}).items())
        lack = ", ".join(sorted(left.get("lacking", {})))
        out += (f"; the rest paired by graph tags and replay numbers: {left['passes']} of {left['of']} forward "
                f"passes ({where}) lack {lack} and were left out for every name, the other "
                f"{left['of'] - left['passes']} compared")
    if left.get("names"):
        out += f"; {', '.join(left['names'])} fit no forward pass by their graph tags and were not compared at all"
    return out
