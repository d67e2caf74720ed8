"""Every sentence fragment compare's values are put into (compare says what, this says how).

One function per kind of value: a note (compare.types.Note), why a slot expects what it
does (Expectation.reason and Source), how rows met (RowPairing), a stream or tensor name
(``describe``). Findings and the report assemble their messages from these, so a fact is
worded the same way wherever it appears.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from consistency.compare.types import Conflict, Expectation, Meaning, Note, RowPairing, Source
from consistency.contract.codes import C
from consistency.contract.models import NormState
from consistency.dump import names


def describe(name: str | None, stream: int | None = None, num_layers: int | None = None) -> str:
    """The one way a tensor is put into words: 'stream 3 (layer 2's output)', 'final_norm
    (fnorm(s=12), the target's final norm applied)', or the name itself."""
    if name is None:
        return "nothing"
    if name == names.FINAL_NORM:
        s = stream if stream is not None else num_layers
        return f"final_norm (fnorm(s={s}), the target's final norm applied)" if s is not None else \
            "final_norm (the target's final norm applied)"
    s = names.stream_of(name) if stream is None else stream
    if s is not None:
        return names.stream_words(s, num_layers)
    return name


def meaning(m: Meaning | None, num_layers: int | None = None) -> str:
    if m is None or (m.stream is None and m.norm == NormState.none):
        return "an unknown stream"
    if m.norm == NormState.other:
        return "none of the recorded streams"
    if m.post_norm:
        return f"fnorm(s={m.stream if m.stream is not None else 'N'}), the target's final norm applied"
    assert m.stream is not None
    return names.stream_words(m.stream, num_layers)


SOURCE_WORDS = {Source.ref_values: "the reference's values", Source.ref_claim: "the reference's metadata",
                Source.declared: "your declaration", Source.name: "the same name", Source.none: "nothing"}


def why(e: Expectation) -> str:
    """Why a candidate tensor is compared with what it is compared with."""
    r = e.reason
    if r == "ref_slot":
        return f"the reference's {e.tensor}"
    if r == "ref_claim":
        return "the reference's metadata (aux.stream_ids)"
    if r == "declared":
        return "the declaration (--contract / --layer-ids)"
    if r == "consumer":
        return "the reference's draft consumer reads fnorm(s=N)"
    if r == "name":
        return "same name"
    if r.startswith("beyond:"):
        n = int(r.split(":", 1)[1])
        return f"the reference has {n} slot{'s' if n != 1 else ''}"
    return "no contract, no reference aux slots and no claimed streams"


def conflict(c: Conflict, num_layers: int | None = None) -> str:
    """A conflict between two sources, naming both and saying which one the comparison used."""
    d = dict(c.detail)
    where = f"slot {c.slot}" if c.slot is not None else "the draft"
    if d.get("what") == "slot count":
        return (f"{c.by} declares {d['declared']} slots but the reference holds {d['reference']}: the reference "
                f"defines the slot list (its draft's fc takes {d['reference']} hidden states)")
    if d.get("what") == "consumer slot":
        return (f"slot 0: {c.by} says {meaning(c.said, num_layers)}, but the reference's metadata declares a draft "
                f"that reads {meaning(c.holds, num_layers)}: the reference's is used")
    if d.get("what") == "consumer":
        return (f"{c.by} declares a {d['declared'][0]} consumer recycling {d['declared'][1]}, the reference's metadata "
                f"a {d['reference'][0]} consumer recycling {d['reference'][1]}: the reference's is used")
    if c.kind == C.REF_CLAIM_CONTRADICTED:
        tensor = d.get("tensor", f"aux.{c.slot}")
        holds = f"hold {describe(d['holds'], c.holds.stream, num_layers)}" if d.get("holds") else \
            f"is not {meaning(c.said, num_layers)} (nor any recorded stream)"
        return (f"reference {tensor} claims {meaning(c.said, num_layers)} in its metadata but its values "
                f"{holds}; the values are used")
    winner = SOURCE_WORDS[c.winner]
    tensor = d.get("tensor")
    held = f"the reference's {tensor} holds" if tensor else "the reference's metadata says"
    return (f"{where}: {c.by} says {meaning(c.said, num_layers)}, but {held} {meaning(c.holds, num_layers)} "
            f"({winner} decide what the candidate is compared with)")


def _anchors(xs: tuple[int, ...] | list[int], n: int) -> str:
    return str(list(xs)) if n <= len(xs) else f"{list(xs)} ... ({n} in all)"


ORIGIN = {"both": "token_index of both sides", "candidate": "the candidate's token_index",
          "reference": "the reference's token_index", "step0": "row r of a draft's step 0 is position r"}


def rows(p: RowPairing) -> str:
    """One clause for a report: how many rows were compared and what was left out."""
    s = f"{p.compared} of {p.cand_rows} candidate rows compared by anchor ({ORIGIN.get(p.origin, p.origin)})"
    if p.n_cand_only:
        s += f"; not compared, candidate only: anchor{'s' if p.n_cand_only > 1 else ''} " \
             f"{_anchors(p.cand_only, p.n_cand_only)}"
        if p.past_end:
            s += " (past the reference's last anchor: a runtime drafts it from the sampled token, which no " \
                 "training reference holds)"
    if p.n_ref_only:
        s += f"; reference only: anchor{'s' if p.n_ref_only > 1 else ''} {_anchors(p.ref_only, p.n_ref_only)}"
    return s


def no_rows(p: RowPairing) -> str:
    """One clause for a pair with no common anchor."""
    span = f"anchors {p.ref_span[0]}..{p.ref_span[1]}" if p.ref_span else "no rows"
    pl = "s" if p.n_cand_only > 1 else ""
    s = f"the candidate's row{pl} at anchor{pl} {_anchors(p.cand_only, p.n_cand_only)} " \
        f"{'have' if p.n_cand_only > 1 else 'has'} no reference row (the reference holds {span}; paired by " \
        f"{ORIGIN.get(p.origin, p.origin)})"
    if p.past_end:
        s += ": past the reference's last anchor, where a runtime drafts from the sampled token"
    return s


def _plural(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


NOTES: dict[str, Callable[[Mapping[str, Any]], str]] = {
    "concat_beside_slots": lambda d: f"{d['file']}: 'aux' stored beside per-slot aux.{{i}}: both compared",
    "concat_unsplit": lambda d: f"{d['file']}: 'aux' ({d['width']} wide) does not split into the {d['slots']} slots "
                                "aux.{i}: compared by name only",
    "concat_whole": lambda d: f"'aux' is {d['width']} wide and could not be split into slots (hidden size unknown); "
                              "compared whole",
    "concat_split": lambda d: f"'aux' split into {d['slots']} slots of {d['width']}",
    "file_note": lambda d: f"{d['file']}: {d['text']}",
    "token_index_ignored": lambda d: f"{d['side']} {d['tensor']}: token_index ignored ({d['entries']} entries for "
                                     f"{d['rows']} rows, or not anchors >= 0); its rows are paired by order",
    "too_large_to_pair": lambda d: f"{d['tensor']}: too large to pair by token_index; its rows are paired by order",
    "effective_dtype": lambda d: (f"{_plural(len(d['tensors']), 'float32 tensor')} hold {'/'.join(d['dtypes'])} "
                                  f"values (e.g. {d['tensors'][0]}): judged against the {'/'.join(d['dtypes'])} "
                                  "noise floor"),
    "text": lambda d: str(d["text"]),
    # the user's ids for a side (consistency.pipeline.claims): declared for the reference, claimed for the candidate
    "ids_declared": lambda d: f"{d['file']}: streams {d['streams']} declared by {d['flag']} {d['ids']}",
    "ids_claimed": lambda d: f"{d['file']}: streams {d['streams']} from {d['flag']} {d['ids']}"
                             + (f" (it recorded {d['recorded']})" if d.get("recorded") else ""),
    "ids_not_applied": lambda d: f"{d['file']} records streams {d['recorded']}; --layer-ids {d['ids']} not applied to "
                                 + (f"it (use {d['own_flag']} to declare them, which its own record outranks)"
                                    if d["side"] == "reference" else f"it (use {d['own_flag']} to override)"),
}


def note(n: Note) -> str:
    fn = NOTES.get(n.key)
    return fn(n.data) if fn is not None else f"{n.key}: {dict(n.data)}"
