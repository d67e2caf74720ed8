"""Run the checks a :class:`~consistency.gate.config.GateConfig` declares.

The commands arrive as functions (:class:`Runners`): the CLI passes ``run_lint``,
``run_compare`` and ``replay_check`` (None when torch is missing: a replay check is then an
error, or skipped when the config marks it ``optional = true``). Each check's report
is consumed as JSON (``model_dump``), turned into cases, and a failing input (a missing
dump, a corrupt config) becomes an ``error`` check instead of stopping the other checks.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from consistency import __version__
from consistency.errors import ConsistencyError
from consistency.gate.config import Check, GateConfig
from consistency.gate.report import GateCase, GateCheck, GateReport


@dataclass
class Runners:
    lint: Callable[[dict[str, Any]], Any]  # options -> report (pydantic model or dict)
    compare: Callable[[dict[str, Any]], Any]
    replay: Callable[[dict[str, Any]], Any] | None = None
    replay_missing: str = "replay is not available: consistency.replay.api does not import"


def _as_dict(rep: Any) -> dict[str, Any]:
    if hasattr(rep, "model_dump"):
        return rep.model_dump(mode="json")
    if isinstance(rep, dict):
        return rep
    raise TypeError(f"a check returned {type(rep).__name__}, expected a report model or a dict")


def lint_cases(name: str, rep: dict[str, Any], fail_on: str = "error") -> list[GateCase]:
    by_code: dict[str, list[dict[str, Any]]] = {}
    for f in rep.get("findings", []):
        by_code.setdefault(f["code"], []).append(f)
    cases = []
    for r in rep.get("rules", []):
        fs = [f for f in by_code.get(r["code"], []) if f["severity"] != "info"]
        st = r["status"]
        status = {"pass": "passed", "not_evaluated": "skipped", "not_applicable": "skipped", "fail": "failed",
                  "warn": "failed" if fail_on == "warning" else "passed"}[st]
        top = fs[0] if fs else (by_code.get(r["code"]) or [None])[0]
        loc = (top or {}).get("location") or {}
        sev = "error" if st == "fail" else "warning" if st == "warn" else "info" if st == "not_evaluated" else None
        cases.append(GateCase(id=f"lint/{name}/{r['code']}", name=f"{r['code']} {r['name']}", status=status,
                              severity=sev,
                              message="\n".join(f["message"] for f in fs) or (top or {}).get("message", "")
                              or (f"not applicable: {r['reason']}" if r.get("reason") else ""),
                              code=r["code"], file=loc.get("file"), line=loc.get("line"),
                              fix=(top or {}).get("fix") if fs else None, doc=r["doc"]))
    return cases


def _fails(code: str) -> bool:
    """A slot code fails by its severity in the one code registry (never a list kept here)."""
    from consistency.contract.findings import CODES, Severity

    c = CODES.get(code)
    return c is None or c.severity == Severity.error


def compare_cases(name: str, rep: dict[str, Any]) -> list[GateCase]:
    tensors: dict[str, list[dict[str, Any]]] = {}
    for s in rep.get("slots", []):
        tensors.setdefault(s["tensor"], [])
    for f in rep.get("findings", []):
        if f.get("code") == "OK":
            tensors.setdefault(f.get("tensor") or "(report)", [])
            continue
        tensors.setdefault(f.get("tensor") or "(report)", []).append(f)
    slot_code = {s["tensor"]: s.get("code", "OK") for s in rep.get("slots", [])}
    cases = []
    for t, fs in tensors.items():
        errs = [f for f in fs if f["severity"] == "error"] or (
            [{"code": slot_code[t], "message": f"slot code {slot_code[t]}", "severity": "error"}]
            if _fails(slot_code.get(t, "OK")) else [])
        shown = errs or [f for f in fs if f["severity"] == "warning"]
        cases.append(GateCase(id=f"compare/{name}/{t}", name=t, status="failed" if errs else "passed",
                              severity="error" if errs else ("warning" if shown else None),
                              message="\n".join(f"{f['code']}: {f['message']}" for f in shown),
                              code=shown[0]["code"] if shown else None, fix=shown[0].get("fix") if shown else None,
                              doc=shown[0].get("doc") if shown else None))
    if rep.get("verdict") != "pass" and not any(c.status == "failed" for c in cases):
        cases.append(GateCase(id=f"compare/{name}/(report)", name="(report)", status="failed", severity="error",
                              message=rep.get("summary", "")))  # the verdict is the authority, never a case list
    if not cases:
        cases.append(GateCase(id=f"compare/{name}/(report)", name="(report)",
                              status="passed" if rep.get("verdict") == "pass" else "failed",
                              message=rep.get("summary", "")))
    return cases


def replay_cases(name: str, rep: dict[str, Any]) -> list[GateCase]:
    cases = []
    for i, f in enumerate(rep.get("findings", [])):
        sev = f.get("severity", "error")
        cases.append(GateCase(id=f"replay/{name}/{f.get('tensor') or f.get('code') or i}",
                              name=f"{f.get('code', 'finding')} {f.get('tensor') or ''}".strip(),
                              status="failed" if sev == "error" else "passed", severity=sev,
                              message=f.get("message", ""), code=f.get("code"), fix=f.get("fix"), doc=f.get("doc")))
    cases.append(GateCase(id=f"replay/{name}/verdict", name="verdict",
                          status="passed" if rep.get("verdict") == "pass" else "failed",
                          message=rep.get("summary", "")))
    return cases


def _unavailable(check: Check, why: str, t0: float) -> GateCheck:
    """A check that cannot run in this environment (a dependency is missing).

    Never a pass and, unless the config marked the check ``optional = true``, not a skip
    either: an error, so a CI job that lacks torch cannot turn a declared replay into a
    green gate. An optional check is skipped, and the summary says what was not checked.
    """
    if check.options.get("optional") is True:
        msg = f"not checked: {why} (optional = true: skipped where it cannot run)"
        case = GateCase(id=f"{check.kind}/{check.name}/available", name="dependencies", status="skipped",
                        severity="info", message=msg)
        return GateCheck(kind=check.kind, name=check.name, verdict="skipped",  # type: ignore[arg-type]
                         summary=msg, cases=[case], seconds=time.perf_counter() - t0)
    msg = (f"cannot run here: {why}; install what it needs, or mark the check optional = true to skip it "
           "where it cannot run")
    case = GateCase(id=f"{check.kind}/{check.name}/available", name="dependencies", status="error",
                    severity="error", message=msg)
    return GateCheck(kind=check.kind, name=check.name, verdict="error",  # type: ignore[arg-type]
                     summary=msg, cases=[case], seconds=time.perf_counter() - t0)


def _run(check: Check, runners: Runners) -> GateCheck:
    t0 = time.perf_counter()
    opts = {k: v for k, v in check.options.items() if k != "optional"}
    try:
        if check.kind == "lint":
            rep = _as_dict(runners.lint(opts))
            cases = lint_cases(check.name, rep, opts.get("fail_on", "error"))
        elif check.kind == "compare":
            rep = _as_dict(runners.compare(opts))
            cases = compare_cases(check.name, rep)
        else:
            if runners.replay is None:
                return _unavailable(check, runners.replay_missing, t0)
            rep = _as_dict(runners.replay(opts))
            cases = replay_cases(check.name, rep)
    except ImportError as exc:  # an optional dependency this check needs: an error (or skipped if optional)
        from consistency.errors import missing_dependency

        dep = missing_dependency(exc, "replay" if check.kind == "replay" else None)
        if dep is None:
            raise
        return _unavailable(check, str(dep), t0)
    except ConsistencyError as exc:
        case = GateCase(id=f"{check.kind}/{check.name}/input", name="input", status="error", severity="error",
                        message=str(exc))
        return GateCheck(kind=check.kind, name=check.name, verdict="error",  # type: ignore[arg-type]
                         summary=str(exc), cases=[case], seconds=time.perf_counter() - t0)
    verdict = "pass" if rep.get("verdict") == "pass" else "fail"
    return GateCheck(kind=check.kind, name=check.name, verdict=verdict,  # type: ignore[arg-type]
                     summary=str(rep.get("summary", "")), cases=cases, report=rep, seconds=time.perf_counter() - t0)


def run_gate(cfg: GateConfig, runners: Runners, only: tuple[str, ...] = ()) -> GateReport:
    t0 = time.perf_counter()
    checks = [c for c in cfg.checks if not only or c.name in only or f"{c.kind}/{c.name}" in only]
    if not checks:  # a run that checks nothing is never a pass
        from consistency.errors import UsageError

        what = f"--only {', '.join(only)} names no declared check" if only else "the selection holds no check"
        declared = ", ".join(f"{c.kind}/{c.name}" for c in cfg.checks) or "none"
        raise UsageError(f"nothing to check: {what}; declared: {declared}")
    results = [_run(c, runners) for c in checks]
    counts = {s: sum(k.status == s for r in results for k in r.cases) for s in ("passed", "failed", "skipped", "error")}
    verdicts = [r.verdict for r in results]
    verdict = "error" if "error" in verdicts else "fail" if "fail" in verdicts else "pass"
    bad = [f"{r.kind}/{r.name}" for r in results if r.verdict in ("fail", "error")]
    skipped = [f"{r.kind}/{r.name}" for r in results if r.verdict == "skipped"]
    n = len(results)
    summary = (f"{n} check{'s' * (n != 1)}: {verdicts.count('pass')} passed, {verdicts.count('fail')} failed, "
               f"{verdicts.count('error')} errored, {verdicts.count('skipped')} skipped"
               + (f" ({', '.join(bad)})" if bad else "") + (f"; not checked: {', '.join(skipped)}" if skipped else ""))
    if results and verdict == "pass" and "pass" not in verdicts:  # nothing was checked: not a pass
        verdict = "error"
        summary += "; nothing was checked, so this is not a pass"
    return GateReport(version=__version__, verdict=verdict, summary=summary, config=str(cfg.path), checks=results,
                      counts=counts, seconds=time.perf_counter() - t0)
