"""Every page of docs/ holds to what the tool does (issue 39: the docs beyond the README had drifted).

- Every block a reader types (``$ commands``, ``>>>`` sessions) either runs in a test against
  its shown output, or the page says right above it, where the reader sees it, why it is not
  run (``*Not run by the docs test: REASON.*``: a GPU, a server, files only the reader has).
  The pages' runnable commands run in tests/project/test_newcomer_install.py's installed-wheel venv (slow);
  the rule pages' examples run here, in-process, on each rule's failing scenario.
- Every ``import`` a Python block of docs/ shows resolves against this package.
- Every option of every command is named on the page that documents the command.
"""

from __future__ import annotations

import ast
import importlib
import json
import re
import shlex
import shutil
from pathlib import Path

import pytest

from tests.conftest import ROOT, run_cli
from tests.docrun import blocks, commands

DOCS = sorted((ROOT / "docs").rglob("*.md"))
# the page that documents each command's options (commands.md's section, else its own page)
OPTION_PAGES = {"lint": "lint.md", "gate": "ci.md", "replay": "replay.md"}


def _rel(p: Path) -> str:
    return str(p.relative_to(ROOT))


def test_every_session_block_in_docs_runs_or_says_why_not() -> None:
    unmarked, marked, runnable = [], 0, 0
    for page in DOCS:
        for b in blocks(page):
            if not b.is_session:
                continue
            if b.not_run is not None:
                assert len(b.not_run) >= 20, f"{_rel(page)}:{b.line}: say why it is not run, not just that"
                marked += 1
            elif b.lang != "console":
                unmarked.append(f"{_rel(page)}:{b.line}: a >>> session the sweep does not run")
            else:
                runnable += 1
    assert not unmarked, unmarked
    assert runnable >= 60 and marked <= 40, (runnable, marked)  # the sweep runs most, marks few


def test_the_not_run_marker_is_read_only_right_above_a_block(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text("intro\n\n*Not run by the docs test: needs a GPU and a server.*\n\n```console\n$ a\n```\n\n"
                    "*Not run by the docs test: above another paragraph.*\n\ntext\n\n```console\n$ b\n```\n")
    got = [(b.body.strip(), b.not_run) for b in blocks(page)]
    assert got == [("$ a", "needs a GPU and a server"), ("$ b", None)]
    assert [c.text for c in commands(page, runnable_only=True)] == ["b"]


def _imports(code: str) -> list[tuple[str, str | None]]:
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return []
    out: list[tuple[str, str | None]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out += [(node.module, a.name) for a in node.names]
    return out


def test_every_import_a_python_block_shows_exists() -> None:
    """``import consistency.compare.align`` (api.md) raised ModuleNotFoundError for a reader."""
    bad, seen = [], 0
    for page in [ROOT / "README.md", *DOCS]:
        for b in blocks(page):
            if b.lang not in ("python", "py", "pycon"):
                continue
            code = "\n".join(ln[4:] if ln.startswith((">>> ", "... ")) else ln for ln in b.body.splitlines()
                             if not b.is_session or ln.startswith((">>> ", "... ")))
            for mod, name in _imports(code):
                if mod.split(".")[0] != "consistency":
                    continue  # the reader's own packages (sglang, vllm, nnsight)
                seen += 1
                try:
                    m = importlib.import_module(mod)
                except ImportError as exc:
                    bad.append(f"{_rel(page)}:{b.line}: import {mod}: {exc}")
                    continue
                if name is not None and not hasattr(m, name):
                    try:
                        importlib.import_module(f"{mod}.{name}")
                    except ImportError:
                        bad.append(f"{_rel(page)}:{b.line}: from {mod} import {name}: no such name")
    assert not bad, bad
    assert seen >= 10, seen


def test_every_option_of_every_command_is_on_its_page() -> None:
    """commands.md's demo synopsis lacked --no-replay: each option appears on its command's page."""
    from consistency.cli import COMMANDS

    text = (ROOT / "docs" / "commands.md").read_text()
    sections = {s.split("\n", 1)[0].strip(): s for s in re.split(r"^## ", text, flags=re.M)[1:]}
    missing = []
    for name, (mod, fn, _help) in COMMANDS.items():
        cmd = getattr(importlib.import_module(mod), fn)
        page = (ROOT / "docs" / OPTION_PAGES[name]).read_text() if name in OPTION_PAGES else \
            sections.get(name, text)
        for p in cmd.params:
            flags = [o for o in p.opts + p.secondary_opts if o.startswith("-")]
            if flags and not any(re.search(rf"(?<![\w-]){re.escape(o)}(?![\w-])", page) for o in flags):
                missing.append(f"{name}: {'/'.join(flags)}")
    assert not missing, missing


def _doc_pages() -> list[Path]:
    """The pages with a runnable command, but the rule pages (run below, on their scenarios) and
    the tutorial (tests/project/test_newcomer_install.py runs it, with the README, on the installed wheel)."""
    from tests.project.test_newcomer_install import PAGES

    return [p for p in DOCS if p.parent.name != "rules" and p not in PAGES and commands(p, runnable_only=True)]


@pytest.mark.slow
def test_every_docs_page_prints_what_it_shows(tmp_path: Path) -> None:
    """Each page's commands, in order, in one shell per page, from a copy of the checkout
    (tests/project/test_newcomer_install.run_pages: exit codes, shown lines, no traceback, nothing written
    outside out/), with this environment's ``consistency`` on PATH."""
    import os
    import sys

    from tests.project.test_newcomer_install import _env, run_pages

    env = _env()
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    run_pages(_doc_pages(), tmp_path, env, at_least=20)


def test_every_page_with_a_runnable_command_is_run() -> None:
    pages = {_rel(p) for p in _doc_pages()}
    assert pages >= {"docs/lint.md", "docs/commands.md", "docs/report.md", "docs/ci.md",
                                             "docs/conventions.md", "docs/replay.md", "docs/integrations/specforge.md"}, pages


# -- the rule pages: each example runs on its rule's failing scenario -------------------------------

SEED_PAGES = {"IDS002"}
_FINDING = re.compile(r"(error|warning|info)\s+([A-Z]{2}[A-Z1]\d{3})\s+(\S+)\s+(.*)")


def _collapse(s: str) -> str:
    return " ".join(s.split())


def _contains(whole: str, shown: str) -> bool:
    return all(f in _collapse(whole) for f in (_collapse(x) for x in shown.split("...")) if len(f) >= 4)


def _place(tmp: Path, code: str, args: list[str]) -> None:
    """The rule's failing scenario under the names the page's command uses."""
    import sys

    sys.path.insert(0, str(ROOT / "tests"))
    from tests.lint.test_lint_rules import FAIL

    paths = FAIL[code]().write(tmp / "_scenario")
    if code in SEED_PAGES:  # the seed story's own draft and target, as the page tells it
        fx = ROOT / "fixtures" / "configs"
        shutil.copyfile(fx / "drafts" / "sglang" / "kimi-k2.5-eagle3-seed.json", Path(paths["draft"]) / "config.json")
        shutil.copyfile(fx / "targets" / "kimi-k2.5.json", paths["target"])
    for flag, key in (("--draft", "draft"), ("--target", "target")):
        if flag in args and paths[key]:
            name = args[args.index(flag) + 1]
            dst, fixture = tmp / name, ROOT / name
            dst.parent.mkdir(parents=True, exist_ok=True)
            if name.startswith("fixtures/") and fixture.exists():  # the page names a repository fixture: that one
                (shutil.copytree if fixture.is_dir() else shutil.copyfile)(fixture, dst)
            else:
                shutil.move(paths[key], dst)
    if "--trained-with" in args and args[args.index("--trained-with") + 1].endswith(".safetensors"):
        import numpy as np

        from consistency.contract.models import AuxInfo, DumpMetadata
        from consistency.dump.writer import write_dump

        aux = {f"aux.{i}": np.zeros((4, 8), np.float32) for i in range(3)}  # the seed's training streams
        write_dump(tmp / args[args.index("--trained-with") + 1], aux,
                   DumpMetadata(side="training", aux=AuxInfo(stream_ids=[0, 3, 31])))


@pytest.mark.parametrize("page", sorted((ROOT / "docs" / "rules").glob("[A-Z][A-Z][A-Z1][0-9][0-9][0-9].md")), ids=lambda p: p.stem)
def test_a_rule_page_example_prints_what_the_page_shows(page: Path, tmp_path: Path) -> None:
    code = page.stem
    cmds = commands(page, runnable_only=True)
    assert cmds, f"{page.name}: no example command"
    for c in cmds:
        args = shlex.split(c.text.replace("\\\n", " "))
        assert args[:2] == ["consistency", "lint"], c.text
        _place(tmp_path, code, args)
        r = run_cli(*args[1:], "--format", "json", cwd=tmp_path)
        assert r.stdout.strip(), (r.returncode, r.stderr[-500:])
        found = json.loads(r.stdout)["findings"]
        last = None
        for line in c.shown:
            if line.strip().startswith("fix:") and last is not None:
                assert _contains(f"fix: {last.get('fix') or ''}", line.strip()), (line, last.get("fix"))
                continue
            m = _FINDING.match(line)
            assert m, f"{page.name}: a shown line that is not a finding: {line[:80]!r}"
            sev, shown_code, _name, msg = m.groups()
            hits = [f for f in found if f["severity"] == sev and f["code"] == shown_code and _contains(f["message"], msg)]
            assert hits, (f"{page.name}: not printed: {line[:200]}", [f["message"] for f in found if f["code"] == shown_code])
            last = hits[0]


# -- api.md's pytest example: the block runs, its AssertionError is the one the page shows ------------

def test_the_pytest_example_of_api_md_fails_as_the_page_shows(tmp_path: Path) -> None:
    """The page showed ``expected aux.0 (stream 1)`` where the tool says ``hidden.1``. The
    example's two names a reader supplies are built here: a tiny Llama, and a "runtime" that
    captures the streams one layer later than training used (the SGLang +1 family)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import consistency
    from tests.conftest import prompt_ids, tiny

    page = ROOT / "docs" / "api.md"
    bl = blocks(page)
    i = next(k for k, b in enumerate(bl) if "def test_serving_capture_matches_training" in b.body)
    code, shown = bl[i].body, bl[i + 1].body.splitlines()
    model = tiny("tiny-llama")
    ids = prompt_ids(model, 32)

    def my_runtime_capture(model, ids):  # noqa: ANN001, ANN202 - the page's own signature
        with torch.no_grad():
            hs = model(torch.as_tensor(ids)[None], output_hidden_states=True).hidden_states
        return {"aux.0": hs[2][0], "aux.1": hs[4][0]}  # streams [2, 4]; training records [1, 3]

    ns = {"consistency": consistency, "model": model, "ids": ids, "my_runtime_capture": my_runtime_capture}
    exec(compile(code, f"{page}:{bl[i].line}", "exec"), ns)  # noqa: S102 - our own page
    with pytest.raises(AssertionError) as exc:
        ns["test_serving_capture_matches_training"](tmp_path)
    real = _collapse(f"AssertionError: {exc.value}")
    lost = [ln for ln in shown if ln.strip() not in ("E", "...")
            and not _contains(real, re.sub(r"^E\s*", "", ln))]
    assert not lost, (lost, str(exc.value)[:3000])
