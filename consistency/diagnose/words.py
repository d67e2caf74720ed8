"""Every sentence fragment compare's values are put into (compare says what, this says how).

One function per kind of value: a note (compare.types.Note), why a slot expects what it
does (Expectation.reason and Source), how rows met (RowPairing), a stream or tensor name
(``describe``). Findings and the report assemble their messages from these, so a fact is
worded the same way wherever it appears.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from consistency.compare.metrics import PairMetrics
from consistency.compare.types import Conflict, Expectation, Meaning, Note, RowPairing, Source
from consistency.contract.codes import C
from consistency.contract.models import NormState
from consistency.dump import names


def stream_words(s: int, num_layers: int | None = None, meaning_first: bool = False) -> str:
    """The one way a stream is put into words: 'stream 3 (layer 2's output)'.

    ``meaning_first`` leads with what it is ('the embedding (stream 0)'), for sentences
    that list what a side is missing; other streams read the same either way."""
    if s == 0:
        meaning = "the embedding"
    elif num_layers is not None and s == num_layers:
        meaning = "the last layer's output, pre-norm" if not meaning_first else "the last layer's output"
    else:
        return f"stream {s} (layer {s - 1}'s output)" if not meaning_first else f"stream {s}"
    return f"{meaning} (stream {s})" if meaning_first else f"stream {s} ({meaning})"


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
        return stream_words(s, num_layers)
    return name


def meaning(m: Meaning | None, num_layers: int | None = None) -> str:
    if m is None or (m.stream is None and m.norm == NormState.none):
        return "an unknown stream"
    if m.norm == NormState.other:
        return "none of the recorded streams"
    if m.post_norm:
        return f"fnorm(s={m.stream if m.stream is not None else 'N'}), the target's final norm applied"
    assert m.stream is not None
    return stream_words(m.stream, num_layers)


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


def mismatch(m: PairMetrics, shape: tuple[int, ...] | None = None) -> str:
    """torch.testing-style: how many elements, how far, where."""
    pct = 100.0 * m.mismatched / m.numel if m.numel else 0.0
    at = m.as_dict(shape)["max_abs_at"]
    return (f"Mismatched elements: {m.mismatched} / {m.numel} ({pct:.1f}%); greatest absolute difference "
            f"{m.max_abs_diff:.3g} at index {tuple(at) if at is not None else '?'} "
            f"(reference {m.max_ref:.4g}, candidate {m.max_cand:.4g})")


FLOORS: dict[str, Callable[[Mapping[str, Any]], str]] = {
    "floor_rule": lambda d: f"rule {d['pattern']}={d['floor']:g}",
    "floor_threshold": lambda d: f"--threshold {d['floor']:g}",
    "floor_dtype": lambda d: f"{d['dtype']} floor {d['floor']:g}",
    "floor_gap": lambda d: f"neighbour gap {d['gap']:.3g}/{d['divisor']:g}",
    "floor_storage": lambda d: (f"{d['dtype']} storage floor {d['floor']:.2g} (measured {d['measured']:.2g} on "
                                "these values)"),
}


def floor(n: Note | None) -> str:
    """Where a noise floor came from (compare.tolerance, compare.context); '' when none was set."""
    return "" if n is None else FLOORS[n.key](n.data)


SKIPPED = {"int_too_large": "integer tensor too large to compare exactly"}


def skipped(key: str) -> str:
    """Why a tensor was not evaluated (Verdict.skipped)."""
    return SKIPPED.get(key, key)


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
    "declared_twice": lambda d: (f"{d['by']} and the contract {d['contract']} declare the same streams "
                                 f"{list(d['streams'])}"),
    # the token stage (compare.tokens, compare.prepare, dump.segments)
    "positions_gap": lambda d: f"{d['tensor']}: positions {d['first']}..{d['last']} were not captured (a gap)",
    "request_unmatched": lambda d: f"reference {d['request']} ({d['tokens']} tokens) matches no candidate request",
    "same_context_only": lambda d: (f"compared only the {d['kept']} tokens whose context is the same on both sides"
                                    + (" or unproven" if d["unproven"] else "")),
    "context_by_values": lambda d: (f"the {d['side']} records no positions (or only declares them); its states equal "
                                    f"the other side's at the same tokens within noise ({', '.join(d['shown'])}), so "
                                    "they saw the same context" + (": a prefix-cache hit" if d["cached"] else "")),
    "no_ids_by_position": lambda d: "no input_ids on one side: tokens paired by position, their ids unchecked",
    "no_ids_by_rows": lambda d: "no input_ids on one side: rows paired in order, their ids unchecked",
    "no_ids_unaligned": lambda d: (f"no input_ids on one side and {d['ref_tokens']} vs {d['cand_tokens']} tokens: "
                                   "the tokens could not be aligned"),
}


def note(n: Note) -> str:
    fn = NOTES.get(n.key)
    return fn(n.data) if fn is not None else f"{n.key}: {dict(n.data)}"
