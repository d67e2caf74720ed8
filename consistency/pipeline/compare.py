"""The compare front door: one :class:`~consistency.compare.request.CompareRequest` in, one
:class:`~consistency.contract.findings.CompareReport` out.

The CLI, the gate, the demo, the Python API and the pytest helper all call :func:`run`, so
every entry point reaches the same verdict on the same inputs (no command imports another
command). It sits above both ``compare`` (numbers) and ``diagnose`` (words) and runs their
stages in order; each stage returns a value the next one reads:

    open sides -> claims (the user's ids, contract, consumer) -> prepare (anchors checked,
    captures stitched, tokens aligned) -> compare -> context_by_values -> explain -> report

The request travels whole: no stage is handed a loose copy of its options. What the user
declares becomes values (:mod:`consistency.pipeline.claims`), never writes into a dump the
caller holds, and a dump the caller opened is neither written nor closed here.
"""

from __future__ import annotations

import os
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

from consistency.compare.request import CompareRequest
from consistency.compare.types import Pair
from consistency.pipeline.claims import CANDIDATE, REFERENCE, carrying, claims_of, declaration

if TYPE_CHECKING:
    from consistency.compare.types import Declared
    from consistency.contract.findings import CompareReport
    from consistency.dump.reader import Dump


def compare(reference: Any, candidate: Any, **options: Any) -> CompareReport:
    """Compare REFERENCE (what the draft was trained on) with CANDIDATE (what it is fed);
    ``options`` are :class:`CompareRequest`'s fields (an unknown one is a usage error)."""
    return run(CompareRequest.build(reference, candidate, **options))


def run(req: CompareRequest) -> CompareReport:
    """The stages, in order. ``layer_ids`` describe each side that does not record its own
    ids; ``ref_layer_ids`` declare what the reference holds (its own values and claims
    outrank them: a disagreement is CONTRACT_CONFLICT); ``cand_layer_ids`` say what the
    candidate claims (compared with its values, never trusted). Several captures of a name
    (chunked prefill, decode steps) are stitched and the two sides' tokens aligned by
    ``input_ids`` first; ``tokenizer`` (an object or a local path) only decodes unaligned
    spans."""
    from consistency.compare.anchors import check as check_anchors
    from consistency.compare.engine import compare as compare_values
    from consistency.compare.prepare import context_by_values, prepare
    from consistency.diagnose import recorded
    from consistency.diagnose import tokens as token_words
    from consistency.diagnose.engine import explain
    from consistency.diagnose.report import build

    tol = req.tolerance_model()
    contract = load_contract(req.contract) if isinstance(req.contract, (str, os.PathLike)) else req.contract
    with ExitStack() as stack:
        # open both sides (only what is opened here is closed here)
        ref = _open(req.reference, req.ref_layer_ids, req, stack)
        cand = _with_n(_open(req.candidate, req.cand_layer_ids, req, stack), ref, stack)
        # what the user declares and claims: values, read from the request and the sides
        claims = Pair(claims_of(ref, REFERENCE, req), claims_of(cand, CANDIDATE, req))
        declared, contract_notes = declaration(claims.ref, contract, req)
        cand = carrying(cand, claims.cand)
        notes: list[Any] = [n for c in (claims.ref, claims.cand) if c is not None for n in c.notes] + contract_notes
        ref, note = read_for(ref, declared, stack)
        notes += note
        tokenizer = _tokenizer(req.tokenizer)
        labels = (token_words.side_label(ref, "reference"), token_words.side_label(cand, "candidate"))
        raw = (ref, cand)  # the recorders' own words are read from these, before stitching
        # prepare: anchors checked before any row is paired by them; captures stitched; tokens aligned
        checked, problems = check_anchors(Pair(ref, cand))
        ref, cand, alignment = prepare(checked.ref, checked.cand, tokenizer, same_context_only=True)
        drops = (recorded.dropped(raw[0], "reference", ref) + recorded.dropped(raw[1], "candidate", cand)
                 + recorded.refuted_anchors(problems))
        cmp = compare_values(ref, cand, contract, tol, progress=req.progress, declared=declared)
        alignment = context_by_values(alignment, cmp.results)  # a capture without positions: the values decide
        # explain and report: words, from the values above
        tok = token_words.findings(alignment, labels[0], labels[1], tokenizer)
        findings, st = explain(cmp)
        findings = drops + token_words.reconcile(findings, alignment, tok)  # an incomplete recording leads
        notes += recorded.mtp_hint(cmp, declared)
        return build(cmp, findings, st, alignment, notes)


def load_contract(path: str | os.PathLike[str] | None) -> Any:
    if path is None:
        return None
    from consistency.contract.io import read_contract

    return read_contract(path)


def _open(spec: Any, own_ids: tuple[int, ...] | None, req: CompareRequest, stack: ExitStack) -> Dump:
    """One side; a foreign reader takes the side's ids (its own, else the common ones)."""
    from consistency.dump.reader import Dump
    from consistency.dump.sets import open_side

    ids = own_ids if own_ids is not None else req.layer_ids
    d = open_side(spec, list(ids) if ids is not None else None, req.convention)
    return d if isinstance(spec, Dump) else stack.enter_context(d)  # the caller's own dump stays open


def _with_n(cand: Dump, ref: Dump, stack: ExitStack) -> Dump:
    """A vLLM extract_hidden_states candidate whose ids end with the reference's N holds the
    verifier's last state there, not a draft slot (contract/ids.py split_appended)."""
    from consistency.dump.formats.vllm_hidden import with_target_layers

    meta = getattr(ref, "metadata", None)
    n = meta.model.num_layers if meta is not None and meta.model is not None else None
    again = with_target_layers(cand, n) if getattr(cand, "format", None) == "vllm-extract-hidden-states" else None
    return stack.enter_context(again) if again is not None else cand


def read_for(ref: Dump, declared: Declared, stack: ExitStack) -> tuple[Dump, list[str]]:
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


def _tokenizer(tokenizer: Any) -> Any:
    if isinstance(tokenizer, str):
        from consistency.compare.tokenizer import load_tokenizer

        return load_tokenizer(tokenizer)
    return tokenizer
