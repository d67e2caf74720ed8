"""CI renderings of a gate report: JUnit XML, GitHub Actions annotations, Markdown summary.

All three read the gate report's JSON form (schemas/gate-report.schema.json), so they
can also be produced later from a saved ``--json`` file. JUnit gets one test case per
lint rule and per compared tensor; annotations are workflow commands that GitHub shows
on the config line at fault; the Markdown goes to ``$GITHUB_STEP_SUMMARY``.

Every string in a gate report may come from a file (check names from the config, tensor
names and metadata from dumps), so each goes through :mod:`consistency.escape`
for the output it lands in: ``xml`` for JUnit, ``annotation_*`` for workflow commands,
``md`` for the summary.
"""

from __future__ import annotations

import html
import re
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from consistency import escape as esc
from consistency.dump.atomic import MD_TRAILER
from consistency.report.links import published

_SAFE_URL = re.compile(r"(https://[A-Za-z0-9./#_-]+|docs/[A-Za-z0-9./#_-]+)")
_ICON = {"pass": "✅", "fail": "❌", "error": "⛔", "skipped": "⏭️"}


def junit_xml(report: dict[str, Any]) -> str:
    """JUnit XML: a <testsuite> per check, a <testcase> per rule/tensor."""
    root = ET.Element("testsuites", name="consistency")
    tot = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for chk in report.get("checks", []):
        cases = chk.get("cases", [])
        n = {"tests": len(cases), "failures": sum(c["status"] == "failed" for c in cases),
             "errors": sum(c["status"] == "error" for c in cases),
             "skipped": sum(c["status"] == "skipped" for c in cases)}
        for k in tot:
            tot[k] += n[k]
        suite = ET.SubElement(root, "testsuite", name=esc.xml(f"{chk['kind']}: {chk['name']}"),
                              time=f"{chk.get('seconds') or 0:.3f}", **{k: str(v) for k, v in n.items()})
        for c in cases:
            attrs = {"classname": esc.xml(f"consistency.{chk['kind']}.{chk['name']}"), "name": esc.xml(c["name"])}
            if c.get("file"):
                attrs["file"] = esc.xml(c["file"])
                if c.get("line"):
                    attrs["line"] = str(c["line"])
            tc = ET.SubElement(suite, "testcase", **attrs)
            body = esc.xml(c.get("message", "") + (f"\nfix: {c['fix']}" if c.get("fix") else "") + (
                f"\nsee: {published(str(c['doc'])) or c['doc']}" if c.get("doc") else ""))
            first = esc.xml((c.get("message") or "").split("\n", 1)[0])
            if c["status"] == "failed":
                ET.SubElement(tc, "failure", message=first, type=esc.xml(c.get("code") or "failure")).text = body
            elif c["status"] == "error":
                ET.SubElement(tc, "error", message=first, type="input").text = body
            elif c["status"] == "skipped":
                ET.SubElement(tc, "skipped", message=first)
            elif c.get("severity") == "warning":
                ET.SubElement(tc, "system-out").text = "warning: " + body
    for k, v in tot.items():
        root.set(k, str(v))
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def _rel(path: str, base: Path | None) -> str:
    """GitHub places annotations by repository-relative path: strip the workspace prefix."""
    if base is None:
        return path
    try:
        return Path(path).resolve().relative_to(base.resolve()).as_posix()
    except ValueError:
        return path


def github_annotations(report: dict[str, Any], base: Path | None = None) -> list[str]:
    """``::error file=...,line=...,title=...::message`` lines for failing and warning cases;
    ``base`` (the workspace, usually the current directory) makes file paths relative."""
    out = []
    for chk in report.get("checks", []):
        for c in chk.get("cases", []):
            if c["status"] in ("failed", "error"):
                level = "error"
            elif c.get("severity") == "warning":
                level = "warning"
            else:
                continue
            props = []
            if c.get("file"):
                props.append(f"file={esc.annotation_prop(_rel(c['file'], base))}")
                if c.get("line"):
                    props.append(f"line={int(c['line'])}")
            title = "consistency {} {}: {}".format(chk["kind"], chk["name"], c["name"])
            props.append(f"title={esc.annotation_prop(title)}")
            msg = c.get("message", "") + (f"\nfix: {c['fix']}" if c.get("fix") else "")
            out.append(f"::{level} {','.join(props)}::{esc.annotation_data(msg)}")
    return out


def _cell(s: Any) -> str:
    return esc.md(s, br=True)


def markdown_summary(report: dict[str, Any]) -> str:
    """A step summary: the verdict, a table of checks, then what failed and how to fix it."""
    lines = [f"## consistency gate: {_ICON.get(report['verdict'], '')} {report['verdict'].upper()}", "",
             _cell(report.get("summary", "")), "", "| check | verdict | cases | summary |", "|---|---|---|---|"]
    for chk in report.get("checks", []):
        cs = chk.get("cases", [])
        counts = ", ".join(f"{sum(c['status'] == s for c in cs)} {s}" for s in ("passed", "failed", "skipped", "error")
                           if any(c["status"] == s for c in cs))
        lines.append(f"| {chk['kind']} {esc.md_code(chk['name'])} | {_ICON.get(chk['verdict'], '')} "
                     f"{chk['verdict']} | {counts} "
                     f"| {_cell(chk.get('summary', ''))} |")
    for chk in report.get("checks", []):
        rep = chk.get("report") or {}
        bad = [c for c in chk.get("cases", []) if c["status"] in ("failed", "error") or c.get("severity") == "warning"]
        slots = rep.get("slots") if chk["kind"] == "lint" else None
        if not bad and not (slots and chk["verdict"] != "pass"):
            continue
        lines += ["", f"### {chk['kind']} {esc.md_code(chk['name'])}", ""]
        if slots and chk["kind"] == "lint":
            lines += ["| slot | training stream | serving stream | config id |", "|---|---|---|---|"]
            for r in slots:
                mark = "" if r.get("match") in (None, True) else " ❌"
                lines.append(f"| {r['slot']} | {_v(r.get('training_stream'))} | {_v(r.get('serving_stream'))}{mark} "
                             f"| {_v(r.get('serving_id'))} |")
            lines.append("")
        for c in bad:
            where = (f" ({esc.md_code(str(c['file']) + (':' + str(c['line']) if c.get('line') else ''))})"
                     if c.get("file") else "")
            lines.append(f"- **{c['status'] if c['status'] != 'passed' else 'warning'}** {_cell(c['name'])}{where}: "
                         f"{_cell(c.get('message', ''))}")
            if c.get("fix"):
                lines.append(f"  - fix: {_cell(c['fix'])}")
            if c.get("doc"):
                doc = published(str(c["doc"])) or str(c["doc"])  # absolute: the user's repository has no docs/
                lines.append(f"  - see [{doc}]({doc})" if _SAFE_URL.fullmatch(doc) else f"  - see {_cell(doc)}")
        if chk["kind"] == "lint":
            lines += _fix_section(rep)
    return "\n".join(lines + ["", MD_TRAILER]) + "\n"


def _fix_section(rep: dict[str, Any]) -> list[str]:
    """The lint's determined fixes as a diff (``consistency lint --fix`` writes it; CI never does),
    the corrected command line, and the fixes held back with the input that decides them."""
    from consistency.contract.fixes import SERVE, Edit
    from consistency.contract.fixtext import apply_edits, unified
    from consistency.errors import InputError

    edits: dict[str, dict[str, Edit]] = {}
    held: list[str] = []
    for f in rep.get("findings", []):
        fx = f.get("autofix") or {}
        if fx.get("status") == "determined":
            for e in fx.get("edits", []):
                if e["file"] != SERVE:
                    edits.setdefault(e["file"], {}).setdefault(e["key"], Edit(**e))
        elif fx and (line := f"{f['code']}: {fx.get('summary', '')}" + (
                f" (decided by {fx['decided_by']})" if fx.get("decided_by") else "")) not in held:
            held.append(line)
    body: list[str] = []
    for file, by_key in edits.items():
        try:
            old = Path(file).read_text(encoding="utf-8")
            body += unified(file, old, apply_edits(old, list(by_key.values()), file)).splitlines()
        except (OSError, UnicodeDecodeError, InputError):
            continue
    if rep.get("fixed_serve"):
        body += ["# corrected serving command (not run):", str(rep["fixed_serve"])]
    if not body and not held:
        return []
    out = ["", f"#### Suggested fix (not applied in CI: run {esc.md_code('consistency lint ... --fix')} locally)", ""]
    if body:  # an HTML <pre> block: no Markdown inside, every character of the config's lines escaped
        out += ["<pre>", *(html.escape(esc.term(b), quote=False).replace("`", "&#96;") for b in body), "</pre>"]
    out += [f"- not applied, {_cell(h)}" for h in held]
    return out  # the trailer: how a re-run knows its own file


def _v(x: Any) -> str:
    return "-" if x is None else esc.md(x)
