"""SARIF 2.1.0 from a lint report, for GitHub code scanning and other SARIF viewers.

Works from the report's JSON form (schemas/lint-report.schema.json) rather than the
Python model, so the report package stays below the lint package in the layering and
any tool that saved a lint JSON can turn it into SARIF later.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from consistency import HOME
from consistency import escape as esc
from consistency.report.links import published

SARIF_SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"
INFO_URI = HOME
_LEVEL = {"error": "error", "warning": "warning", "info": "note"}


def _uri(path: str, base: Path | None) -> str:
    """Percent-encoded (a file name with spaces, ``#`` or ``%`` is still one valid URI)."""
    return esc.uri(path, base)


def _msg(s: Any) -> str:
    """SARIF message text: controls shown escaped; ``[``/``]`` escaped because SARIF reads
    ``[text](id)`` in a message as an embedded link (SARIF 2.1.0 §3.11.6)."""
    return esc.controls(s).replace("[", "\\[").replace("]", "\\]")


def lint_sarif(report: dict[str, Any], base: Path | None = None, include_info: bool = False) -> dict[str, Any]:
    """A SARIF log with one rule per lint rule run and one result per finding.

    ``base``: paths are written relative to it (a repository root), so code scanning can
    place the annotation on the config line that causes it.
    """
    base = base if base is not None else Path.cwd()
    rules = [{
        "id": r["code"], "name": r["name"],
        "shortDescription": {"text": r["title"]},
        "fullDescription": {"text": f"{r['title']}. Source: {r['source']}"},
        "help": {"text": f"Fix: {r['fix']}", "markdown": f"**Fix:** {r['fix']}\n\nSource: {r['source']}"},
        "helpUri": published(r["doc"]) or r["doc"],  # absolute: a relative URI would point into the scanned repo
        "defaultConfiguration": {"level": _LEVEL[r["severity"]]},
        "properties": {"source": r["source"], "tags": [r["code"][:3]]},
    } for r in report.get("rules", [])]
    index = {r["id"]: i for i, r in enumerate(rules)}
    results = []
    for f in report.get("findings", []):
        if f["severity"] == "info" and not include_info:
            continue
        res: dict[str, Any] = {"ruleId": f["code"], "level": _LEVEL[f["severity"]],
                               "message": {"text": _msg(f["message"] + (f" Fix: {f['fix']}" if f.get("fix") else ""))}}
        if f["code"] in index:
            res["ruleIndex"] = index[f["code"]]
        loc = f.get("location") or {}
        if loc.get("file"):
            phys: dict[str, Any] = {"artifactLocation": {"uri": _uri(loc["file"], base)}}
            if loc.get("line"):
                phys["region"] = {"startLine": int(loc["line"])}
            res["locations"] = [{"physicalLocation": phys}]
            if loc.get("key"):
                res["locations"][0]["logicalLocations"] = [{"fullyQualifiedName": esc.controls(loc["key"]),
                                                            "kind": "member"}]
        _attach_fix(res, f.get("autofix"), base, report.get("fixed_serve"))
        results.append(res)
    return {
        "$schema": SARIF_SCHEMA, "version": "2.1.0",
        "runs": [{
            "tool": {"driver": {"name": "consistency", "version": report.get("version", ""),
                                "informationUri": INFO_URI, "rules": rules}},
            "results": results,
            "properties": {"verdict": report.get("verdict"), "training_streams": report.get("training_streams"),
                           "serving_streams": report.get("serving_streams")},
        }],
    }


def _attach_fix(res: dict[str, Any], fix: dict[str, Any] | None, base: Path, fixed_serve: str | None) -> None:
    """SARIF ``fixes`` for a determined config edit (shown, never applied in CI); the fix as
    data, and the corrected command line, in the result's properties."""
    if not fix:
        return
    from consistency.contract.fixes import SERVE, Edit
    from consistency.contract.fixtext import apply_edits, replacements
    from consistency.errors import InputError

    props = res.setdefault("properties", {})
    props["autofix"] = fix
    edits = [Edit(**e) for e in fix.get("edits", [])]
    if fixed_serve and any(e.file == SERVE for e in edits):
        props["fixed_serve"] = esc.controls(fixed_serve)
    if fix.get("status") != "determined":
        return
    changes = []
    for file in dict.fromkeys(e.file for e in edits if e.file != SERVE):
        try:
            old = Path(file).read_text(encoding="utf-8")
            new = apply_edits(old, [e for e in edits if e.file == file], file)
        except (OSError, UnicodeDecodeError, ValueError, InputError):
            continue  # the file changed or went away since lint read it: no replacement to offer
        changes.append({"artifactLocation": {"uri": _uri(file, base)}, "replacements": replacements(old, new)})
    if changes:
        res["fixes"] = [{"description": {"text": _msg(fix.get("summary", ""))}, "artifactChanges": changes}]
