"""The evidence model: what each candidate slot should equal, decided once, by authority.

For slot i, in order (docs/architecture.md, "The evidence model"):

1. **the reference's values**: the reference has slot i, so the candidate's slot i is
   compared with it, whatever anyone says; what it *is* (stream, norm state) comes from its
   values (compare.refslots), else its claim, else the user's declaration;
2. **the reference's claims**: no slot i, but the metadata says which stream (and norm
   state) slot i fed: compared with that tensor of the reference (``hidden.s``, or
   ``final_norm`` for a post-norm claim), not verified when the reference lacks it;
3. **the user's declaration** (``--contract``, ``--layer-ids``, a gate's ``contract =``);
4. a reference that declares a last-state consumer (MTP, EAGLE-1, Medusa) and records
   ``final_norm``: its draft reads fnorm(s=N) at slot 0.

The candidate's own claims never appear here. A declaration that contradicts a stronger
source is a :class:`Conflict` (an error diagnosis names both sides of), never a silent loss.
"""

from __future__ import annotations

from consistency.compare.types import (Conflict, Declared, Expectation, Meaning, Pair, RefSlot, SideFacts,
                                       Source)
from consistency.contract.codes import C
from consistency.contract.models import Consumer, ConsumerSpec, NormState
from consistency.dump import names
from consistency.dump.reader import Dump

LAST_STATE = (Consumer.mtp, Consumer.eagle1, Consumer.medusa)  # one slot: the target's last state, post-norm


def tensor_for(ref: Dump, m: Meaning) -> str | None:
    """The reference tensor that holds a meaning, when the reference records it."""
    if m.post_norm:
        return names.FINAL_NORM if names.FINAL_NORM in ref.tensors else None
    if m.stream is not None and names.hidden(m.stream) in ref.tensors:
        return names.hidden(m.stream)
    return None


def consumer_of(ref: SideFacts, declared: Declared) -> tuple[ConsumerSpec | None, Source, list[Conflict]]:
    """The draft's consumer: the reference's claim, else the user's; a disagreement is a conflict."""
    if ref.consumer is not None:
        conflicts = []
        d = declared.consumer
        if d is not None and (d.kind, d.recycle) != (ref.consumer.kind, ref.consumer.recycle):
            conflicts.append(Conflict(C.CONTRACT_CONFLICT, None, Source.ref_claim, Meaning(None), Meaning(None),
                                      declared.origin or "contract",
                                      {"what": "consumer", "reference": [ref.consumer.kind.value, ref.consumer.recycle.value],
                                       "declared": [d.kind.value, d.recycle.value]}))
        return ref.consumer, Source.ref_claim, conflicts
    if declared.consumer is not None:
        return declared.consumer, Source.declared, []
    return None, Source.none, []


def expected_count(sides: Pair[SideFacts], declared: Declared, consumer: ConsumerSpec | None) -> tuple[int, Source]:
    """How many slots the draft reads, and who says so (the reference defines the slot list:
    its fc takes that many hidden states)."""
    ref = sides.ref
    if ref.slots:
        return ref.slot_count, Source.ref_values
    if ref.claims:
        return len(ref.claims), Source.ref_claim
    if declared.slots:
        return len(declared.slots), Source.declared
    if consumer is not None and consumer.kind in LAST_STATE:
        return 1, Source.ref_claim
    return 0, Source.none


def expect_slot(i: int, ref: Dump, ref_side: SideFacts, rs: RefSlot | None, declared: Declared,
                consumer: ConsumerSpec | None, consumer_source: Source,
                n_layers: int | None) -> tuple[Expectation, list[Conflict]]:
    dec = declared.slot(i)
    by = declared.origin or "contract"
    if rs is not None:
        m = rs.meaning
        conflicts = []
        if dec is not None and m is not None and m.stream is not None and not dec.agrees(m):
            conflicts.append(Conflict(C.CONTRACT_CONFLICT, i, rs.source, m, dec, by, {"tensor": rs.view.name}))
        elif dec is not None and (m is None or m.stream is None) and (m is None or m.norm == dec.norm):
            m = dec  # the values could not tell which stream; the declaration names it, and nothing contradicts it
        known = m is not None and m.stream is not None
        return Expectation(rs.view.name, m, Source.ref_values, "ref_slot", stream_known=known), conflicts
    claim = ref_side.claim(i)
    if claim is not None:
        m = claim.meaning
        conflicts = [] if dec is None or dec.agrees(m) else \
            [Conflict(C.CONTRACT_CONFLICT, i, Source.ref_claim, m, dec, by, {})]
        return Expectation(tensor_for(ref, m), m, Source.ref_claim, "ref_claim"), conflicts
    last = i == 0 and consumer is not None and consumer.kind in LAST_STATE
    if last and consumer_source == Source.ref_claim:  # the reference's own consumer outranks a declaration
        m = Meaning(n_layers, NormState.final_norm)
        conflicts = [] if dec is None or dec.agrees(m) else \
            [Conflict(C.CONTRACT_CONFLICT, i, Source.ref_claim, m, dec, by, {"what": "consumer slot"})]
        return Expectation(tensor_for(ref, m), m, consumer_source, "consumer"), conflicts
    if dec is not None:
        return Expectation(tensor_for(ref, dec), dec, Source.declared, "declared"), []
    if last and consumer_source != Source.none:
        m = Meaning(n_layers, NormState.final_norm)
        return Expectation(tensor_for(ref, m), m, consumer_source, "consumer"), []
    return Expectation(None, None, Source.none, "none"), []


def beyond(i: int, count: int, source: Source) -> Expectation:
    """A candidate slot past the slots the reference defines: nothing to compare it with."""
    return Expectation(None, None, source, f"beyond:{count}")


def count_conflict(sides: Pair[SideFacts], declared: Declared) -> Conflict | None:
    """A declaration with another number of slots than the reference holds (or claims)."""
    ref = sides.ref
    have = ref.slot_count or len(ref.claims or ())
    if not declared.slots or not have or len(declared.slots) == have:
        return None
    return Conflict(C.CONTRACT_CONFLICT, None, Source.ref_values if ref.slots else Source.ref_claim, Meaning(None),
                    Meaning(None), declared.origin or "contract",
                    {"what": "slot count", "reference": have, "declared": len(declared.slots)})
