"""What compare concludes about one candidate tensor: the value every later stage reads.

A :class:`Result` is the frozen composite of one plan entry's stage values (its
expectation, its rows, its identification, its metrics, its verdict, its recycled state),
built once when compare returns. "Which tensor is this" is final here: ``expected`` and
``expected_stream`` come from the plan (the evidence model), ``holds``/``holds_stream`` from
the judge; nothing downstream recomputes or patches them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from consistency.compare import identify
from consistency.compare.metrics import PairMetrics
from consistency.compare.tolerance import USER_FLOORS
from consistency.compare.types import Entry, Expectation, Identity, Note, RowPairing, Rows, Status, StepHeld, Verdict
from consistency.dump.reader import TensorView

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


@dataclass(frozen=True)
class Result:
    """One candidate tensor against the reference tensor it should equal."""

    entry: Entry
    paired: Rows
    verdict: Verdict
    ident: identify.Identification | None = None
    metrics: PairMetrics | None = None
    step: StepHeld | None = None

    # -- the plan's decisions ---------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def slot(self) -> int | None:
        return self.entry.slot

    @property
    def concat_of(self) -> int | None:
        return self.entry.concat_of

    @property
    def expectation(self) -> Expectation:
        return self.entry.expect

    @property
    def expected(self) -> str | None:
        return self.entry.expect.tensor

    @property
    def expected_stream(self) -> int | None:
        return self.entry.expect.stream

    @property
    def post_norm(self) -> bool:
        return self.entry.expect.post_norm

    @property
    def identity(self) -> Identity:
        """Who this tensor is and what it should be, resolved once by the plan."""
        assert self.entry.identity is not None, "an Entry reaches a Result through compare.plan.build"
        return self.entry.identity

    @property
    def why(self) -> str:
        return self.entry.expect.reason

    # -- the rows as compared -----------------------------------------------------------------
    @property
    def cand(self) -> TensorView:
        return self.paired.cand

    @property
    def ref(self) -> TensorView | None:
        return self.paired.ref

    @property
    def rows(self) -> RowPairing | None:
        return self.paired.pairing

    # -- the verdict ----------------------------------------------------------------------------
    @property
    def status(self) -> Status:
        return self.verdict.status

    @property
    def floor(self) -> float | None:
        return self.verdict.floor

    @property
    def floor_why(self) -> Note | None:
        return self.verdict.floor_why

    @property
    def floor_user(self) -> bool:
        """The floor is the user's (a ``--tolerance`` rule or a threshold), not noise."""
        return self.verdict.floor_why is not None and self.verdict.floor_why.key in USER_FLOORS

    @property
    def bad_tokens(self) -> list[int]:
        return list(self.verdict.bad_tokens)

    @property
    def matched(self) -> bool:
        return self.verdict.matched

    @property
    def tolerated(self) -> bool:
        return self.verdict.tolerated

    @property
    def exact(self) -> dict | None:
        return dict(self.verdict.exact) if self.verdict.exact is not None else None

    @property
    def holds(self) -> str | None:
        """What the candidate is, when the values say so (canonical name; None: matches nothing)."""
        return self.verdict.holds

    @property
    def holds_stream(self) -> int | None:
        return self.verdict.holds_stream

    @property
    def identified(self) -> str | None:
        """The best-ranked reference name (whether or not it is within noise)."""
        return self.ident.best.name if self.ident and self.ident.best else None
