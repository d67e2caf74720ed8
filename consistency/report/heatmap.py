"""The slot x stream heatmap as plain data, shared by the SVG (HTML) and PNG renderers.

Why a separate model: the HTML report draws hand-written SVG (no plotting library at
view or build time) and ``--png`` draws with matplotlib; both must show the *same*
picture (same columns, colours, outlines and marks), or a reader comparing a PNG pasted
in a ticket with the HTML report would see two stories. Everything that decides what
the picture says lives here; the renderers only place shapes.

Two views of one :class:`~consistency.contract.findings.SimilarityMatrix`:

- **focus**: only the streams some slot was expected to hold or was identified as
  holding. A slot shift then reads as a diagonal moved one column to the right (or left),
  whatever the gaps between the layer ids are;
- **all streams**: every reference stream, so a reader also sees how close the
  neighbouring layers are (how confident the identification is).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from consistency.contract.findings import SimilarityMatrix
from consistency.dump import names

# matplotlib's viridis sampled at 17 stops: perceptually uniform, readable in grey and by
# most colour-blind readers. Reversed use: the closest match is the brightest cell.
VIRIDIS = ("#440154", "#48186a", "#472d7b", "#424086", "#3b528b", "#33638d", "#2c728e", "#26828e", "#21918c",
           "#1fa088", "#28ae80", "#3fbc73", "#5ec962", "#84d44b", "#addc30", "#d8e219", "#fde725")
EXPECTED_COLOUR = "#ff3d00"  # outline of the expected cell: no viridis colour is near it
NAN_COLOUR = "#b0b0b0"
MIN_LOG = 1e-12  # exact zeros (bit-identical tensors) are drawn at this value


@dataclass(frozen=True)
class Scale:
    """Maps a metric value to closeness in [0, 1] (1 = the closest match on the page)."""

    lo: float
    hi: float
    log: bool
    higher_is_closer: bool

    def closeness(self, v: float) -> float | None:
        if v is None or not math.isfinite(v):
            return None
        if self.log:
            v = max(v, self.lo)
            f = (math.log10(v) - math.log10(self.lo)) / max(math.log10(self.hi) - math.log10(self.lo), 1e-12)
        else:
            f = (v - self.lo) / max(self.hi - self.lo, 1e-12)
        f = min(max(f, 0.0), 1.0)
        return f if self.higher_is_closer else 1.0 - f

    def ticks(self) -> list[tuple[float, float]]:
        """(value, closeness) for axis labels: decades on a log scale, five steps otherwise."""
        if self.log:
            a, b = round(math.log10(self.lo)), round(math.log10(self.hi))
            step = max(1, math.ceil((b - a) / 8))
            vals = [10.0 ** e for e in range(a, b + 1, step)]
        else:
            vals = [self.lo + (self.hi - self.lo) * i / 4 for i in range(5)]
        return [(v, self.closeness(v) or 0.0) for v in vals]


def scale_for(metric: str, values: list[list[float]]) -> Scale:
    """Log scale over whole decades for distances (rel_diff spans 1e-6..1), linear for cosine."""
    finite = [v for row in values for v in row if v is not None and math.isfinite(v)]
    if "cos" in metric.lower():
        lo = min(finite, default=0.0)
        return Scale(lo=min(lo, 0.0) if lo < 0 else lo if lo < 1.0 else 0.0, hi=1.0, log=False, higher_is_closer=True)
    pos = [v for v in finite if v > 0]
    lo = min(pos, default=1e-6)
    hi = max(pos, default=1.0)
    lo_d = 10.0 ** math.floor(math.log10(max(lo, MIN_LOG)))
    hi_d = 10.0 ** math.ceil(math.log10(max(hi, lo_d * 10)))
    if hi_d <= lo_d:
        hi_d = lo_d * 10
    return Scale(lo=lo_d, hi=hi_d, log=True, higher_is_closer=False)


def colour(t: float | None) -> str:
    """Viridis at closeness t (None: not a number, drawn grey)."""
    if t is None:
        return NAN_COLOUR
    x = min(max(t, 0.0), 1.0) * (len(VIRIDIS) - 1)
    i = min(int(x), len(VIRIDIS) - 2)
    f = x - i
    a, b = _rgb(VIRIDIS[i]), _rgb(VIRIDIS[i + 1])
    return "#" + "".join(f"{round(a[k] + (b[k] - a[k]) * f):02x}" for k in range(3))


def ink(t: float | None) -> str:
    """Text colour readable on colour(t): dark on the bright end of viridis, white elsewhere."""
    return "#111111" if t is not None and t > 0.62 else "#ffffff"


def _rgb(h: str) -> tuple[int, int, int]:
    return int(h[1:3], 16), int(h[3:5], 16), int(h[5:7], 16)


@dataclass(frozen=True)
class Grid:
    """One heatmap: rows are candidate slots, columns reference streams."""

    view: str  # "focus" | "all"
    metric: str
    rows: list[str]
    cols: list[str]
    values: list[list[float]]
    expected: list[int | None]  # column index per row
    identified: list[int | None]
    scale: Scale

    @property
    def col_labels(self) -> list[str]:
        return [stream_label(c) for c in self.cols]


def stream_label(col: str) -> str:
    """Short column label: the stream index for ``hidden.s`` (the reader's unit), else the name."""
    s = names.stream_of(col)
    return str(s) if s is not None else col


def grids(sim: SimilarityMatrix) -> list[Grid]:
    """The focus view (when it drops columns) then the all-streams view; [] if nothing to draw."""
    if not sim.rows or not sim.cols or not sim.values:
        return []
    rows = sim.rows[:len(sim.values)]
    values = [list(sim.values[i][:len(sim.cols)]) + [math.nan] * (len(sim.cols) - len(sim.values[i]))
              for i in range(len(rows))]
    scale = scale_for(sim.metric, values)
    index = {c: j for j, c in enumerate(sim.cols)}
    exp = [index.get(c) if c else None for c in _pad(sim.expected, len(rows))]
    ident = [index.get(c) if c else None for c in _pad(sim.identified, len(rows))]
    full = Grid("all", sim.metric, rows, list(sim.cols), values, exp, ident, scale)
    keep = sorted({j for j in exp + ident if j is not None})
    if not keep or len(keep) >= len(sim.cols):
        return [full]
    remap = {j: k for k, j in enumerate(keep)}
    focus = Grid("focus", sim.metric, rows, [sim.cols[j] for j in keep], [[row[j] for j in keep] for row in values],
                 [remap.get(j) if j is not None else None for j in exp],
                 [remap.get(j) if j is not None else None for j in ident], scale)
    return [focus, full]


def _pad(xs: list[str | None], n: int) -> list[str | None]:
    return list(xs[:n]) + [None] * (n - len(xs))


def describe(g: Grid) -> str:
    """One sentence a reader can check against the picture."""
    pairs = [(i, e, d) for i, (e, d) in enumerate(zip(g.expected, g.identified)) if e is not None and d is not None]
    if not pairs:
        return "No slot has both an expected and an identified stream to mark."
    wrong = [p for p in pairs if p[1] != p[2]]
    if not wrong:
        return "Every slot holds the stream it was expected to hold: each ring sits inside its outline."
    k = slot_shift(g)
    offsets = {d - e for _, e, d in wrong}
    if k:
        head = (f"Slot shift by {abs(k)}: slot i holds the stream that slot i{'+' if k > 0 else '-'}{abs(k)} "
                f"was expected to hold")
        if len(offsets) == 1 and len(wrong) == len(pairs):
            d = offsets.pop()
            return (f"{head}, so the ringed diagonal sits {abs(d)} column{'s' if abs(d) != 1 else ''} "
                    f"{'right' if d > 0 else 'left'} of the outlined one.")
        return (f"{head}: each ring sits in the column of the outline {abs(k)} row{'s' if abs(k) != 1 else ''} "
                f"{'below' if k > 0 else 'above'} it.")
    return (f"{len(wrong)} of {len(pairs)} slot{'s' if len(pairs) != 1 else ''} hold another stream than expected: "
            f"in those rows the ring sits outside the outline.")


def slot_shift(g: Grid) -> int:
    """k != 0 when slot i holds what slot i+k was expected to hold, in every row where both are known."""
    n = len(g.rows)
    for k in sorted(range(-(n - 1), n), key=abs):
        if k == 0:
            continue
        hits = [g.identified[i] == g.expected[i + k] for i in range(n) if 0 <= i + k < n
                and g.identified[i] is not None and g.expected[i + k] is not None]
        if hits and all(hits) and len(hits) >= (n - abs(k) + 1) // 2:
            return k
    return 0


def fmt(v: float | None) -> str:
    """Compact value for a cell: 3 significant digits, 'nan' for non-finite."""
    if v is None or not math.isfinite(v):
        return "nan" if v is None or math.isnan(v) else ("inf" if v > 0 else "-inf")
    if v == 0:
        return "0"
    if 1e-3 <= abs(v) < 1e4:
        return f"{v:.3g}"
    return f"{v:.1e}".replace("e-0", "e-").replace("e+0", "e+")
