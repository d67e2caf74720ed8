"""The HTML report in a real browser (headless Chromium) and the PNG heatmap, checked as pictures.

A person looks at the report and sees the shifted diagonal; so does this test: it finds
the red-orange outlines (expected) in the screenshot and the bright cell (the close
match) in each outlined row, and checks the bright cell sits one column right of the
outline in the focus view, and under the next row's outline in the all-streams view.
The screenshot, the page and the PNGs are kept in tests/artifacts/ for a human to open.

Needs Debian's ``chromium`` package (``apt-get install -y chromium``), which scripts/test
(the README's test command, which CI runs) installs when it can and then requires
(CONSISTENCY_REQUIRE_BROWSER=1): its absence is a failure there, a skip under a bare
``pytest``, and CONSISTENCY_SKIP_BROWSER=1 skips it on a machine that cannot have one.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.conftest import ROOT, cli
from tests.report.test_visual import SERVE, TRAIN, parse, record_pair, rings_vs_outlines

ARTIFACTS = ROOT / "tests" / "artifacts"
EXPECTED_RGB = (0xFF, 0x3D, 0x00)  # consistency.report.heatmap.EXPECTED_COLOUR
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars",
         "--force-device-scale-factor=1", "--host-resolver-rules=MAP * ~NOTFOUND"]


def chromium() -> str:
    exe = os.environ.get("CONSISTENCY_CHROMIUM") or next(
        (p for p in (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")) if p), None)
    if exe:
        return exe
    msg = ("headless Chromium not found: apt-get install -y chromium (Debian; scripts/test does it as root), set "
           "CONSISTENCY_CHROMIUM=/path/to/chrome, or CONSISTENCY_SKIP_BROWSER=1 to skip this test")
    if os.environ.get("CONSISTENCY_REQUIRE_BROWSER"):
        pytest.fail(msg)
    pytest.skip(msg)


def pil():  # noqa: ANN201
    try:
        from PIL import Image
    except ImportError:
        if os.environ.get("CONSISTENCY_REQUIRE_BROWSER"):
            pytest.fail("Pillow is needed to read the screenshot: pip install 'specdec-consistency[report]'")
        pytest.skip("Pillow is needed to read the screenshot (pip install 'specdec-consistency[report]')")
    return Image


def browse(page: Path, *args: str) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory(prefix="consistency-chromium-") as profile:
        return subprocess.run([chromium(), *FLAGS, f"--user-data-dir={profile}", *args, page.resolve().as_uri()],
                              capture_output=True, text=True, timeout=180)


def components(mask) -> list[tuple[int, int, int, int]]:  # noqa: ANN001 - bool ndarray
    """Bounding boxes (x0, y0, x1, y1) of 8-connected regions of a boolean image."""
    todo = set(zip(*[a.tolist() for a in mask.nonzero()]))
    boxes = []
    while todo:
        stack = [todo.pop()]
        ys, xs = [], []
        while stack:
            y, x = stack.pop()
            ys.append(y)
            xs.append(x)
            for dy in (-1, 0, 1):
                for dx in (-1, 0, 1):
                    q = (y + dy, x + dx)
                    if q in todo:
                        todo.remove(q)
                        stack.append(q)
        boxes.append((min(xs), min(ys), max(xs), max(ys)))
    return boxes


def outlines_and_matches(path: Path) -> list[tuple[float, float, float]]:
    """For every expected outline in a picture: (outline centre x, nearest bright cell centre x, outline y)."""
    import numpy as np

    with pil().open(path) as im:
        a = np.asarray(im.convert("RGB")).astype(int)
    r, g, b = a[..., 0], a[..., 1], a[..., 2]
    red = (abs(r - EXPECTED_RGB[0]) <= 14) & (abs(g - EXPECTED_RGB[1]) <= 22) & (b <= 22)
    boxes = [bx for bx in components(red) if bx[2] - bx[0] >= 24 and bx[3] - bx[1] >= 12]
    lum = 0.2126 * r + 0.7152 * g + 0.0722 * b
    bright = (lum > 150) & (a.max(axis=2) - a.min(axis=2) > 60)  # the bright end of viridis, not white text
    out = []
    for x0, y0, x1, y1 in sorted(boxes, key=lambda bx: (bx[1], bx[0])):
        cols = bright[y0 + 4:y1 - 3].any(axis=0).nonzero()[0].tolist()
        runs: list[list[int]] = []
        for c in cols:
            if runs and c - runs[-1][-1] <= 6:
                runs[-1].append(c)
            else:
                runs.append([c])
        centres = [(run[0] + run[-1]) / 2 for run in runs if run[-1] - run[0] >= 10]
        assert centres, f"no bright cell in the row of the outline at y={y0} in {path.name}"
        mid = (x0 + x1) / 2
        out.append((mid, min(centres, key=lambda c: abs(c - mid)), (y0 + y1) / 2))
    return out


def split_heatmaps(marks: list[tuple[float, float, float]]) -> list[list[tuple[float, float, float]]]:
    groups: list[list[tuple[float, float, float]]] = []
    for m in marks:
        if groups and m[2] - groups[-1][-1][2] < 80:
            groups[-1].append(m)
        else:
            groups.append([m])
    return groups


@pytest.fixture(scope="module")
def seed_report(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("browser")
    ref, cand = record_pair(d, TRAIN, SERVE)
    html, png = d / "report.html", d / "png"
    r = cli("compare", ref, cand, "--html", str(html), *(["--png", str(png)] if _mpl() else []), "-q")
    assert r.returncode == 1, r.stderr
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shutil.copy(html, ARTIFACTS / "seed-report.html")
    if png.is_dir():
        shutil.rmtree(ARTIFACTS / "seed-png", ignore_errors=True)
        shutil.copytree(png, ARTIFACTS / "seed-png")
    return html, png


@pytest.mark.slow
def test_report_opens_in_chromium_and_shows_the_shift(seed_report):
    html, _ = seed_report
    dom = browse(html, "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    p = parse(dom.stdout)  # the DOM as Chromium built it, not our string
    assert "consistency compare" in dom.stdout and "FAIL" in dom.stdout
    codes = [c for c, _ in p.codes]
    assert codes[0] == "SLOT_SHIFT" and codes.count("LAYER_MISMATCH") == 3
    assert all(href and href.split("#")[0].endswith("findings.md") for _, href in p.codes)
    assert dom.stdout.count('class="token-plot"') == 3 and dom.stdout.count("<polyline") == 3
    fexp, fid = rings_vs_outlines(p, "focus")
    assert all(fid[r] == fexp[r] + 1 for r in range(3))

    shot = ARTIFACTS / "seed-report.png"
    shot.unlink(missing_ok=True)
    r = browse(html, f"--screenshot={shot}", "--window-size=1400,3400")
    assert r.returncode == 0 and shot.is_file(), r.stderr[-2000:]
    focus, full = split_heatmaps(outlines_and_matches(shot))
    assert len(focus) == len(full) == 3
    cell = focus[1][0] - focus[0][0]  # focus outlines step one column per row
    assert cell > 30
    for box, match, _ in focus:  # the bright cell sits one column right of every outline
        assert abs((match - box) - cell) < 0.15 * cell, (box, match, cell)
    for (_, match, _), (nxt, _, _) in zip(full, full[1:]):  # ... and under the next row's outline
        assert abs(match - nxt) <= 4, (match, nxt)


def test_png_heatmap_shows_the_shift(seed_report):
    _, png = seed_report
    if not png.is_dir():
        pytest.skip("matplotlib (the report extra) is not installed: no --png")
    marks = outlines_and_matches(png / "heatmap.png")
    assert len(marks) == 3
    cell = marks[1][0] - marks[0][0]
    assert cell > 30 and all(abs((m - b) - cell) < 0.15 * cell for b, m, _ in marks)
    full = outlines_and_matches(png / "heatmap-all-streams.png")
    assert [abs(m - nxt) <= 4 for (_, m, _), (nxt, _, _) in zip(full, full[1:])] == [True, True]


def _mpl() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True
