"""Terminal report of a lint run: verdict, the slot table (what the server feeds against
what training used), then the findings with their fix and doc page."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from consistency.contract.findings import Severity
from consistency.lint.report import LintReport
from consistency.escape import term

_STYLE = {Severity.error: "bold red", Severity.warning: "yellow", Severity.info: "dim"}


def render(rep: LintReport, con: Console, quiet: bool = False, show_info: bool = True) -> None:
    style = "bold green" if rep.verdict == "pass" else "bold red"
    verdict = Text.assemble((rep.verdict.upper(), style), "  ", term(rep.summary))
    if quiet:
        con.print(verdict)
        return
    head = ", ".join(f"{k} {v}" for k, v in rep.inputs.model_dump().items() if v and k != "serve")
    con.print(Text.assemble(("consistency lint ", "bold"), term(head)))
    if rep.inputs.serve:
        con.print(Text(f"serve: {term(rep.inputs.serve)}", style="dim"))
    con.print(verdict)
    for a in rep.assumptions:
        con.print(Text(f"note: {term(a)}", style="dim"))
    if rep.serving is not None:
        s = rep.serving
        where = f"reads {s.key} = {s.ids}" if s.key else "finds no ids under the keys it reads: its default"
        con.print(Text(term(f"serving: {s.label} {where}; {s.meaning}"), style="dim"))
    if rep.slots:
        t = Table(title="aux slots (stream indices)", title_justify="left", show_edge=False, pad_edge=False)
        for col in ("slot", "training", "serving", "config id", ""):
            t.add_column(col, justify="right" if col in ("slot", "config id") else "left")
        for r in rep.slots:
            mark = (Text("-") if r.match is None else Text("ok", style="green") if r.match
                    else Text("DIFFERS", style="red"))
            t.add_row(Text(str(r.slot)), Text(_cell(r.training_stream, r.training_meaning)),
                      Text(_cell(r.serving_stream, r.serving_meaning)),
                      Text("-" if r.serving_id is None else term(r.serving_id)), mark)
        con.print(t)
    shown = [f for f in rep.findings if show_info or f.severity != Severity.info]
    if shown:
        ft = Table(title="findings", title_justify="left", show_edge=False, pad_edge=False)
        for col in ("severity", "code", "message"):
            ft.add_column(col, overflow="fold")
        for f in shown:
            msg = Text(term(f.message, multiline=True))
            if f.location and f.location.file:
                msg.append(f"\n  at {term(f.location.file)}" + (f":{f.location.line}" if f.location.line else "")
                           + (f" ({term(f.location.key)})" if f.location.key else ""), style="dim")
            if f.severity != Severity.info and f.fix:
                msg.append(f"\n  fix: {term(f.fix, multiline=True)}", style="cyan")
            if f.severity != Severity.info and f.autofix is not None:  # the fix as data (lint/fix_rules.py)
                a = f.autofix
                msg.append("\n  [*] --fix applies: " + term(a.summary) if a.status == "determined" else
                           f"\n  not auto-fixed ({a.status}): {term(a.summary)}"
                           + (f"; decided by {term(a.decided_by)}" if a.decided_by else ""), style="cyan")
            if f.severity != Severity.info:
                msg.append(f"\n  see {term(f.doc)} (source: {term(f.source)})", style="dim")
            ft.add_row(Text(f.severity.value, style=_STYLE[f.severity]), Text(term(f"{f.code} {f.name}")), msg)
        con.print(ft)
    c = rep.counts
    ne = sum(r.status == "not_evaluated" for r in rep.rules)
    na = [r for r in rep.rules if r.status == "not_applicable"]
    e, w = c.get("error", 0), c.get("warning", 0)
    tail = (f"{len(rep.rules)} rules: {e} error{'s' * (e != 1)}, {w} warning{'s' * (w != 1)}, {ne} not evaluated "
            "for lack of input")
    if na:
        tail += f", {len(na)} not applicable ({term(na[0].reason or 'another kind of draft')})"
    fixable = sum(f.autofix is not None and f.autofix.status == "determined" and f.severity != Severity.info
                  for f in rep.findings)
    if fixable:
        tail += f"; [*] {fixable} fixable: --diff shows, --fix writes"
    if rep.seconds is not None:
        tail += f"; {rep.seconds * 1000:.0f} ms"
    con.print(Text(tail, style="dim"))


def _cell(stream: int | None, meaning: str | None) -> str:
    return "-" if stream is None else term(f"{stream} ({meaning})")
