"""The values compare's stages return, and the one precedence rule they follow.

Each stage is a function from earlier values to a new value, never a writer of an earlier
stage's fields (the shape of SGLang's comparator: planner, executor, types per stage, a
``Pair[T]`` for the two sides):

    sides (Pair[SideFacts]) -> reference slots (RefSlot) -> plan (Plan: an Entry per
    candidate tensor, each with its Expectation) -> rows (Rows) -> identification
    (Identification) -> metrics -> verdict (Verdict) -> recycled state (StepHeld)

and :class:`Result` is the frozen composite of one entry's values, built once at the end.
"Which tensor is this and what should it equal" is decided in the plan, from evidence in a
fixed order of authority (:class:`Source`), and never recomputed downstream. Words are made
in ``consistency.diagnose`` only: a stage says what it found as data (:class:`Note`,
:class:`Conflict`), never as a sentence.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType
from typing import Any, Generic, TypeVar

from consistency.contract.models import ConsumerSpec, NormState
from consistency.dump.reader import TensorView

T = TypeVar("T")
U = TypeVar("U")
SIDES = ("ref", "cand")


@dataclass(frozen=True)
class Pair(Generic[T]):
    """The reference and the candidate value of one thing (SGLang comparator's ``Pair``)."""

    ref: T
    cand: T

    def map(self, fn: Callable[[T], U]) -> Pair[U]:
        return Pair(fn(self.ref), fn(self.cand))

    def side(self, which: str) -> T:
        if which not in SIDES:
            raise ValueError(f"side is 'ref' or 'cand', not {which!r}")
        return self.ref if which == "ref" else self.cand

    def items(self) -> Iterator[tuple[str, T]]:
        yield "ref", self.ref
        yield "cand", self.cand


class Source(str, Enum):
    """Who decided what a candidate tensor should equal, strongest first.

    The reference's values > the reference's own claims (its metadata, its declared
    consumer) > what the user declares (``--contract``, ``--layer-ids``, a gate's
    ``contract =``). The candidate's claims are compared, never a source: a serving dump
    must never certify itself (docs/architecture.md, "The evidence model")."""

    ref_values = "reference values"
    ref_claim = "reference claim"
    declared = "user declaration"
    name = "same name"
    none = "nothing"


class Status(str, Enum):
    """What the judge concluded about one result (a str, so reports and JSON read it as text)."""

    ok = "ok"
    drift = "drift"  # still closest to the expected tensor, with error beyond the floor
    mismatch = "mismatch"
    bad_tokens = "bad_tokens"  # the tensor agrees except for a few token positions
    shape = "shape"
    nonfinite = "nonfinite"
    empty = "empty"
    exact_mismatch = "exact_mismatch"
    unpaired = "unpaired"  # nothing says what it should equal: judged by identification alone
    unverified = "unverified"  # its expected tensor is known, but the reference does not record it
    skipped = "skipped"  # not evaluated (too large to compare exactly, ...): terminal, never OK


CHECKED = frozenset({Status.ok, Status.drift, Status.bad_tokens, Status.mismatch, Status.nonfinite,
                     Status.exact_mismatch})  # a verdict about values (compared, whatever the outcome)


@dataclass(frozen=True)
class Meaning:
    """What a tensor is in the canonical unit: a stream, and whether the target's final norm
    was applied to it (``fnorm(s=N)`` is ``Meaning(N, final_norm)``). ``stream`` None:
    the norm state is known but not the stream."""

    stream: int | None
    norm: NormState = NormState.none

    @property
    def post_norm(self) -> bool:
        return self.norm == NormState.final_norm

    def agrees(self, other: Meaning) -> bool:
        """Same tensor as far as both say (an unknown stream agrees with any)."""
        same_stream = self.stream is None or other.stream is None or self.stream == other.stream
        return same_stream and self.norm == other.norm


@dataclass(frozen=True)
class Note:
    """Something a stage did or assumed, as data; ``consistency.diagnose.words.note`` words it.
    ``key`` names the kind of note (its template), ``data`` the facts it states."""

    key: str
    data: Mapping[str, Any] = field(default_factory=dict)

    @staticmethod
    def of(key: str, **data: Any) -> Note:
        return Note(key, MappingProxyType(dict(data)))


@dataclass(frozen=True)
class Conflict:
    """Two sources that disagree on what a slot is. The stronger one won (``winner``); the
    other is reported, never silently dropped (``kind`` is the finding code diagnosis uses)."""

    kind: str  # CONTRACT_CONFLICT (a user declaration against the reference), REF_CLAIM_CONTRADICTED, ...
    slot: int | None
    winner: Source
    holds: Meaning  # what the winner says
    said: Meaning  # what the loser says
    by: str  # who said the losing thing: "contract", "--layer-ids", "metadata", ...
    detail: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Claim:
    """What a side's metadata says slot i holds (``aux.stream_ids`` and the norm state)."""

    stream: int
    norm: NormState = NormState.none

    @property
    def meaning(self) -> Meaning:
        return Meaning(self.stream, self.norm)


@dataclass(frozen=True)
class SideFacts:
    """One dump as the planner reads it: its slots by their own index (``aux.2`` is slot 2,
    whatever else is there), its claims and its model facts. Nothing here is trusted yet."""

    label: str  # "training"/"serving" as its metadata says, else "reference"/"candidate"
    slots: Mapping[int, TensorView]  # slot index -> view (``aux.{i}``, or a split concatenated ``aux``)
    claims: tuple[Claim, ...] | None
    num_layers: int | None
    hidden_size: int | None
    runtime: str | None
    consumer: ConsumerSpec | None  # metadata.extra["consumer"]
    side: str | None  # "training"/"serving" when the metadata says so
    concat: tuple[TensorView, ...] = ()  # a concatenated ``aux`` beside ``aux.{i}``, split into slot views
    notes: tuple[Note, ...] = ()

    @property
    def slot_count(self) -> int:
        """Slots the side defines: one past its highest slot index."""
        return max(self.slots) + 1 if self.slots else 0

    @property
    def claimed_streams(self) -> list[int] | None:
        return [c.stream for c in self.claims] if self.claims is not None else None

    def claim(self, i: int) -> Claim | None:
        return self.claims[i] if self.claims is not None and i < len(self.claims) else None


@dataclass(frozen=True)
class RefSlot:
    """What the reference's slot i is: its values decide when they can (``values``: the
    reference stream or final norm it equals), else its claim."""

    index: int
    view: TensorView
    values: str | None  # the reference tensor its values equal (hidden.3, final_norm), None: not told
    claim: Claim | None
    meaning: Meaning | None  # from the values, else the claim; None when neither says
    source: Source


@dataclass(frozen=True)
class Declared:
    """What the user declares the draft reads, slot by slot (``--contract``, ``--layer-ids``,
    a gate's ``contract =``), and what its consumer is."""

    slots: tuple[Meaning, ...] | None = None
    consumer: ConsumerSpec | None = None  # only when the declaration names one
    origin: str = ""  # "contract", "--layer-ids", ...

    def slot(self, i: int) -> Meaning | None:
        return self.slots[i] if self.slots is not None and i < len(self.slots) else None


@dataclass(frozen=True)
class Expectation:
    """What one candidate tensor should equal, decided once (``reason`` is a key that
    diagnose words: "ref_slot", "ref_claim", "declared", "consumer", "name", "none", ...)."""

    tensor: str | None  # the reference tensor to compare with (None: nothing to compare with)
    meaning: Meaning | None
    source: Source
    reason: str
    stream_known: bool = True  # False: the tensor is known but nothing says its stream

    @property
    def stream(self) -> int | None:
        return self.meaning.stream if self.meaning is not None else None

    @property
    def post_norm(self) -> bool:
        return self.meaning is not None and self.meaning.post_norm


@dataclass(frozen=True)
class Identity:
    """Who one candidate tensor is and what it should be, its names parsed once, by the plan
    (``compare.plan.identity``): diagnose reads these fields and never re-parses a result's
    names or re-derives what a reference slot is.

    ``expected`` is the reference tensor as the reference names it (``aux.2``);
    ``canonical`` what that tensor is by the reference's values (a slot whose values are
    ``hidden.3`` is ``hidden.3``, decided by compare.refslots); ``ref_stream`` the stream
    the expected tensor stands for by its name or its reference slot (None: not a pre-norm
    stream), ``stream`` the stream the plan expects (its Expectation)."""

    name: str  # the candidate tensor
    kind: str  # its kind by its name: aux, recycle, draft_ids, hidden, ... (dump.names)
    index: int | None  # its index: aux.2 -> 2, recycle.1 -> step 1
    expected: str | None = None
    expected_kind: str | None = None
    expected_index: int | None = None
    canonical: str | None = None
    canonical_kind: str | None = None
    canonical_index: int | None = None
    ref_stream: int | None = None
    stream: int | None = None
    post_norm: bool = False


@dataclass(frozen=True)
class Entry:
    """One candidate tensor to judge: a slot, a split ``aux`` part, or a by-name pair."""

    name: str
    cand: TensorView
    expect: Expectation
    slot: int | None = None
    concat_of: int | None = None  # a slot of a concatenated ``aux`` beside per-slot ``aux.{i}``
    identity: Identity | None = None  # resolved by the plan once every reference slot is known


@dataclass(frozen=True)
class Plan:
    """Every decision made before a value is read, plus the conflicts found making them."""

    sides: Pair[SideFacts]
    ref_slots: tuple[RefSlot, ...]
    entries: tuple[Entry, ...]
    missing: tuple[str, ...]  # expected by the reference (or the declaration), absent in the candidate
    extra: tuple[str, ...]
    not_compared: tuple[str, ...]  # reference kinds the candidate never records
    consumer: ConsumerSpec | None  # the draft's consumer: the reference's claim, else the user's
    consumer_source: Source
    num_layers: int | None  # N: the reference's metadata, else the declaration (never the highest recorded stream)
    conflicts: tuple[Conflict, ...] = ()
    notes: tuple[Note, ...] = ()

    @property
    def ref(self) -> SideFacts:
        return self.sides.ref

    @property
    def cand(self) -> SideFacts:
        return self.sides.cand

    @property
    def slots(self) -> tuple[Entry, ...]:
        return tuple(e for e in self.entries if e.slot is not None)

    def entry(self, name: str) -> Entry | None:
        return next((e for e in self.entries if e.name == name), None)


Key = tuple[int, int]  # (anchor, occurrence): the i-th row at anchor a is (a, i)


@dataclass(frozen=True)
class RowPairing:
    """How one pair's rows met (``TensorMeta.token_index`` anchors): compared on
    ``compared`` common anchors; the rest held by one side only."""

    compared: int
    cand_rows: int
    ref_rows: int
    cand_only: tuple[int, ...] = ()  # anchors only the candidate has (the first few)
    ref_only: tuple[int, ...] = ()
    n_cand_only: int = 0
    n_ref_only: int = 0
    origin: str = ""  # "both", "candidate", "reference", "step0": whose token_index paired them
    past_end: bool = False  # every candidate-only anchor lies past the reference's last one (drafted continuation)
    ref_span: tuple[int, int] | None = None  # the reference's first and last anchor
    cand_keys: tuple[Key, ...] = ()  # (anchor, occurrence) of each row of the compared candidate view
    ref_keys: tuple[Key, ...] = ()

    @property
    def one_sided(self) -> bool:
        return bool(self.n_cand_only or self.n_ref_only)

    def as_dict(self) -> dict[str, Any]:
        return {"compared": self.compared, "candidate_rows": self.cand_rows, "reference_rows": self.ref_rows,
                "candidate_only": list(self.cand_only), "candidate_only_count": self.n_cand_only,
                "reference_only": list(self.ref_only), "reference_only_count": self.n_ref_only,
                "paired_by": self.origin, "past_reference_end": self.past_end,
                "reference_span": list(self.ref_span) if self.ref_span else None}


@dataclass(frozen=True)
class Rows:
    """The rows stage's value for one entry: the two views as compared (row subsets where
    anchors paired them) and how they were paired (None: by order, all rows)."""

    cand: TensorView
    ref: TensorView | None
    pairing: RowPairing | None = None

    @property
    def none_common(self) -> bool:
        return self.pairing is not None and self.pairing.compared == 0


@dataclass(frozen=True)
class StepHeld:
    """What ``recycle.k`` holds on each side: a kind (d_norm, d_raw, target) and the tensor
    that showed it ("candidate:draft_norm.0", "reference:final_norm[+1]" for rows one later),
    matched row by row at equal anchors.

    ``rule`` is what it should be: the reference's own recycle (its values), else the
    reference's declared consumer, else the user's contract (``rule_source`` says which);
    never the candidate's. ``own_only``: the reference has no row at the candidate's anchors
    (a serving step >= 1), so only the candidate's own states could be tried."""

    cand_kind: Any  # Recycle | None
    cand_source: str | None
    ref_kind: Any
    ref_source: str | None
    distances: Mapping[str, float] = field(default_factory=dict)  # candidate to each source tried (sample)
    own_only: bool = False
    rule: Any = None  # Recycle | None
    rule_source: Source = Source.none
    rule_kind: str = ""  # the consumer kind that says the rule ("mtp", ...)
    anchors: tuple[int, ...] = ()  # the candidate rows' anchors (first few), for the report
    claimed_rule: Any = None  # what the candidate's metadata claims it recycles (compared, never trusted)


@dataclass(frozen=True)
class Verdict:
    """The judge's value for one entry. ``holds`` is what the values say the candidate is,
    under its canonical name (a reference slot equal to ``hidden.3`` is ``hidden.3``), and
    ``holds_stream`` its stream; both None when it matches nothing within noise."""

    status: Status
    floor: float | None = None
    floor_why: Note | None = None  # where the floor came from (compare.tolerance), worded by diagnose
    bad_tokens: tuple[int, ...] = ()  # token rows far beyond the floor
    matched: bool = False  # the best identification is within noise of the candidate (it *is* that tensor)
    tolerated: bool = False  # within a user tolerance only; it is not the expected tensor
    holds: str | None = None
    holds_stream: int | None = None
    held: str | None = None  # the reference tensor name that showed it (``holds`` is its canonical name)
    exact: Mapping[str, Any] | None = None
    skipped: str = ""  # why it was not evaluated (Status.skipped), a key diagnose words ("int_too_large")
