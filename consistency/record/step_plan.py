"""A decode step whose captures repeat step after step, staged from a plan.

With every stream, a batch-1 eager decode step captures 33 small points, and the step is
host-bound: each capture's Python is the model thread's time (measured on an H100: the
recorder's checks and bookkeeping cost about as much host time as the copy itself, and
slowed the rest of the step as much again). Once two consecutive steps captured the same
points in the same order with the same layouts, the next steps follow a plan: a capture
is one check of the expected point and one device copy into a view that the plan built
for this step's place in the staging buffer. What each capture would have booked one by
one (its number, its key, its layout, its share of the host budget) is booked once a step
as one staging item, and turned into keys and layouts only at ``wait()``, off the decode.
A capture that does not follow the plan ends it (the step so far is booked capture by
capture, as the general path would have), so the plan never changes what is written.
"""

from __future__ import annotations

from typing import Any

MAX_STEP_VIEWS = 64  # cached (buffer, offset) places of a step: a batch holds a few steps, two buffers


class StepPlan:
    """The points of a repeating step, their offsets inside the step's staging span, and the
    counts each name had before the plan began (a capture's number is base + steps + 1)."""

    def __init__(self, names: list[str], hots: list[Any], counts: dict[str, int]) -> None:
        self.names = names
        self.nameset = frozenset(names)
        self.hots = hots  # record/async_capture._Point per point: layout, sizes, the checks' facts
        self.n = len(names)
        self.offs: list[int] = []
        span = 0
        for h in hots:
            self.offs.append(span)
            span += h.pad
        self.span = span
        self.nbytes = sum(h.nbytes for h in hots)
        self.base = [counts.get(nm, 0) for nm in names]
        self.k = 0  # steps completed under the plan
        self.i = 0  # the next point of the current step
        self.at = 0  # the current step's offset in the staging buffer
        self.views: list[Any] = []
        self._cache: dict[tuple[int, int], list[Any]] = {}

    @staticmethod
    def build(prev: list[tuple[str, Any]] | None, step: list[tuple[str, Any]], counts: dict[str, int],
              room: int) -> StepPlan | None:
        """A plan when ``step`` repeats ``prev`` point for point (same names, same checked
        layouts, in order), each name once, the whole step fitting ``room`` bytes of staging."""
        if prev is None or len(prev) != len(step) or len(step) < 2:
            return None
        if any(a[0] != b[0] or a[1] is not b[1] for a, b in zip(prev, step)):
            return None
        names = [nm for nm, _h in step]
        if len(set(names)) != len(names):
            return None
        plan = StepPlan(names, [h for _nm, h in step], counts)
        return plan if plan.span <= room else None

    def begin(self, staging: Any) -> None:
        """Place this step at the staging buffer's current offset: its views, its span taken."""
        at, cur = staging.at, staging.cur
        views = self._cache.get((cur, at))
        if views is None:
            if len(self._cache) >= MAX_STEP_VIEWS:
                self._cache.clear()
            buf = staging.bufs[cur]
            views = self._cache[(cur, at)] = [buf[at + o:at + o + h.nbytes].view(h.sel_dtype).view(h.sel_shape)
                                              for o, h in zip(self.offs, self.hots)]
        self.at, self.views = at, views
        staging.at = at + self.span

    def end(self, staging: Any) -> None:
        """The step's captures, booked as one staging item (expanded by :meth:`expand`)."""
        staging.items.append((None, self.at, self.span, self, self.k))  # span: copy_out's end covers the padding
        staging.names = set(self.names)
        self.k += 1
        self.i = 0

    def expand(self, at: int, k: int, upto: int | None = None) -> list[tuple[tuple, Any]]:
        """Step ``k`` at ``at`` as the staging items the general path would have made, each
        with its layout; ``upto``: only the first points (a step the plan did not finish)."""
        out = []
        for j in range(self.n if upto is None else upto):
            name, h, num = self.names[j], self.hots[j], self.base[j] + k + 1
            key = name if num == 1 else f"{name}#{num}"
            out.append(((key, at + self.offs[j], h.nbytes, h.sel_dname, h.sel_shape), h.layout))
        return out

    def counts(self) -> dict[str, int]:
        """Each name's capture count now (the points of an unfinished step included)."""
        return {nm: self.base[j] + self.k + (j < self.i) for j, nm in enumerate(self.names)}

    def stop(self, staging: Any) -> tuple[list[tuple[tuple, Any]], int]:
        """End the plan mid-step: the points captured so far as staging items (with layouts),
        the span of the rest given back, and the bytes of the points not captured."""
        if self.i == 0:
            return [], 0
        done = self.expand(self.at, self.k, self.i)
        staging.items.extend(item for item, _layout in done)
        staging.names = set(self.names[:self.i])
        staging.at = self.at + (self.offs[self.i] if self.i < self.n else self.span)
        return done, sum(h.nbytes for h in self.hots[self.i:])


def expand_batch(batch: list, layouts: dict[str, tuple]) -> list:
    """A batch's plan steps as the items the general path would have made, each key's layout
    put in ``layouts`` (at wait(), off the decode)."""
    out = []
    for item in batch:
        if item[0] is not None:
            out.append(item)
            continue
        for one, layout in item[3].expand(item[1], item[4]):
            layouts[one[0]] = layout
            out.append(one)
    return out
