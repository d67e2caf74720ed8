"""A thin reference (aux slots only: speculators ``hs_*`` files, SpecForge ``.ckpt``, an
aux-only dump): where a slot that matches nothing lies between the streams it does record.

Residual streams move monotonically with depth: on every scenario family the distance from
stream a to stream b grows with |a - b| (tests/diagnose/test_causes.py checks it on the recordings).
So a slot that should hold stream s and holds an unrecorded one lies *later* when it is
closer than s itself to the next recorded stream (by a margin), and *earlier* when it is
closer than s to the previous one; without a recorded stream beyond, later when it is
farther than s from the previous one by a margin -- a weak reading (an unrelated error
moves it away as much: the layers' deltas are nearly orthogonal), said as "no earlier
stream", and a story needs a strong reading beside it. A slot far from s, or one that moved
both ways or neither, lies nowhere said: nothing is claimed. When every slot lies on the same side, the pattern is a layer offset
whose size the reference cannot measure -- said as such, never as drift.

Where that sided reading says nothing (real weights: a layer's move need not bring a stream
closer to the next recorded one), the bounded reading measures each slot against the
reference's own recorded slots, token by token: nearer the stream it should hold than any
other recorded stream is to it, and moving along the model's own streams (|cos| of the move
with the path to another recorded stream; unrelated noise reads ~0). Then the list is
LAYER_OFFSET said as "consistent with, cannot be proven", with the streams recorded as its
bound and no sign claimed from the values -- never UNKNOWN for it, never PASS.

N (the model's top stream) comes from the metadata or a declaration, never from the
highest stream a thin reference happens to record.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from consistency.compare.engine import Result
from consistency.contract.codes import C
from consistency.diagnose.evidence import Evidence
from consistency.diagnose.story import Story, family
from consistency.dump import names


@dataclass(frozen=True)
class Position:
    """Where a candidate tensor lies among the reference's recorded streams."""

    expected: int  # the stream it should hold (recorded)
    lower: int | None  # the nearest recorded stream below it
    upper: int | None  # ... above it
    side: str | None  # "later", "earlier", or None (not near the expected stream)
    d_expected: float
    d_lower: float | None
    d_upper: float | None
    strong: bool = False  # between two recorded streams; False: only "not on the other side" (one-sided)

    @property
    def between(self) -> tuple[int, int | None] | None:
        """The recorded streams it lies between (exclusive), or None; below the lowest
        recorded stream the lower bound is -1 (streams 0..expected-1): dropping such a slot
        shifted every later slot's range onto the wrong claim."""
        if self.side == "later":
            return (self.expected, self.upper)
        if self.side == "earlier":
            return (self.lower if self.lower is not None else -1, self.expected)
        return None


def _stream_names(ev: Evidence, r: Result) -> dict[int, str]:
    """Recorded stream -> one reference tensor holding it, at the candidate's shape."""
    fp = ev.cmp.ref_fp.get(ev.key(r))
    out: dict[int, str] = {}
    for n in fp.names if fp is not None else []:
        s = ev.cmp.stream_by_values(n)
        if s is not None and (s not in out or names.preference(n) < names.preference(out[s])):
            out[s] = n
    return out


def position(ev: Evidence, r: Result) -> Position | None:
    """Where ``r`` lies, when its expected stream is recorded but an adjacent one is not."""
    s = r.expected_stream if not r.post_norm else None
    fp, cfp = ev.cmp.ref_fp.get(ev.key(r)), ev.cmp.cand_fp.get(ev.key(r))
    if s is None or fp is None or cfp is None or r.cand.name not in cfp:
        return None
    at = _stream_names(ev, r)
    if s not in at:
        return None
    lower = max((x for x in at if x < s), default=None)
    upper = min((x for x in at if x > s), default=None)
    d = lambda x: cfp.distance(r.cand.name, at[x], fp)  # noqa: E731  (pair by pair: O(1) per slot)
    gap = lambda x: fp.distance(at[s], at[x])  # noqa: E731
    de = d(s)
    dl, du = (d(lower) if lower is not None else None), (d(upper) if upper is not None else None)
    gl, gu = (gap(lower) if lower is not None else None), (gap(upper) if upper is not None else None)
    top = ev._num_layers()
    strong_l, strong_e = _toward(de, du, gu), _toward(de, dl, gl)
    later = strong_l or (upper is None and (top is None or s < top) and _away(de, dl, gl))
    earlier = strong_e or (lower is None and s > 0 and _away(de, du, gu))
    side = "later" if later and not earlier else "earlier" if earlier and not later else None
    strong = (strong_l if side == "later" else strong_e) if side else False
    return Position(s, lower, upper, side, de, dl, du, strong)


MARGIN = 0.25  # a move toward (or away from) a stream must exceed a quarter of the distance moved


def _toward(de: float, dn: float | None, gn: float | None) -> bool:
    """Closer to a neighbouring recorded stream than the expected stream is, by a margin, and
    nearer the expected stream than that neighbour is: it lies between them."""
    return dn is not None and gn is not None and de < gn and dn < gn - MARGIN * de


def _away(de: float, dn: float | None, gn: float | None) -> bool:
    """The one-sided test (no recorded stream beyond): farther than the expected stream from
    the neighbour on the other side, by a margin, and near the expected stream. Weak: the
    layers' deltas are nearly orthogonal (the streams walk at random: d(6, 8) = d(6, 7) +
    d(7, 8) on the tiny models), so a later stream and the expected one plus an unrelated
    error look alike from below; it says "not an earlier stream", no more."""
    return dn is not None and gn is not None and de < 2 * gn and dn > gn + MARGIN * de


def recorded(ev: Evidence, r: Result) -> list[int]:
    return sorted(ev.cmp.recorded_streams(ev.key(r)))


def _only(ev: Evidence) -> str:
    """' of 0..N only', N from the metadata or a declaration (never the highest recorded stream)."""
    n = ev._num_layers()
    return f" of 0..{n} only" if n is not None else \
        " only (the model's depth is unknown here: the highest recorded stream is not its top)"


def note(ev: Evidence, r: Result) -> str:
    """Why an unexplained difference may still be another layer, and where the slot lies."""
    s = r.expected_stream if not r.post_norm else None
    if s is None:
        return ""
    have = recorded(ev, r)
    if (s - 1 in have or s == 0) and s + 1 in have:
        return ""
    head = f" The reference records streams {have}{_only(ev)}" if have else \
        " The reference records no stream (hidden.*) to measure the neighbours by"
    p = position(ev, r)
    if p is None or p.side is None:
        return head + ": an adjacent layer (off by one) cannot be ruled out; record every stream on the reference " \
                      "side to tell."
    return head + ": " + where(p, ev._num_layers()) + "; record every stream on the reference side to name it."


def where(p: Position, top: int | None) -> str:
    """'it lies after stream 3, between it and stream 7 (token rel_diff 0.22 and 0.29): one of
    streams 4..6, which the reference does not record'."""
    if not p.strong:
        if p.side == "later":
            hi = f"{p.expected + 1}..{top}" if top is not None else f"past {p.expected}"
            return (f"it is no stream before {p.expected} (token rel_diff {p.d_lower:.3g} to stream {p.lower}, "
                    f"farther than stream {p.expected} is): a later stream the reference does not record ({hi}), or "
                    "none of the streams")
        return (f"it is no stream after {p.expected} (token rel_diff {p.d_upper:.3g} to stream {p.upper}, farther "
                f"than stream {p.expected} is): an earlier stream the reference does not record (0..{p.expected - 1}), "
                "or none of the streams")
    if p.side == "later":
        hi = p.upper - 1 if p.upper is not None else top
        span = f"between it and stream {p.upper}" if p.upper is not None else "past every stream it records"
        dist = f"token rel_diff {p.d_expected:.3g} to stream {p.expected}" + \
            (f", {p.d_upper:.3g} to stream {p.upper}" if p.d_upper is not None else "")
        return (f"it lies after stream {p.expected}, {span} ({dist}): "
                + ((f"stream {hi}" if hi == p.expected + 1 else f"one of streams {p.expected + 1}..{hi}")
                   if hi is not None else f"a stream past {p.expected}")
                + ", which the reference does not record")
    assert p.side == "earlier"
    lo = p.lower + 1 if p.lower is not None else 0
    span = f"between stream {p.lower} and it" if p.lower is not None else "before every stream it records"
    dist = f"token rel_diff {p.d_expected:.3g} to stream {p.expected}" + \
        (f", {p.d_lower:.3g} to stream {p.lower}" if p.d_lower is not None else "")
    which = f"stream {lo}" if lo == p.expected - 1 else f"one of streams {lo}..{p.expected - 1}"
    return f"it lies before stream {p.expected}, {span} ({dist}): {which}, which the reference does not record"


def _short(p: Position, top: int | None) -> str:
    """'lies after stream 0 (one of 1..2)', for a list of slots."""
    b = p.between
    if p.side == "later":
        hi = (b[1] - 1) if b is not None and b[1] is not None and p.strong else top
        rng = f"{p.expected + 1}..{hi}" if hi is not None else f"past {p.expected}"
        one = hi is not None and hi == p.expected + 1
        return (f"lies after stream {p.expected} (stream {hi}, unrecorded)" if one else
                f"lies after stream {p.expected} (one of {rng})") if p.strong else \
            f"is no stream before {p.expected} ({rng}, or none)"
    lo = b[0] + 1 if b is not None and p.strong else 0
    return f"lies before stream {p.expected} (one of {lo}..{p.expected - 1})" if p.strong else \
        f"is no stream after {p.expected} (0..{p.expected - 1}, or none)"


def story(ev: Evidence, slots: Sequence[Result], unexplained: Sequence[bool], cand_side: str,
          ref_side: str) -> Story | None:
    """The sided reading when it holds, else the bounded one (never UNKNOWN for a list that
    every measured distance says is the model's own streams, never a cause it cannot prove)."""
    if all(_neighbours_recorded(ev, r) for r in slots):
        return None  # a reference that records each slot's neighbours measured any offset: no reading to add
    return _sided(ev, slots, unexplained, cand_side, ref_side) or bounded(ev, slots, unexplained, cand_side, ref_side)


def _neighbours_recorded(ev: Evidence, r: Result) -> bool:
    """The reference records the streams on both sides of the one ``r`` should hold (or the
    model ends there), so a layer off by one was measured, never left to a reading."""
    s, top = (r.expected_stream if not r.post_norm else None), ev._num_layers()
    have = set(recorded(ev, r))
    return s is not None and (s == 0 or s - 1 in have) and (s == top or s + 1 in have)


def _sided(ev: Evidence, slots: Sequence[Result], unexplained: Sequence[bool], cand_side: str,
           ref_side: str) -> Story | None:
    """Every slot unexplained and on the same side of the stream it should hold: a layer
    offset the thin reference cannot measure; on different sides: said once, no offset."""
    if len(slots) < 2 or not all(unexplained):
        return None
    ps = [position(ev, r) for r in slots]
    sides = {p.side for p in ps if p is not None}
    have = recorded(ev, slots[0])
    if any(p is None for p in ps) or not any(p.strong for p in ps if p):
        return None
    if len(sides - {None}) > 1:  # read both ways: not one offset, said once for the list
        top = ev._num_layers()
        said = "; ".join(f"slot {r.slot} {_short(p, top)}" for r, p in zip(slots, ps, strict=True)
                         if p is not None and p.side is not None)
        return Story(C.UNKNOWN, f"the slots did not all move the same way ({said}): no single layer offset explains "
                     f"them; the reference records streams {have}{_only(ev)}, so record every stream on the "
                     "reference side to name each", {"directions": [p.side if p else None for p in ps],
                                                     "measured": False, "recorded": have})
    if len(sides) != 1 or None in sides:
        return None
    side = sides.pop()
    ranges = [p.between if p is not None else None for p in ps]  # slot by slot: zipped with the claims below
    if any(b is not None and b[1] is not None and b[1] - b[0] < 2 for b in ranges):
        return None  # no unrecorded stream lies between two adjacent recorded ones: not a layer, whatever it is
    top = ev._num_layers()
    fmt = lambda b: f"{b[0] + 1}..{(b[1] - 1) if b[1] is not None else top if top is not None else 'N'}"  # noqa: E731
    expected = [p.expected for p in ps if p is not None]
    sentence = (f"every slot lies {side} than the stream {ref_side} used ({ref_side} used {expected}; {cand_side}'s "
                f"slots lie in streams [{', '.join(fmt(b) for b in ranges if b is not None)}]): a layer offset for "
                f"every slot ({'the SGLang +1 family' if side == 'later' else 'a layer id read one too low'}), whose "
                f"size this reference cannot measure: it records streams {have}{_only(ev)}; record every stream "
                "on the reference side to measure it")
    claimed = ev.cmp.plan.cand.claimed_streams
    if claimed and len(claimed) == len(slots):
        fits = all(b is not None and b[0] < c < (b[1] if b[1] is not None else (top or c) + 1)
                   for b, c in zip(ranges, claimed, strict=False))
        sentence += f" ({cand_side}'s metadata claims streams {list(claimed)}, " + \
            ("which the values agree with; a claim is compared, never trusted)" if fits else
             "which the values do not bear out)")
    return Story(C.LAYER_OFFSET, sentence, {"direction": side, "expected": expected, "measured": False,
                                           "ranges": [list(b) if b else None for b in ranges], "recorded": have})


def mixed(ev: Evidence, slots: Sequence[Result], expected: Sequence[int | None], got: Sequence[int | None],
          unexplained: Sequence[bool], cand_side: str, ref_side: str) -> Story | None:
    """Some slots measured at one offset k (the reference records the stream they hold), the
    others unexplained but each lying on that side of its expected stream, between recorded
    streams that leave room for s + k: one layer offset for every slot, said with which
    slots measure it and which are only consistent with it (never "UNKNOWN" for the list)."""
    known = [(e, g) for e, g in zip(expected, got, strict=False) if e is not None and g is not None]
    if len(slots) < 2 or not known or len(known) == len(slots) or any(e is None for e in expected):
        return None
    offs = {g - e for e, g in known}
    k = offs.pop() if len(offs) == 1 else 0
    if k == 0:
        return None
    side, top = ("later" if k > 0 else "earlier"), ev._num_layers()
    said = []
    for r, e, g, u in zip(slots, expected, got, unexplained, strict=False):
        if g is not None:
            continue
        p = position(ev, r)
        b = p.between if p is not None and u and p.strong and p.side == side else None
        if b is None or e is None:
            return None
        hi = b[1] if b[1] is not None else (top + 1 if top is not None else e + k + 1)
        if not b[0] < e + k < hi:
            return None
        said.append(f"slot {r.slot} {_short(p, top)}")  # type: ignore[arg-type]
    measured = [r.slot for r, g in zip(slots, got, strict=False) if g is not None]
    fmt = "[" + ", ".join("?" if x is None else str(x) for x in got) + "]"
    sentence = (f"{cand_side} fed streams {fmt}; {ref_side} used {list(expected)} -- every slot is {abs(k)} layer"
                f"{'s' if abs(k) != 1 else ''} {side} (a layer-id convention off by {k:+d}{family(k)}): "
                f"measured on slot{'s' if len(measured) != 1 else ''} {measured}; {'; '.join(said)}, consistent with "
                f"it (the reference records streams {recorded(ev, slots[0])}{_only(ev)})")
    return Story(C.LAYER_OFFSET, sentence, {"offset": k, "expected": list(expected), "actual": list(got),
                                           "measured_slots": measured, "measured": True})


STRUCTURED = 0.2  # |cos| of a slot's move with the path to another recorded stream; noise reads < 0.02


@dataclass(frozen=True)
class Reading:
    """One slot measured against the streams the reference's own slots record, medians over
    tokens (no assumed growth with depth: real weights break it, issue 36)."""

    expected: int
    moved: float  # |c - R_s| / |R_s|
    nearest_other: tuple[int, float]  # the other recorded stream nearest R_s, and how far
    cos: dict[int, float]  # cos(c - R_s, R_x - R_s) per other recorded stream x


def _recorded_slots(ev: Evidence, slots: Sequence[Result]) -> dict[int, np.ndarray]:
    """Stream -> rows of the reference slot holding it, from what the reference's slots are
    (its values, claims or the declaration: the expectation each slot was paired under)."""
    out: dict[int, np.ndarray] = {}
    for r in slots:
        s = r.expected_stream if not r.post_norm else None
        x = ev.ref(r, r.expected) if s is not None and r.expected is not None else None
        if s is not None and x is not None:
            out[s] = np.asarray(x, np.float64)
    return out


def reading(ev: Evidence, r: Result, at: dict[int, np.ndarray]) -> Reading | None:
    s = r.expected_stream if not r.post_norm else None
    c = ev.cand(r)
    if s is None or s not in at or c is None or len(at) < 2 or np.shape(c) != at[s].shape:
        return None
    # read token by token and take the median: a sink row 1e4 strong (SmolLM2's first token),
    # or one a float8 file saturated at 448, must not be the whole reading
    base = at[s]
    size = np.maximum(np.linalg.norm(base, axis=-1), 1e-30)
    move = np.asarray(c, np.float64) - base
    nm = np.linalg.norm(move, axis=-1)
    path = {x: v - base for x, v in at.items() if x != s}
    pn = {x: np.linalg.norm(v, axis=-1) for x, v in path.items()}
    if not nm.any() or any(not v.all() for v in pn.values()):
        return None
    moved = float(np.median(nm / size))
    gaps = {x: float(np.median(v / size)) for x, v in pn.items()}
    cos = {x: float(np.median((move * path[x]).sum(-1) / np.maximum(nm * pn[x], 1e-30))) for x in path}
    near = min(gaps.items(), key=lambda kv: kv[1])
    return Reading(s, moved, near, cos)


def bounded(ev: Evidence, slots: Sequence[Result], unexplained: Sequence[bool], cand_side: str,
            ref_side: str) -> Story | None:
    """Every slot unexplained, each nearer the stream it should hold than any other stream the
    reference records is to that one, and the moves follow the model's own streams (a slot's
    move shares a direction with the path to another recorded stream, |cos| >= 0.2, where an
    unrelated error reads ~0): consistent with a layer offset, said with its bound -- its
    size and sign the reference cannot prove, so no direction is claimed from the values."""
    if len(slots) < 2 or not all(unexplained):
        return None
    at = _recorded_slots(ev, slots)
    rs = [reading(ev, r, at) for r in slots]
    if any(x is None for x in rs):
        return None
    ok = [x for x in rs if x is not None and x.moved < x.nearest_other[1]]
    if len(ok) != len(rs) or max(max(map(abs, x.cos.values())) for x in ok) < STRUCTURED:
        return None
    have = sorted(at)
    said = "; ".join(_moved(r, x) for r, x in zip(slots, ok, strict=True))
    claimed = ev.cmp.plan.cand.claimed_streams
    expected = [x.expected for x in ok]
    fits = claimed and len(claimed) == len(ok) and all(isinstance(c, int) for c in claimed)
    ks = {c - e for c, e in zip(claimed, expected, strict=True)} if fits else set()
    k = ks.pop() if len(ks) == 1 else None
    which = (f"{k:+d}, as {cand_side}'s metadata claims (streams {list(claimed or ())}; a claim is compared, "
             "never trusted)") if k else "an adjacent layer: +1 (the SGLang family) or -1"
    sentence = (f"every slot differs from the stream {ref_side} used ({expected}) by a move along the model's own "
                f"streams ({said}): consistent with a layer offset ({which}); cannot be proven: the reference "
                f"records streams {have}{_only(ev)}, so neither the size nor the sign is measured; record every "
                "stream on the reference side to prove it")
    return Story(C.LAYER_OFFSET, sentence, {"measured": False, "proven": False, "expected": expected,
                                           "recorded": have, "claimed_offset": k,
                                           "moved": [round(x.moved, 4) for x in ok]})


def _moved(r: Result, x: Reading) -> str:
    """'slot 0 moved 0.12 from stream 2 (stream 6 lies 1.3 from it; the move's cos with the path
    to stream 6 is +0.29)': the measured bound, slot by slot (medians over tokens)."""
    far, d = x.nearest_other
    best = max(x.cos, key=lambda k: abs(x.cos[k]))
    return (f"slot {r.slot} moved {x.moved:.3g} from stream {x.expected} (stream {far} lies {d:.3g} from it; the "
            f"move's cos with the path to stream {best} is {x.cos[best]:+.2f})")
