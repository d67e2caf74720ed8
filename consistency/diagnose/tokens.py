"""Word what token alignment decided (compare.prepare, compare.tokens): what did not align,
whether contexts differ, or that nothing aligned at all; and the demotion of per-state
findings when every compared token saw another context.
"""

from __future__ import annotations

from typing import Any

from consistency.compare.tokens import Replacement, Span, TokenAlignment
from consistency.contract.codes import C
from consistency.contract.findings import Finding, Severity, with_property
from consistency.dump import names
from consistency.dump.reader import Dump


def side_label(d: Dump, default: str) -> str:
    side = d.metadata.side if d.metadata else None
    return {"training": "training", "serving": "serving"}.get(side or "", default)


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
        out.append(Finding.make(C.NO_COMMON_TOKENS, f"the {clabel} side's {_count(al.cand_tokens)} and the {rlabel} "
                                f"side's {_count(al.ref_tokens)} share no run of tokens: different prompts, nothing "
                                "to compare", tensor=tensor, metrics={"reference_tokens": al.ref_tokens,
                                                                      "candidate_tokens": al.cand_tokens}))
        return out
    for side, facts in al.stitching.items():
        out.append(_verify(facts, rlabel if side == "reference" else clabel))
    for sp in al.extra:
        out.append(_extra(sp, rlabel, clabel, tokenizer))
    for sp in al.missing:
        out.append(_missing(sp, rlabel, clabel, al.unknown.any() and al.prefix_values == "differ"))
    for rep in al.replaced:
        out.append(_replaced(rep, rlabel, clabel))
    for sp in al.uncaptured:
        out.append(_uncaptured(sp, rlabel, clabel, al))
    for sp in al.ref_uncaptured:  # the reference is the serving capture: the same, the other way round
        out.append(_uncaptured(sp, clabel, rlabel, al))
    if al.context_differs:
        n = int(al.context.sum())
        lead = next((f"{clabel} has {_count(s.length, 'extra')} at the start" for s in al.extra if s.where == "start"), None) \
            or next((f"{clabel} lacks {_count(s.length)} at the start" for s in al.missing if s.where == "start"), None) \
            or next((f"the two sides hold other tokens from {rlabel} row {r.ref.start}" for r in al.replaced
                     if r.where != "end"), None) \
            or "the token positions or earlier tokens differ"
        out.append(Finding.make(
            C.CONTEXT_DIFFERS,
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
    return Finding.make(C.TOKENS_EXTRA, msg, sev, tensor=names.INPUT_IDS,
                        metrics={"start": sp.start, "stop": sp.stop, "where": sp.where, "tokens": sp.length})


def _missing(sp: Span, rlabel: str, clabel: str, disproved: bool = False) -> Finding:
    n = _count(sp.length)
    if sp.where == "end":
        msg = f"{rlabel} side continues for {n} after the {clabel} capture ends {_describe(sp)}; not compared"
        sev = Severity.info
    elif sp.where == "start" and disproved:
        msg = (f"{clabel} lacks the {rlabel} side's first {n} {_describe(sp)} and records no positions; its states "
               f"are not the {rlabel} side's at the same tokens, so they were computed without them (a truncated "
               "prompt, a BOS or template dropped), not read from a prefix cache")
        sev = None
    elif sp.where == "start":
        msg = (f"{clabel} lacks the {rlabel} side's first {n} {_describe(sp)}: a BOS or template dropped, or a "
               "prefix-cache hit recorded without positions (record positions to tell)")
        sev = None
    else:
        msg = f"{clabel} lacks {sp.length} of the {rlabel} side's tokens in the middle {_describe(sp)}"
        sev = None
    return Finding.make(C.TOKENS_MISSING, msg, sev, tensor=names.INPUT_IDS,
                        metrics={"start": sp.start, "stop": sp.stop, "where": sp.where, "tokens": sp.length})


def _replaced(rep: Replacement, rlabel: str, clabel: str) -> Finding:
    r, c = rep.ref, rep.cand
    both = f"{rlabel} {_count(r.length)} {_describe(r)} vs {clabel} {_count(c.length)} {_describe(c)}"
    pos = r.positions or c.positions
    at = f" (position {pos[0]})" if pos else ""
    if rep.where == "end":
        msg = (f"{clabel} went on differently from {rlabel} row {r.start}{at}: {both}; a sampled continuation (both "
               "sides diverge at one token), not decode steps or a shorter capture; the tokens before it are compared, "
               "neither continuation is")
        sev = Severity.info
    elif rep.where == "start":
        msg = f"the two sides begin with other tokens: {both}; a different preamble (template, system prompt)"
        sev = None
    else:
        msg = f"the two sides hold other tokens in the middle: {both}; an edit of the text (a replacement)"
        sev = None
    return Finding.make(C.TOKENS_REPLACED, msg, sev, tensor=names.INPUT_IDS,
                        metrics={"where": rep.where, "reference": [r.start, r.stop], "candidate": [c.start, c.stop],
                                 "reference_tokens": r.length, "candidate_tokens": c.length})


def _uncaptured(sp: Span, rlabel: str, clabel: str, al: TokenAlignment) -> Finding:
    n = _count(sp.length)
    if sp.where in ("start", "whole") and al.cached_by_values:
        msg = (f"a prefix-cache hit: the first {n} were not recomputed {_describe(sp)}; {clabel} records no positions, "
               f"but its states equal the {rlabel} side's at the same tokens within noise, so they saw the same context")
    elif sp.where in ("start", "whole"):
        msg = (f"a prefix-cache hit: the first {n} were not recomputed {_describe(sp)}; {clabel}'s positions start "
               "where they end, so its tokens saw them")
    else:
        msg = (f"{clabel} did not record {n} of the {rlabel} side's {_describe(sp)}; its positions continue across "
               "them (tokens another data-parallel rank holds, or a pass not captured), so later tokens saw them")
    return Finding.make(C.NOT_CAPTURED, msg, tensor=names.INPUT_IDS,
                        metrics={"start": sp.start, "stop": sp.stop, "where": sp.where, "tokens": sp.length,
                                 "by_values": bool(al.cached_by_values and sp.where in ("start", "whole"))})


def _verify(v: dict, label: str) -> Finding:
    bits = [f"{v['rewinds']} verify pass{'es' if v['rewinds'] != 1 else ''} rewound into the drafted rows of the pass "
            f"before, superseding {v['superseded']} row{'s' if v['superseded'] != 1 else ''} of rejected drafts (recomputed by "
            "the next pass)"]
    if v["unconfirmed"]:
        bits.append(f"{_count(v['unconfirmed'])} drafted by the last verify pass of a request were not kept: no later "
                    "pass shows which were accepted")
    if v["ambiguous"]:
        bits.append(f"{_count(v['ambiguous'])} at positions one pass held twice (a tree of drafts) were not kept: "
                    "which row was accepted cannot be told")
    ex = "; ".join(f"{e['request']} at position {e['position']} in {e['pass']} ({e['rows']} superseded)"
                   for e in v.get("examples", [])[:3])
    msg = f"{label} side: " + "; ".join(bits) + (f" (e.g. {ex})" if ex else "") + \
        "; the kept rows are those of accepted tokens, compared as the model computed them"
    return Finding.make(C.VERIFY_PASSES, msg, tensor=names.INPUT_IDS, metrics=dict(v))


def _is_bos(sp: Span, tokenizer: Any) -> bool:
    bos = getattr(tokenizer, "bos_token_id", None) if tokenizer is not None else None
    return sp.length == 1 and bos is not None and sp.ids[0] == bos


CONTEXT_SENSITIVE = with_property("context_sensitive")  # value findings a context difference alone can cause


def reconcile(found: list[Finding], al: TokenAlignment, token_findings: list[Finding]) -> list[Finding]:
    """The alignment's findings first, then the comparison's; when every compared token saw
    a different context, value findings on states are demoted to ``info`` and say so (the
    context difference, an error itself, explains them; a layer story would mislead)."""
    out = list(token_findings)
    hit = al.context_differs and not al.only_same_context
    for f in found:
        if hit and f.code in CONTEXT_SENSITIVE and f.tensor != names.INPUT_IDS and f.severity != Severity.info:
            f = f.model_copy(update={"severity": Severity.info,
                                     "message": "not evaluated, the tokens' context differs (CONTEXT_DIFFERS): " + f.message})
        out.append(f)
    return out
