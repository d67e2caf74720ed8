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

from typing import Any

import numpy as np

from consistency.compare.tokenizer import load_tokenizer
from consistency.compare.tokens import Side, TokenAlignment, align
from consistency.dump.reader import Dump
from consistency.dump.rows import restrict
from consistency.dump.stitch import Layout, stitch
from consistency.errors import InputError

MAX_REQUEST_PAIRS = 65_536  # every candidate request is tried against every reference request


def _side(label: str, lay: Layout) -> Side | None:
    if lay.ids is None:
        return None
    return Side(label, lay.ids, lay.positions, lay.bounds(), [s.request for s in lay.segments])


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
    rs, cs = _side("reference", ref_lay), _side("candidate", cand_lay)
    if rs is not None and cs is not None and len(rs.bounds) * len(cs.bounds) > MAX_REQUEST_PAIRS:
        raise InputError(cand.path, f"{len(cs.bounds)} candidate requests against {len(rs.bounds)} reference requests: "
                         f"more than {MAX_REQUEST_PAIRS} pairs to align; record fewer requests per dump")
    if rs is None or cs is None:
        al = _without_ids(ref_lay, cand_lay)
    else:
        al = align(rs, cs, tokenizer)
    al.notes = ref_lay.notes + cand_lay.notes + al.notes
    if al.method == "none" or _whole(al, ref_lay, cand_lay):
        return ref_v, cand_v, al
    keep = np.ones(al.compared, bool)
    if same_context_only and al.context_differs and al.same_context_rows:
        keep = ~al.context
        al.only_same_context = True
        al.notes.append(f"compared only the {int(keep.sum())} tokens whose context is the same on both sides")
    ref_out = restrict(ref_v, al.ref_rows[keep], ref_lay.tokens, "aligned tokens")
    cand_out = restrict(cand_v, al.cand_rows[keep], cand_lay.tokens, "aligned tokens")
    return ref_out, cand_out, al


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
        al = TokenAlignment(ir.astype(np.int64), ic.astype(np.int64), n_r, n_c, "positions" if len(common) else "none")
        al.context, al.ids_checked = np.zeros(len(common), bool), False
        al.notes.append("no input_ids on one side: tokens paired by position, their ids unchecked")
        return al
    if n_r == n_c:
        al = TokenAlignment(np.arange(n_r), np.arange(n_c), n_r, n_c, "rows")
        al.context, al.ids_checked = np.zeros(n_r, bool), False
        al.notes.append("no input_ids on one side: rows paired in order, their ids unchecked")
        return al
    al = TokenAlignment(empty, empty, n_r, n_c, "none", ids_checked=False)
    al.notes.append(f"no input_ids on one side and {n_r} vs {n_c} tokens: the tokens could not be aligned")
    return al
