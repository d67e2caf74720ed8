"""Tensor names in a dump: one name, one meaning (as TransformerLens hook names).

``hidden.{s}``   residual stream after s layers, pre-final-norm (s = 0 is the embedding)
``attn_out.{k}`` what layer k's attention block adds to the stream
``mlp_out.{k}``  what layer k's MLP block adds to the stream
``final_norm``   the final norm's output;  ``logits``;  ``input_ids``
``aux.{i}``      the i-th aux slot as fed to the draft;  ``aux`` the concatenation
Anything else is allowed and compared by name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

_INDEXED = re.compile(r"^(hidden|attn_out|mlp_out|aux|resid_mid)\.(\d{1,6})$")

HIDDEN = "hidden"
ATTN_OUT = "attn_out"
MLP_OUT = "mlp_out"
RESID_MID = "resid_mid"  # stream s plus layer s's attention output (TransformerLens resid_mid)
AUX = "aux"
FINAL_NORM = "final_norm"
LOGITS = "logits"
INPUT_IDS = "input_ids"


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


def hidden(s: int) -> str:
    return f"{HIDDEN}.{s}"


def aux(i: int) -> str:
    return f"{AUX}.{i}"


def attn_out(k: int) -> str:
    return f"{ATTN_OUT}.{k}"


def mlp_out(k: int) -> str:
    return f"{MLP_OUT}.{k}"


def stream_of(name: str) -> int | None:
    """Stream index of a ``hidden.{s}`` name, else None."""
    n = parse(name)
    return n.index if n.kind == HIDDEN else None


def sort_key(name: str) -> tuple[int, str, int]:
    """Order names the way a reader expects: ids, streams by index, components, the rest."""
    n = parse(name)
    rank = {INPUT_IDS: 0, HIDDEN: 1, RESID_MID: 2, ATTN_OUT: 3, MLP_OUT: 4, FINAL_NORM: 5, LOGITS: 6, AUX: 7}
    return (rank.get(n.kind, 8), n.kind, -1 if n.index is None else n.index)


def preference(name: str) -> int:
    """Lower is preferred when several reference names hold the same values."""
    kind = parse(name).kind
    return {HIDDEN: 0, FINAL_NORM: 1, RESID_MID: 2, MLP_OUT: 3, ATTN_OUT: 4, AUX: 5}.get(kind, 6)


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
