"""The aligner: decide which reference tensor each candidate tensor should equal.

Aux slots are paired by meaning, not only by name: a slot's expected reference is, in
order of authority, the contract's stream for that slot, the reference dump's own aux
slot of that index, or the stream the reference metadata claims. Everything else pairs
by name. A concatenated ``aux`` [T, n*H] is split into n slot views here. A slot the
contract marks post-norm (MTP, EAGLE-1, Medusa read fnorm(s=N)) expects ``final_norm``,
not ``hidden.N`` (compare/steps.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from consistency.compare import steps
from consistency.contract.models import AuxContract, ConsumerSpec, NormState
from consistency.dump import names
from consistency.dump.reader import Dump, TensorView


@dataclass
class SideInfo:
    slots: list[TensorView]
    claimed_streams: list[int] | None
    num_layers: int | None
    hidden_size: int | None
    runtime: str | None
    split_note: str | None = None
    concat: list[TensorView] = field(default_factory=list)  # a concatenated ``aux`` beside ``aux.{i}``, split
    side: str | None = None  # "training"/"serving" as the file's metadata says


@dataclass
class SlotPlan:
    index: int
    cand: TensorView
    expected: str | None
    expected_stream: int | None
    why: str
    post_norm: bool = False  # the expected tensor is fnorm(s=N), the target's final norm applied


@dataclass
class Plan:
    ref: SideInfo
    cand: SideInfo
    slots: list[SlotPlan]
    pairs: list[tuple[str, TensorView, TensorView]]  # by-name pairs (no aux)
    missing: list[str] = field(default_factory=list)  # expected by the reference, absent in the candidate
    extra: list[str] = field(default_factory=list)
    not_compared: list[str] = field(default_factory=list)  # reference kinds the candidate never records
    notes: list[str] = field(default_factory=list)
    ref_meta_tensors: dict = field(default_factory=dict)  # reference per-tensor metadata (norm state, ...)
    consumer: ConsumerSpec | None = None  # the draft's consumer (contract, else reference metadata)
    consumer_origin: str = ""


COMPONENTS = (".hidden_states", ".residual")


def is_component(name: str) -> bool:
    """``aux.{i}.hidden_states`` / ``aux.{i}.residual``: a slot's parts, kept as evidence."""
    return name.startswith(names.AUX + ".") and name.endswith(COMPONENTS)


def hidden_width(d: Dump) -> int | None:
    for n in d.names:
        if names.parse(n).kind in (names.HIDDEN, names.MLP_OUT, names.ATTN_OUT) and d[n].cols > 1:
            return d[n].cols
    return None


def describe_side(d: Dump, width_hint: int | None, n_hint: int | None) -> SideInfo:
    meta = d.metadata
    claimed = meta.aux.stream_ids if meta and meta.aux and meta.aux.stream_ids else None
    n_layers = meta.model.num_layers if meta and meta.model else None
    h = (meta.model.hidden_size if meta and meta.model and meta.model.hidden_size else None) or hidden_width(d) or width_hint
    runtime = None
    if meta and meta.runtime and meta.runtime.name:
        runtime = meta.runtime.name + (f"@{meta.runtime.version}" if meta.runtime.version else "")
    indexed = sorted((names.parse(n).index, n) for n in d.tensors
                     if names.parse(n).kind == names.AUX and names.parse(n).index is not None)
    note = None
    concat: list[TensorView] = []
    if indexed:
        slots = [d[n] for _i, n in indexed]
        if names.AUX in d.tensors:  # both forms: each is checked (which one did the draft get?)
            parts, _ = split_concat(d[names.AUX], claimed, slots[0].cols if slots[0].cols > 1 else h, len(slots))
            if len(parts) == len(slots) and all(p.cols == v.cols for p, v in zip(parts, slots, strict=True)):
                concat = [p.column_view(0, p.cols, f"{names.AUX}[{i}]") for i, p in enumerate(parts)]
                note = f"{d.path.name}: 'aux' stored beside per-slot aux.{{i}}: both compared"
            else:
                note = f"{d.path.name}: 'aux' ({d[names.AUX].cols} wide) does not split into the {len(slots)} slots " \
                       f"aux.{{i}}: compared by name only"
    elif names.AUX in d.tensors:
        slots, note = split_concat(d[names.AUX], claimed, h, n_hint)
    else:
        slots = []
    if h is None and slots:
        h = slots[0].cols
    side = meta.side if meta and meta.side in ("training", "serving") else None
    return SideInfo(slots, claimed, n_layers, h, runtime, note, concat, side)


def split_concat(view: TensorView, claimed: list[int] | None, h: int | None, n_hint: int | None) -> tuple[list[TensorView], str | None]:
    width = view.cols
    n = len(claimed) if claimed else (width // h if h and width % h == 0 else None)
    if n is None and n_hint and width % n_hint == 0:
        n = n_hint
    if n is None or n <= 0 or width % n != 0:
        return [view], f"'aux' is {width} wide and could not be split into slots (hidden size unknown); compared whole"
    w = width // n
    return [view.column_view(i * w, (i + 1) * w, names.aux(i)) for i in range(n)], f"'aux' split into {n} slots of {w}"


def build(ref: Dump, cand: Dump, contract: AuxContract | None = None) -> Plan:
    ref_h, cand_h = hidden_width(ref), hidden_width(cand)
    c_width = contract.slots[0].width if contract and contract.slots[0].width else None
    n_hint = len(contract.slots) if contract else None
    rs = describe_side(ref, cand_h or c_width, n_hint)
    cs = describe_side(cand, ref_h or rs.hidden_size or c_width, n_hint or (len(rs.slots) or None))
    plan = Plan(rs, cs, [], [], ref_meta_tensors=dict(ref.metadata.tensors) if ref.metadata else {})
    plan.consumer, plan.consumer_origin = steps.consumer_of(contract, ref)
    plan.notes += [n for n in (rs.split_note, cs.split_note) if n]
    contract_streams = contract.stream_ids if contract else None
    for i, view in enumerate(cs.slots):
        plan.slots.append(_expect(i, view, ref, rs, contract_streams, contract))
    n_expected = len(contract_streams) if contract_streams else len(rs.slots)
    for i in range(len(cs.slots), n_expected):
        plan.missing.append(names.aux(i))
    # by-name pairs for everything that is not an aux slot
    aux_names = {v.name for v in rs.slots} | {v.name for v in cs.slots} | {names.AUX}
    cand_kinds = _recorded_kinds(ref, cand)
    for n in ref.names:
        if n in aux_names:
            continue
        if n in cand.tensors:
            plan.pairs.append((n, ref[n], cand[n]))
        elif names.parse(n).kind in cand_kinds:
            plan.missing.append(n)
        else:
            plan.not_compared.append(n)
    step_missing = steps.step_missing(ref, cand, plan.not_compared)  # per-step draft tensors (compare/steps.py)
    plan.missing += step_missing
    plan.not_compared = [n for n in plan.not_compared if n not in step_missing]
    plan.extra = [n for n in cand.names if n not in ref.tensors and n not in aux_names and not is_component(n)]
    for d in (ref, cand):
        if d.metadata and isinstance(d.metadata.extra.get("notes"), list):
            plan.notes += [f"{d.path.name}: {x}" for x in d.metadata.extra["notes"] if isinstance(x, str)]
    return plan


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


def _expect(i: int, view: TensorView, ref: Dump, rs: SideInfo, contract_streams: list[int] | None,
            contract: AuxContract | None = None) -> SlotPlan:
    if contract_streams is not None:
        if i >= len(contract_streams):
            return SlotPlan(i, view, None, None, "the contract has no such slot")
        s = contract_streams[i]
        if contract is not None and contract.slots[i].norm == NormState.final_norm:  # MTP / EAGLE-1 / Medusa
            name, why = steps.slot_expectation(ref, contract.slots[i], i, rs.slots)
            return SlotPlan(i, view, name, s, why, post_norm=True)
        return SlotPlan(i, view, _stream_tensor(ref, rs, s), s, "contract")
    last = steps.last_state_default(ref, steps.declared_consumer(ref), bool(rs.slots or rs.claimed_streams))
    if i == 0 and last is not None:
        return SlotPlan(i, view, last[0], None, last[1], post_norm=True)
    if i < len(rs.slots):
        s = rs.claimed_streams[i] if rs.claimed_streams and i < len(rs.claimed_streams) else None
        return SlotPlan(i, view, rs.slots[i].name, s, f"reference {rs.slots[i].name}")
    if rs.claimed_streams and i < len(rs.claimed_streams):
        s = rs.claimed_streams[i]
        return SlotPlan(i, view, _stream_tensor(ref, rs, s), s, "reference metadata")
    if rs.slots:
        return SlotPlan(i, view, None, None, "the reference has fewer slots")
    return SlotPlan(i, view, None, None, "no contract, no reference aux slots and no claimed streams")


def _stream_tensor(ref: Dump, rs: SideInfo, s: int) -> str | None:
    if names.hidden(s) in ref.tensors:
        return names.hidden(s)
    if rs.claimed_streams and s in rs.claimed_streams:
        j = rs.claimed_streams.index(s)
        if j < len(rs.slots):
            return rs.slots[j].name
    return None
