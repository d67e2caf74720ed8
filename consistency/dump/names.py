"""Tensor names in a dump: one name, one meaning (as TransformerLens hook names).

``hidden.{s}``   residual stream after s layers, pre-final-norm (s = 0 is the embedding)
``attn_out.{k}`` what layer k's attention block adds to the stream
``mlp_out.{k}``  what layer k's MLP block adds to the stream
``final_norm``   the final norm's output;  ``logits``;  ``input_ids``
``aux.{i}``      the i-th aux slot as fed to the draft at step 0;  ``aux`` the concatenation
                 (an MTP / EAGLE-1 / Medusa draft has one slot: the target's last state)
Drafts that run several steps (docs/methods.md), step k = 0, 1, ...:
``recycle.{k}``     the hidden state the draft is fed at step k >= 1 (what it recycles)
``draft_out.{k}``   the draft's output at step k before its own final norm (d_raw)
``draft_norm.{k}``  the draft's output at step k after its own final norm (d_norm)
``draft_ids.{k}``   the token ids the draft embeds at step k, row-aligned with its hidden input
``draft_embed.{k}`` the embedding rows the draft reads at step k (after any position-0 masking)
``draft_cat.{k}``   the concatenation fed to the draft's input projection (eh_proj / fc) at step k
Anything else is allowed and compared by name.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache

_INDEXED = re.compile(r"^(hidden|attn_out|mlp_out|aux|resid_mid|recycle|draft_out|draft_norm|draft_ids|draft_embed|draft_cat)"
                      r"\.(\d{1,6})$")

HIDDEN = "hidden"
ATTN_OUT = "attn_out"
MLP_OUT = "mlp_out"
RESID_MID = "resid_mid"  # stream s plus layer s's attention output (TransformerLens resid_mid)
AUX = "aux"
FINAL_NORM = "final_norm"
LOGITS = "logits"
INPUT_IDS = "input_ids"
RECYCLE = "recycle"
DRAFT_OUT = "draft_out"
DRAFT_NORM = "draft_norm"
DRAFT_IDS = "draft_ids"
DRAFT_EMBED = "draft_embed"
DRAFT_CAT = "draft_cat"
DRAFT_KINDS = (RECYCLE, DRAFT_OUT, DRAFT_NORM, DRAFT_IDS, DRAFT_EMBED, DRAFT_CAT)  # the draft's own side, per step


@dataclass(frozen=True, order=True)
class Name:
    kind: str
    index: int | None = None

    def __str__(self) -> str:
        return self.kind if self.index is None else f"{self.kind}.{self.index}"


@lru_cache(maxsize=1 << 17)  # asked per tensor per pair: dumps hold up to 100,000 names
def parse(name: str) -> Name:
    m = _INDEXED.match(name)
    if m:
        return Name(m.group(1), int(m.group(2)))
    return Name(name)


def canonical(name: str) -> str:
    """The one spelling of an indexed name: ``hidden.01`` is ``hidden.1`` (stream 1)."""
    n = parse(name)
    return str(n) if n.index is not None else name


# a dotted part that is all digits ("03" in model.layers.03.mlp, "00" in aux.00, "#02"): its value,
# not its spelling, is what every reader keys on (int(), canonical())
_PADDED = re.compile(r"(?<![^.#/])0+(?=\d+(?:[.#/]|$))")


def spelling(name: str) -> str:
    """The one spelling of any name: every all-digit part without leading zeros
    (``model.layers.03.mlp`` -> ``model.layers.3.mlp``, ``aux.00`` -> ``aux.0``). Two names
    of one spelling are one name written twice, and a reader that keyed on either would
    keep whichever came first or last: the order of a file would decide PASS or FAIL."""
    return _PADDED.sub("", name)


def twin_spellings(keys: Iterable[str]) -> tuple[str, str] | None:
    """The first two different names of one :func:`spelling` among ``keys`` (sorted), or None.
    The same name repeated is no twin (a dumper writes ``input_ids`` per layer)."""
    seen: dict[str, str] = {}
    for k in keys:
        if not isinstance(k, str):
            continue
        first = seen.setdefault(spelling(k), k)
        if first != k:
            a, b = sorted((first, k))
            return a, b
    return None


def refuse_twins(path: object, keys: Iterable[str], what: str = "holds") -> None:
    """One line naming the file and both spellings (exit 2) when ``keys`` hold two spellings
    of one name: every reader calls it on the names it keys on, every writer before writing."""
    pair = twin_spellings(keys)
    if pair is not None:
        from consistency.errors import InputError

        a, b = (x if len(x) <= 80 else x[:80] + "..." for x in pair)
        raise InputError(path, f"{what} {a!r} and {b!r}: two spellings of {spelling(pair[0])[:80]!r}; refused, "
                               "since either could be meant")


def hidden(s: int) -> str:
    return f"{HIDDEN}.{s}"


def aux(i: int) -> str:
    return f"{AUX}.{i}"


def attn_out(k: int) -> str:
    return f"{ATTN_OUT}.{k}"


def mlp_out(k: int) -> str:
    return f"{MLP_OUT}.{k}"


def recycle(k: int) -> str:
    return f"{RECYCLE}.{k}"


def draft(kind: str, k: int) -> str:
    """``draft(DRAFT_NORM, 0)`` -> ``draft_norm.0``; one spelling for every per-step name."""
    if kind not in DRAFT_KINDS:
        raise ValueError(f"not a per-step draft tensor kind: {kind!r}")
    return f"{kind}.{k}"


def stream_of(name: str) -> int | None:
    """Stream index of a ``hidden.{s}`` name, else None."""
    n = parse(name)
    return n.index if n.kind == HIDDEN else None


def sort_key(name: str) -> tuple[int, str, int]:
    """Order names the way a reader expects: ids, streams by index, components, the rest."""
    n = parse(name)
    rank = {INPUT_IDS: 0, HIDDEN: 1, RESID_MID: 2, ATTN_OUT: 3, MLP_OUT: 4, FINAL_NORM: 5, LOGITS: 6, AUX: 7,
            DRAFT_IDS: 8, DRAFT_EMBED: 9, DRAFT_CAT: 10, DRAFT_OUT: 11, DRAFT_NORM: 12, RECYCLE: 13}
    if n.kind in DRAFT_KINDS and n.index is not None:  # step by step: everything of step 0, then step 1, ...
        return (8, f"{n.index:06d}", rank[n.kind])
    return (rank.get(n.kind, 14), n.kind, -1 if n.index is None else n.index)


def preference(name: str) -> int:
    """Lower is preferred when several reference names hold the same values."""
    kind = parse(name).kind
    return {HIDDEN: 0, FINAL_NORM: 1, RESID_MID: 2, MLP_OUT: 3, ATTN_OUT: 4, AUX: 5}.get(kind, 6)
