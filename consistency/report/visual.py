"""Reports to look at: ``compare --html`` (self-contained page) and ``compare --png DIR``.

The HTML needs nothing beyond the core install (hand-written SVG, see html_svg.py). PNG
needs matplotlib, the optional ``report`` extra, imported only inside :func:`write_pngs`
so that importing this module (and ``compare --html``) stays light. Both draw the same
picture from heatmap.py: same columns, colours, outlines and rings.

Every file is written atomically and never clobbers an existing one without ``force``;
for ``--png`` all target names are checked before the first file is written, so a
refusal leaves the directory as it was.
"""

from __future__ import annotations

import hashlib
import io
import math
import re
from pathlib import Path

from consistency.contract.findings import CompareReport
from consistency.dump.atomic import check_writable, write_bytes_atomic, write_text_atomic
from consistency.errors import InputError, need
from consistency import escape as esc
from consistency.report import html_page
from consistency.report.heatmap import EXPECTED_COLOUR, Grid, colour, describe, fmt, grids, ink

PNG_DPI = 110
MAX_STEM = 96  # characters of a tensor name kept in a PNG file name (NAME_MAX is 255 bytes)


def write_html(rep: CompareReport, path: Path, force: bool = False) -> Path:
    """Write the one-file HTML report (no network needed to view it)."""
    check_writable(path, force)
    write_text_atomic(path, html_page.render(rep), force=force)
    return path


def require_png() -> None:
    """Fail before any work when --png cannot be honoured (matplotlib missing)."""
    need("report", "matplotlib", "--png (the --html report does not)")


def png_names(rep: CompareReport) -> list[tuple[str, str, object]]:
    """(file name, kind, payload) for every PNG of a report: heatmaps, then one per mismatched tensor."""
    out: list[tuple[str, str, object]] = []
    for k, g in enumerate(grids(rep.similarity) if rep.similarity else []):
        out.append(("heatmap.png" if k == 0 else "heatmap-all-streams.png", "heatmap", g))
    used = {n for n, _, _ in out}
    for name in rep.per_token:
        safe = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "tensor"
        if len(safe) > MAX_STEM:  # a 300-character tensor name must not exceed NAME_MAX (ENAMETOOLONG)
            safe = f"{safe[:MAX_STEM]}-{hashlib.sha256(name.encode('utf-8', 'surrogatepass')).hexdigest()[:10]}"
        stem = "per-token-" + safe
        fname, k = f"{stem}.png", 2
        while fname in used:
            fname, k = f"{stem}-{k}.png", k + 1
        used.add(fname)
        out.append((fname, "tokens", name))
    return out


def write_pngs(rep: CompareReport, out_dir: Path, force: bool = False) -> list[Path]:
    """Write heatmap.png (+ heatmap-all-streams.png) and per-token-<tensor>.png into out_dir."""
    require_png()
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise InputError(out_dir, "exists and is not a directory; --png needs a directory")
    plan = png_names(rep)
    if out_dir.is_dir():
        for fname, _, _ in plan:
            check_writable(out_dir / fname, force)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(out_dir, f"cannot create directory: {exc.strerror or exc}") from None
    written = []
    for fname, kind, payload in plan:
        if kind == "heatmap":
            data = _heatmap_png(payload)  # type: ignore[arg-type]
        else:
            data = _tokens_png(rep, str(payload))
        write_bytes_atomic(out_dir / fname, data, force=force)
        written.append(out_dir / fname)
    return written


def _figure(w: float, h: float):  # noqa: ANN202 - matplotlib Figure, imported lazily
    """A Figure on the Agg canvas without pyplot: no global state, no display needed."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(w, h), dpi=PNG_DPI)
    FigureCanvasAgg(fig)
    return fig


def _save(fig) -> bytes:  # noqa: ANN001
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=PNG_DPI, bbox_inches="tight", metadata={"Software": "consistency"})
    return buf.getvalue()


def _heatmap_png(g: Grid) -> bytes:
    """Same picture as the SVG: viridis by closeness, outlined expected cell, ringed identified cell."""
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Ellipse, Rectangle

    nr, nc = len(g.rows), len(g.cols)
    cell = 0.62 if nc <= 16 else max(0.18, 10.0 / nc)
    height = max(2.2, 1.5 + nr * max(cell * 0.62, 0.3))
    fig = _figure(max(4.5, 1.6 + nc * cell), height)
    ax = fig.add_subplot(1, 1, 1)
    rgb = [[_rgb01(colour(g.scale.closeness(v))) for v in row] for row in g.values]
    ax.imshow(rgb, aspect="auto", interpolation="nearest")
    if nc <= 16:
        for i, row in enumerate(g.values):
            for j, v in enumerate(row):
                ax.text(j, i, fmt(v), ha="center", va="center", fontsize=7, color=ink(g.scale.closeness(v)))
    for i, j in enumerate(g.identified):
        if j is not None:
            for c, w in (("#111111", 3.2), ("#ffffff", 1.4)):
                ax.add_patch(Ellipse((j, i), 0.86, 0.78, fill=False, edgecolor=c, linewidth=w))
    for i, j in enumerate(g.expected):
        if j is not None:
            ax.add_patch(Rectangle((j - 0.44, i - 0.44), 0.88, 0.88, fill=False, edgecolor=EXPECTED_COLOUR,
                                   linewidth=2.4))
    ax.set_yticks(range(nr), [esc.mpl(r) for r in g.rows], fontsize=8)  # names from the dumps: no mathtext
    every = max(1, math.ceil(nc / 40))
    ax.set_xticks(range(0, nc, every), [esc.mpl(c) for c in g.col_labels[::every]], fontsize=7 if nc > 20 else 8)
    ax.set_xlabel("reference stream s (0 = embedding, s = output of layer s-1)", fontsize=8)
    ax.set_title(("focus: streams some slot expects or holds" if g.view == "focus" else "all reference streams")
                 + f" ({g.metric}, log scale: bright = close)", fontsize=9)
    caption = esc.mpl(describe(g)) + "  Red-orange outline: expected; ring: identified."
    fig.text(0.01, -0.3 / height, _wrap(caption, 130),
             fontsize=7.5, va="top")
    cmap = ListedColormap([colour(k / 255) for k in range(256)])
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import LogNorm, Normalize

    norm = LogNorm(g.scale.lo, g.scale.hi) if g.scale.log else Normalize(g.scale.lo, g.scale.hi)
    cm = cmap if g.scale.higher_is_closer else cmap.reversed()
    bar = fig.colorbar(ScalarMappable(norm=norm, cmap=cm), ax=ax, fraction=0.04, pad=0.02)
    bar.ax.tick_params(labelsize=7)
    bar.set_label(g.metric, fontsize=8)
    return _save(fig)


def _tokens_png(rep: CompareReport, name: str) -> bytes:
    ys = rep.per_token[name]
    f = next((f for f in rep.findings if f.tensor == name and f.severity.value == "error"),
             next((f for f in rep.findings if f.tensor == name), None))
    fl = f.metrics.get("floor") if f else None
    floor = float(fl) if isinstance(fl, (int, float)) and math.isfinite(fl) and fl > 0 else None
    fig = _figure(6.4, 2.4)
    ax = fig.add_subplot(1, 1, 1)
    pts = [(i, y) for i, y in enumerate(ys) if y is not None and math.isfinite(y) and y > 0]
    if pts:
        ax.plot([p[0] for p in pts], [p[1] for p in pts], color="#3b528b", linewidth=1.1)
        ax.fill_between([p[0] for p in pts], [p[1] for p in pts], min(p[1] for p in pts), color="#3b528b", alpha=0.12)
        wi, wy = max(pts, key=lambda p: p[1])
        ax.plot([wi], [wy], "o", color="#d00000", markersize=4)
        ax.set_yscale("log")
    else:
        ax.text(0.5, 0.5, "no positive finite values to plot", ha="center", transform=ax.transAxes)
    if floor:
        ax.axhline(floor, color="#d00000", linestyle="--", linewidth=1)
        ax.text(len(ys) - 1, floor, f" noise floor {fmt(floor)}", color="#d00000", fontsize=7, va="bottom", ha="right")
    ax.set_xlabel("token position (row)", fontsize=8)
    ax.set_ylabel("token rel_diff", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(True, which="major", color="#e4e4e4", linewidth=0.6)
    vs = html_page.versus(rep, name, f)
    ax.set_title(esc.mpl(f"{name}{vs}" + (f"  [{f.code}]" if f else "")), fontsize=9)
    return _save(fig)


def _rgb01(h: str) -> tuple[float, float, float]:
    return int(h[1:3], 16) / 255, int(h[3:5], 16) / 255, int(h[5:7], 16) / 255


def _wrap(s: str, width: int) -> str:
    import textwrap

    return "\n".join(textwrap.wrap(s, width))
