"""Word what merging a parallel layout's rank files found (dump.layout.LayoutFact).

The merge (dump/stages.py) keeps facts; these are their sentences: a stage with no file
(the capture guarded by ``is_first_rank``, vLLM PR #45985), layer ranges that overlap or
leave a gap, a stream outside its stage's range (a local layer index, vLLM PR #36731), two
stages holding one stream with different values, a token no DP rank holds or two do.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from consistency.contract.codes import C
from consistency.contract.findings import Finding
from consistency.dump.layout import LayoutFact
from consistency.dump.ranks import _ranges
from consistency.dump.reader import Dump
from consistency.dump.stages import layout_facts

SHOW = 16  # token keys listed in a message


def show_keys(keys: Sequence[tuple[Any, ...]]) -> str:
    """Token keys for a message: rows as ints, request tokens as 'request q pos p'."""
    def one(k: tuple[Any, ...]) -> str:
        if len(k) == 1:
            return str(k[0])
        if k[0] == "...":
            return f"{k[1]} more at the end"
        return f"request {repr(k[0][1])[:40]} pos {k[1]}"
    more = f" ... ({len(keys)} in all)" if len(keys) > SHOW else ""
    return "[" + ", ".join(one(k) for k in keys[:SHOW]) + "]" + more


def _some(xs: list[Any], n: int, total: int, fmt: Callable[[Any], str] = str) -> str:
    shown = ", ".join(fmt(x) for x in xs[:n])
    return shown + (f" ... ({total} in all)" if total > n else "")


def _nodes(d: Mapping[str, Any]) -> str:
    nodes = d.get("nodes") or []
    return f"; files came from nodes {', '.join(repr(n) for n in nodes)}" if nodes else ""


def _where(d: Mapping[str, Any]) -> str:
    return f"pipeline stage {d['stage']}: " if d.get("stage") is not None else ""


def _missing(d: Mapping[str, Any]) -> str:
    lo, hi = d["layers"]
    layers = f"layers [{lo}, {hi})" if lo is not None and hi is not None and lo < hi else "its layers"
    return (f"pipeline stage {d['stage']} of {d['pp']} wrote no rank file (ranks {_ranges(list(d['missing_ranks']))} "
            f"of {d['world']} missing{_nodes(d)}): {layers} were not recorded")


def _duplicate(d: Mapping[str, Any]) -> str:
    pairs = "; ".join(f"dp ranks {p}: {show_keys([tuple(k) if isinstance(k, list) else k for k in ks])}"
                      for p, ks in d["pairs"])
    same = "identical copies" if d["worst"] == 0 else f"copies differ (token rel_diff up to {d['worst']:.3g})"
    return (f"{_where(d)}{d['tokens']} token(s) held by two data-parallel ranks ({same}): {pairs}; rank {d['kept']}'s "
            "copy was kept")


def _conflict(d: Mapping[str, Any]) -> str:
    a, b = d["stages"]
    shown = _some(d["items"], 8, d["count"], lambda x: f"{x[0]} ({x[1]:.3g})")
    return (f"pipeline stages {a} and {b} both recorded {d['count']} tensor(s) with different values -- {shown} "
            "(token rel_diff); a stream crossing a stage boundary is a copy, so one stage names them wrongly")


def _outside(d: Mapping[str, Any]) -> str:
    lo, hi = d["layers"]
    hint = (f"; shifted by the stage's first layer ({lo}) they all fall inside it: a local layer index (0-based "
            "within the stage) was used where a global one belongs" if d["local_index"] else "")
    return f"pipeline stage {d['stage']} (layers [{lo}, {hi})) recorded {_some(d['names'], 8, d['count'])}, " \
           f"outside its layer range{hint}"


def _ranges_words(d: Mapping[str, Any]) -> str:
    what, st, rg = d["what"], d["stages"], d["ranges"]
    if what == "overlap":
        (alo, ahi), (blo, bhi) = rg
        return f"pipeline stages {st[0]} (layers [{alo}, {ahi})) and {st[1]} (layers [{blo}, {bhi})) overlap on " \
               f"layers [{blo}, {min(ahi, bhi)})"
    if what == "gap":
        (_alo, ahi), (blo, _bhi) = rg
        return f"layers [{ahi}, {blo}) belong to no pipeline stage (stage {st[0]} ends at {ahi}, stage {st[1]} starts " \
               f"at {blo})"
    if what == "late_start":
        return f"pipeline stage 0 starts at layer {rg[0][0]}: layers before it belong to no stage"
    return f"the last pipeline stage {st[0]} ends at layer {rg[0][1]}, but the model has {d['num_layers']} layers"


WORDS: dict[str, Callable[[Mapping[str, Any]], str]] = {
    C.STAGE_MISSING: _missing,
    C.TOKEN_UNOWNED: lambda d: f"{_where(d)}{d['tokens']} token(s) held by no data-parallel rank: "
                               f"{show_keys([tuple(k) if isinstance(k, list) else k for k in d['keys']])}; the merged "
                               "dump lacks them",
    C.TOKEN_DUPLICATE: _duplicate,
    C.STAGE_CONFLICT: _conflict,
    C.STAGE_OUT_OF_RANGE: _outside,
    C.STAGE_RANGES: _ranges_words,
}


def _evidence(code: str, d: Mapping[str, Any]) -> dict[str, Any]:
    """The machine-readable part of each fact, in the report's evidence schema."""
    if code == C.STAGE_MISSING:
        return {"stage": d["stage"], "missing_ranks": list(d["missing_ranks"]), "layers": list(d["layers"])}
    if code == C.TOKEN_UNOWNED:
        return {"stage": d["stage"], "tokens": d["tokens"]}
    if code == C.TOKEN_DUPLICATE:
        return {"stage": d["stage"], "tokens": d["tokens"], "token_rel_diff": float(f"{d['worst']:.4g}")}
    if code == C.STAGE_CONFLICT:
        return {"stages": list(d["stages"]), "names": [n for n, _ in d["items"]],
                "token_rel_diff": {n: float(f"{x:.4g}") for n, x in d["items"]}}
    if code == C.STAGE_OUT_OF_RANGE:
        return {"stage": d["stage"], "layers": list(d["layers"]), "names": list(d["names"]),
                "local_index": d["local_index"]}
    return {"stages": list(d.get("stages", []))}


def finding(fact: LayoutFact, which: str = "candidate") -> Finding:
    msg = WORDS[fact.code](fact.data)
    evidence = _evidence(fact.code, fact.data)
    if which == "candidate":
        return Finding.make(fact.code, msg, tensor=fact.tensor, evidence=evidence)
    return Finding.make(fact.code, f"{which}: {msg}", tensor=None, evidence=evidence)


def findings(d: Dump, which: str = "candidate") -> list[Finding]:
    """The findings a merged rank set's facts make (the reference side names no candidate tensor)."""
    return [finding(f, which) for f in layout_facts(d)]
