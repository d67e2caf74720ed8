"""The slot list as a whole: shifted, offset, permuted -- said once, in one sentence.

Per-slot findings say what each slot holds; users need the pattern (the SGLang +1 family
is a constant offset, the seed's bug a one-slot shift) because the fix is different.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from consistency.contract.codes import C
from consistency.diagnose import words


@dataclass
class Story:
    code: str  # SLOT_SHIFT, LAYER_OFFSET, ORDER_MISMATCH
    sentence: str
    detail: dict


def _fmt(xs: Sequence[int | None]) -> str:
    return "[" + ", ".join("?" if x is None else str(x) for x in xs) + "]"


def _shifts(n: int) -> range:
    """Shifts a slot list of n can show: at least two slots must confirm one (one slot in
    common is a coincidence, not a shift), except in a list of two."""
    return range(1, n - 1) if n > 2 else range(1, n)


def family(k: int) -> str:
    """The convention family an offset of k layers belongs to (SGLang's model files add 1)."""
    if k == 1:
        return ", the SGLang +1 family"
    if k == -1:
        return ", the SGLang +1 family the other way round: the reference's ids were read with the +1"
    return ""


def describe(stream: int, num_layers: int | None) -> str:
    return words.stream_words(stream, num_layers, meaning_first=True)


def tell(expected: Sequence[int | None], actual: Sequence[int | None], cand_side: str, ref_side: str,
         num_layers: int | None = None) -> Story | None:
    """A story when every expected stream is known and the slots differ. A slot that holds
    no recorded stream (None) may only stand where a shift adds one."""
    n = min(len(expected), len(actual))
    if n == 0 or any(x is None for x in expected[:n]):
        return None
    if any(x is None for x in actual[:n]):
        return _shift_with_unknown([int(x) for x in expected[:n]], list(actual[:n]), cand_side, ref_side, num_layers)  # type: ignore[arg-type]
    e = [int(x) for x in expected[:n]]  # type: ignore[arg-type]
    a = [int(x) for x in actual[:n]]  # type: ignore[arg-type]
    if e == a:
        return None
    head = f"{cand_side} fed streams {_fmt(a)}; {ref_side} used {_fmt(e)}"
    if n >= 2 and sorted(a) == sorted(e):
        rot = next((k for k in range(1, n) if a == e[k:] + e[:k]), None)
        how = f"rotated by {rot} slot{'s' if rot != 1 else ''}" if rot else "a permutation"
        return Story(C.ORDER_MISMATCH, f"{head} -- the same streams in another order ({how})",
                     {"expected": e, "actual": a, "permutation": [e.index(x) for x in a]})
    if n >= 2 and len(set(a)) == len(a):  # a stream fed twice is no shift or offset: per-slot findings say it
        offs = {x - y for x, y in zip(a, e, strict=True)}
        if len(offs) == 1:
            k = offs.pop()
            return Story(C.LAYER_OFFSET, f"{head} -- every slot is {abs(k)} layer{'s' if abs(k) != 1 else ''} "
                         f"{'later' if k > 0 else 'earlier'} (a layer-id convention off by {k:+d}{family(k)})",
                         {"offset": k, "expected": e, "actual": a})
        for k in _shifts(n):
            if a[: n - k] == e[k:]:
                missing = ", ".join(describe(x, num_layers) for x in e[:k])
                extra = ", ".join(describe(x, num_layers) for x in a[n - k:])
                return Story(C.SLOT_SHIFT, f"{head} -- the slot list is shifted by {k} slot{'s' if k > 1 else ''}: "
                             f"{cand_side} is missing {missing} and adds {extra}",
                             {"shift": -k, "missing": e[:k], "added": a[n - k:], "expected": e, "actual": a})
            if a[k:] == e[: n - k]:
                missing = ", ".join(describe(x, num_layers) for x in e[n - k:])
                extra = ", ".join(describe(x, num_layers) for x in a[:k])
                return Story(C.SLOT_SHIFT, f"{head} -- the slot list is shifted by {k} slot{'s' if k > 1 else ''}: "
                             f"{cand_side} adds {extra} in front and is missing {missing}",
                             {"shift": k, "missing": e[n - k:], "added": a[:k], "expected": e, "actual": a})
    return Story(C.LAYER_MISMATCH, head, {"expected": e, "actual": a})


def _shift_with_unknown(e: list[int], a: list[int | None], cand_side: str, ref_side: str,
                        num_layers: int | None) -> Story | None:
    n = len(e)
    for k in _shifts(n):
        if all(x is not None for x in a[: n - k]) and a[: n - k] == e[k:] and all(x is None or x not in e for x in a[n - k:]):
            missing = ", ".join(describe(x, num_layers) for x in e[:k])
            extra = ", ".join("a stream the reference does not record" if x is None else describe(x, num_layers)
                              for x in a[n - k:])
            return Story(C.SLOT_SHIFT, f"{cand_side} fed streams {_fmt(a)}; {ref_side} used {_fmt(e)} -- the slot list "
                         f"is shifted by {k} slot{'s' if k > 1 else ''}: {cand_side} is missing {missing} and adds "
                         f"{extra}", {"shift": -k, "missing": e[:k], "added": a[n - k:], "expected": e, "actual": a})
    return None


def tell_by_slot(expected: Sequence[int | None], actual: Sequence[int | None], cand_side: str,
                 ref_side: str) -> Story | None:
    """The story told in the reference's own slots, for a thin reference whose slots say
    no stream: "serving slot 0 holds what training put in slot 1"."""
    n = min(len(expected), len(actual))
    if n < 2 or any(x is None for x in expected[:n]) or all(x is None for x in actual[:n]):
        return None
    e, a = list(expected[:n]), list(actual[:n])
    if e == a:
        return None
    head = "; ".join(f"{cand_side} slot {i} holds " + (f"what {ref_side} put in slot {x}" if x is not None else
                                                        f"a stream {ref_side} never recorded")
                     for i, x in enumerate(a) if x != e[i])
    if all(x is not None for x in a) and sorted(a) == sorted(e):  # type: ignore[type-var]
        return Story(C.ORDER_MISMATCH, f"{head} -- the same slots in another order",
                     {"expected_slots": e, "actual_slots": a, "by": "reference slots"})
    for k in _shifts(n):
        if a[: n - k] == e[k:] and all(x is None or x not in e[k:] for x in a[n - k:]):
            return Story(C.SLOT_SHIFT, f"{head} -- the list is shifted by {k} slot{'s' if k > 1 else ''}",
                         {"shift": -k, "expected_slots": e, "actual_slots": a, "by": "reference slots"})
        if a[k:] == e[: n - k] and all(x is None or x not in e[: n - k] for x in a[:k]):
            return Story(C.SLOT_SHIFT, f"{head} -- the list is shifted by {k} slot{'s' if k > 1 else ''}",
                         {"shift": k, "expected_slots": e, "actual_slots": a, "by": "reference slots"})
    return Story(C.LAYER_MISMATCH, head, {"expected_slots": e, "actual_slots": a})
