"""A newcomer's first hour, in CI: install by the distribution's name, run what the docs show.

The wheel is built from the checkout and installed by name (``specdec-consistency``, from
the local wheel through ``--find-links``) into fresh venvs, as a user would: its declared
dependencies resolved by pip, torch as the CPU pin ``torch==2.13.0`` (a local wheel here;
a bare ``torch`` would be the multi-GB CUDA build). Then:

- with the ``[hf]`` extra, every ``$ command`` of README.md and the tutorial (but those a page
  marks as not run, with its reason; the other pages: tests/project/test_docs_sweep.py) runs in a copy
  of the checkout that holds no ``consistency/`` source (so each command uses the installed
  wheel), in order, in one shell; each exits as its shown output implies, prints every line
  the page shows (docrun.missing), and writes nothing outside the git-ignored ``out/``;
- with the core install only (no torch), compare, inspect, lint and gate work, and each
  command that needs an extra says so in one line whose install line names this
  distribution (with the CPU wheel of torch when the extra pulls torch);
- no printed or documented install line names another distribution (``consistency`` on
  PyPI is an unrelated project).

Figures (this machine, 2 shared cores): the [hf] venv installs in ~55 s (torch 24 s), the
core one in ~15 s; the pages' commands take ~2 min.
"""

from __future__ import annotations

import ast
import fcntl
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from consistency import DIST, __version__
from tests.conftest import ROOT
from tests.docrun import Command, commands, missing, run_page, setup

# a reader's first hour; every other page of docs/ runs in tests/project/test_docs_sweep.py (in this
# environment, in parallel with this test: the wheel's install is proven here once)
PAGES = [ROOT / "README.md", ROOT / "docs" / "tutorial-low-acceptance.md"]
TORCH_PIN = "torch==2.13.0"  # the CPU wheel (scripts/test, scripts/demo)
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def _env(venv: Path | None = None) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("CONSISTENCY_", "PYTHON", "VIRTUAL_ENV"))}
    e["NO_COLOR"] = "1"
    if venv is not None:
        e["PATH"] = f"{venv / 'bin'}{os.pathsep}{e.get('PATH', '')}"
        e["VIRTUAL_ENV"] = str(venv)
    return e


def _run(*cmd: str | Path, cwd: Path, env: dict[str, str] | None = None, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, cwd=cwd, env=env or _env(),
                          timeout=timeout)


def _wheel(tmp: Path) -> Path:
    with open(Path(tempfile.gettempdir()) / f"consistency-wheel-{os.getuid()}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # setuptools builds in the checkout's build/ (test_packaging too)
        shutil.rmtree(ROOT / "build", ignore_errors=True)  # never cleaned by setuptools: stale modules ship
        r = _run(sys.executable, "-m", "pip", "wheel", ROOT, "--no-deps", "-q", "-w", tmp / "dist", cwd=tmp)
    assert r.returncode == 0, r.stderr[-3000:]
    whl = next((tmp / "dist").glob("*.whl"))
    assert whl.name == f"{DIST.replace('-', '_')}-{__version__}-py3-none-any.whl", whl.name
    return whl


def _venv(tmp: Path, extra: str) -> tuple[Path, dict[str, float]]:
    """A fresh venv with this distribution installed by name from the local wheel."""
    whl = _wheel(tmp)
    venv, took = tmp / f"venv-{extra or 'core'}", {}
    assert _run(sys.executable, "-m", "venv", venv, cwd=tmp).returncode == 0
    pip = [venv / "bin" / "python", "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    if extra in ("hf", "torch"):
        t = time.perf_counter()
        r = _run(*pip, TORCH_PIN, cwd=tmp)
        assert r.returncode == 0, r.stderr[-3000:]
        took["torch"] = time.perf_counter() - t
    t = time.perf_counter()
    req = f"{DIST}[{extra}]=={__version__}" if extra else f"{DIST}=={__version__}"
    r = _run(*pip, "--find-links", whl.parent, req, cwd=tmp)
    assert r.returncode == 0, r.stderr[-3000:]
    took["package"] = time.perf_counter() - t
    show = _run(venv / "bin" / "python", "-m", "pip", "show", "-f", DIST, cwd=tmp)
    assert show.returncode == 0 and f"Version: {__version__}" in show.stdout, show.stdout + show.stderr
    where = _run(venv / "bin" / "python", "-c", "import consistency; print(consistency.__file__)", cwd=tmp)
    assert where.stdout.strip().startswith(str(venv)), where.stdout + where.stderr  # the wheel, not a checkout
    # no other distribution provides the import name (PyPI's `consistency` would)
    other = _run(venv / "bin" / "python", "-m", "pip", "show", "consistency", cwd=tmp)
    assert other.returncode != 0, other.stdout
    return venv, took


def _checkout_copy(tmp: Path) -> Path:
    """The tracked files of the checkout, without the package source: commands must use the wheel."""
    work = tmp / "checkout"
    listed = _run("git", "-C", ROOT, "ls-files", cwd=tmp)
    names = listed.stdout.splitlines() if listed.returncode == 0 else [
        str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if p.is_file()
        and not {".git", ".venv", "build", "out", "__pycache__"} & set(p.relative_to(ROOT).parts)]
    for name in names:
        src = ROOT / name
        if name.startswith("consistency/") or not src.is_file():
            continue
        (work / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, work / name)
    return work


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts}


_INSTALL = re.compile(r"pip3? install\s+([^\n;`|]*)")
_TAKES_ARG = {"-c", "-r", "-e", "-f", "-i", "-t", "-w", "--constraint", "--requirement", "--editable", "--find-links",
              "--index-url", "--extra-index-url", "--python", "--target", "--prefix", "--root"}
_PROSE = {"for", "and", "or", "to", "first", "then", "alone", "with", "in", "on", "the", "a", "into", "from",
          "instead", "inside", "after", "before", "is", "are", "once"}
_REQ = re.compile(r"([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?([<>=!~]=?\S*)?")


def install_problems(text: str) -> list[str]:
    """Install lines in ``text`` that name this package by another distribution name
    (``consistency``, ``consistency[hf]``, ``consistency==0.1.0``): the requirements of each
    ``pip install`` command, read up to where the sentence goes on."""
    bad = []
    for m in _INSTALL.finditer(text):
        toks, i = m.group(1).split(), 0
        while i < len(toks):
            tok = toks[i].strip("'\"")
            i += 1
            if tok.startswith("-"):
                i += tok.split("=")[0] in _TAKES_ARG and "=" not in tok  # skip a flag's argument
                continue
            if tok.startswith(("(", "#", "<", "$")) or tok.lower() in _PROSE:
                break
            req = _REQ.fullmatch(tok.rstrip(".,:"))
            if req is None:
                continue  # a path, a URL, a wheel file
            name = req.group(1).lower().replace("_", "-")
            if "consistency" in name and name != DIST:
                bad.append(f"pip install {m.group(1).strip()[:120]} (names {name!r}, not {DIST!r})")
    return bad


def test_install_lines_in_the_code_and_the_docs_name_this_distribution() -> None:
    """Static: every string of the package, every page of the docs, the Action and the scripts."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["name"] == DIST
    assert f'DIST = "{DIST}"' in (ROOT / "scripts" / "action.py").read_text()  # stdlib-only: its own copy
    found = []
    for f in sorted((ROOT / "consistency").rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                found += [f"{f.relative_to(ROOT)}: {b}" for b in install_problems(node.value)]
    for f in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), ROOT / "action.yml",
              *sorted((ROOT / "scripts").iterdir()), ROOT / ".ci" / "run"]:
        if f.is_file():
            found += [f"{f.relative_to(ROOT)}: {b}" for b in install_problems(f.read_text())]
    assert not found, found
    for bad in ("pip install consistency", "pip install 'consistency[hf]'", "pip install consistency==0.1.0"):
        assert install_problems(bad), bad  # the check itself sees the wrong name
    assert not install_problems(f"pip install '{DIST}[hf]' (without a GPU, first: pip install torch --index-url "
                                f"{CPU_INDEX})")


def test_every_hint_that_pulls_torch_says_how_to_get_the_cpu_wheel() -> None:
    from consistency.errors import TORCH_EXTRAS, install_line

    for extra in ("torch", "hf", "interop", "test", "report", None):
        line = install_line(extra)
        assert line.startswith(f"pip install '{DIST}[{extra}]'" if extra else f"pip install {DIST}"), line
        assert (f"pip install torch --index-url {CPU_INDEX}" in line) == (extra in TORCH_EXTRAS), line


@pytest.mark.slow
def test_core_install_by_name_runs_without_torch_and_its_hints_name_us(tmp_path: Path) -> None:
    venv, took = _venv(tmp_path, "")
    exe, env = venv / "bin" / "consistency", _env(venv)
    mods = _run(venv / "bin" / "python", "-c", "import importlib.util as u; print([m for m in ('torch', "
                "'transformers', 'matplotlib') if u.find_spec(m)])", cwd=tmp_path)
    assert mods.stdout.strip() == "[]", mods.stdout  # the core install pulls no torch
    from consistency.dump.writer import write_dump

    rng = np.random.default_rng(0)
    h = {f"hidden.{i}": rng.standard_normal((8, 16)).astype(np.float32) for i in range(3)}
    a, b = write_dump(tmp_path / "a.safetensors", h), write_dump(tmp_path / "b.safetensors", h)
    fix = ROOT / "fixtures" / "configs"
    works = [["compare", a, b, "-q"], ["inspect", a],
             ["lint", "--draft", fix / "drafts" / "sglang" / "kimi-k2.5-eagle3-fixed.json", "--target",
              fix / "targets" / "kimi-k2.5.json", "--runtime", "sglang@0.5.23", "--trained-with", "stream:0,3,31", "-q"],
             ["gate", "--config", ROOT / ".github" / "consistency" / "pass.toml", "-q"]]
    for args in works:
        r = _run(exe, *args, cwd=tmp_path, env=env)
        assert r.returncode == 0, (args, r.stdout[-1500:], r.stderr[-1500:])
    needs = {("demo",): "hf", ("record", "--model", "tiny-llama", "--prompt", "hi", "-o", "r.safetensors"): "hf",
             ("replay", "--draft", "tiny-llama-eagle3", "--target", "tiny-llama", a, b): "hf",
             ("compare", a, b, "-q", "--png", "png"): "report"}
    for args, extra in needs.items():
        r = _run(exe, *args, cwd=tmp_path, env=env)
        err = r.stderr.strip()
        assert r.returncode == 2 and err.count("\n") == 0 and "Traceback" not in err, (args, r.stderr[-1500:])
        assert f"install it with: pip install '{DIST}[{extra}]'" in err, err
        assert (f"--index-url {CPU_INDEX}" in err) == (extra == "hf"), err
        assert not install_problems(err), err
    cfg = tmp_path / "g" / "consistency.toml"
    cfg.parent.mkdir()
    cfg.write_text('[[replay]]\nname = "acc"\ndraft = "tiny-llama-eagle3"\ntarget = "tiny-llama"\n'
                   f'reference = "{a}"\ncandidate = "{b}"\n')
    r = _run(exe, "gate", "--config", cfg, cwd=tmp_path, env=env)  # replay skipped (never passed), with the line
    assert f"pip install '{DIST}[hf]'" in r.stdout and not install_problems(r.stdout + r.stderr), r.stdout
    assert took["package"] < 600, took


@pytest.mark.slow
def test_hf_install_by_name_runs_every_command_of_the_readme_and_the_tutorial(tmp_path: Path) -> None:
    venv, _took = _venv(tmp_path, "hf")
    run_pages(PAGES, tmp_path, _env(venv), at_least=30)


def run_pages(pages: list[Path], tmp_path: Path, env: dict[str, str], at_least: int) -> None:
    """Every runnable command of ``pages`` (each page in its own shell, after its setup lines)
    in a copy of the checkout without the package source: exit codes as the shown output
    implies, every shown line printed, no traceback, no install line naming another
    distribution, nothing written outside ``out/`` and nothing edited."""
    work = _checkout_copy(tmp_path)
    before = _snapshot(work)
    assert "/out/" in (work / ".gitignore").read_text().split()  # where the pages write
    problems, ran_total = [], 0
    for page in pages:
        cmds = commands(page, runnable_only=True)
        assert cmds, page
        pre = [Command(s, [], str(page), 0) for s in setup(page)]  # the inputs the page assumes (docinputs.py)
        ran = run_page(pre + cmds, work, env, timeout=1500)
        assert len(ran) == len(pre) + len(cmds), f"{page.name}: the shell stopped at {ran[-1].command.text[:80]!r}"
        problems += [f"{page.name}: setup {r.command.text[:80]!r} failed: {r.stderr[-400:]}" for r in ran[:len(pre)]
                     if r.rc != 0]
        ran = ran[len(pre):]
        ran_total += len(ran)
        for r in ran:
            where = f"{page.name}:{r.command.line} $ {r.command.text.splitlines()[0][:90]}"
            if r.rc != r.command.expected_rc():
                problems.append(f"{where}: exit {r.rc}, the page implies {r.command.expected_rc()}: "
                                f"{(r.stderr or r.stdout)[-400:]}")
            problems += [f"{where}: not printed: {frag[:160]}" for frag in missing(r)]
            problems += [f"{where}: {b}" for b in install_problems(r.output)]
            if "Traceback" in r.output:
                problems.append(f"{where}: a traceback: {r.output[-400:]}")
    assert not problems, "\n".join(problems)
    after = _snapshot(work)
    littered = sorted(p for p in set(after) - set(before) if not p.startswith("out/"))
    changed = sorted(p for p in set(before) & set(after) if before[p] != after[p])
    assert not littered and not changed, (littered[:20], changed[:20])  # nothing outside out/, nothing edited
    assert ran_total >= at_least, ran_total
