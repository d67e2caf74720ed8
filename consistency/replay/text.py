"""Terminal report of a replay: the verdict, both sides side by side, the drop, the findings.

Numbers a user acts on come first (acceptance and accepted length, the units a serving
dashboard shows); the per-step table shows where the chain breaks (vLLM reports the same
per-position acceptance).
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from consistency.contract.findings import Severity
from consistency.replay.report import ReplayReport, SideReplay
from consistency.escape import term

_STYLE = {Severity.error: "bold red", Severity.warning: "yellow", Severity.info: "dim"}


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _side_label(s: SideReplay) -> str:
    streams = f" streams {s.claimed_streams}" if s.claimed_streams else ""
    return term(f"{s.aux_dtype}{streams}")


def _labels(s: SideReplay) -> str:
    return f"{s.label_source} {s.label_dtype}" if s.label_dtype else s.label_source


def verdict_line(rep: ReplayReport) -> Text:
    style = "bold green" if rep.verdict == "pass" else "bold red"
    return Text.assemble((rep.verdict.upper(), style), "  ", term(rep.summary))


def render(rep: ReplayReport, con: Console, quiet: bool = False) -> None:
    if quiet:
        con.print(verdict_line(rep))
        return
    d = rep.draft
    con.print(Text.assemble(("consistency replay ", "bold"), term(rep.reference.path), "  vs  ",
                            term(rep.candidate.path)))
    what = (f"{d.layout} layout, {d.num_aux} aux slots x {d.target_hidden_size}, hidden {d.hidden_size}, vocab "
            f"{d.draft_vocab_size}/{d.target_vocab_size}; embed from {d.sources.get('embed_tokens', '?')}, lm_head from "
            f"{d.sources.get('lm_head', '?')}, d2t {d.sources.get('d2t', '?')}") if d.method == "eagle3" else (
            f"{d.method}, {d.layout} layout, reads aux.0 x {d.hidden_size}, vocab {d.draft_vocab_size}; embed from "
            f"{d.sources.get('embed_tokens', '?')}, lm_head from {d.sources.get('lm_head', '?')}; recycles "
            f"{d.consumer.recycle.value if d.consumer else '?'}")
    con.print(Text(term(f"draft {d.path} ({what}); target {rep.target or '-'}; K={rep.steps} chained steps, "
                   f"topk 1, fed its {'own proposals' if rep.feed == 'own' else 'recorded tokens'}"), style="dim"))
    con.print(verdict_line(rep))
    t = Table(show_edge=False, pad_edge=False)
    t.add_column("")
    t.add_column("reference", justify="right")
    t.add_column("candidate", justify="right")
    t.add_column("change", justify="right")
    r, c, dr = rep.reference, rep.candidate, rep.drop
    bad = "red" if rep.verdict == "fail" else "green"
    t.add_row("aux fed", Text(_side_label(r)), Text(_side_label(c)), "")
    t.add_row("top-1 accuracy (step 1)", _pct(r.top1), _pct(c.top1), Text(f"{-dr.top1_points:+.1f} pts", style=bad))
    t.add_row("acceptance rate", _pct(r.acceptance_rate), _pct(c.acceptance_rate),
              Text(f"{-dr.acceptance_points:+.1f} pts", style=bad))
    t.add_row("mean accepted length", f"{r.accept_length:.2f}", f"{c.accept_length:.2f}",
              Text(f"{-dr.accept_length:+.2f} tok", style=bad))
    for rs, cs in zip(r.per_step, c.per_step):
        t.add_row(f"  step {rs.step} accepted | reached", f"{_pct(rs.conditional)} of {rs.reached}",
                  f"{_pct(cs.conditional)} of {cs.reached}", "")
    t.add_row("tokens / verify passes", f"{r.tokens} / {r.anchors}", f"{c.tokens} / {c.anchors}", "")
    t.add_row("labels", Text(term(_labels(r))), Text(term(_labels(c))), "")
    if r.recycle_fed or c.recycle_fed:  # MTP / EAGLE-1: what steps >= 2 read
        t.add_row("recycle fed", Text(term(r.recycle_fed or "-")), Text(term(c.recycle_fed or "-")), "")
    con.print(t)
    if dr.lost or dr.gained:
        con.print(Text(f"position by position: {dr.lost} step-1 hits lost, {dr.gained} gained", style="dim"))
    shown = [f for f in rep.findings if f.code != "OK"]
    if shown:
        ft = Table(title="findings", title_justify="left", show_edge=False, pad_edge=False)
        ft.add_column("severity")
        ft.add_column("code")
        ft.add_column("message", overflow="fold")
        for f in sorted(shown, key=lambda f: list(Severity).index(f.severity)):
            msg = Text(term(f.message, multiline=True))
            if f.severity != Severity.info and f.fix:
                msg.append(f"\n  fix: {term(f.fix, multiline=True)}", style="cyan")
            ft.add_row(Text(f.severity.value, style=_STYLE[f.severity]), Text(term(f.code)), msg)
        con.print(ft)
    for n in rep.notes:
        con.print(Text(f"note: {term(n)}", style="dim"))
    if rep.seconds is not None:
        con.print(Text(f"{rep.seconds:.2f} s", style="dim"))
