"""The self-contained HTML report of a compare run: one file, inline CSS and SVG, no script.

Why one file with nothing external: reports get attached to tickets, opened from CI
artefacts and read on air-gapped clusters; a page that fetches a stylesheet, a font or a
chart library breaks in exactly those places. Links to the finding docs are the only
references out of the file, and the page reads fine without following them (each code
carries its one-line meaning as a tooltip, each finding its fix).

Order of the page = order of a reader's questions: did it pass and why (verdict, story),
which stream does each slot really hold (heatmap), where in the sequence does it go
wrong (per-token plots), what exactly was found and how to fix it (findings), and what
else differs (metadata).
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from consistency.contract.findings import CODES, CompareReport, DumpSummary, Finding, Severity, SlotReport
from consistency import escape as esc
from consistency.report.links import DOCS_ENV, doc_href, docs_base  # noqa: F401 - DOCS_ENV re-exported
from consistency.report.heatmap import EXPECTED_COLOUR, describe, fmt, grids
from consistency.report.html_svg import colorbar_svg, heatmap_svg, token_plot_svg

MAX_PLOTS = 48  # per-token plots drawn; the rest are listed (a full-model compare can mismatch hundreds)

CSS = """
:root{--fg:#1d1d1f;--muted:#5f6368;--line:#e3e3e3;--bg:#ffffff;--panel:#f7f7f8;--err:#c5221f;--warn:#b06000;
--info:#5f6368;--ok:#137333}
*{box-sizing:border-box}
body{margin:0;background:var(--bg);color:var(--fg);font:15px/1.45 system-ui,-apple-system,'Segoe UI','DejaVu Sans',
sans-serif}
main{max-width:1240px;margin:0 auto;padding:28px 32px 48px}
h1{font-size:24px;margin:0 0 6px}h2{font-size:19px;margin:34px 0 6px;padding-top:8px;border-top:1px solid var(--line)}
h3{font-size:15px;margin:18px 0 6px}
p.lead{color:var(--muted);margin:0 0 10px;max-width:940px}
.verdict{display:flex;gap:14px;align-items:flex-start;padding:14px 16px;border-radius:8px;margin:14px 0;
background:var(--panel);border-left:6px solid var(--ok)}
.verdict.fail{border-left-color:var(--err);background:#fdf3f2}
.pill{font-weight:700;font-size:14px;letter-spacing:.04em;color:#fff;background:var(--ok);border-radius:4px;
padding:2px 10px;white-space:nowrap}
.fail .pill{background:var(--err)}
.verdict .summary{font-size:16px;font-weight:500}
.chips span{display:inline-block;margin:2px 6px 2px 0;padding:1px 8px;border-radius:10px;background:#eceff1;
font-size:13px}
table{border-collapse:collapse;width:100%;font-size:14px;margin:6px 0 4px}
th,td{text-align:left;padding:6px 10px;border-bottom:1px solid var(--line);vertical-align:top}
th{background:var(--panel);font-weight:600;font-size:13px;color:#333}
td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
code,.mono{font-family:ui-monospace,'DejaVu Sans Mono',Menlo,Consolas,monospace;font-size:13px}
.sev{font-weight:600;white-space:nowrap}.sev.error{color:var(--err)}.sev.warning{color:var(--warn)}
.sev.info{color:var(--info)}
.code-ok{color:var(--ok)}.code-bad{color:var(--err)}.code-warn{color:var(--warn)}
a.code{font-family:ui-monospace,'DejaVu Sans Mono',Menlo,Consolas,monospace;font-size:13px;font-weight:600;
color:#0b57d0;text-decoration:none;white-space:nowrap}a.code:hover{text-decoration:underline}
.fix{color:#0b6b58;margin-top:3px}.ev{color:var(--muted);font-size:13px;margin-top:2px}
.src{color:var(--muted);font-size:12px}
.figure{background:#fff;border:1px solid var(--line);border-radius:8px;padding:12px 14px;margin:10px 0;
overflow-x:auto}
.figure .cap{font-size:14px;margin:0 0 8px}
.legend{display:flex;flex-wrap:wrap;gap:18px;align-items:center;font-size:13px;color:#333;margin-top:4px}
.legend .box{display:inline-block;width:18px;height:12px;border:3px solid %EXP%;vertical-align:middle;
margin-right:6px}
.legend .ring{display:inline-block;width:22px;height:13px;border:2px solid #fff;border-radius:50%%;
box-shadow:0 0 0 1.5px #111,inset 0 0 0 1.2px #111;background:#888;vertical-align:middle;margin-right:6px}
.plots{display:grid;grid-template-columns:repeat(auto-fill,minmax(580px,1fr));gap:12px}
.plots .figure{margin:0}
.meta{display:grid;grid-template-columns:1fr 1fr;gap:12px}
.meta table{margin:0}
details summary{cursor:pointer;color:#0b57d0;margin:6px 0}
footer{margin-top:36px;color:var(--muted);font-size:12px}
@media print{main{max-width:none;padding:0}.figure{break-inside:avoid}}
""".replace("%EXP%", EXPECTED_COLOUR).replace("%%", "%")


def _e(v: object) -> str:
    """Every value from a dump or a path: markup and controls escaped (consistency/escape.py)."""
    return esc.html(v)


def render(rep: CompareReport, docs: str | None = None) -> str:
    """The whole page as one string."""
    base = docs_base() if docs is None else docs
    parts = [_head(rep), _verdict(rep), _heatmaps(rep), _slots(rep.slots), _token_plots(rep),
             _findings(rep.findings, base), _metadata(rep), _footer(rep)]
    return "".join(parts) + "</main></body></html>\n"


def _head(rep: CompareReport) -> str:
    title = f"consistency compare: {Path(rep.reference.path).name} vs {Path(rep.candidate.path).name}"
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f'<meta name="generator" content="consistency {_e(rep.version)}">'
            f'<title>{_e(title)}</title><style>{CSS}</style></head><body><main>'
            f'<h1>consistency compare</h1>'
            f'<p class="lead"><span class="mono">{_e(rep.reference.path)}</span> (reference: what the draft was '
            f'trained on) vs <span class="mono">{_e(rep.candidate.path)}</span> (candidate: what it is fed)</p>')


def _verdict(rep: CompareReport) -> str:
    cls = "verdict fail" if rep.verdict == "fail" else "verdict"
    errors = sum(f.severity == Severity.error for f in rep.findings)
    warnings = sum(f.severity == Severity.warning for f in rep.findings)
    chips = [f"{errors} error{'s' if errors != 1 else ''}", f"{warnings} warning{'s' if warnings != 1 else ''}",
             f"{rep.counts.get('OK', 0)} ok"]
    if rep.not_compared:
        chips.append(f"{rep.not_compared} reference tensors not compared (kinds the candidate does not record)")
    if rep.seconds is not None:
        chips.append(f"{rep.seconds:.2f} s")
    notes = "".join(f"<li>{_e(a)}</li>" for a in rep.assumptions)
    from consistency.report.alignment import alignment_line, worth_showing

    if worth_showing(rep.alignment):
        notes += f'<li id="alignment">tokens: {_e(alignment_line(rep.alignment))}</li>'
    return (f'<div class="{cls}" id="verdict"><span class="pill">{_e(rep.verdict.upper())}</span><div>'
            f'<div class="summary">{_e(rep.summary)}</div><div class="chips">'
            + "".join(f"<span>{_e(c)}</span>" for c in chips) + "</div>"
            + (f'<ul class="src">{notes}</ul>' if notes else "") + "</div></div>"
            + f'<div class="meta">{_side("reference", rep.reference)}{_side("candidate", rep.candidate)}</div>')


def _side(label: str, d: DumpSummary) -> str:
    rows = [("file", f'<span class="mono">{_e(d.path)}</span>'), ("format", _e(d.format)),
            ("tensors", _e(d.tensors)), ("runtime", _e(d.runtime or "-")),
            ("claimed streams", _e(d.claimed_streams if d.claimed_streams is not None else "-"))]
    if d.ranks:
        rows.append(("ranks", _e(d.ranks)))
    return (f'<table><tr><th colspan="2">{label}</th></tr>'
            + "".join(f"<tr><td>{k}</td><td>{v}</td></tr>" for k, v in rows) + "</table>")


def _floors(rep: CompareReport, tensors: set[str]) -> dict[str, float]:
    """Noise floors of the heatmap's rows, labelled by what set them (e.g. 'bfloat16')."""
    out: dict[str, float] = {}
    for f in rep.findings:
        fl = f.metrics.get("floor") if f.tensor in tensors else None
        if isinstance(fl, (int, float)) and math.isfinite(fl) and fl > 0:
            why = str(f.metrics.get("floor_source") or "")
            label = why.split(" floor")[0].strip() if " floor" in why else fmt(float(fl))
            out.setdefault(label[:24], float(fl))
    return dict(list(out.items())[:3])


def _heatmaps(rep: CompareReport) -> str:
    head = ('<h2 id="heatmap">Which stream does each slot hold?</h2><p class="lead">Rows are the candidate\'s '
            'aux slots, columns the reference streams; each cell is how far the slot is from that stream '
            '(brighter = closer, log scale). The <b>outlined</b> cell is the stream training fed that slot; the '
            '<b>ringed</b> cell is the stream the slot actually holds. When they coincide the slot is right; a '
            'slot shift shows as a ringed diagonal beside the outlined one.</p>')
    gs = grids(rep.similarity) if rep.similarity else []
    if not gs:
        return head + '<p class="lead"><i>No aux slots in this comparison, so there is no slot x stream heatmap.</i></p>'
    floors = _floors(rep, set(gs[0].rows))
    figs = []
    for g in gs:
        title = ("Focus: only the streams some slot expects or holds" if g.view == "focus"
                 else "All reference streams")
        figs.append(f'<div class="figure" data-view="{g.view}"><p class="cap"><b>{title}.</b> {_e(describe(g))}</p>'
                    f'{heatmap_svg(g)}</div>')
    legend = (f'<div class="legend"><span><span class="box"></span>expected (what training fed this slot)</span>'
              f'<span><span class="ring"></span>identified (what the slot holds)</span>'
              f'{colorbar_svg(gs[0].scale, gs[0].metric.replace("_", " "), floors)}</div>')
    return head + figs[0] + legend + "".join(figs[1:])


def _code_class(code: str) -> str:
    """A slot code's colour comes from the code registry's severity, so a new code needs no edit here."""
    c = CODES.get(code)
    if code == "OK":
        return "code-ok"
    if c is not None and c.severity != Severity.error:
        return "code-warn"
    return "code-bad"  # an error, or a code this version does not know: never shown as fine


def _slots(slots: list[SlotReport]) -> str:
    if not slots:
        return ""
    rows = []
    for s in slots:
        exp = f"{s.expected or '-'}" + (f" (stream {s.expected_stream})" if s.expected_stream is not None else "")
        holds = f"{s.identified_as or '-'}" + (f" (stream {s.identified_stream})"
                                                if s.identified_stream is not None and s.identified_as
                                                and not s.identified_as.startswith("hidden.") else "")
        conf = "-" if s.confidence is None else (">1e6" if s.confidence > 1e6 else f"{s.confidence:.3g}x")
        cls = _code_class(s.code)
        rows.append(f'<tr><td class="num">{s.slot}</td><td class="mono">{_e(s.tensor)}</td><td>{_e(exp)}</td>'
                    f'<td>{_e(holds)}</td><td class="num">{fmt(s.token_rel_diff) if s.token_rel_diff is not None else "-"}'
                    f'</td><td class="num">{_e(conf)}</td><td class="num">{_e(s.runner_up or "-")}</td>'
                    f'<td class="{cls}"><b>{_e(s.code)}</b></td></tr>')
    return ('<h3>Aux slots</h3><table id="slots"><tr><th>slot</th><th>tensor</th><th>expected</th><th>holds</th>'
            '<th>token rel_diff</th><th>confidence</th><th>runner-up</th><th>code</th></tr>'
            + "".join(rows) + "</table>")


def _token_plots(rep: CompareReport) -> str:
    if not rep.per_token:
        return ""
    by_tensor: dict[str, Finding] = {}
    for f in rep.findings:
        if f.tensor and (f.tensor not in by_tensor or f.severity == Severity.error):
            by_tensor[f.tensor] = f
    items = list(rep.per_token.items())
    figs = []
    for name, ys in items[:MAX_PLOTS]:
        f = by_tensor.get(name)
        fl = f.metrics.get("floor") if f else None
        floor = float(fl) if isinstance(fl, (int, float)) and math.isfinite(fl) else None
        finite = [y for y in ys if y is not None and math.isfinite(y)]
        stats = ""
        if finite:
            worst = max(range(len(ys)), key=lambda i: ys[i] if ys[i] is not None and math.isfinite(ys[i]) else -1)
            above = sum(y > floor for y in finite) if floor else None
            stats = (f"median {fmt(statistics.median(finite))}, worst token {worst} ({fmt(ys[worst])})"
                     + (f", {above} of {len(ys)} tokens above the floor" if above is not None else ""))
        vs = versus(rep, name, f)
        code = f' <span class="code-bad"><b>{_e(f.code)}</b></span>' if f else ""
        figs.append(f'<div class="figure"><p class="cap"><span class="mono"><b>{_e(name)}</b>{_e(vs)}</span>{code}'
                    f'<br><span class="src">{_e(stats)}</span></p>{token_plot_svg(name, ys, floor)}</div>')
    more = (f'<p class="lead">{len(items) - MAX_PLOTS} more mismatched tensors are not drawn: '
            + _e(", ".join(n for n, _ in items[MAX_PLOTS:MAX_PLOTS + 40])) + ("..." if len(items) > MAX_PLOTS + 40
                                                                             else "") + "</p>"
            if len(items) > MAX_PLOTS else "")
    return ('<h2 id="per-token">Where in the sequence does it go wrong?</h2><p class="lead">Token rel_diff of each '
            'mismatched tensor against the reference tensor it should equal, per token (row), on a log scale. A '
            'flat line far above the floor is a different tensor altogether; a spike at a few positions is a '
            'position-dependent bug (masking, BOS, a shifted token); a rising line is error that accumulates.</p>'
            f'<div class="plots">{"".join(figs)}</div>{more}')


def versus(rep: CompareReport, name: str, f: Finding | None) -> str:
    """' vs reference aux.0 (stream 0)': say which side each name is from, since both sides often share names."""
    slot = next((s for s in rep.slots if s.tensor == name), None)
    exp = (f.expected if f else None) or (slot.expected if slot else None)
    if not exp:
        return ""
    stream = slot.expected_stream if slot else None
    return f" vs reference {exp}" + (f" (stream {stream})" if stream is not None and not exp.startswith("hidden.")
                                     else "")


def _findings(findings: list[Finding], base: str) -> str:
    if not findings:
        return '<h2 id="findings">Findings</h2><p class="lead">None.</p>'
    rank = {Severity.error: 0, Severity.warning: 1, Severity.info: 2}
    main = [f for f in findings if f.code != "OK"]
    ok = [f for f in findings if f.code == "OK"]
    head = ('<table class="findings-table"><tr><th>severity</th><th>code</th><th>tensor</th><th>what and how to fix'
            '</th></tr>')
    ok_part = (f'<details><summary>{len(ok)} tensor{"s" if len(ok) != 1 else ""} agree within their noise floor'
               f'</summary>{head}{"".join(_finding_row(f, base) for f in ok)}</table></details>' if ok else "")
    return ('<h2 id="findings">Findings</h2><p class="lead">Each code links to its documentation (what it means, '
            'an example, where the rule comes from); hover a code for its one-line meaning.</p>'
            + (head + "".join(_finding_row(f, base) for f in sorted(main, key=lambda f: rank[f.severity]))
               + "</table>" if main else "") + ok_part)


def _finding_row(f: Finding, base: str) -> str:
    """One finding: severity, code linked to its doc, tensor, message with evidence, fix and source."""
    href = doc_href(f.doc, base)
    meaning = CODES[f.code].title if f.code in CODES else ""
    code = (f'<a class="code" href="{_e(href)}" title="{_e(meaning)}">{_e(f.code)}</a>' if href
            else f'<span class="code mono" title="{_e(meaning)}">{_e(f.code)}</span>')
    ev = f.evidence
    extra = ""
    if isinstance(ev.get("before"), (int, float)) and isinstance(ev.get("after"), (int, float)):
        extra = (f'<div class="ev">token rel_diff {fmt(ev["before"])} &rarr; {fmt(ev["after"])} once explained'
                 f'{" (approximate)" if ev.get("approximate") else ""}</div>')
    fix = (f'<div class="fix">fix: {_e(f.fix)}</div>' if f.fix and f.severity != Severity.info else "")
    src = f'<div class="src">source: {_e(f.source)}</div>' if f.source else ""
    return (f'<tr class="finding" data-code="{_e(f.code)}"><td class="sev {f.severity.value}">'
            f'{f.severity.value}</td><td>{code}</td><td class="mono">{_e(f.tensor or "")}</td>'
            f'<td>{_e(f.message)}{extra}{fix}{src}</td></tr>')


def _metadata(rep: CompareReport) -> str:
    if not rep.metadata_diff:
        return ""
    rows = "".join(f'<tr><td class="mono">{_e(d.path)}</td><td class="mono">{_e(_short(d.reference))}</td>'
                   f'<td class="mono">{_e(_short(d.candidate))}</td><td>{_e(d.change)}</td></tr>'
                   for d in rep.metadata_diff)
    n = len(rep.metadata_diff)
    return (f'<h2 id="metadata">Metadata differences</h2><details{" open" if n <= 15 else ""}><summary>{n} '
            f'difference{"s" if n != 1 else ""} between the dumps\' metadata</summary><table><tr><th>field</th>'
            f'<th>reference</th><th>candidate</th><th>meaning</th></tr>{rows}</table></details>')


def _short(v: object) -> str:
    s = v if isinstance(v, str) else repr(v)
    return s if len(s) <= 80 else s[:77] + "..."


def _footer(rep: CompareReport) -> str:
    return (f'<footer>consistency {_e(rep.version)} &middot; self-contained report: no script, no network; '
            f'the machine-readable report is <span class="mono">consistency compare ... --json</span>.</footer>')
