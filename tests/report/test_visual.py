"""compare --html / --png on dumps recorded from real tiny models: the seed's case and its family.

The browser half (headless Chromium renders the page, the screenshot is checked for the
shifted diagonal) is in test_visual_browser.py.
"""

from __future__ import annotations

import math
import os
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest

from consistency.pipeline.compare import compare as run_compare
from consistency.contract.findings import CompareReport, SimilarityMatrix
from consistency.errors import ConsistencyError, OutputExistsError
from consistency.report import heatmap, html_page, visual
from tests.conftest import ROOT, prompt_ids, recorded, run_cli, tiny

TRAIN, SERVE = [0, 3, 7], [3, 7, 10]  # the seed, scaled to tiny-llama (consistency demo)


def record_pair(d: Path, train: list[int], serve: list[int], arch: str = "tiny-llama") -> tuple[str, str]:
    """Training dump (HF hooks, fp32) and serving dump (fused residual, bf16) of one real tiny model."""
    m = tiny(arch)
    ids = prompt_ids(m, 48)
    ref = recorded("training", arch, ids, d / "train.safetensors", train)  # cached on disk by content
    cand = recorded("serving", arch, ids, d / "serve.safetensors", serve, dtype="bfloat16")
    return str(ref), str(cand)


@pytest.fixture(scope="module")
def seed(tmp_path_factory: pytest.TempPathFactory) -> tuple[CompareReport, str, str]:
    d = tmp_path_factory.mktemp("seed")
    ref, cand = record_pair(d, TRAIN, SERVE)
    return run_compare(ref, cand), ref, cand


class Svg(HTMLParser):
    """Collects the heatmaps' cells, outlines and rings, and the findings table, as a browser's DOM has them."""

    def __init__(self) -> None:
        super().__init__()
        self.view: str | None = None
        self.marks: dict[str, dict[str, list[tuple[int, int, float]]]] = {}
        self.cells: dict[str, dict[tuple[int, int], str]] = {}
        self.codes: list[tuple[str, str | None]] = []
        self.srcs: list[str] = []
        self.tags: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        self.tags.add(tag)
        if a.get("src") is not None:
            self.srcs.append(a["src"] or "")
        if tag == "svg" and "heatmap" in (a.get("class") or ""):
            self.view = a.get("data-view")
            self.marks[self.view or ""] = {"expected": [], "identified": []}
            self.cells[self.view or ""] = {}
        cls = a.get("class") or ""
        if self.view is not None and cls in ("expected", "identified"):
            x = float(a.get("x") or a.get("cx") or "nan")
            self.marks[self.view][cls].append((int(a["data-row"] or 0), int(a["data-col"] or 0), x))
        if self.view is not None and cls == "cell":
            self.cells[self.view][(int(a["data-row"] or 0), int(a["data-col"] or 0))] = a.get("fill") or ""
        if tag == "a" and "code" in cls:
            self.codes.append(("", a.get("href")))

    def handle_endtag(self, tag: str) -> None:
        if tag == "svg":
            self.view = None

    def handle_data(self, data: str) -> None:
        if self.codes and self.codes[-1][0] == "":
            self.codes[-1] = (data, self.codes[-1][1])


def parse(html: str) -> Svg:
    p = Svg()
    p.feed(html)
    return p


def rings_vs_outlines(p: Svg, view: str) -> tuple[dict[int, int], dict[int, int]]:
    exp = {r: c for r, c, _ in p.marks[view]["expected"]}
    ident = {r: c for r, c, _ in p.marks[view]["identified"]}
    return exp, ident


def test_seed_heatmap_shows_the_shifted_diagonal(seed, tmp_path):
    rep, _, _ = seed
    out = visual.write_html(rep, tmp_path / "r.html")
    p = parse(out.read_text())
    assert set(p.marks) == {"focus", "all"}
    fexp, fid = rings_vs_outlines(p, "focus")
    assert fexp == {0: 0, 1: 1, 2: 2}  # focus columns: streams 0, 3, 7, 10
    assert fid == {0: 1, 1: 2, 2: 3}  # one column right of the outline, every row
    exp, ident = rings_vs_outlines(p, "all")
    assert exp == {0: 0, 1: 3, 2: 7} and ident == {0: 3, 1: 7, 2: 10}
    assert all(ident[i] == exp[i + 1] for i in range(2))  # ring of row i under the outline of row i+1
    # the ringed cells are the brightest of their rows (closest), the outlined ones are dark
    for r in range(3):
        row = {c: f for (rr, c), f in p.cells["focus"].items() if rr == r}
        assert row[fid[r]] == max(row.values(), key=_lum)
        assert _lum(row[fexp[r]]) < _lum(row[fid[r]]) - 80
    assert "sits 1 column right of the outlined one" in out.read_text()


def _lum(h: str) -> float:
    r, g, b = (int(h[k:k + 2], 16) for k in (1, 3, 5))
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def test_html_is_self_contained_and_links_codes_to_docs(seed, tmp_path, monkeypatch):
    rep, _, _ = seed
    monkeypatch.setenv(html_page.DOCS_ENV, "https://example.invalid/consistency/docs")
    text = visual.write_html(rep, tmp_path / "r.html").read_text()
    p = parse(text)
    assert not ({"script", "link", "img", "iframe", "object"} & p.tags) and not p.srcs
    assert "url(" not in text and "@import" not in text
    links = dict(p.codes)
    assert links["SLOT_SHIFT"] == "https://example.invalid/consistency/docs/findings.md#slot-shift"
    assert links["LAYER_MISMATCH"].endswith("findings.md#layer-mismatch")
    assert {f.code for f in rep.findings} == set(links)
    for tensor in rep.per_token:  # one per-token plot per mismatched tensor
        assert f'class="token-plot" data-tensor="{tensor}"' in text
    assert rep.summary.split(" -- ")[0] in text


def test_docs_link_defaults(seed, monkeypatch, tmp_path):
    rep, _, _ = seed
    monkeypatch.delenv(html_page.DOCS_ENV, raising=False)
    base = html_page.docs_base()  # readable by whoever the page is sent to: not file://, not relative
    assert base == "https://github.com/consistency-dev/consistency/blob/main/docs/"
    assert (ROOT / "docs" / "findings.md").is_file()  # what it points at, in the repository
    text = visual.write_html(rep, tmp_path / "r.html").read_text()
    assert "file://" not in text and f'href="{base}findings.md#slot-shift"' in text
    assert html_page.doc_href("docs/findings.md#slot-shift", "docs/") == "docs/findings.md#slot-shift"
    for bad in ('javascript:alert(1)', 'docs/x" onmouseover="y', "/etc/passwd", None):
        assert html_page.doc_href(bad, "docs/") is None


def test_hostile_names_are_escaped(seed, tmp_path):
    rep, _, _ = seed
    evil = '<script>alert("x")</script>'
    sim = rep.similarity.model_copy(update={"rows": [evil + r for r in rep.similarity.rows]})
    bad = rep.model_copy(update={"similarity": sim, "summary": evil,
                                 "per_token": {evil: next(iter(rep.per_token.values()))}})
    text = visual.write_html(bad, tmp_path / "r.html").read_text()
    assert "<script" not in text and "&lt;script&gt;" in text


def test_refuses_to_clobber_and_writes_atomically(seed, tmp_path):
    rep, _, _ = seed
    target = tmp_path / "r.html"
    target.write_text("keep me")
    with pytest.raises(OutputExistsError):
        visual.write_html(rep, target)
    assert target.read_text() == "keep me"
    visual.write_html(rep, target, force=True)
    assert target.read_text().startswith("<!DOCTYPE html>")
    assert sorted(x.name for x in tmp_path.iterdir()) == ["r.html"]  # no temporary file left behind


def test_pass_case_rings_sit_inside_outlines(tmp_path):
    rep = run_compare(*record_pair(tmp_path, TRAIN, TRAIN))
    assert rep.verdict == "pass"
    text = html_page.render(rep)
    p = parse(text)
    exp, ident = rings_vs_outlines(p, "all")
    assert exp == ident == {0: 0, 1: 3, 2: 7}
    assert "Every slot holds the stream it was expected to hold" in text
    assert 'class="token-plot"' not in text  # nothing mismatched, nothing to plot


def test_order_mismatch_is_not_called_a_shift(seed):
    rep, _, _ = seed
    s = rep.similarity
    swapped = s.model_copy(update={"identified": [s.expected[1], s.expected[0], s.expected[2]]})
    g = heatmap.grids(swapped)[-1]
    assert heatmap.slot_shift(g) == 0
    assert heatmap.describe(g).startswith("2 of 3 slots hold another stream")
    shifted = heatmap.grids(s)
    assert [heatmap.slot_shift(g) for g in shifted] == [1, 1]


def test_degenerate_matrices_render(seed, tmp_path):
    """NaN and zero cells, a 62-stream target, no similarity at all: the page still says what it can."""
    rep, _, _ = seed
    n = 62
    vals = [[0.0 if j == 3 * i + 2 else (math.nan if j == 5 else 0.3 + 0.01 * j) for j in range(n)] for i in range(3)]
    cols = [f"hidden.{j}" for j in range(n)]
    sim = SimilarityMatrix(rows=["aux.0", "aux.1", "aux.2"], cols=cols, values=vals,
                           expected=["hidden.0", "hidden.3", "hidden.6"], identified=["hidden.2", None, "hidden.8"])
    text = html_page.render(rep.model_copy(update={"similarity": sim}))
    p = parse(text)
    assert len(p.cells["all"]) == 3 * n and p.cells["all"][(0, 5)] == heatmap.NAN_COLOUR
    assert p.cells["all"][(0, 2)] == heatmap.colour(1.0)  # exact zero: the closest colour, not an error
    assert rings_vs_outlines(p, "all") == ({0: 0, 1: 3, 2: 6}, {0: 2, 2: 8})
    none = html_page.render(rep.model_copy(update={"similarity": None, "per_token": {}, "findings": []}))
    assert "no slot x stream heatmap" in none and 'class="heatmap"' not in none


def test_log_scale_and_colours():
    sc = heatmap.scale_for("token_rel_diff", [[1.5e-5, 0.27, 0.9]])
    assert (sc.lo, sc.hi, sc.log) == (1e-5, 1.0, True)
    assert sc.closeness(1e-5) == 1.0 and sc.closeness(1.0) == 0.0
    assert abs(sc.closeness(1e-3) - 0.6) < 1e-9  # two decades of five from the close end
    assert heatmap.colour(0.0) == heatmap.VIRIDIS[0] and heatmap.colour(1.0) == heatmap.VIRIDIS[-1]
    cos = heatmap.scale_for("cosine", [[0.2, 0.99]])
    assert cos.higher_is_closer and cos.closeness(1.0) == 1.0


def test_pngs(seed, tmp_path):
    pytest.importorskip("matplotlib")
    from PIL import Image

    rep, _, _ = seed
    out = tmp_path / "png"
    written = visual.write_pngs(rep, out)
    names = sorted(p.name for p in written)
    assert names == ["heatmap-all-streams.png", "heatmap.png", "per-token-aux.0.png", "per-token-aux.1.png",
                     "per-token-aux.2.png"]
    for p in written:
        with Image.open(p) as im:
            assert im.format == "PNG" and im.size[0] > 300 and im.size[1] > 150
    assert len(visual.write_pngs(rep, out)) == 5  # our own plots are outputs: a re-run rewrites them
    (out / "heatmap.png").unlink()
    (out / "per-token-aux.0.png").write_bytes(b"\x89PNG\r\n\x1a\nsomeone else's picture")
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    with pytest.raises(OutputExistsError):  # a PNG that is not ours: refuse before writing anything
        visual.write_pngs(rep, out)
    assert not (out / "heatmap.png").exists()
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    assert len(visual.write_pngs(rep, out, force=True)) == 5


def test_png_dir_that_is_a_file(seed, tmp_path):
    pytest.importorskip("matplotlib")
    rep, _, _ = seed
    f = tmp_path / "f"
    f.write_text("x")
    with pytest.raises(ConsistencyError, match="not a directory"):
        visual.write_pngs(rep, f)


def test_cli_html_png_and_no_clobber(seed, tmp_path):
    _, ref, cand = seed
    html, png = tmp_path / "r.html", tmp_path / "png"
    args = ["compare", ref, cand, "--html", str(html), "-q"]
    if _has_matplotlib():
        args += ["--png", str(png)]
    r = run_cli(*args)
    assert r.returncode == 1, r.stderr
    assert html.read_text().count('class="finding"') >= 4
    if _has_matplotlib():
        assert (png / "heatmap.png").stat().st_size > 1000
    again = run_cli(*args)  # reports are outputs: the same command re-runs over its own reports
    assert again.returncode == 1, again.stderr
    html.write_text("<!DOCTYPE html><p>my notes</p>")  # not a report of ours: kept
    again = run_cli("compare", ref, cand, "--html", str(html), "-q")
    assert again.returncode == 2
    assert re.search(r"r\.html: output exists; pass --force", again.stderr)
    assert html.read_text() == "<!DOCTYPE html><p>my notes</p>"
    assert run_cli("compare", ref, cand, "--html", str(html), "-q", "--force").returncode == 1


def test_png_without_matplotlib_is_one_line_usage_error(seed, tmp_path):
    """The core install has no matplotlib: --png says how to get it; --html still works."""
    _, ref, cand = seed
    code = ("import sys; sys.modules['matplotlib'] = None; from consistency.cli import run; "
            f"sys.argv = ['consistency', 'compare', {ref!r}, {cand!r}, '--png', {str(tmp_path / 'p')!r}, '-q']; run()")
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "NO_COLOR": "1"})
    assert r.returncode == 2, r.stderr
    assert "pip install 'specdec-consistency[report]'" in r.stderr and r.stderr.count("\n") == 1
    assert not (tmp_path / "p").exists()


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True
