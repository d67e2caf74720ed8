"""The token alignment in one line, for every report that shows it (text, HTML): everything
the JSON's ``alignment`` says, so a terminal reader sees what a JSON reader sees."""

from __future__ import annotations


def _spans(spans: list) -> str:
    return ", ".join(f"[{s.get('start')}, {s.get('stop')})" for s in spans[:4]) + (" ..." if len(spans) > 4 else "")


def alignment_line(al: dict) -> str:
    """How the tokens were lined up: what was compared, what only one side has, what the
    candidate had in its context without recording it, what stitching superseded."""
    out = (f"{al.get('compared', 0)} compared of {al.get('reference_tokens', '?')} reference / "
           f"{al.get('candidate_tokens', '?')} candidate tokens ({al.get('method')})")
    if al.get("context_differs"):
        out += f"; {al.get('same_context', 0)} with the same context on both sides"
    n = al.get("not_captured") or 0
    if n:
        how = "by their values" if al.get("cached_by_values") else "by positions"
        out += f"; {n} reference token{'s' if n != 1 else ''} not captured (in the candidate's context, {how}: " \
               f"{_spans(al.get('not_captured_spans') or [])})"
    front = al.get("reference_not_captured_spans") or []
    if front:
        k = sum(int(sp.get("stop", 0)) - int(sp.get("start", 0)) for sp in front)
        out += f"; {k} candidate token{'s' if k != 1 else ''} not captured by the reference (in its context: " \
               f"{_spans(front)})"
    for key, what in (("extra", "candidate only"), ("missing", "reference only")):
        spans = al.get(key) or []
        if spans:
            out += f"; {what}: " + _spans(spans)
    for r in (al.get("replaced") or [])[:4]:
        ref, cand = r.get("reference") or {}, r.get("candidate") or {}
        out += f"; replaced at the {r.get('where')}: reference [{ref.get('start')}, {ref.get('stop')}) vs " \
               f"candidate [{cand.get('start')}, {cand.get('stop')})"
    for side, v in (al.get("stitching") or {}).items():
        out += f"; {side}: {v.get('superseded', 0)} rows superseded by {v.get('rewinds', 0)} verify passes"
        if v.get("unconfirmed") or v.get("ambiguous"):
            out += f" ({v.get('unconfirmed', 0)} unconfirmed, {v.get('ambiguous', 0)} ambiguous not kept)"
    return out


def worth_showing(al: dict | None) -> bool:
    """Anything beyond "both sides hold the same tokens"."""
    return bool(al) and (al.get("method") not in (None, "identical") or bool(al.get("not_captured"))
                         or bool(al.get("reference_not_captured_spans"))
                         or bool(al.get("stitching")) or bool(al.get("replaced")))
