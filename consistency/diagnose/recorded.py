"""What each side's recorder says about itself, and how a side was read, in words.

The front door (consistency.pipeline.compare) hands these the values compare's stages
returned: the anchor problems ``compare.anchors.check`` found, each side's metadata (the
captures its recorder says it left out) and the comparison. Nothing here opens a file or
calls back into the pipeline.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from consistency.contract.codes import C
from consistency.contract.findings import Finding

if TYPE_CHECKING:
    from consistency.compare.anchors import AnchorProblem
    from consistency.compare.types import Declared


def refuted_anchors(problems: Sequence[AnchorProblem]) -> list[Finding]:
    """TOKEN_INDEX_FALSE for each ``token_index`` the values refute (compare/anchors.py
    drops those anchors, so the rows pair by order and the values decide): a refuted claim
    is a finding, never a pairing."""
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
    return out


def dropped(d: Any, side: str, stitched: Any = None) -> list[Finding]:
    """CAPTURES_DROPPED when a dump's metadata says its recorder left captures out (a full
    host ring, a graph-buffer budget, a host value inside a CUDA graph, a capture it refused:
    ``extra.refused_captures``): those rows were not compared, so the verdict can never pass
    on them. Read defensively (a hostile file). ``stitched`` (the dump as compared) says which
    forward passes pairing by graph tags left out (dump.passes): every name of a pass some name lacks."""
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


def mtp_hint(cmp: Any, declared: Declared) -> list[str]:
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
