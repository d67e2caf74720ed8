"""Before comparing: stitch both sides' captures, align their tokens, keep the common ones.

``prepare(ref, cand)`` is the one call between opening two dumps and comparing them::

    ref_v, cand_v, alignment = prepare(ref, cand, tokenizer=None, same_context_only=True)
    cmp = compare(ref_v, cand_v, ...)
    findings, story = explain(cmp)
    findings = diagnose.tokens.reconcile(findings, alignment, tok_findings)   # the token findings first

Both views are lazy (:mod:`consistency.dump.rows`): only the aligned rows are ever read,
in the same order on both sides, so every tensor pair the engine measures holds the same
tokens. Dumps that already hold the same tokens come back unchanged.

A context difference (tokens in front that only one side has, a change earlier in the
request) moves every later state a little. ``same_context_only`` compares only tokens whose
context is the same on both sides when there are any (so a real fault is still diagnosed
exactly); when there are none, ``consistency.diagnose.tokens.reconcile`` demotes the per-slot
value findings to ``info`` ("not evaluated, the tokens' context differs") and
``CONTEXT_DIFFERS`` is the error.

Zero compared tokens never passes: when both sides have ids and none align, the views
are returned *unrestricted* (the engine then fails on shapes or values on its own) and
``NO_COMMON_TOKENS`` (an error, worded by consistency.diagnose.tokens) says why.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from types import MappingProxyType
from typing import Any

import numpy as np

from consistency.compare.tokenizer import load_tokenizer
from consistency.compare.tokens import Side, TokenAlignment, align
from consistency.compare.types import Note
from consistency.dump import names
from consistency.dump.reader import Dump, TensorView
from consistency.dump.rows import ViewDump, restrict
from consistency.dump.stitch import Layout, stitch
from consistency.errors import InputError

MAX_REQUEST_PAIRS = 65_536  # every candidate request is tried against every reference request


def _side(label: str, lay: Layout) -> Side | None:
    if lay.ids is None:
        return None
    return Side(label, lay.ids, lay.positions, lay.bounds(), [s.request for s in lay.segments],
                declared=lay.declared)


def prepare(ref: Dump, cand: Dump, tokenizer: Any = None, *,
            same_context_only: bool = False) -> tuple[Dump, Dump, TokenAlignment]:
    """(reference view, candidate view, alignment); see the module docstring.

    ``tokenizer``: a transformers tokenizer, or a path (directory / ``.gguf``) to load one
    from, used only to decode unaligned spans. ``same_context_only``: restrict to tokens
    whose context is the same on both sides, when there are any (an opt-in for callers
    that want exact comparisons despite, say, a template difference).
    """
    if isinstance(tokenizer, str):
        tokenizer = load_tokenizer(tokenizer)
    ref_v, ref_lay = stitch(ref)
    cand_v, cand_lay = stitch(cand)
    ref_v, cand_v = flat_ids(ref_v, ref_lay.tokens), flat_ids(cand_v, cand_lay.tokens)
    rs, cs = _side("reference", ref_lay), _side("candidate", cand_lay)
    if rs is not None and cs is not None and len(rs.bounds) * len(cs.bounds) > MAX_REQUEST_PAIRS:
        raise InputError(cand.path, f"{len(cs.bounds)} candidate requests against {len(rs.bounds)} reference requests: "
                         f"more than {MAX_REQUEST_PAIRS} pairs to align; record fewer requests per dump")
    if rs is None or cs is None:
        al = _without_ids(ref_lay, cand_lay)
    else:
        al = align(rs, cs, tokenizer)
    gaps = tuple(Note.of("positions_gap", tensor=g.where, first=g.first, last=g.last)
                 for g in list(ref_lay.gaps) + list(cand_lay.gaps))
    stitching = {side: lay.verify.as_dict() for side, lay in (("reference", ref_lay), ("candidate", cand_lay))
                 if lay.verify.any}
    al = replace(al, notes=gaps + al.notes, stitching=MappingProxyType(stitching))
    if al.method == "none" or _whole(al, ref_lay, cand_lay):
        return ref_v, cand_v, al
    keep = np.ones(al.compared, bool)
    unknown = al.unknown if len(al.unknown) == al.compared else np.zeros(al.compared, bool)
    if same_context_only and al.context_differs and int((~al.context | unknown).sum()) < al.compared \
            and al.same_context_rows:
        keep = ~al.context | unknown  # tokens whose context is unproven are compared: their values decide
        al = replace(al, only_same_context=not unknown.any(), notes=al.notes + (
            Note.of("same_context_only", kept=int(keep.sum()), unproven=bool(unknown.any())),))
    ref_out = restrict(ref_v, al.ref_rows[keep], ref_lay.tokens, "aligned tokens")
    cand_out = restrict(cand_v, al.cand_rows[keep], cand_lay.tokens, "aligned tokens")
    return ref_out, cand_out, al


def flat_ids(d: Dump, tokens: int) -> Dump:
    """``input_ids`` as the token axis it is: a ``[1, T]`` (or ``[B, T]``) batch of ids is
    the ``[T]`` (``[B*T]``) tokens the states' rows are, so ``[1, T]`` against ``[T]`` is the
    same tokens, not a shape mismatch. Ids are small (one integer a token): read once."""
    v = d.tensors.get(names.INPUT_IDS)
    if v is None or len(v.shape) < 2 or v.numel != tokens or v.rows == tokens:
        return d
    arr = np.ascontiguousarray(v.read_all().reshape(-1))
    flat = TensorView(v.name, v.dtype, (tokens,), arr.dtype, None, 0, v.path, array=arr)
    return ViewDump(d, {**d.tensors, names.INPUT_IDS: flat}, fmt=d.format)


def context_by_values(al: TokenAlignment, results: Iterable[Any]) -> TokenAlignment:
    """A capture without positions that lacks the reference's first tokens (a prefix-cache
    hit, or a prompt really cut short): the values decide. A deep state equal to the
    reference's at the same tokens within noise saw the same context (a different context
    moves every later state), so the unproven tokens' context is the same and the missing
    prefix was in the candidate's cache. Embedding-only evidence (stream 0) proves nothing.
    Returns ``al`` unchanged when nothing is unproven or the values do not prove it."""
    unknown = al.unknown if len(al.unknown) == al.compared else np.zeros(al.compared, bool)
    if not unknown.any():
        return al
    results = list(results)
    proof = [r for r in results if _within_noise(r) and _context_dependent(r)]
    if not proof:
        from consistency.compare.types import CHECKED

        read = any(r.status in CHECKED and r.holds_stream != 0 and r.cand.is_float for r in results)
        return replace(al, prefix_values="differ") if read else al
    starts = [s for s in al.missing if s.where in ("start", "whole")]
    fronts = [s for s in al.extra if s.where == "start"]  # the reference lacks them (it is the serving capture)
    out = replace(al, context=al.context & ~unknown, unknown=np.zeros_like(unknown),
                  missing=tuple(s for s in al.missing if s not in starts), uncaptured=al.uncaptured + tuple(starts),
                  not_captured=al.not_captured + sum(s.length for s in starts),
                  extra=tuple(s for s in al.extra if s not in fronts), ref_uncaptured=al.ref_uncaptured + tuple(fronts),
                  cached_by_values=sum(s.length for s in starts + fronts), prefix_values="same")
    shown = tuple(sorted({str(r.name) for r in proof})[:4])
    who = "reference" if fronts and not starts else "candidate"
    return replace(out, notes=out.notes + (Note.of("context_by_values", side=who, shown=shown,
                                                   cached=bool(starts or fronts)),))


def _context_dependent(r: Any) -> bool:
    """A float state that depends on earlier tokens: not ids, not an embedding row."""
    from consistency.dump import names

    if r.holds is None or not r.cand.is_float or r.cand.cols < 2 or r.holds_stream == 0:
        return False
    return names.parse(r.holds).kind not in (names.DRAFT_EMBED, names.DRAFT_IDS, names.INPUT_IDS)


def _within_noise(r: Any) -> bool:
    """A slot whose rows all agree: one with bad rows (BAD_TOKENS, its first rows off after a
    dropped BOS) is itself wrong and proves no context, however close its other rows are."""
    from consistency.compare.types import Status

    return ((r.status == Status.ok and not r.tolerated) or bool(r.matched)) and r.status != Status.bad_tokens


def _whole(al: TokenAlignment, ref_lay: Layout, cand_lay: Layout) -> bool:
    """Every token of both sides, in order: nothing to restrict."""
    n = al.compared
    return n == ref_lay.tokens == cand_lay.tokens and bool(
        np.array_equal(al.ref_rows, np.arange(n)) and np.array_equal(al.cand_rows, np.arange(n)))


def _without_ids(ref_lay: Layout, cand_lay: Layout) -> TokenAlignment:
    """No ids on one side: positions if both have them (one request each), else rows."""
    n_r, n_c = ref_lay.tokens, cand_lay.tokens
    empty = np.zeros(0, np.int64)
    if ref_lay.positions is not None and cand_lay.positions is not None and \
            len(ref_lay.segments) == 1 and len(cand_lay.segments) == 1:
        common, ir, ic = np.intersect1d(ref_lay.positions, cand_lay.positions, return_indices=True)
        return TokenAlignment(ir.astype(np.int64), ic.astype(np.int64), n_r, n_c,
                              "positions" if len(common) else "none", context=np.zeros(len(common), bool),
                              ids_checked=False, notes=(Note.of("no_ids_by_position"),))
    if n_r == n_c:
        return TokenAlignment(np.arange(n_r), np.arange(n_c), n_r, n_c, "rows", context=np.zeros(n_r, bool),
                              ids_checked=False, notes=(Note.of("no_ids_by_rows"),))
    return TokenAlignment(empty, empty, n_r, n_c, "none", ids_checked=False,
                          notes=(Note.of("no_ids_unaligned", ref_tokens=n_r, cand_tokens=n_c),))
