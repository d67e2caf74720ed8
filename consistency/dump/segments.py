"""Which rows of a dump's forward passes belong to which request, verify passes included.

A server decoding with a draft runs *target-verify* passes: pass k holds the token the
last verification produced and the drafted tokens after it ([t_s, d1, .., dK] at positions
s..s+K). The target accepts a prefix of the drafts and adds its own token, so the next pass
starts right after the accepted ones (at s+a+1): it *rewinds* into pass k's drafted rows,
and the rows it recomputes supersede pass k's (those tokens were rejected). A row is kept
when it is the last pass's capture of its position and the next pass continued from it:

* a run that starts inside the drafted rows of the request's previous pass (after that
  pass's first row, which was already accepted) supersedes them: counted, not compared;
* a run that starts anywhere else before the request's last position is refused: prompt
  rows (the request's first pass) and rows a later pass confirmed are never recomputed;
* the last verify pass of a request has no next pass to confirm its drafts: its rows after
  the first are *unconfirmed* and not kept (said, never compared as if accepted);
* one pass that holds a position twice (a tree of drafts, EAGLE top-k > 1) cannot say which
  of its rows was accepted: those rows are *ambiguous* and not kept.

Everything here is data (:class:`Verify`, :class:`Gap`); consistency.diagnose
words it. A request's *generation* starts at its first decode pass (one row) or verify
pass (one that rewinds, or is rewound into, or one of the request's trailing passes of one
length, :func:`verify_passes`: a pass that accepted every draft rewinds nothing): rows from
there on are the response a server drafts on (replay scores there when nothing better says
which positions were drafted).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from consistency.errors import InputError

EXAMPLES = 8  # rewinds described one by one in the facts


@dataclass
class Segment:
    """One request's tokens on the stitched axis, in position order."""

    request: str
    rows: list[int] = field(default_factory=list)  # rows of the concatenated captures
    positions: list[int] = field(default_factory=list)
    passes: list[int] = field(default_factory=list)  # the forward pass (0-based) of each row
    rewinds: int = 0
    superseded: int = 0
    unconfirmed: int = 0
    ambiguous: list[int] = field(default_factory=list)  # positions a pass held twice (not kept)
    generated_from: int | None = None  # first position of the request's first decode or verify pass
    block: tuple[int, int] | None = None  # (pass, position): a tree inside that pass from that position on
    spans: list[tuple[int, int, int]] = field(default_factory=list)  # (pass, first position, rows) of each run added

    @property
    def start(self) -> int | None:
        return self.positions[0] if self.positions else None

    def expects(self) -> int | None:
        return self.positions[-1] + 1 if self.positions else None

    def last_pass_start(self) -> int:
        """Index (in this segment) of the first row of the last pass that added rows."""
        k = self.passes[-1]
        i = len(self.passes) - 1
        while i > 0 and self.passes[i - 1] == k:
            i -= 1
        return i

    def cut(self, at: int) -> int:
        """Drop the rows from index ``at`` on; return how many."""
        n = len(self.rows) - at
        del self.rows[at:], self.positions[at:], self.passes[at:]
        return n

    def generation(self, pos: int) -> None:
        self.generated_from = pos if self.generated_from is None else min(self.generated_from, pos)


@dataclass
class Verify:
    """What verify passes did to a dump's rows (all zero for a dump without them)."""

    rewinds: int = 0  # passes that started inside the previous pass's drafted rows
    superseded: int = 0  # rows a later pass recomputed (rejected drafts): not compared
    unconfirmed: int = 0  # drafted rows of a request's last verify pass: no later pass confirmed them
    ambiguous: int = 0  # rows at a position one pass held twice (a tree of drafts): not compared
    requests: int = 0  # requests with at least one rewind
    examples: list[dict[str, Any]] = field(default_factory=list)  # {request, pass, position, rows} per rewind

    @property
    def any(self) -> bool:
        return bool(self.rewinds or self.ambiguous)

    def as_dict(self) -> dict[str, Any]:
        return {"rewinds": self.rewinds, "superseded": self.superseded, "unconfirmed": self.unconfirmed,
                "ambiguous": self.ambiguous, "requests": self.requests, "examples": list(self.examples)}


@dataclass(frozen=True)
class Gap:
    """Positions a request skips between two captured runs (``first``..``last`` were never
    recorded): a fact; consistency.diagnose words it."""

    where: str  # the positions tensor's key of the pass that jumped ("positions#3")
    first: int
    last: int


class Joiner:
    """Applies runs of consecutive positions, pass by pass, to their requests' segments."""

    def __init__(self, path: Any, key_of: Callable[[int], str], recorded: bool = True) -> None:
        self.path = path
        self.recorded = recorded  # False: "positions" are the row order (request ids without positions)
        self.key_of = key_of  # pass index -> the positions tensor's key ("positions", "positions#3")
        self.segs: list[Segment] = []
        self.verify = Verify()
        self.gaps: list[Gap] = []

    # -- one run ----------------------------------------------------------------------------
    def add(self, seg: Segment, k: int, rows: list[int], pos: list[int], where: str) -> None:
        """Rows ``rows`` (positions ``pos``, consecutive) of pass ``k`` continue ``seg``."""
        start = pos[0]
        seg.spans.append((k, start, len(rows)))
        if seg.block is not None and seg.block[0] == k and start >= seg.block[1]:
            seg.ambiguous += pos
            return
        if seg.positions and start <= seg.positions[-1]:
            if seg.passes[-1] == k:  # the same pass holds these positions twice: a tree of drafts
                at = next(i for i in range(seg.last_pass_start(), len(seg.rows)) if seg.positions[i] >= start)
                seg.ambiguous += seg.positions[at:] + pos
                seg.cut(at)
                seg.block = (k, start)
                seg.generation(start)
                return
            self._rewind(seg, k, start, where)
        elif seg.positions and start > seg.positions[-1] + 1 and self.recorded:
            lost = [p for p in range(seg.positions[-1] + 1, start) if p not in seg.ambiguous]
            if lost:
                self.gaps.append(Gap(where, lost[0], lost[-1]))
        if seg.positions and len(rows) == 1:
            seg.generation(start)  # a decode step: this request generates from here on
        seg.rows += rows
        seg.positions += pos
        seg.passes += [k] * len(rows)

    def can_rewind(self, seg: Segment, k: int, start: int) -> bool:
        """``start`` lies inside the drafted rows of the segment's last pass (after its first
        row), and that pass is neither this one nor the request's first."""
        if not seg.positions or seg.passes[-1] == k or seg.passes[-1] == seg.passes[0]:
            return False
        first = seg.positions[seg.last_pass_start()]
        return first < start <= seg.positions[-1]

    def _rewind(self, seg: Segment, k: int, start: int, where: str) -> None:
        if not self.can_rewind(seg, k, start):
            raise InputError(self.path, f"tensor {where!r}: {seg.request} goes from position {seg.positions[-1]} to "
                             f"{start} (positions go backwards or overlap; a verify pass rewinds only into the drafted "
                             "rows of the pass before it)")
        first_of_last = seg.positions[seg.last_pass_start()]
        at = next(i for i in range(seg.last_pass_start(), len(seg.rows)) if seg.positions[i] >= start)
        n = seg.cut(at)
        seg.rewinds += 1
        seg.superseded += n
        seg.generation(first_of_last)
        v = self.verify
        v.rewinds += 1
        v.superseded += n
        if len(v.examples) < EXAMPLES:
            v.examples.append({"request": seg.request, "pass": where, "position": start, "rows": n})

    # -- the end of the dump ----------------------------------------------------------------
    def finish(self) -> list[Segment]:
        """Drop each request's unconfirmed drafted rows; tally the facts."""
        for seg in self.segs:
            verified = verify_passes(seg)
            if verified is not None:
                seg.generation(verified)
            if (seg.rewinds or verified is not None) and seg.positions:
                at = seg.last_pass_start() + 1
                n = seg.cut(at) if at < len(seg.rows) else 0
                seg.unconfirmed += n
                self.verify.unconfirmed += n
            self.verify.ambiguous += len(seg.ambiguous)
            self.verify.requests += bool(seg.rewinds)
        return self.segs


MIN_VERIFY_PASSES = 2  # equal-length passes in a row before they read as verify passes without a rewind


def verify_passes(seg: Segment) -> int | None:
    """The first position of a request's verify passes, read from their lengths: a chain server
    verifies ``[root, d1..dK]`` in every pass, so K+1 rows each however many drafts the target
    accepted; a pass that accepts all of them is continued at its end, with no rewind to show it.
    The request's trailing passes of one length L >= 2 (at least two of them, after its first
    pass) are verify passes when a rewind confirmed that the request speculates or L is shorter
    than its first pass (prefill chunks are as long as the first one, but for the last)."""
    passes: list[tuple[int, int, int]] = []
    for k, start, n in seg.spans:  # one entry per pass (a tree's runs are one pass)
        if passes and passes[-1][0] == k:
            passes[-1] = (k, passes[-1][1], passes[-1][2] + n)
        else:
            passes.append((k, start, n))
    if len(passes) < 1 + MIN_VERIFY_PASSES:
        return None
    first, rest = passes[0], passes[1:]
    length = rest[-1][2]
    run = 0
    while run < len(rest) and rest[-1 - run][2] == length:
        run += 1
    if length < 2 or run < MIN_VERIFY_PASSES or not (seg.rewinds or length < first[2]):
        return None
    return rest[-run][1]


def runs(pos: np.ndarray) -> list[tuple[int, int]]:
    """[i, j) of each run of consecutive positions (p, p+1, ...) in one pass."""
    out, i = [], 0
    while i < len(pos):
        j = i + 1
        while j < len(pos) and pos[j] == pos[j - 1] + 1:
            j += 1
        out.append((i, j))
        i = j
    return out


def by_request(path: Any, req: np.ndarray, pos: np.ndarray, offsets: np.ndarray,
               key_of: Callable[[int], str], recorded: bool = True) -> Joiner:
    """Rows grouped by request id; inside a request, runs continue, rewind (verify) or fail."""
    j = Joiner(path, key_of, recorded)
    by_id: dict[int, Segment] = {}
    for k in range(len(offsets) - 1):
        lo, hi = int(offsets[k]), int(offsets[k + 1])
        r_k, p_k = req[lo:hi].tolist(), pos[lo:hi].tolist()
        i = 0
        while i < len(r_k):  # runs: same request, consecutive positions
            e = i + 1
            while e < len(r_k) and r_k[e] == r_k[i] and p_k[e] == p_k[e - 1] + 1:
                e += 1
            r = r_k[i]
            seg = by_id.get(r)
            if seg is None:
                seg = by_id[r] = Segment(f"request {r}")
                j.segs.append(seg)
            j.add(seg, k, list(range(lo + i, lo + e)), p_k[i:e], key_of(k))
            i = e
    return j


def by_positions(path: Any, parts: list[np.ndarray], offsets: np.ndarray, key_of: Callable[[int], str]) -> Joiner:
    """Runs of consecutive positions, each continuing the open segment that expects it, else
    rewinding one (a verify pass), else a tree inside its own pass, else after a gap."""
    j = Joiner(path, key_of)
    segs = j.segs
    for k, pos in enumerate(parts):
        key = key_of(k)
        used: set[int] = set()
        for a, b in runs(pos):
            start = int(pos[a])
            rows = list(range(int(offsets[k]) + a, int(offsets[k]) + b))
            free = [(n, s) for n, s in enumerate(segs) if n not in used]
            seg = next((s for _n, s in free if s.expects() == start), None)
            if seg is None and k > 0:
                seg = next((s for n, s in enumerate(segs) if n in used and _tree(s, k, start)), None)
                if seg is None:
                    back = [s for _n, s in free if j.can_rewind(s, k, start)]
                    seg = min(back, key=lambda s: s.positions[-1] - start) if back else None
            if seg is None and start != 0 and segs and k > 0:
                prev = [s for _n, s in free if (s.expects() or 0) <= start]
                if not prev:
                    last = max(segs, key=lambda s: s.positions[-1] if s.positions else -1)
                    reached = last.positions[-1] if last.positions else start
                    raise InputError(path, f"tensor {key!r} starts a run at position {start} but a request already "
                                     f"reached position {reached} (positions go backwards or overlap; a verify pass "
                                     "rewinds only into the drafted rows of the pass before it)")
                seg = max(prev, key=lambda s: s.positions[-1])
            if seg is None:
                seg = Segment(f"request {len(segs)}")
                segs.append(seg)
            used.add(segs.index(seg))
            j.add(seg, k, rows, pos[a:b].tolist(), key)
    return j


def _tree(seg: Segment, k: int, start: int) -> bool:
    """A run of pass ``k`` at a position this segment already holds from pass ``k``."""
    if seg.block is not None and seg.block[0] == k:
        return start >= seg.block[1]
    if not seg.positions or seg.passes[-1] != k:
        return False
    return seg.positions[seg.last_pass_start()] < start <= seg.positions[-1]
