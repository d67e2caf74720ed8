"""The planner: one :class:`Entry` per candidate tensor, each with its expectation.

Aux slots meet by meaning (compare.expect: the evidence model), everything else by name.
What the reference (or the declaration) expects and the candidate lacks is ``missing``;
what only the candidate has is ``extra``; reference kinds the candidate never records are
``not_compared`` (a speculators file with one stream does not make thirty streams missing).
"""

from __future__ import annotations

from consistency.compare import expect
from dataclasses import replace

from consistency.compare.refslots import meaning_of, name_by_values, stream_by_values
from consistency.compare.types import (Conflict, Declared, Entry, Expectation, Identity, Note, Pair, Plan, RefSlot,
                                       SideFacts, Source)
from consistency.contract.models import Recycle
from consistency.dump import names
from consistency.dump.reader import Dump

COMPONENTS = (".hidden_states", ".residual")
OWN_STEP = "own_step"  # a candidate recycle.k the reference lacks: checked against the candidate's own states


def is_component(name: str) -> bool:
    """``aux.{i}.hidden_states`` / ``aux.{i}.residual``: a slot's parts, kept as evidence."""
    return name.startswith(names.AUX + ".") and name.endswith(COMPONENTS)


def build(dumps: Pair[Dump], sides: Pair[SideFacts], ref_slots: tuple[RefSlot, ...],
          ref_conflicts: tuple[Conflict, ...], declared: Declared, n_layers: int | None = None) -> Plan:
    """``n_layers``: N as the reference's metadata, else the declaration, else a full recording
    of the reference says it (compare.sides.recorded_top)."""
    ref, cand = dumps.ref, dumps.cand
    rs, cs = sides.ref, sides.cand
    conflicts = list(ref_conflicts)
    consumer, csource, cc = expect.consumer_of(rs, declared)
    conflicts += cc
    count, count_source = expect.expected_count(sides, declared, consumer)
    if (c := expect.count_conflict(sides, declared)) is not None:
        conflicts.append(c)
    by_index = {s.index: s for s in ref_slots}
    exps: dict[int, Expectation] = {}
    for i in sorted(set(cs.slots) | set(range(count))):
        if count and i >= count and i not in by_index:
            exps[i] = expect.beyond(i, count, count_source)
            continue
        e, found = expect.expect_slot(i, ref, rs, by_index.get(i), declared, consumer, csource, n_layers)
        exps[i] = e
        conflicts += found
    entries = [Entry(v.name, v, exps[i], slot=i) for i, v in cs.slots.items()]
    entries += [Entry(v.name, v, exps[i], concat_of=i) for i, v in enumerate(cs.concat) if i in exps]
    missing = [names.aux(i) for i in range(count) if i not in cs.slots]
    aux_names = {v.name for v in rs.slots.values()} | {v.name for v in cs.slots.values()} | {names.AUX}
    cand_kinds = _recorded_kinds(ref, cand)
    not_compared: list[str] = []
    for n in ref.names:
        if n in aux_names:
            continue
        if n in cand.tensors:
            entries.append(Entry(n, cand[n], Expectation(n, meaning_of(n, n_layers), Source.name, "name")))
        elif names.parse(n).kind in cand_kinds:
            missing.append(n)
        else:
            not_compared.append(n)
    step_missing = _step_missing(cand, not_compared)  # per-step draft tensors: one absent step is MISSING
    missing += step_missing
    not_compared = [n for n in not_compared if n not in step_missing]
    own = _own_steps(cand, ref, consumer)
    entries += [Entry(n, cand[n], Expectation(None, None, csource, OWN_STEP)) for n in own]
    extra = [n for n in cand.names if n not in ref.tensors and n not in aux_names and not is_component(n)
             and n not in own]
    notes = list(rs.notes) + list(cs.notes)
    for label, d in (("reference", ref), ("candidate", cand)):
        if d.metadata and isinstance(d.metadata.extra.get("notes"), list):
            notes += [Note.of("file_note", file=d.path.name, text=x) for x in d.metadata.extra["notes"]
                      if isinstance(x, str)]
    entries = [replace(e, identity=identity(e, ref_slots)) for e in entries]
    return Plan(sides, ref_slots, tuple(entries), tuple(missing), tuple(extra), tuple(not_compared), consumer,
                csource, n_layers, tuple(conflicts), tuple(notes))


def identity(e: Entry, ref_slots: tuple[RefSlot, ...]) -> Identity:
    """The entry's names resolved once: its own kind and index, the expected tensor's, and
    what that tensor is by the reference's values (every later stage reads these)."""
    own, exp = names.parse(e.name), e.expect.tensor
    canon = name_by_values(ref_slots, exp)
    want = names.parse(exp) if exp is not None else None
    held = names.parse(canon) if canon is not None else None
    return Identity(e.name, own.kind, own.index, exp, want.kind if want else None, want.index if want else None,
                    canon, held.kind if held else None, held.index if held else None,
                    stream_by_values(ref_slots, exp), e.expect.stream, e.expect.post_norm)


def _own_steps(cand: Dump, ref: Dump, consumer: object | None) -> list[str]:
    """The candidate's ``recycle.k`` (k >= 1) the reference does not record, when the
    reference's consumer (else the user's) says what the draft recycles: each is checked
    against the candidate's own step k-1 states (compare.steps), never left as "extra"."""
    if consumer is None or getattr(consumer, "recycle", None) not in (Recycle.d_norm, Recycle.d_raw, Recycle.target):
        return []
    return [n for n in cand.names if n not in ref.tensors and names.parse(n).kind == names.RECYCLE
            and names.parse(n).index]


def _recorded_kinds(ref: Dump, cand: Dump) -> set[str]:
    """Kinds the candidate records as a set, so an absent member is MISSING. An indexed kind
    counts only when the candidate holds at least half of the reference's members: a
    speculators file whose last slot is ``hidden.N`` records one stream, not "the streams",
    and the other thirty are not compared rather than missing."""
    count_ref: dict[str, int] = {}
    count_both: dict[str, int] = {}
    for n in ref.tensors:
        k = names.parse(n)
        count_ref[k.kind] = count_ref.get(k.kind, 0) + 1
        if n in cand.tensors:
            count_both[k.kind] = count_both.get(k.kind, 0) + 1
    kinds = set()
    for n in cand.tensors:
        k = names.parse(n)
        if k.index is None or 2 * count_both.get(k.kind, 0) >= count_ref.get(k.kind, 0):
            kinds.add(k.kind)
    return kinds


def _step_missing(cand: Dump, not_compared: list[str]) -> list[str]:
    """Per-step names the candidate should have had. A draft kind the candidate records is
    recorded for every step (one absent step is MISSING, not "not compared"); once it records
    any per-step tensor, the recycled state of every step the reference has is expected too."""
    kinds = {names.parse(n).kind for n in cand.tensors}
    steps = bool(kinds & set(names.DRAFT_KINDS))
    out = []
    for n in not_compared:
        kind = names.parse(n).kind
        if kind in names.DRAFT_KINDS and (kind in kinds or (steps and kind == names.RECYCLE)):
            out.append(n)
    return out


def declared_from_contract(contract: object | None, origin: str = "contract") -> tuple[Declared, int | None]:
    """A contract as a declaration (its slots with their norm states; its consumer only
    when it names one: contracts written before ``consumer`` existed read as EAGLE-3)."""
    from consistency.compare.types import Meaning

    if contract is None:
        return Declared(), None
    slots = tuple(Meaning(s.stream, s.norm) for s in contract.slots)  # type: ignore[attr-defined]
    named = "consumer" in getattr(contract, "model_fields_set", set())
    consumer = contract.consumer if named else None  # type: ignore[attr-defined]
    return Declared(slots, consumer, origin), contract.target.num_layers  # type: ignore[attr-defined]
