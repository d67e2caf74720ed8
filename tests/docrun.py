"""Run the commands a Markdown page shows, as a reader would, and hold the page to the output.

A page's ```console blocks hold ``$ command`` lines (a trailing backslash continues a
command, a ``<<'EOF'`` heredoc runs to its ``EOF`` line) followed by the output the page
shows. :func:`commands` reads them; :func:`run_page` runs them in order in one bash session
(so ``P=...`` and ``cd`` carry over, as in a reader's terminal) and returns each command's
exit code and output; :func:`missing` says which shown lines the real output does not
contain. The page's conventions are honoured: a line that is ``...`` stands for lines left
out, ``...`` inside a line for a cut, and a shown line may wrap where the terminal wrapped it
(whitespace is compared collapsed). The exit code a page implies: that of its last
``PASS``/``FAIL`` verdict line, 2 after ``consistency: error``, else 0.

The docs sweep (tests/project/test_docs_sweep.py) holds every page of docs/ to the same rules:
:func:`blocks` lists each fenced block with what a reader sees just above it. A command
block that cannot run here (a GPU, a server, a model the reader brings) says so where the
reader sees it, in the paragraph right above it: ``*Not run by the docs test: REASON.*``
(:data:`NOT_RUN`). A page's commands that need inputs get them from
``<!-- docs-test setup: COMMAND -->`` lines (:func:`setup`), run first in the same shell.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

_BLOCK = re.compile(r"^```console\n(.*?)^```", re.S | re.M)
_FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```", re.S | re.M)
NOT_RUN = re.compile(r"^\*Not run by the docs test: (?P<why>.+?)\.?\*\s*$")
_SETUP = re.compile(r"^<!-- docs-test setup: (.+?) -->$", re.M)
_HEREDOC = re.compile(r"<<-?\s*'?(\w+)'?")
_TIMING = re.compile(r"\d+(\.\d+)? m?s\b")  # "0.02 s", "5 ms": how long a run took is never the same twice
# a figure in e-notation ("2.52e+03x", a difference over its noise floor) is a ratio of two
# float results, and a CPU's bf16 kernels (AVX-512/AMX or not) move its third digit: a shown
# one holds when the real one is within SCI_REL of it; any other number must match exactly
_SCI = re.compile(r"\d+(?:\.\d+)?e[+-]\d+")
SCI_REL = 0.03


@dataclass
class Command:
    text: str  # as bash gets it: continuation lines and heredoc bodies included
    shown: list[str] = field(default_factory=list)  # the output lines the page shows under it
    page: str = ""
    line: int = 0

    def expected_rc(self) -> int:
        """The exit code the shown output implies: its last verdict line's (a gate shows one per
        check, then its own), 2 for an error line, else 0."""
        verdicts = [s for s in self.shown if s.startswith(("PASS  ", "FAIL  ", "NOT_EVALUATED  "))]
        if verdicts:  # nothing checked is not a pass: lint's NOT_EVALUATED exits 1 as a FAIL does
            return 0 if verdicts[-1].startswith("PASS") else 1
        return 2 if any(s.startswith("consistency: error") for s in self.shown) else 0


@dataclass
class Block:
    page: Path
    line: int  # of the opening fence
    lang: str
    body: str
    above: str  # the last non-blank line above the fence: where a NOT_RUN marker goes

    @property
    def not_run(self) -> str | None:
        """The reason the page gives for not running this block, else None."""
        m = NOT_RUN.match(self.above)
        return m.group("why").strip() if m else None

    @property
    def is_session(self) -> bool:
        """A block a reader types into: ``$ commands`` or a ``>>>`` Python session."""
        lines = self.body.splitlines()
        return (self.lang == "console" and any(ln.startswith("$ ") for ln in lines)) or \
            (self.lang in ("python", "pycon", "") and any(ln.startswith(">>> ") for ln in lines))


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    out = []
    for m in _FENCE.finditer(text):
        before = [ln for ln in text[:m.start()].splitlines() if ln.strip()]
        out.append(Block(page, text[:m.start()].count("\n") + 1, m.group(1).strip(), m.group(2),
                         before[-1].strip() if before else ""))
    return out


def setup(page: Path) -> list[str]:
    """The page's setup commands (``<!-- docs-test setup: ... -->``), in order."""
    return _SETUP.findall(page.read_text())


def commands(page: Path, runnable_only: bool = False) -> list[Command]:
    """The ``$ command`` lines of the page's console blocks; ``runnable_only`` leaves out
    the blocks the page marks NOT_RUN."""
    text = page.read_text()
    out: list[Command] = []
    skip = {b.line for b in blocks(page) if b.not_run} if runnable_only else set()
    for m in _BLOCK.finditer(text):
        if text[:m.start()].count("\n") + 1 in skip:
            continue
        first_line = text[:m.start()].count("\n") + 2
        lines = m.group(1).splitlines()
        i = 0
        while i < len(lines):
            if not lines[i].startswith("$ "):
                if out and out[-1].page == str(page):
                    out[-1].shown.append(lines[i])
                i += 1
                continue
            start = i
            body = [lines[i][2:]]
            while body[-1].endswith("\\") and i + 1 < len(lines):
                i += 1
                body.append(lines[i])
            here = _HEREDOC.search(body[0])
            if here:
                while i + 1 < len(lines) and lines[i].strip() != here.group(1):
                    i += 1
                    body.append(lines[i])
            out.append(Command("\n".join(body), [], str(page), first_line + start))
            i += 1
    return out


@dataclass
class Ran:
    command: Command
    rc: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def run_page(cmds: list[Command], cwd: Path, env: dict[str, str], timeout: int = 900) -> list[Ran]:
    """All commands in one bash session; a marker after each gives its exit code and splits
    the two streams (a command that kills the shell ends the list there)."""
    marks = [f"@@docrun-{i}@@" for i in range(len(cmds))]
    script = ["set +e"]
    for c, mark in zip(cmds, marks):
        script += [c.text, f"__rc=$?; printf '\\n{mark}%d\\n' $__rc; printf '\\n{mark}\\n' >&2"]
    r = subprocess.run(["bash", "-c", "\n".join(script)], cwd=cwd, env=env, capture_output=True, text=True,
                       timeout=timeout)
    ran: list[Ran] = []
    out, err = r.stdout, r.stderr
    for c, mark in zip(cmds, marks):
        m = re.search(rf"\n?{re.escape(mark)}(\d+)\n", out)
        e = err.find(f"\n{mark}\n")
        if m is None or e < 0:
            ran.append(Ran(c, -1, out, err))  # the session ended before this command finished
            break
        ran.append(Ran(c, int(m.group(1)), out[:m.start()], err[:e]))
        out, err = out[m.end():], err[e + len(mark) + 2:]
    return ran


def _collapse(s: str) -> str:
    return " ".join(s.split())


def missing(ran: Ran) -> list[str]:
    """The shown lines (fragments between cuts) that the real output does not contain.

    A shown line may wrap at a different column than the real one, so whitespace is collapsed
    on both sides; a timing is any timing; fragments under 4 characters carry no claim."""
    real = _collapse(ran.output)
    return [frag for line in ran.command.shown for frag in (_collapse(f) for f in line.split("..."))
            if len(frag) >= 4 and not _shown_in(frag, real)]


def _shown_in(frag: str, real: str) -> bool:
    """``frag`` occurs in ``real``, a timing standing for any timing and an e-notation figure
    for any figure within SCI_REL of it."""
    pieces, shown, at = [], [], 0
    for t in sorted([*_TIMING.finditer(frag), *_SCI.finditer(frag)], key=lambda m: m.start()):
        if t.start() < at:
            continue
        sci = _SCI.fullmatch(t.group()) is not None
        pieces += [re.escape(frag[at:t.start()]), r"(\d+(?:\.\d+)?e[+-]\d+)" if sci else r"\d+(?:\.\d+)? m?s\b"]
        if sci:
            shown.append(float(t.group()))
        at = t.end()
    pattern = re.compile("".join(pieces) + re.escape(frag[at:]))
    return any(all(abs(float(got) - want) <= SCI_REL * abs(want) for got, want in zip(m.groups(), shown))
               for m in pattern.finditer(real))
