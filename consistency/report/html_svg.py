"""Hand-written SVG for the HTML report: the heatmap, its colour bar, per-token error plots.

Why not a plotting library: the HTML report must open anywhere with no network and the
core install must stay light; inline SVG is text, scales crisply when zoomed or printed,
and keeps every cell addressable (``data-row``/``data-col`` and a tooltip with the exact
value), which is also what lets a test check the picture in a real browser. Every string
that comes from a dump (tensor names) is escaped.
"""

from __future__ import annotations

import math

from consistency import escape as esc
from consistency.report.heatmap import EXPECTED_COLOUR, Grid, Scale, colour, fmt, ink

FONT = "font-family=\"system-ui, -apple-system, 'Segoe UI', 'DejaVu Sans', sans-serif\""


def _a(v: object) -> str:
    return esc.html(v)


def heatmap_svg(g: Grid) -> str:
    """The slot x stream grid: outlined expected cells, ringed identified cells, values printed when they fit."""
    nr, nc = len(g.rows), len(g.cols)
    cw = max(14, min(72, 820 // max(nc, 1)))
    ch = max(18, min(40, int(cw * 0.62))) if cw >= 40 else max(22, min(cw, 28))
    text_fits = cw >= 46
    labels = [r if len(r) <= 32 else r[:31] + "\u2026" for r in g.rows]  # full name in each cell's tooltip
    left = 12 + 7 * max(len(r) for r in labels)
    top = 10
    notes = [_row_note(g, i) for i in range(nr)]
    right = 16 + (14 + 7 * max(len(n[0]) for n in notes) if any(n[0] for n in notes) else 0)
    width = max(left + nc * cw + right, left + 430)
    grid_h = nr * ch
    axis_h = 46
    height = top + grid_h + axis_h
    out = [f'<svg class="heatmap" data-view="{g.view}" xmlns="http://www.w3.org/2000/svg" width="{width}" '
           f'height="{height}" viewBox="0 0 {width} {height}" role="img" {FONT} '
           f'data-cell-width="{cw}" data-cell-height="{ch}" data-left="{left}" data-top="{top}" '
           f'aria-label="{_a(g.metric)} of {nr} candidate slots against {nc} reference streams">']
    out.append('<g shape-rendering="crispEdges">')
    for i, row in enumerate(g.values):
        for j, v in enumerate(row):
            t = g.scale.closeness(v)
            x, y = left + j * cw, top + i * ch
            out.append(f'<rect class="cell" data-row="{i}" data-col="{j}" data-value="{_a(v)}" x="{x}" y="{y}" '
                       f'width="{cw}" height="{ch}" fill="{colour(t)}"><title>{_a(g.rows[i])} vs {_a(g.cols[j])}: '
                       f'{_a(g.metric)} {fmt(v)}</title></rect>')
    out.append("</g>")
    if text_fits:
        for i, row in enumerate(g.values):
            for j, v in enumerate(row):
                t = g.scale.closeness(v)
                out.append(f'<text x="{left + j * cw + cw / 2:.1f}" y="{top + i * ch + ch / 2 + 4:.1f}" '
                           f'text-anchor="middle" font-size="11" fill="{ink(t)}" pointer-events="none">'
                           f'{fmt(v)}</text>')
    for i, j in enumerate(g.identified):
        if j is None:
            continue
        cx, cy = left + j * cw + cw / 2, top + i * ch + ch / 2
        rx, ry = max(cw / 2 - 4, 4), max(ch / 2 - 4, 4)
        for stroke, w in (("#111111", 4.5), ("#ffffff", 2)):
            out.append(f'<ellipse class="identified" data-row="{i}" data-col="{j}" cx="{cx:.1f}" cy="{cy:.1f}" '
                       f'rx="{rx:.1f}" ry="{ry:.1f}" fill="none" stroke="{stroke}" stroke-width="{w}">'
                       f'<title>{_a(g.rows[i])} holds {_a(g.cols[j])} (identified)</title></ellipse>')
    for i, j in enumerate(g.expected):
        if j is None:
            continue
        out.append(f'<rect class="expected" data-row="{i}" data-col="{j}" x="{left + j * cw + 2.5}" '
                   f'y="{top + i * ch + 2.5}" width="{cw - 5}" height="{ch - 5}" fill="none" '
                   f'stroke="{EXPECTED_COLOUR}" stroke-width="3" shape-rendering="crispEdges">'
                   f'<title>{_a(g.rows[i])} should hold {_a(g.cols[j])} (expected)</title></rect>')
    for i, r in enumerate(labels):
        out.append(f'<text class="row-label" x="{left - 8}" y="{top + i * ch + ch / 2 + 4:.1f}" text-anchor="end" '
                   f'font-size="12" fill="#222">{_a(r)}</text>')
    for i, (note, bad) in enumerate(notes):
        if note:
            out.append(f'<text class="row-note" x="{left + nc * cw + 12}" y="{top + i * ch + ch / 2 + 4:.1f}" '
                       f'font-size="12" fill="{"#c5221f" if bad else "#137333"}">{_a(note)}</text>')
    every = max(1, math.ceil(26 / cw))
    for j, lab in enumerate(g.col_labels):
        if j % every and j != nc - 1:
            continue
        fs = 11 if cw >= 20 else 9
        room = max(3, int(cw * every / (fs * 0.62)))
        lab = lab if len(lab) <= room else lab[:room - 1] + "\u2026"
        out.append(f'<text class="col-label" x="{left + j * cw + cw / 2:.1f}" y="{top + grid_h + 15}" '
                   f'text-anchor="middle" font-size="{fs}" fill="#222">{_a(lab)}</text>')
    label = ("reference stream s (0 = embedding, s = output of layer s-1)"
             if all(c.startswith("hidden.") for c in g.cols) else "reference tensor")
    cx = min(max(left + nc * cw / 2, 8 + 3.3 * len(label)), width - 8 - 3.3 * len(label))
    out.append(f'<text x="{cx:.1f}" y="{top + grid_h + 36}" text-anchor="middle" font-size="12" '
               f'fill="#444">{label}</text>')
    out.append("</svg>")
    return "".join(out)


def _row_note(g: Grid, i: int) -> tuple[str, bool]:
    """Right-of-row text: what the slot should hold and what it holds, in the column labels' unit."""
    e, d = g.expected[i], g.identified[i]
    lab = g.col_labels
    if e is None and d is None:
        return "", False
    if e is not None and d is not None and e == d:
        return f"holds {lab[d]} as expected", False
    return (f"expected {lab[e] if e is not None else '?'}, holds {lab[d] if d is not None else '?'}",
            True)


def colorbar_svg(scale: Scale, metric: str, floors: dict[str, float] | None = None, width: int = 420) -> str:
    """Horizontal colour bar, closest match on the right, with decade ticks and the noise floor(s)."""
    left, bar_w, bar_h, top = 10, width - 20, 14, 18
    n = 64
    parts = [f'<svg class="colorbar" xmlns="http://www.w3.org/2000/svg" width="{width}" height="62" '
             f'viewBox="0 0 {width} 62" {FONT}><g shape-rendering="crispEdges">']
    for k in range(n):
        parts.append(f'<rect x="{left + k * bar_w / n:.2f}" y="{top}" width="{bar_w / n + 0.6:.2f}" '
                     f'height="{bar_h}" fill="{colour(k / (n - 1))}"/>')
    parts.append("</g>")
    parts.append(f'<text x="{left}" y="12" font-size="11" fill="#444">{_a(metric)}: far</text>'
                 f'<text x="{left + bar_w}" y="12" font-size="11" fill="#444" text-anchor="end">close</text>')
    for v, t in scale.ticks():
        x = left + t * bar_w
        parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top + bar_h}" y2="{top + bar_h + 4}" stroke="#444"/>'
                     f'<text x="{x:.1f}" y="{top + bar_h + 16}" font-size="10" text-anchor="middle" fill="#444">'
                     f'{_tick(v, scale.log)}</text>')
    for label, v in (floors or {}).items():
        t = scale.closeness(v)
        if t is None:
            continue
        x = left + t * bar_w
        parts.append(f'<path d="M{x - 5:.1f},{top - 1} L{x + 5:.1f},{top - 1} L{x:.1f},{top + 6} Z" fill="#d00000">'
                     f'<title>noise floor {_a(label)}: {fmt(v)}</title></path>'
                     f'<text x="{x:.1f}" y="{top + bar_h + 30}" font-size="10" text-anchor="middle" fill="#d00000">'
                     f'{_a(label)} noise floor</text>')
    parts.append("</svg>")
    return "".join(parts)


def _tick(v: float, log: bool) -> str:
    if log:
        e = round(math.log10(v))
        return "1" if e == 0 else f"1e{e}"
    return f"{v:.2g}"


def token_plot_svg(name: str, ys: list[float], floor: float | None = None, width: int = 560,
                   height: int = 190) -> str:
    """Token rel_diff along the sequence (log y): where in the sequence it goes wrong."""
    left, right, top, bottom = 54, 14, 12, 34
    pw, ph = width - left - right, height - top - bottom
    finite = [(i, y) for i, y in enumerate(ys) if y is not None and math.isfinite(y)]
    out = [f'<svg class="token-plot" data-tensor="{_a(name)}" xmlns="http://www.w3.org/2000/svg" width="{width}" '
           f'height="{height}" viewBox="0 0 {width} {height}" {FONT} role="img" '
           f'aria-label="token rel_diff along the sequence for {_a(name)}">']
    out.append(f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="#fafafa" stroke="#ccc"/>')
    if not finite:
        out.append(f'<text x="{left + pw / 2}" y="{top + ph / 2}" text-anchor="middle" font-size="12" fill="#a00">'
                   f'no finite values to plot</text></svg>')
        return "".join(out)
    pos = [y for _, y in finite if y > 0] + ([floor] if floor and floor > 0 else [])
    lo = 10.0 ** math.floor(math.log10(max(min(pos, default=1e-6), 1e-12)))
    hi = 10.0 ** math.ceil(math.log10(max(max(pos, default=1.0), lo * 10)))
    n = max(len(ys) - 1, 1)

    def px(i: float) -> float:
        return left + pw * i / n

    def py(y: float) -> float:
        y = max(y, lo)
        return top + ph * (1 - (math.log10(y) - math.log10(lo)) / (math.log10(hi) - math.log10(lo)))

    for e in range(round(math.log10(lo)), round(math.log10(hi)) + 1):
        y = py(10.0 ** e)
        out.append(f'<line x1="{left}" x2="{left + pw}" y1="{y:.1f}" y2="{y:.1f}" stroke="#e4e4e4"/>'
                   f'<text x="{left - 6}" y="{y + 4:.1f}" font-size="10" text-anchor="end" fill="#555">'
                   f'{_tick(10.0 ** e, True)}</text>')
    for t in _nice_ticks(len(ys)):
        out.append(f'<text x="{px(t):.1f}" y="{top + ph + 15}" font-size="10" text-anchor="middle" fill="#555">{t}</text>')
    out.append(f'<text x="{left + pw / 2}" y="{height - 4}" font-size="11" text-anchor="middle" fill="#444">'
               f'token position (row)</text>')
    pts = _decimate(finite, pw)
    path = " ".join(f"{px(i):.1f},{py(y):.1f}" for i, y in pts)
    base = f"{px(pts[-1][0]):.1f},{top + ph} {px(pts[0][0]):.1f},{top + ph}"
    out.append(f'<polygon points="{path} {base}" fill="#3b528b" fill-opacity="0.12"/>')
    out.append(f'<polyline class="series" points="{path}" fill="none" stroke="#3b528b" stroke-width="1.4"/>')
    if floor and floor > 0:
        y = py(floor)
        out.append(f'<line class="floor" x1="{left}" x2="{left + pw}" y1="{y:.1f}" y2="{y:.1f}" stroke="#d00000" '
                   f'stroke-dasharray="5,4" stroke-width="1.2"/><text x="{left + pw - 4}" y="{y - 4:.1f}" '
                   f'font-size="10" text-anchor="end" fill="#d00000">noise floor {fmt(floor)}</text>')
    wi, wy = max(finite, key=lambda p: p[1])
    out.append(f'<circle cx="{px(wi):.1f}" cy="{py(wy):.1f}" r="3.5" fill="#d00000"><title>worst token {wi}: '
               f'{fmt(wy)}</title></circle>')
    if len(finite) < len(ys):
        out.append(f'<text x="{left + 6}" y="{top + 14}" font-size="10" fill="#a00">'
                   f'{len(ys) - len(finite)} non-finite rows not drawn</text>')
    out.append("</svg>")
    return "".join(out)


def _decimate(pts: list[tuple[int, float]], width: int) -> list[tuple[int, float]]:
    """At most ~2 points per pixel column (min and max of each bin) so long sequences stay small."""
    if len(pts) <= 2 * width:
        return pts
    step = len(pts) / width
    out: list[tuple[int, float]] = []
    for b in range(width):
        chunk = pts[int(b * step):int((b + 1) * step)] or pts[-1:]
        out.extend(sorted({min(chunk, key=lambda p: p[1]), max(chunk, key=lambda p: p[1])}))
    return out


def _nice_ticks(n: int) -> list[int]:
    if n <= 1:
        return [0]
    raw = (n - 1) / 6
    mag = 10 ** math.floor(math.log10(raw)) if raw >= 1 else 1
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    return list(range(0, n, int(step)))
