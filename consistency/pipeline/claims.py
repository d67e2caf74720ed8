"""What the user says each side holds, as values: ``--layer-ids``, ``--ref-layer-ids``,
``--cand-layer-ids``, ``--contract`` and ``--consumer`` turned into claims before anything
is compared.

The ids used to be applied by two near-twin functions, one of which wrote them into the
dump it was handed (an in-memory dump compared twice then carried claims it never made).
Here one function reads a side and the request and returns an :class:`IdClaims` value;
what follows from it is computed from that value: the reference's :class:`Declared`
(its own record outranks it, compare.expect) and the candidate *as compared*, a new side
carrying the claims (compared with its values, never trusted). The dump the caller holds
is never written.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from consistency.compare.types import Declared, Meaning, Note

if TYPE_CHECKING:
    from consistency.compare.request import CompareRequest
    from consistency.dump.reader import Dump

REFERENCE, CANDIDATE = "reference", "candidate"
OWN_FLAG = {REFERENCE: "--ref-layer-ids", CANDIDATE: "--cand-layer-ids"}


@dataclass(frozen=True)
class IdClaims:
    """The ids the user gives one side, resolved against it. ``applied``: they say what the
    side holds (its own ids, or common ids for a side that records none); otherwise they
    agree with or differ from what it records, and ``notes`` says which."""

    side: str  # reference | candidate
    flag: str  # the option they came from: --layer-ids, --ref-layer-ids, --cand-layer-ids
    ids: tuple[int, ...]  # as the convention spells them (the verifier's appended N split off)
    streams: tuple[int, ...]
    convention: str | None
    recorded: tuple[int, ...] | None  # what the side's own metadata records
    applied: bool
    notes: tuple[Note, ...] = field(default=())

    def declared(self) -> Declared:
        """The reference's declaration (an empty one when the ids were not applied)."""
        if not self.applied:
            return Declared()
        return Declared(tuple(Meaning(s) for s in self.streams), None, f"{self.flag} {list(self.ids)}")


def claims_of(d: Dump, side: str, req: CompareRequest) -> IdClaims | None:
    """``side``'s ids from the request, resolved against the side's own metadata; None when
    the request gives it none or its foreign reader already took them."""
    from consistency.dump.formats.base import ForeignDump, resolve_claims

    own = req.ref_layer_ids if side == REFERENCE else req.cand_layer_ids
    given = own if own is not None else req.layer_ids
    if given is None or isinstance(d, ForeignDump):
        return None
    meta = d.metadata
    recorded = tuple(meta.aux.stream_ids) if meta is not None and meta.aux is not None and meta.aux.stream_ids \
        else None
    n_layers = meta.model.num_layers if meta is not None and meta.model is not None else None
    flag = OWN_FLAG[side] if own is not None else "--layer-ids"
    slots = sum(x[:4] == "aux." and x[4:].isdigit() for x in d.tensors) or None
    ids, appended = _appended(list(given), n_layers, req.convention, slots)
    res = resolve_claims(d.path, ids, req.convention, "stream", sorted_slots=False, num_layers=n_layers,
                         slots=slots, what=flag)
    streams = tuple(res.streams or ())
    file = d.path.name
    if recorded and own is None:  # common ids never override what a side records
        if list(recorded) == list(streams):
            return IdClaims(side, flag, tuple(ids), streams, res.convention, recorded, False)
        return IdClaims(side, flag, tuple(ids), streams, res.convention, recorded, False,
                        (Note.of("ids_not_applied", file=file, side=side, recorded=list(recorded), ids=list(ids),
                                 own_flag=OWN_FLAG[side]),))
    said = Note.of("ids_declared" if side == REFERENCE else "ids_claimed", file=file, streams=list(streams),
                   flag=flag, ids=list(ids), recorded=list(recorded) if recorded else None)
    extra = [Note.of("text", text=t) for t in appended + list(res.notes)]
    return IdClaims(side, flag, tuple(ids), streams, res.convention, recorded, True, (said, *extra))


def carrying(d: Dump, claims: IdClaims | None) -> Dump:
    """The candidate as compared: a new side whose metadata states ``claims`` (they are only
    ever compared with its values, so carrying them decides nothing). The caller's dump
    keeps its own metadata; closing stays with the original."""
    if claims is None or not claims.applied:
        return d
    from consistency.contract.models import AuxInfo, DumpMetadata

    meta = d.metadata.model_copy(deep=True) if d.metadata is not None else DumpMetadata()
    meta.aux = (meta.aux or AuxInfo()).model_copy(update={"stream_ids": list(claims.streams),
                                                          "native_ids": list(claims.ids),
                                                          "convention": claims.convention})
    out = copy.copy(d)
    out.metadata = meta
    return out


def declaration(claims: IdClaims | None, contract: Any, req: CompareRequest) -> tuple[Declared, list[Note]]:
    """What the user declares the reference holds: its ids, a contract (which must name the
    same streams), and the consumer (a contract's own consumer, when it names one, is kept)."""
    declared = claims.declared() if claims is not None else Declared()
    notes: list[Note] = []
    if contract is not None:
        from consistency.compare.plan import declared_from_contract
        from consistency.compare.sides import combine_declared

        name = os.fspath(req.contract) if isinstance(req.contract, (str, os.PathLike)) else "given"
        declared, notes = combine_declared(declared, declared_from_contract(contract)[0], name)
    return with_consumer(declared, req.consumer), notes


def with_consumer(declared: Declared, kind: str | None) -> Declared:
    """``--consumer KIND``: the draft the user declares, as that method's majority serving
    behaviour (a contract's own consumer, when it names one, is kept)."""
    if kind is None or declared.consumer is not None:
        return declared
    from consistency.compare.sides import declared_consumer_of

    return replace(declared, consumer=declared_consumer_of(kind), origin=declared.origin or f"--consumer {kind}")


def _appended(ids: list[int], n: int | None, convention: str | None, slots: int | None) -> tuple[list[int], list[str]]:
    """speculators' data-generation ids end with N, the verifier's last state (contract/ids.py): not a slot."""
    from consistency.contract.ids import split_appended

    aux, last, why = split_appended(ids, n, convention, slots)
    return aux, ([why] if last is not None else [])
