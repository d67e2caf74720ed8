"""Word what token alignment decided (compare.prepare, compare.tokens): what did not align,
whether contexts differ, or that nothing aligned at all; and the demotion of per-state
findings when every compared token saw another context.
"""

from __future__ import annotations

from typing import Any

from consistency.compare.tokens import Span, TokenAlignment
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
