"""The compare pipeline as a library function: open both sides, compare, diagnose, report.

The CLI, the gate, the demo, the Python API and the pytest helper all call :func:`run`,
so every entry point reaches the same verdict on the same inputs (no command imports
another command).
"""

from __future__ import annotations

import os
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

from consistency.contract.codes import C
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
        cand = _with_n(cand, ref, stack)
        declared, dnotes = declare_ids(ref, ids, ref_ids, conv)
        cand, cnotes = apply_ids(cand, ids, cand_ids, conv, "--cand-layer-ids")
        notes += dnotes + cnotes
        if con is not None:
            from consistency.compare.plan import declared_from_contract
            from consistency.compare.sides import combine_declared
            from consistency.diagnose.words import note as word

            declared, cnote = combine_declared(declared, declared_from_contract(con)[0],
                                               os.fspath(req.contract) if isinstance(req.contract, (str, os.PathLike))
                                               else "given")
            notes += [word(n) for n in cnote]
        declared = with_consumer(declared, req.consumer)
        ref, note = read_for(ref, declared, stack)
        notes += note
        # stitch multi-capture names, align tokens by input_ids, compare only aligned rows
        tokenizer = req.tokenizer
        if isinstance(tokenizer, str):
            from consistency.compare.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(tokenizer)
        labels = (token_words.side_label(ref, "reference"), token_words.side_label(cand, "candidate"))
        raw = (ref, cand)  # the recorders' own words are read from these, before stitching
        ref, cand, false_anchors = checked_anchors(ref, cand)  # claims checked before any row is paired by them
        ref, cand, alignment = prepare(ref, cand, tokenizer, same_context_only=True)
        # the recorders' own words (read before stitching), with what stitching could not pair
        drops = dropped(raw[0], "reference", ref) + dropped(raw[1], "candidate", cand) + false_anchors
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
    if len(slots) != 1 or last is None or slots[0].holds is None or slots[0].holds != cmp.name_by_values(last):
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
    slots = sum(x[:4] == "aux." and x[4:].isdigit() for x in d.tensors) or None
    ids, appended = _appended(ids, n_layers, convention, slots)
    claims = resolve_claims(d.path, ids, convention, "stream", sorted_slots=False, num_layers=n_layers,
                            slots=slots, what=flag)
    claims.notes[:0] = appended
    streams = claims.streams or []
    if recorded and own is None:
        if list(recorded) != list(streams):
            return Declared(), [f"{d.path.name} records streams {list(recorded)}; --layer-ids {ids} not applied to "
                                f"it (use --ref-layer-ids to declare them, which its own record outranks)"]
        return Declared(), []
    return Declared(tuple(Meaning(s) for s in streams), None, f"{flag} {ids}"), \
        [f"{d.path.name}: streams {streams} declared by {flag} {ids}"] + list(claims.notes)


def apply_ids(d: Any, common: list[int] | None, own: list[int] | None, convention: str | None,
              flag: str) -> tuple[Any, list[str]]:
    """The candidate's claims as the user states them (``--cand-layer-ids``, or common ids
    for a candidate that records none): claims are only ever compared with the candidate's
    values, so carrying them decides nothing (foreign readers already took them). They go
    on a shallow copy of the dump, never into the caller's: an in-memory dump compared
    again must not carry claims it never made."""
    from consistency.dump.formats.base import ForeignDump, resolve_claims

    ids = own if own is not None else common
    if ids is None or isinstance(d, ForeignDump):
        return d, []
    meta = d.metadata
    recorded = meta.aux.stream_ids if meta is not None and meta.aux is not None else None
    n_layers = meta.model.num_layers if meta is not None and meta.model is not None else None
    slots = sum(x[:4] == "aux." and x[4:].isdigit() for x in d.tensors) or None
    ids, appended = _appended(ids, n_layers, convention, slots)
    claims = resolve_claims(d.path, ids, convention, "stream", sorted_slots=False, num_layers=n_layers,
                            slots=slots, what=flag if own is not None else "--layer-ids")
    claims.notes[:0] = appended
    streams = claims.streams
    if recorded and own is None:
        if list(recorded) != list(streams or []):
            return d, [f"{d.path.name} records streams {list(recorded)}; --layer-ids {ids} not applied to it "
                       f"(use {flag} to override)"]
        return d, []
    import copy

    from consistency.contract.models import AuxInfo, DumpMetadata

    meta = meta.model_copy(deep=True) if meta is not None else DumpMetadata()
    meta.aux = (meta.aux or AuxInfo()).model_copy(update={"stream_ids": streams, "native_ids": ids,
                                                          "convention": claims.convention})
    out = copy.copy(d)  # the caller's dump keeps its own metadata; closing stays with the original
    out.metadata = meta
    what = f"{d.path.name}: streams {streams} from {flag if own is not None else '--layer-ids'} {ids}"
    return out, [what + (f" (it recorded {list(recorded)})" if recorded else "")] + list(claims.notes)


def checked_anchors(ref: Any, cand: Any) -> tuple[Any, Any, list[Finding]]:
    """TOKEN_INDEX_FALSE for each ``token_index`` the values refute (compare/anchors.py);
    the sides come back with those anchors dropped, so the rows pair by order and the values
    decide: a refuted claim is a finding, never a pairing."""
    from consistency.compare.anchors import check
    from consistency.compare.types import Pair
    from consistency.contract.findings import Finding

    sides, problems = check(Pair(ref, cand))
    out = []
    for p in problems:
        x = p.detail
        if p.kind == "positions":
            why = (f"{x['differ']} of its {x['rows']} rows claim other anchors than the positions of the forward pass "
                   f"they belong to (row {x['row']}: anchor {x['anchor']}, position {x['position']})")
        elif p.kind == "absent":
            why = (f"{x['count']} row(s) claim anchors its forward pass does not hold (row {x['row']}: anchor "
                   f"{x['anchor']}; the pass holds positions {x['span'][0]}..{x['span'][1]})")
        elif p.kind == "repeat":
            why = (f"anchor {x['anchor']} is claimed by {x['times']} of its {x['rows']} rows, but the file holds "
                   f"{x['sequences']} sequence(s): one token's state cannot be {x['times']} rows")
        elif p.kind == "tokens":
            what = "the token at" if x["shift"] == 0 else "the token after"
            why = (f"{x['count']} of {x['checked']} rows hold other tokens than {what} their anchor in {x['by']} "
                   f"(row {x['row']}: anchor {x['anchor']} holds token {x['held']}, {x['by']} has "
                   f"{x['expected']}): the rows stand for other tokens than it claims")
        else:
            why = (f"it is row-aligned with {x['with']} (one step, one pass) but claims other anchors (row {x['row']}: "
                   f"{x['anchor']} against {x['other']})")
        out.append(Finding.make(C.TOKEN_INDEX_FALSE, f"the {p.side}'s token_index of {p.tensor[:80]} is refuted by "
                                f"values: {why}; its rows were paired by order, not by that claim",
                                tensor=p.tensor[:80], metrics={"side": p.side, "check": p.kind, **x}))
    return sides.ref, sides.cand, out


def _with_n(cand: Any, ref: Any, stack: ExitStack) -> Any:
    """A vLLM extract_hidden_states candidate whose ids end with the reference's N holds the
    verifier's last state there, not a draft slot (contract/ids.py split_appended)."""
    from consistency.dump.formats.vllm_hidden import with_target_layers

    meta = getattr(ref, "metadata", None)
    n = meta.model.num_layers if meta is not None and meta.model is not None else None
    again = with_target_layers(cand, n) if getattr(cand, "format", None) == "vllm-extract-hidden-states" else None
    return stack.enter_context(again) if again is not None else cand


def _appended(ids: list[int], n: int | None, convention: str | None, slots: int | None) -> tuple[list[int], list[str]]:
    """speculators' data-generation ids end with N, the verifier's last state (contract/ids.py): not a slot."""
    from consistency.contract.ids import split_appended

    aux, last, why = split_appended(ids, n, convention, slots)
    return aux, ([why] if last is not None else [])


def dropped(d: Any, side: str, stitched: Any = None) -> list[Finding]:
    """CAPTURES_DROPPED when a dump's metadata says its recorder left captures out (a full
    host ring, a graph-buffer budget, a host value inside a CUDA graph, a capture it refused:
    ``extra.refused_captures``): those rows were not compared, so the verdict can never pass
    on them. Read defensively (a hostile file). ``stitched`` (the dump as compared) says which
    forward passes pairing by graph tags left out (dump.passes): every name of a pass some name lacks."""
    from consistency.contract.findings import Finding
    from consistency.dump.sets import member_metadata

    counts: dict[str, int] = {}
    reasons: list[str] = []
    files: list[str] = []
    members = member_metadata(d)
    for label, meta in members:  # every rank of a set: rank 1's losses are as real as rank 0's
        got, why = _losses(meta)
        for name, n in got.items():
            counts[name] = counts.get(name, 0) + n
        reasons += [r for r in why if r not in reasons]
        if got and label:
            files.append(label)
    if not counts:
        return []
    shown = ", ".join(f"{k} x{v}" for k, v in sorted(counts.items())[:8]) + (", ..." if len(counts) > 8 else "")
    why = f" ({'; '.join(reasons[:4])})" if reasons else ""
    where = f" in {', '.join(files[:4])}{', ...' if len(files) > 4 else ''}" if len(members) > 1 else ""
    left = _left_out(stitched)
    return [Finding.make(C.CAPTURES_DROPPED, f"the {side}'s recorder did not record {sum(counts.values())} "
                         f"capture(s){where}{why}: {shown}; what they held was not compared{_left_words(left)}",
                         metrics={"dropped": dict(sorted(counts.items())[:64]), "side": side,
                                  **({"files": files[:64]} if where else {}),
                                  **({"left_out": left} if left else {})})]


def _losses(meta: Any) -> tuple[dict[str, int], list[str]]:
    """Captures one file's recorder says it left out: dropped (a full ring), not recorded
    inside a CUDA graph, refused (a name or dtype the dump could not hold). Read
    defensively: the metadata is the file's claim, and the file may be hostile."""
    extra = meta.extra if meta is not None and isinstance(meta.extra, dict) else {}
    counts: dict[str, int] = {}
    reasons: list[str] = []
    flat = extra.get("dropped_captures")
    graph = extra.get("cuda_graphs", {}).get("not_recorded") if isinstance(extra.get("cuda_graphs"), dict) else None
    refused = extra.get("refused_captures")
    for source in ([flat] if isinstance(flat, dict) else []) + (list(graph.values()) if isinstance(graph, dict) else []):
        for name, n in (source.items() if isinstance(source, dict) else ()):
            if isinstance(n, int) and not isinstance(n, bool) and n > 0:
                counts[str(name)[:80]] = max(counts.get(str(name)[:80], 0), n)
    for name, entry in (refused.items() if isinstance(refused, dict) else ()):
        n = entry.get("count") if isinstance(entry, dict) else None
        if isinstance(n, int) and not isinstance(n, bool) and n > 0:
            counts[str(name)[:80]] = counts.get(str(name)[:80], 0) + n
            line = f"{str(name)[:40]} refused: {str(entry.get('reason'))[:100]}"
            if line not in reasons:
                reasons.append(line)
    if isinstance(graph, dict):
        reasons = [str(r)[:120] for r in list(graph)[:4]] + reasons
    return counts, reasons


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
