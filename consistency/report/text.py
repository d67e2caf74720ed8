"""Terminal report of a compare run (rich): the story first, then slots, then findings.

Colour only when attached to a terminal (rich decides; ``NO_COLOR`` is honoured); a CI
log gets the same content as plain text. ``quiet`` prints one line.
"""

from __future__ import annotations

from typing import IO

from rich.console import Console
from rich.table import Table
from rich.text import Text

from consistency.contract.findings import CODES, CompareReport, Finding, Severity
from consistency.escape import term
from consistency.report.alignment import alignment_line, worth_showing

_STYLE = {Severity.error: "bold red", Severity.warning: "yellow", Severity.info: "dim"}


def console(file: IO[str] | None = None) -> Console:
    import sys

    tty = (file or sys.stdout).isatty()
    return Console(file=file, highlight=False, soft_wrap=False, width=None if tty else 140, emoji=False, markup=False)


def verdict_line(rep: CompareReport) -> Text:
    style = "bold green" if rep.verdict == "pass" else "bold red"
    return Text.assemble((rep.verdict.upper(), style), "  ", term(rep.summary))


def render(rep: CompareReport, con: Console, quiet: bool = False, show_ok: bool = False) -> None:
    if quiet:
        con.print(verdict_line(rep))
        return
    con.print(Text.assemble(("consistency compare ", "bold"), term(rep.reference.path), "  vs  ",
                            term(rep.candidate.path)))
    con.print(verdict_line(rep))
    for a in rep.assumptions:
        con.print(Text(f"note: {term(a)}", style="dim"))
    if worth_showing(rep.alignment):
        con.print(Text(f"tokens: {term(alignment_line(rep.alignment))}", style="dim"))
    if rep.slots:
        t = Table(title="aux slots", title_justify="left", show_edge=False, pad_edge=False)
        for col in ("slot", "tensor", "expected", "holds", "token rel_diff", "confidence", "code"):
            t.add_column(col, justify="right" if col in ("slot", "token rel_diff", "confidence") else "left")
        for s in rep.slots:
            exp = _stream(s.expected, s.expected_stream)
            holds = _stream(s.identified_as, s.identified_stream)
            conf = "-" if s.confidence is None else (">1e6" if s.confidence > 1e6 else f"{s.confidence:.3g}x")
            trd = "-" if s.token_rel_diff is None else f"{s.token_rel_diff:.2e}"
            code_style = _code_style(s.code)
            t.add_row(Text(str(s.slot)), Text(term(s.tensor)), Text(term(exp)), Text(term(holds)), Text(trd),
                      Text(conf), Text(term(s.code), style=code_style))
        con.print(t)
    shown = [f for f in rep.findings if show_ok or f.code not in ("OK",)]
    if shown:
        ft = Table(title="findings", title_justify="left", show_edge=False, pad_edge=False)
        ft.add_column("severity")
        ft.add_column("code")
        ft.add_column("message", overflow="fold")
        for f in _ordered(shown):
            ft.add_row(Text(f.severity.value, style=_STYLE[f.severity]), Text(term(f.code)), _message(f))
        con.print(ft)
    diffs = [d for d in rep.metadata_diff]
    if diffs:
        mt = Table(title="metadata differences", title_justify="left", show_edge=False, pad_edge=False)
        for col in ("field", "reference", "candidate", "meaning"):
            mt.add_column(col, overflow="fold")
        for d in diffs[:40]:
            mt.add_row(*(Text(term(x)) for x in (d.path, _short(d.reference), _short(d.candidate), d.change)))
        if len(diffs) > 40:
            mt.add_row(Text(f"... {len(diffs) - 40} more (see --json)"), "", "", "")
        con.print(mt)
    errors = sum(f.severity == Severity.error for f in rep.findings)
    warnings = sum(f.severity == Severity.warning for f in rep.findings)
    ok = rep.counts.get("OK", 0)
    tail = f"{ok} ok, {errors} error{'s' if errors != 1 else ''}, {warnings} warning{'s' if warnings != 1 else ''}"
    if rep.not_compared:
        tail += f"; {rep.not_compared} reference tensors of kinds the candidate does not record were not compared"
    if rep.seconds is not None:
        tail += f"; {rep.seconds:.2f} s"
    con.print(Text(tail, style="dim"))


def _stream(name: str | None, stream: int | None) -> str:
    if name is None:
        return "-"
    if stream is not None and not name.startswith("hidden."):
        return f"{name} (stream {stream})"
    return name


def _short(v: object) -> str:
    s = repr(v) if not isinstance(v, str) else v
    return s if len(s) <= 60 else s[:57] + "..."


def _ordered(fs: list[Finding]) -> list[Finding]:
    rank = {Severity.error: 0, Severity.warning: 1, Severity.info: 2}
    return sorted(fs, key=lambda f: rank[f.severity])


def _message(f: Finding) -> Text:
    t = Text(term(f.message, multiline=True))
    ev = f.evidence
    if ev.get("before") is not None and ev.get("after") is not None:
        t.append(f"  [token rel_diff {ev['before']:.3g} -> {ev['after']:.3g} once explained"
                 f"{', approximate' if ev.get('approximate') else ''}]", style="dim")
    if f.severity != Severity.info and f.fix:
        t.append(f"\n  fix: {term(f.fix)}", style="cyan")
    return t


def _code_style(code: str) -> str:
    """A slot code's colour comes from the code registry's severity (as in the HTML report):
    a new code needs no edit here, and a code this version does not know is shown as an error."""
    c = CODES.get(code)
    if code == "OK":
        return "green"
    return "yellow" if c is not None and c.severity != Severity.error else "red"
