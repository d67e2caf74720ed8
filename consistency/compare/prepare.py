"""Before comparing: stitch both sides' captures, align their tokens, keep the common ones.

``prepare(ref, cand)`` is the one call between opening two dumps and comparing them::

    ref_v, cand_v, alignment = prepare(ref, cand, tokenizer=None, same_context_only=True)
    cmp = compare(ref_v, cand_v, ...)
    findings, summary = explain(cmp)
    findings = reconcile(findings, alignment)   # TOKENS_EXTRA / TOKENS_MISSING / CONTEXT_DIFFERS / NO_COMMON_TOKENS first

Both views are lazy (:mod:`consistency.dump.rows`): only the aligned rows are ever read,
in the same order on both sides, so every tensor pair the engine measures holds the same
tokens. Dumps that already hold the same tokens come back unchanged.

A context difference (tokens in front that only one side has, a change earlier in the
request) moves every later state a little. ``same_context_only`` compares only tokens whose
context is the same on both sides when there are any (so a real fault is still diagnosed
exactly); when there are none, :func:`reconcile` demotes the per-slot value findings to
``info`` ("not evaluated, the tokens' context differs") and ``CONTEXT_DIFFERS`` is the error.

Zero compared tokens never passes: when both sides have ids and none align, the views
are returned *unrestricted* (the engine then fails on shapes or values on its own) and
``NO_COMMON_TOKENS`` (an error) says why.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from consistency.compare.tokenizer import load_tokenizer
from consistency.compare.tokens import Side, Span, TokenAlignment, align
from consistency.contract.findings import Finding, Severity
from consistency.dump import names
from consistency.dump.reader import Dump
from consistency.dump.rows import restrict
from consistency.dump.stitch import Layout, stitch
from consistency.errors import InputError

MAX_REQUEST_PAIRS = 65_536  # every candidate request is tried against every reference request


def _side(label: str, lay: Layout) -> Side | None:
    if lay.ids is None:
        return None
    return Side(label, lay.ids, lay.positions, lay.bounds(), [s.request for s in lay.segments])


def _label(d: Dump, default: str) -> str:
    side = d.metadata.side if d.metadata else None
    return {"training": "training", "serving": "serving"}.get(side or "", default)


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
    rlabel, clabel = _label(ref, "reference"), _label(cand, "candidate")
    rs, cs = _side("reference", ref_lay), _side("candidate", cand_lay)
    if rs is not None and cs is not None and len(rs.bounds) * len(cs.bounds) > MAX_REQUEST_PAIRS:
        raise InputError(cand.path, f"{len(cs.bounds)} candidate requests against {len(rs.bounds)} reference requests: "
                         f"more than {MAX_REQUEST_PAIRS} pairs to align; record fewer requests per dump")
    if rs is None or cs is None:
        al = _without_ids(ref_lay, cand_lay)
    else:
        al = align(rs, cs, tokenizer)
    al.notes = ref_lay.notes + cand_lay.notes + al.notes
    al.findings = findings(al, rlabel, clabel, tokenizer)
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


# -- findings -------------------------------------------------------------------------------

def _count(n: int, adj: str = "") -> str:
    return f"{n} {adj + ' ' if adj else ''}token" + ("" if n == 1 else "s")


def _describe(sp: Span) -> str:
    bits = []
    if sp.special:
        bits.append("special " + ", ".join(repr(s) for s in sp.special[:6]))
    if sp.text:
        bits.append(f"text {sp.text[:120]!r}")
    elif not sp.special:
        bits.append(f"ids {sp.ids[:12]}" + ("..." if len(sp.ids) > 12 else ""))
    where = f"rows {sp.start}..{sp.stop - 1}"
    if sp.positions:
        where += f", positions {sp.positions[0]}..{sp.positions[-1]}"
    return f"({where}; {'; '.join(bits)})"


def findings(al: TokenAlignment, rlabel: str, clabel: str, tokenizer: Any = None) -> list[Finding]:
    """The alignment's own findings: what did not align, whether contexts differ, or that
    nothing aligned at all."""
    out: list[Finding] = []
    tensor = names.INPUT_IDS
    if al.method == "none" and al.ref_tokens and al.cand_tokens and al.ids_checked:
        out.append(Finding.make("NO_COMMON_TOKENS", f"the {clabel} side's {_count(al.cand_tokens)} and the {rlabel} "
                                f"side's {_count(al.ref_tokens)} share no run of tokens: different prompts, nothing "
                                "to compare", tensor=tensor, metrics={"reference_tokens": al.ref_tokens,
                                                                      "candidate_tokens": al.cand_tokens}))
        return out
    for sp in al.extra:
        out.append(_extra(sp, rlabel, clabel, tokenizer))
    for sp in al.missing:
        out.append(_missing(sp, rlabel, clabel))
    if al.context_differs:
        n = int(al.context.sum())
        lead = next((f"{clabel} has {_count(s.length, 'extra')} at the start" for s in al.extra if s.where == "start"), None) \
            or next((f"{clabel} lacks {_count(s.length)} at the start" for s in al.missing if s.where == "start"), None) \
            or "the token positions or earlier tokens differ"
        out.append(Finding.make(
            "CONTEXT_DIFFERS",
            f"{n} of {al.compared} compared tokens saw different tokens before them ({lead}); a causal model's "
            "state depends on every earlier token, so each later state differs a little for that reason alone, "
            "not because of a layer, a norm or a kernel",
            tensor=tensor, metrics={"compared": al.compared, "context_differs": n, "same_context": al.same_context_rows}))
    return out


def _extra(sp: Span, rlabel: str, clabel: str, tokenizer: Any) -> Finding:
    n = _count(sp.length)
    if sp.where == "end":
        msg = f"{clabel} has {n} after the {rlabel} side's last token {_describe(sp)}: decode steps the {rlabel} side did not run; not compared"
        sev = Severity.info
    elif sp.where == "start":
        what = "a BOS token" if _is_bos(sp, tokenizer) else f"a chat template or system prompt the {rlabel} side lacked"
        msg = f"{clabel} has {_count(sp.length, 'extra')} at the start {_describe(sp)}: {what}"
        sev = None
    elif sp.where == "whole":
        msg = f"{clabel} request {sp.segment!r} ({n}) matches no {rlabel} request {_describe(sp)}"
        sev = None
    else:
        msg = f"{clabel} has {_count(sp.length, 'extra')} in the middle {_describe(sp)}: tokens the {rlabel} side lacked"
        sev = None
    return Finding.make("TOKENS_EXTRA", msg, sev, tensor=names.INPUT_IDS,
                        metrics={"start": sp.start, "stop": sp.stop, "where": sp.where, "tokens": sp.length})


def _missing(sp: Span, rlabel: str, clabel: str) -> Finding:
    n = _count(sp.length)
    if sp.where == "end":
        msg = f"{rlabel} side continues for {n} after the {clabel} capture ends {_describe(sp)}; not compared"
        sev = Severity.info
    elif sp.where == "start":
        msg = (f"{clabel} lacks the {rlabel} side's first {n} {_describe(sp)}: a BOS or template dropped, or a "
               "prefix-cache hit recorded without positions (record positions to tell)")
        sev = None
    else:
        msg = f"{clabel} lacks {sp.length} of the {rlabel} side's tokens in the middle {_describe(sp)}"
        sev = None
    return Finding.make("TOKENS_MISSING", msg, sev, tensor=names.INPUT_IDS,
                        metrics={"start": sp.start, "stop": sp.stop, "where": sp.where, "tokens": sp.length})


def _is_bos(sp: Span, tokenizer: Any) -> bool:
    bos = getattr(tokenizer, "bos_token_id", None) if tokenizer is not None else None
    return sp.length == 1 and bos is not None and sp.ids[0] == bos


# value findings that a context difference alone can cause (identification included)
CONTEXT_SENSITIVE = frozenset({"UNKNOWN", "MISMATCH", "NUMERIC_DRIFT", "LAYER_MISMATCH", "LAYER_OFFSET", "ORDER_MISMATCH",
                               "SLOT_SHIFT", "NORM_APPLIED", "NORM_MISSING", "SCALE_MISMATCH", "TOKEN_SHIFT",
                               "RESIDUAL_MISSING", "IDENTIFICATION_AMBIGUOUS", "PARTIAL_SHARD"})


def reconcile(found: list[Finding], al: TokenAlignment) -> list[Finding]:
    """The alignment's findings first, then the comparison's; when every compared token saw
    a different context, value findings on states are demoted to ``info`` and say so (the
    context difference, an error itself, explains them; a layer story would mislead)."""
    out = list(al.findings)
    hit = al.context_differs and not al.only_same_context
    for f in found:
        if hit and f.code in CONTEXT_SENSITIVE and f.tensor != names.INPUT_IDS and f.severity != Severity.info:
            f = f.model_copy(update={"severity": Severity.info,
                                     "message": "not evaluated, the tokens' context differs (CONTEXT_DIFFERS): " + f.message})
        out.append(f)
    return out
