"""A hostile corpus through every output: strings from files are shown, never obeyed.

Tensor names, metadata values, file names, check names and serve commands are written by
whoever wrote the file (or the repository under test). Each is planted in real dump files
(safetensors header names and ``__metadata__``), a real gate config and a real serve
command, then compare, inspect, lint and gate run as a CI job would run them (the console
script's own function in this process, stdout and stderr captured as a pipe would see them;
the text/JSON/HTML/PNG compare as a real ``python -m consistency`` process, so nothing written
below Python escapes the check); every output is checked to be inert: no terminal control
sequence, no line a GitHub runner would read as a workflow command, no rich markup
interpreted (``[/]`` must not crash, ``[link=...]`` must not become a hyperlink), well-formed
XML, escaped Markdown and HTML, percent-encoded URIs, and PNG titles that matplotlib does not
parse as mathtext.
"""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import cli, run_cli
from consistency.contract.models import AuxInfo, DumpMetadata, ModelInfo, RuntimeInfo, TensorMeta
from consistency import escape as esc

# printable (a tensor name must be): markup, workflow commands, HTML, mathtext, Markdown
NAMES = ["[/]", "[link=https://evil.example]click[/link]", "::error::forged-by-name", "<script>alert(1)</script>",
         r"$\frac{}{}$", "a|b`c`*d*", "[bold red]x[/bold red]", "##[error]legacy-by-name",
         "x##[set-output name=verdict;]pass", "#", "#[add-mask]half"]
# metadata values: the reader already refuses C0/C1 controls but tab, CR and newline in
# metadata, so those, bidi overrides and markup are what a hostile header can carry; ESC,
# BEL and C1 arrive through file names (any byte but "/" and NUL), planted below
META = ["line\n::error file=x::forged-by-metadata", "tab\there\rcr", "<script>x</script>", "[/]",
        "[link=https://evil.example]meta[/link]", "$\\frac{}{}$", "a|b`c`", "\u202eevil", "::warning::m",
        "##[stop-commands]tok", "tail ##[add-mask]secret"]
FILE_NAME = "e\x1b[31m\x07[bold]::error::f\nx.safetensors"
CONTROL = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def _inert(text: str, allowed_annotations: int = 0) -> None:
    """No control character but newline; no line a runner reads as a workflow command."""
    assert not CONTROL.search(text), repr(CONTROL.search(text).group(0))  # type: ignore[union-attr]
    assert "\x1b]8" not in text and "MarkupError" not in text and "Traceback" not in text
    commands = [line for line in text.splitlines() if line.lstrip().startswith("::")]
    assert len(commands) <= allowed_annotations, commands
    for line in commands:  # ours: ::error|warning props::data, with the data percent-encoded
        assert re.match(r"^::(error|warning) [^:]*::", line), line
    assert "::error::forged" not in "\n".join(line for line in text.splitlines() if not line.startswith("::"))
    assert "##[" not in text  # the runner's legacy syntax is matched anywhere in a line


def _dumps(d: Path) -> tuple[Path, Path]:
    rng = np.random.default_rng(0)
    h = [rng.standard_normal((12, 16)).astype(np.float32) for _ in range(5)]
    hostile = {n: rng.standard_normal((12, 16)).astype(np.float32) for n in NAMES}
    ref_meta = DumpMetadata(model=ModelInfo(name=" ".join(META), num_layers=4, hidden_size=16),
                            runtime=RuntimeInfo(name="transformers", version=META[0]), aux=AuxInfo(stream_ids=[0, 2]),
                            prompt="\n".join(META), extra={"notes": META, "k\n::error::key": META[1]})
    cand_meta = DumpMetadata(model=ModelInfo(name=META[3] + META[0], num_layers=4, hidden_size=16),
                             runtime=RuntimeInfo(name="sglang", version=META[2]), aux=AuxInfo(stream_ids=[0, 2]),
                             prompt=META[5], extra={"notes": list(reversed(META))})
    ref = {f"hidden.{i}": h[i] for i in range(5)} | {"aux.0": h[0], "aux.1": h[2]} | hostile
    cand = {"aux.0": h[0], "aux.1": h[3]} | {n: v + 1.0 for n, v in hostile.items()}  # every hostile name differs
    rp, cp = d / "ref.safetensors", d / FILE_NAME
    _hostile_dump(rp, ref, ref_meta)
    _hostile_dump(cp, cand, cand_meta)
    return rp, cp


def _hostile_dump(path: Path, tensors: dict[str, np.ndarray], meta: DumpMetadata) -> None:
    """Write the header as an attacker would: our writer escapes controls in metadata, so
    the raw strings (ESC, BEL, NUL, C1) are serialised here with plain ``json.dumps``."""
    from consistency.dump.reader import META_KEY
    from consistency.dump.safetensors_io import write_safetensors

    for name, arr in tensors.items():
        meta.tensors.setdefault(name, TensorMeta(dtype="float32", shape=list(arr.shape)))
    header = {META_KEY: json.dumps(meta.model_dump(mode="json", exclude_none=True))}
    with open(path, "wb") as fh:
        write_safetensors(fh, {n: (a, "float32") for n, a in tensors.items()}, header)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    d = tmp_path_factory.mktemp("hostile")
    rp, cp = _dumps(d)
    return d, rp, cp


def test_the_corpus_is_really_in_the_files(corpus: tuple[Path, Path, Path]) -> None:
    from consistency.dump.reader import open_dump

    d, rp, cp = corpus
    with open_dump(cp) as dump:
        assert set(NAMES) <= set(dump.names) and "\n::error file=x" in (dump.metadata.model.name or "")
    assert "\n" in cp.name and "\x1b" in cp.name


def test_compare_text_json_html_png_are_inert(corpus: tuple[Path, Path, Path]) -> None:
    d, rp, cp = corpus
    out = d / "cmp"
    out.mkdir(exist_ok=True)
    r = cli("compare", str(rp), str(cp), "--show-ok", "--json", str(out / "r.json"), "--html", str(out / "r.html"),
            "--png", str(out / "png"), "--force")
    assert r.returncode == 1, r.stderr  # the hostile tensors differ: findings, not a crash
    _inert(r.stdout)
    _inert(r.stderr)
    assert "[/]" in r.stdout and "[link=https://evil.example]click[/link]" in r.stdout  # shown literally
    assert "\\x1b[31m" in r.stdout  # the ESC of the metadata diff is shown as an escape
    rep = json.loads((out / "r.json").read_text())  # JSON keeps the data exactly (it is data, not display)
    assert {s["tensor"] for s in rep["slots"]} >= {"aux.0", "aux.1"}
    page = (out / "r.html").read_text()
    assert "<script>alert(1)</script>" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert not CONTROL.search(page)
    pngs = sorted((out / "png").iterdir())
    assert len(pngs) >= 1 + len(NAMES) and all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)


def test_compare_run_twice_into_the_same_reports(corpus: tuple[Path, Path, Path]) -> None:
    """Reports are outputs: a previous report of ours is rewritten without --force."""
    d, rp, cp = corpus
    out = d / "loop"
    out.mkdir(exist_ok=True)
    for _ in range(2):
        r = run_cli("compare", str(rp), str(cp), "-q", "--json", str(out / "r.json"), "--html", str(out / "r.html"))
        assert r.returncode == 1, r.stderr
    r = run_cli("compare", str(rp), str(cp), "-q", "--json", str(rp))
    assert r.returncode == 2 and "output exists" in r.stderr  # a dump is data: never replaced without --force


def test_inspect_is_inert(corpus: tuple[Path, Path, Path]) -> None:
    d, rp, cp = corpus
    r = run_cli("inspect", str(cp))
    assert r.returncode == 0, r.stderr
    _inert(r.stdout + r.stderr)
    assert "[bold red]x[/bold red]" in r.stdout  # markup shown, not applied


def test_an_error_naming_a_hostile_file_is_one_inert_line(corpus: tuple[Path, Path, Path]) -> None:
    d, rp, cp = corpus
    bad = d / ("gone\x1b[2J\n::error::forged-by-path.safetensors")
    r = run_cli("compare", str(rp), str(bad))
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    _inert(r.stderr)


def test_lint_serve_command_and_file_names_are_inert(tmp_path: Path) -> None:
    from tests.lint.test_lint_support import FIX

    draft = tmp_path / "d[bold] \x1b[31m::error::x.json"
    draft.write_bytes((FIX / "drafts" / "sglang" / "kimi-k2.5-eagle3-seed.json").read_bytes())
    serve = ("python -m sglang.launch_server --speculative-algorithm EAGLE3 --model [link=https://e.x]m[/link] "
             "--served-model-name \x1b[31m::error::forged-by-serve\x07")
    for fmt in ("text", "json", "sarif"):
        r = run_cli("lint", "--draft", str(draft), "--serve", serve, "--runtime", "sglang@0.5.12", "--format", fmt)
        assert r.returncode in (0, 1), r.stderr
        _inert(r.stderr)
        if fmt == "text":
            _inert(r.stdout)
        else:
            doc = json.loads(r.stdout)
            if fmt == "sarif":
                for res in doc["runs"][0]["results"]:
                    for loc in res.get("locations", []):
                        uri = loc["physicalLocation"]["artifactLocation"]["uri"]
                        assert re.fullmatch(r"[A-Za-z0-9\-._~/%:]+", uri), uri
                    assert not CONTROL.search(res["message"]["text"])


def test_gate_text_annotations_junit_sarif_summary_are_inert(corpus: tuple[Path, Path, Path], tmp_path: Path) -> None:
    from tests.lint.test_lint_support import FIX

    d, rp, cp = corpus
    (tmp_path / "dumps").mkdir()
    (tmp_path / "dumps" / "ref.safetensors").write_bytes(rp.read_bytes())
    (tmp_path / "dumps" / "cand.safetensors").write_bytes(cp.read_bytes())
    draft = tmp_path / "draft <b>|`x`.json"
    draft.write_bytes((FIX / "drafts" / "sglang" / "kimi-k2.5-eagle3-seed.json").read_bytes())
    hostile_check = "::error::forged-by-check [/] <script>x</script> | `y` \\x1b ##[error]legacy"
    cfg = tmp_path / "consistency.toml"
    cfg.write_text(
        f"[[lint]]\nname = {json.dumps(hostile_check + ' lint')}\ndraft = {json.dumps(draft.name)}\n"
        f"runtime = \"sglang@0.5.12\"\ntrained_with = \"stream:0,3,31\"\n"
        f"serve = {json.dumps('python -m sglang.launch_server --speculative-algorithm EAGLE3 [/] ::error::s')}\n"
        f"[[compare]]\nname = {json.dumps(hostile_check + chr(27) + '[31m' + chr(7))}\n"
        "reference = \"dumps/ref.safetensors\"\ncandidate = \"dumps/cand.safetensors\"\n"
        f"[[compare]]\nname = \"gone\"\nreference = \"dumps/ref.safetensors\"\n"
        f"candidate = {json.dumps('dumps/gone' + chr(27) + '[2J' + chr(7) + chr(0x9b) + ' ::error::p.safetensors')}\n")
    summary = tmp_path / "summary.md"
    r = run_cli("gate", "--config", str(cfg), "--junit", str(tmp_path / "j.xml"), "--sarif", str(tmp_path / "g.sarif"),
                "--json", str(tmp_path / "g.json"), env={"GITHUB_ACTIONS": "true", "GITHUB_STEP_SUMMARY": str(summary)})
    assert r.returncode == 2, r.stderr  # the "gone" check cannot read its input; the others still ran
    rep = json.loads((tmp_path / "g.json").read_text())
    assert {c["verdict"] for c in rep["checks"]} == {"fail", "error"}
    failing = sum(c["status"] in ("failed", "error") or c.get("severity") == "warning"
                  for chk in rep["checks"] for c in chk["cases"])
    _inert(r.stdout, allowed_annotations=failing)
    _inert(r.stderr)
    assert any(line.startswith("::error ") for line in r.stdout.splitlines())
    # JUnit parses and keeps the names (escaped, not dropped)
    root = ET.parse(tmp_path / "j.xml").getroot()
    names = [c.get("name") for c in root.iter("testcase")]
    assert "[/]" in names and "<script>alert(1)</script>" in names
    assert not CONTROL.search((tmp_path / "j.xml").read_text().replace("\t", ""))
    # SARIF URIs percent-encoded
    sarif = json.loads((tmp_path / "g.sarif").read_text())
    uris = [loc["physicalLocation"]["artifactLocation"]["uri"] for run in sarif["runs"] for res in run["results"]
            for loc in res.get("locations", [])]
    assert uris and all(re.fullmatch(r"[A-Za-z0-9\-._~/%:]+", u) for u in uris) and any("%20" in u for u in uris)
    # Markdown: no raw HTML, no code span or table cell broken by content, one line per row
    md = summary.read_text()
    assert not CONTROL.search(md)
    assert "<script>" not in md and "<b>" not in md
    for line in md.splitlines():
        if line.startswith("| "):
            cells = re.split(r"(?<!\\)\|", line)
            assert len(cells) in (6, 7), line  # 4-column tables (5 with the slot table's extra), no injected pipe
    assert "`" not in md.replace("\\`", "")  # every backtick from content is escaped


@pytest.mark.parametrize("s", NAMES + META + [FILE_NAME])
def test_each_escape_helper_on_the_corpus(s: str) -> None:
    t = esc.term(s)
    assert not CONTROL.search(t) and "\n" not in t and "::" not in t and not t.startswith(":")
    assert "##[" not in t and "##[" not in esc.term("#") + t + esc.term("#")  # nor where two escaped strings meet
    assert "##[" not in esc.annotation_data(s) and "##[" not in esc.annotation_prop(s)
    el = ET.Element("a", b=esc.xml(s))
    el.text = esc.xml(s)
    assert ET.fromstring(ET.tostring(el, encoding="unicode")).get("b") == esc.xml(s)  # well-formed XML
    m = esc.md(s)
    # every punctuation mark escaped: inert for Markdown, HTML and a shell sourcing the file
    assert "\n" not in m and not re.search(r"(?<!\\)[<>&|`;$()'\"]", m)
    assert re.fullmatch(r"[A-Za-z0-9\-._~/%:]+", esc.uri(Path("/w") / s, Path("/w")))
    h = esc.html(s)
    assert "<" not in h and '"' not in h and not CONTROL.search(h)
    assert not re.search(r"(?<!\\)\$", esc.mpl(s))
    a = esc.annotation_data(s)
    assert "\n" not in a and "\r" not in a and not CONTROL.search(a)


def test_json_on_stdout_is_inert_in_a_ci_log_and_still_the_same_data(corpus: tuple[Path, Path, Path]) -> None:
    """``--json -`` lands in the job log line by line: no line is a workflow command there,
    and a JSON parser reads the same strings back."""
    d, rp, cp = corpus
    for argv in (["compare", str(rp), str(cp), "--json", "-"], ["inspect", str(cp), "--json"]):
        r = run_cli(*argv)
        assert r.returncode in (0, 1), r.stderr
        _inert(r.stdout)
        data = json.loads(r.stdout)
        text = json.dumps(data)
        assert "##[error]legacy-by-name" in text and "::error::forged-by-name" in text


def test_rich_render_of_markup_names_does_not_crash_or_link() -> None:
    """The failure this guards: a str handed to rich is parsed as markup."""
    import io

    from rich.console import Console

    buf = io.StringIO()
    con = Console(file=buf, force_terminal=True, width=200)
    for s in NAMES + META:
        con.print(esc.text(s))
    out = buf.getvalue()
    assert "\x1b]8;" not in out  # no OSC 8 hyperlink
    assert "[/]" in out and "[link=https://evil.example]click[/link]" in out


def test_replay_text_with_hostile_file_names_is_inert(tmp_path: Path) -> None:
    """replay prints both paths and the draft's; recorded for real on the built-in target."""
    pytest.importorskip("transformers")
    d = tmp_path / "d [bold red] [link=https:e.x]x"  # no "/" in a file name: markup that needs none
    d.mkdir()
    train, serve = d / "t\x1b[31m\x07::error::r.safetensors", d / "s\n::error::c\x9b.safetensors"
    for out, extra in ((train, ["--aux-layers", "0,3,7"]),
                       (serve, ["--aux-layers", "2,6,9", "--style", "serving", "--convention", "sglang@0.5.5"])):
        r = run_cli("record", "--model", "tiny-llama", "--prompt", "a hostile path is still a path", *extra,
                    "-o", str(out))
        assert r.returncode == 0, r.stderr
        _inert(r.stdout + r.stderr)
    r = run_cli("replay", "--draft", "tiny-llama-eagle3", "--target", "tiny-llama", str(train), str(serve))
    assert r.returncode == 1, r.stderr  # the shifted serving side loses acceptance
    _inert(r.stdout)
    _inert(r.stderr)
    assert "[link=https:e.x]x" in r.stdout and "\\x1b[31m" in r.stdout
