"""The second stage: what each reference slot is, its values first (:class:`RefSlot`).

A reference slot is identified against the reference's own recorded streams and final norm
(no metadata needed). When its values equal one of them, that is what it is, whatever its
metadata claims; a claim the values contradict is a :class:`Conflict` (reported, never
used). Only where the values cannot tell (a thin reference: the slots and nothing to
compare them with) does the reference's claim stand.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from consistency.compare import identify
from consistency.compare.metrics import median
from consistency.compare.result import MAX_BAD_FRACTION
from consistency.compare.tolerance import ToleranceModel
from consistency.compare.types import Conflict, Meaning, RefSlot, SideFacts, Source
from consistency.contract.codes import C
from consistency.contract.models import NormState
from consistency.dump import names

Shape = tuple[int, int]


def same_floor(tol: ToleranceModel) -> float:
    """References closer than this are one tensor (e.g. ``aux.0`` recorded beside ``hidden.0``)."""
    return tol.dtype_floor("float32", "bfloat16") / 20


def meaning_of(name: str | None, n_layers: int | None, claim_stream: int | None = None) -> Meaning | None:
    """The meaning of a reference stream name: ``hidden.s`` is stream s, ``final_norm`` is
    fnorm(s=N) (N from the metadata, else the slot's claim)."""
    if name is None:
        return None
    if name == names.FINAL_NORM:
        return Meaning(n_layers if n_layers is not None else claim_stream, NormState.final_norm)
    s = names.stream_of(name)
    return Meaning(s) if s is not None else None


def claimed_tensor(meaning: Meaning) -> str:
    return names.FINAL_NORM if meaning.post_norm else names.hidden(meaning.stream if meaning.stream is not None else -1)


def identify_slots(side: SideFacts, fps: dict[Shape, identify.Fingerprints], tol: ToleranceModel,
                   n_layers: int | None) -> tuple[tuple[RefSlot, ...], tuple[Conflict, ...]]:
    out: list[RefSlot] = []
    conflicts: list[Conflict] = []
    for i, v in side.slots.items():
        claim = side.claim(i)
        fp = fps.get((v.rows, v.cols))
        found = _found(v.name, v.dtype, fp, tol) if fp is not None and v.name in fp else None
        values = meaning_of(found, n_layers, claim.stream if claim else None)
        if values is not None:
            if claim is not None and not claim.meaning.agrees(values):
                conflicts.append(Conflict(C.REF_CLAIM_CONTRADICTED, i, Source.ref_values, values, claim.meaning,
                                          "metadata", {"tensor": v.name, "holds": found}))
            out.append(RefSlot(i, v, found, claim, values, Source.ref_values))
            continue
        if claim is not None and fp is not None and claimed_tensor(claim.meaning) in fp:
            # the claimed tensor is recorded beside the slot and the values are not it
            conflicts.append(Conflict(C.REF_CLAIM_CONTRADICTED, i, Source.ref_values, Meaning(None, NormState.other),
                                      claim.meaning, "metadata", {"tensor": v.name, "holds": None}))
            out.append(RefSlot(i, v, None, claim, None, Source.ref_values))
            continue
        out.append(RefSlot(i, v, None, claim, claim.meaning if claim else None,
                           Source.ref_claim if claim else Source.none))
    return tuple(out), tuple(conflicts)


def _found(name: str, dtype: str, fp: identify.Fingerprints, tol: ToleranceModel) -> str | None:
    pool = [n for n in fp.names if n != name and names.parse(n).kind in (names.HIDDEN, names.FINAL_NORM)]
    if not pool:
        return None
    ident = identify.rank(name, fp, fp, pool, same_floor(tol))
    floor = tol.dtype_floor(dtype, "bfloat16")  # one recording against itself: at most its storage rounding
    best = ident.best
    if best is not None and (best.distance <= floor or _most_rows_equal(fp, name, best.name, floor)):
        return best.name
    return None


def _most_rows_equal(fp: identify.Fingerprints, a: str, b: str, floor: float) -> bool:
    """A reference slot that equals a stream except at a few bad tokens is still that
    stream (the bad tokens are judged where they are compared, not here)."""
    x, y = fp.rows(a), fp.rows(b)
    d = x - y
    den = np.einsum("ij,ij->i", x, x) + np.einsum("ij,ij->i", y, y)
    per_row = np.divide(np.einsum("ij,ij->i", d, d), den, out=np.zeros(len(den)), where=den > 0)
    return bool(per_row.size) and median(per_row) <= floor and \
        float(np.mean(per_row <= floor)) >= 1 - MAX_BAD_FRACTION


def name_by_values(ref_slots: Sequence[RefSlot], ref_name: str | None) -> str | None:
    """What a reference tensor is by its values: a reference slot whose values equal
    ``hidden.3`` is ``hidden.3`` (decided by :func:`identify_slots`, never by a claim); any
    other name is itself. (``dump.names.canonical`` is another thing: a name's spelling.)"""
    if ref_name is None:
        return None
    n = names.parse(ref_name)
    if n.kind == names.AUX and n.index is not None:
        rs = next((s for s in ref_slots if s.index == n.index and s.view.name == ref_name), None)
        if rs is not None and rs.values is not None:
            return rs.values
    return ref_name


def stream_by_values(ref_slots: Sequence[RefSlot], ref_name: str | None) -> int | None:
    """The pre-norm stream a reference tensor stands for: by its name (``hidden.3``), else,
    for ``aux.i``, by what the reference slot is (its values, else its claim)."""
    if ref_name is None:
        return None
    s = names.stream_of(ref_name)
    if s is not None:
        return s
    n = names.parse(ref_name)
    if n.kind == names.AUX and n.index is not None:
        rs = next((s for s in ref_slots if s.index == n.index), None)
        if rs is not None and rs.meaning is not None and not rs.meaning.post_norm:
            return rs.meaning.stream
    return None
