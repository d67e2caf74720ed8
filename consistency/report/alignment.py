"""The token alignment in one line, for every report that shows it (text, HTML)."""

from __future__ import annotations


def alignment_line(al: dict) -> str:
    """How the tokens were lined up: what was compared, what only one side has."""
    out = (f"{al.get('compared', 0)} compared of {al.get('reference_tokens', '?')} reference / "
           f"{al.get('candidate_tokens', '?')} candidate tokens ({al.get('method')})")
    if al.get("context_differs"):
        out += f"; {al.get('same_context', 0)} with the same context on both sides"
    for key, what in (("extra", "candidate only"), ("missing", "reference only")):
        spans = al.get(key) or []
        if spans:
            out += f"; {what}: " + ", ".join(f"[{s.get('start')}, {s.get('stop')})" for s in spans[:4]) + \
                   (" ..." if len(spans) > 4 else "")
    return out
