"""What compare concludes about one candidate tensor: the value type every later stage reads.

"Which tensor is this" is resolved once, here (``expected``/``ref`` from alignment,
``ident``/``matched``/``holds`` from identification, ``status`` from the judge), and carried
by every finding and report row; nothing downstream recomputes it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from consistency.compare import identify
from consistency.compare.metrics import PairMetrics
from consistency.dump.reader import TensorView

if TYPE_CHECKING:
    from consistency.compare.rows import RowPairing
    from consistency.compare.steps import StepHeld

DRIFT_WITHOUT_GAP = 10.0  # drift (the same tensor, with error) stays within 10x the floor
CLEAR_BEST_RATIO = 1.5  # drift larger than the neighbour gap still counts as drift past this margin
TOKEN_FACTOR = 10.0  # one token beyond 10x the floor is a defect (bf16: 2e-2; the worst benign token measured ~2e-3)
# Drift is a whole tensor's small error: a token 100x the floor (bf16: 0.2, i.e. a different
# vector) is not drift, however small the mean (MTP scenarios: one zeroed position-0 embedding
# left recycle.1 at 8x the floor on average with one token at 177x; the worst benign token of
# a bf16 MoE forward measured 45x, tiny DeepSeek-V3 deep streams).
DRIFT_TOKEN_CAP = DRIFT_WITHOUT_GAP * TOKEN_FACTOR
MAX_BAD_FRACTION = 0.5  # past half of the tokens, it is the tensor that differs, not a few tokens
MATCH_FACTOR = 3.0  # a slot "holds" a reference only within 3x the noise floor of the pair
ProgressFactory = Callable[[str, int], Callable[[int], None]]


class Status(str, Enum):
    """What the judge concluded about one result (a str, so reports and JSON read it as text)."""

    pending = "pending"
    ok = "ok"
    drift = "drift"  # still closest to the expected tensor, with error beyond the floor
    mismatch = "mismatch"
    bad_tokens = "bad_tokens"  # the tensor agrees except for a few token positions
    shape = "shape"
    nonfinite = "nonfinite"
    empty = "empty"
    exact_mismatch = "exact_mismatch"
    unpaired = "unpaired"  # nothing says what it should equal: judged by identification alone
    unverified = "unverified"  # its expected stream is known, but the reference does not record it


@dataclass
class Result:
    """One candidate tensor against the reference tensor it should equal."""

    name: str
    cand: TensorView
    expected: str | None
    ref: TensorView | None
    slot: int | None = None
    expected_stream: int | None = None
    why: str = ""
    status: Status = Status.pending
    metrics: PairMetrics | None = None
    exact: dict | None = None
    floor: float | None = None
    floor_why: str = ""
    ident: identify.Identification | None = None
    notes: list[str] = field(default_factory=list)
    bad_tokens: list[int] = field(default_factory=list)  # token rows far beyond the floor
    matched: bool = False  # the best identification is within noise of the candidate (it *is* that tensor)
    tolerated: bool = False  # passed only because a user tolerance allowed it; holds another tensor
    concat_of: int | None = None  # a slot of a concatenated ``aux`` beside per-slot ``aux.{i}``
    step: StepHeld | None = None  # ``recycle.k``: what each side recycles (compare.steps.resolve)
    rows: RowPairing | None = None  # rows paired by anchor (token_index): compared / one-sided (compare.rows)

    @property
    def identified(self) -> str | None:
        return self.ident.best.name if self.ident and self.ident.best else None

    @property
    def holds(self) -> str | None:
        """What the candidate is, when the values say so (None when it matches nothing)."""
        if self.status in (Status.ok, Status.drift, Status.bad_tokens) and self.ref is not None and not self.tolerated:
            return self.identified if self.ident and self.ref.name in self.ident.group else self.ref.name
        return self.identified if self.matched else None


