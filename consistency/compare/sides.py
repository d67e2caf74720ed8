"""The first stage: what each dump holds and says, read once (:class:`SideFacts`).

Slots are named by their own index: ``aux.2`` is slot 2 whatever else the file holds (a
pipeline stage without the first slots, vLLM's ``is_last_rank`` guard), never renumbered.
A concatenated ``aux`` [T, n*H] is split into n slot views. Claims (``aux.stream_ids`` with
the norm state the metadata gives them, ``extra.consumer``) are read but not trusted here.
"""

from __future__ import annotations

from types import MappingProxyType

from pydantic import ValidationError

from consistency.compare.types import Claim, Declared, Note, Pair, SideFacts
from consistency.contract import consumers
from consistency.contract.models import Consumer, ConsumerSpec, NormState
from consistency.dump import names
from consistency.dump.reader import Dump, TensorView

EXTRA_KEY = "consumer"  # metadata.extra["consumer"] (docs/format.md)


def hidden_width(d: Dump) -> int | None:
    """The hidden size a dump's tensors show: a stream or block output, else a per-slot
    ``aux.{i}`` (one slot is one hidden state), so the other side's concatenated ``aux`` splits."""
    for n in d.names:
        if names.parse(n).kind in (names.HIDDEN, names.MLP_OUT, names.ATTN_OUT) and d[n].cols > 1:
            return d[n].cols
    for n in d.names:
        if n.startswith(names.AUX + ".") and names.parse(n).kind == names.AUX and names.parse(n).index is not None \
                and n.count(".") == 1 and d[n].cols > 1:
            return d[n].cols
    return None


def declared_consumer_of(kind: str) -> ConsumerSpec:
    """A method's name ("mtp") as that method's majority serving behaviour."""
    k = Consumer(kind)
    rows = [r for r in consumers.rows(k) if r.side == "serving" and r.max_version is None]
    return rows[0].spec() if rows else ConsumerSpec(kind=k)


def declared_consumer(d: Dump) -> ConsumerSpec | None:
    """``metadata.extra["consumer"]``: a ConsumerSpec object, or a kind ("mtp") read as that
    method's majority serving behaviour. Untrusted: anything else is ignored."""
    raw = d.metadata.extra.get(EXTRA_KEY) if d.metadata is not None else None
    try:
        if isinstance(raw, dict):
            return ConsumerSpec.model_validate(raw)
        if isinstance(raw, str):
            return declared_consumer_of(raw)
    except (ValidationError, ValueError):
        return None
    return None


def _claims(d: Dump) -> tuple[Claim, ...] | None:
    """``aux.stream_ids`` with the norm state the metadata gives the slots (``aux.norm``,
    or a slot's own ``tensors[aux.i].norm``): an MTP reference claiming ``[N]`` with
    ``final_norm`` claims fnorm(s=N), never the pre-norm stream N."""
    meta = d.metadata
    if meta is None or meta.aux is None or not meta.aux.stream_ids:
        return None
    out = []
    for i, s in enumerate(meta.aux.stream_ids):
        tm = meta.tensors.get(names.aux(i))
        norm = tm.norm if tm is not None and tm.norm is not None else meta.aux.norm
        out.append(Claim(int(s), norm if norm is not None else NormState.none))
    return tuple(out)


def describe(d: Dump, width_hint: int | None, n_hint: int | None, default_label: str) -> SideFacts:
    meta = d.metadata
    claims = _claims(d)
    n_layers = meta.model.num_layers if meta and meta.model else None
    h = (meta.model.hidden_size if meta and meta.model and meta.model.hidden_size else None) or hidden_width(d) \
        or width_hint
    runtime = None
    if meta and meta.runtime and meta.runtime.name:
        runtime = meta.runtime.name + (f"@{meta.runtime.version}" if meta.runtime.version else "")
    indexed = {names.parse(n).index: d[n] for n in d.tensors
               if names.parse(n).kind == names.AUX and names.parse(n).index is not None}
    notes: list[Note] = []
    concat: list[TensorView] = []
    slots: dict[int, TensorView] = dict(sorted(indexed.items()))
    if indexed and names.AUX in d.tensors:  # both forms: each is checked (which one did the draft get?)
        first = next(iter(slots.values()))
        parts, _ = split_concat(d[names.AUX], claims, first.cols if first.cols > 1 else h, len(slots))
        if len(parts) == len(slots) and all(p.cols == v.cols for p, v in zip(parts, slots.values(), strict=True)):
            concat = [p.column_view(0, p.cols, f"{names.AUX}[{i}]") for i, p in enumerate(parts)]
            notes.append(Note.of("concat_beside_slots", file=d.path.name))
        else:
            notes.append(Note.of("concat_unsplit", file=d.path.name, width=d[names.AUX].cols, slots=len(slots)))
    elif names.AUX in d.tensors:
        parts, note = split_concat(d[names.AUX], claims, h, n_hint)
        slots = dict(enumerate(parts))
        notes.append(note)
    if h is None and slots:
        h = next(iter(slots.values())).cols
    side = meta.side if meta and meta.side in ("training", "serving") else None
    return SideFacts(side or default_label, MappingProxyType(slots), claims, n_layers, h, runtime,
                     declared_consumer(d), side, tuple(concat), tuple(notes))


def split_concat(view: TensorView, claims: tuple[Claim, ...] | None, h: int | None,
                 n_hint: int | None) -> tuple[list[TensorView], Note]:
    width = view.cols
    n = len(claims) if claims else (width // h if h and width % h == 0 else None)
    if n is None and n_hint and width % n_hint == 0:
        n = n_hint
    if n is None or n <= 0 or width % n != 0:
        return [view], Note.of("concat_whole", width=width)
    w = width // n
    return [view.column_view(i * w, (i + 1) * w, names.aux(i)) for i in range(n)], \
        Note.of("concat_split", slots=n, width=w)


def recorded_top(d: Dump) -> int | None:
    """N when a dump records every stream 0..M (M > 2, so the top of a full recording is the
    model's last layer); a thin one proves nothing: its highest stream is not the top."""
    hs = {s for s in (names.stream_of(n) for n in d.tensors) if s is not None}
    return max(hs) if len(hs) > 2 and hs == set(range(max(hs) + 1)) else None


def describe_pair(ref: Dump, cand: Dump, width_hint: int | None, n_hint: int | None) -> Pair[SideFacts]:
    """Both sides; each helps the other split a concatenated ``aux`` (the hidden size)."""
    ref_h, cand_h = hidden_width(ref), hidden_width(cand)
    rs = describe(ref, cand_h or width_hint, n_hint, "reference")
    cs = describe(cand, ref_h or rs.hidden_size or width_hint, n_hint or (rs.slot_count or None), "candidate")
    return Pair(rs, cs)


def combine_declared(by_ids: Declared, by_contract: Declared, contract_name: str) -> tuple[Declared, list[Note]]:
    """Two declarations of the reference (``--contract`` and ``--ref-layer-ids``): one
    declaration when they name the same streams (the contract's, which carries norm states),
    a usage error when they do not. Dropping either silently would let the user believe
    a declaration was checked that never was."""
    from consistency.errors import UsageError

    if by_ids.slots is None:
        return by_contract, []
    mine = [m.stream for m in by_ids.slots]
    theirs = [m.stream for m in by_contract.slots or ()]
    if mine != theirs:
        raise UsageError(f"{by_ids.origin} declares reference streams {mine} but the contract {contract_name} "
                         f"declares {theirs}: two declarations of one reference disagree; give one of them")
    return by_contract, [Note.of("declared_twice", by=by_ids.origin, contract=contract_name, streams=tuple(mine))]
