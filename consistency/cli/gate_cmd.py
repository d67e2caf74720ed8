"""``consistency gate``: run the lints, compares and replays a project declares, for CI."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import click


def lint_runner(opts: dict[str, Any]) -> Any:
    from dataclasses import fields

    from consistency.lint.engine import LintRequest, run_lint

    return run_lint(LintRequest(**{f.name: opts[f.name] for f in fields(LintRequest) if f.name in opts}))


def compare_runner(opts: dict[str, Any]) -> Any:
    from consistency.compare.request import CompareRequest
    from consistency.pipeline.compare import run
    from consistency.errors import UsageError

    for key in ("reference", "candidate"):
        if not opts.get(key):
            raise UsageError(f"[[compare]] needs {key}")
    from consistency.gate.config import COMPARE_KEYS

    asked = {k: v for k, v in opts.items() if k in COMPARE_KEYS - {"name", "optional", "reference", "candidate"}}
    return run(CompareRequest.build(opts["reference"], opts["candidate"], **asked))


def replay_runner() -> tuple[Any, str]:
    """The replay hook, or None and why it is unavailable: replay runs the draft, so it
    needs torch and transformers; without them the gate still runs lint and compare and
    reports each replay as an error with the install line (skipped only when the config
    marks it ``optional = true``; never as passed)."""
    import importlib.util

    from consistency.errors import MissingDependency

    for mod in ("torch", "transformers"):
        try:
            found = importlib.util.find_spec(mod) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            return None, str(MissingDependency("hf", mod, "replay"))
    try:
        from consistency.replay.api import replay_check
    except ImportError as exc:
        return None, f"replay is not available: consistency.replay.api does not import ({exc})"
    return (lambda opts: replay_check(**opts)), ""


def builtin_names() -> list[str]:
    """Model and draft names the commands resolve without a file (a gate config may use them)."""
    from consistency.record.models import builtin_names as models
    from consistency.replay.assets import BUILTIN

    return [*models(), *BUILTIN]


@click.command("gate")
@click.option("--config", "config_path", default="consistency.toml", show_default=True, help="The gate config (TOML).")
@click.option("--json", "json_out", metavar="PATH|-", help="Write the JSON report (default: [gate] json).")
@click.option("--junit", metavar="PATH", help="Write JUnit XML: one test case per rule/tensor (default: [gate] junit).")
@click.option("--sarif", metavar="PATH", help="Write the lint findings as SARIF 2.1.0 (default: [gate] sarif).")
@click.option("--summary", metavar="PATH",
              help="Write a Markdown summary here (default: [gate] summary); $GITHUB_STEP_SUMMARY, when set, is "
                   "appended to as well.")
@click.option("--annotations/--no-annotations", default=None,
              help="Print GitHub Actions annotations (default: on when GITHUB_ACTIONS=true).")
@click.option("--fail-on", "fail_on", type=click.Choice(["error", "warning"]),
              help="warning: lint warnings fail every lint check (the verdict says fail), whatever the config says.")
@click.option("--result", metavar="PATH", help="Also write the JSON report to PATH, which must not exist: the one file "
                                               "a CI step reads back (only this run can have written it).")
@click.option("--plan", "show_plan", is_flag=True,
              help="Print what the config's checks need installed (JSON) and exit; nothing runs.")
@click.option("--only", multiple=True, metavar="NAME", help="Run only these checks (name or kind/name); repeatable.")
@click.option("--kind", "kinds", multiple=True, type=click.Choice(["lint", "compare", "replay"]),
              help="Run only checks of this kind (e.g. lint in a pre-commit hook); repeatable.")
@click.option("--quiet", "-q", is_flag=True, help="Print only the verdict line (annotations and files as usual).")
@click.option("--force", is_flag=True,
              help="Overwrite existing --json/--junit/--sarif/--summary files that are not reports of ours "
                   "(command line only).")
def gate(config_path: str, json_out: str | None, junit: str | None, sarif: str | None, summary: str | None,
         annotations: bool | None, fail_on: str | None, result: str | None, show_plan: bool, only: tuple[str, ...],
         kinds: tuple[str, ...], quiet: bool, force: bool) -> None:
    """Run every [[lint]], [[compare]] and [[replay]] check of a consistency.toml.

    Exit code 0 when every check passes, 1 when one fails, 2 when one cannot read its
    input or cannot run here (a missing dependency; the others still run and are
    reported). Configuration and a GitHub Actions workflow: docs/ci.md. Output paths
    written in the config stay inside its directory and out of dot-directories; --force
    is accepted from the command line only.
    """
    from consistency.dump.atomic import check_outputs, refuse_stdout, write_text_atomic
    from consistency.errors import UsageError
    from consistency.escape import json_log, term
    from consistency.gate.config import load
    from consistency.gate.runner import Runners, run_gate
    from consistency.report.ci_formats import github_annotations, junit_xml, markdown_summary

    cfg = load(config_path, builtin_names())
    if show_plan:
        from consistency.gate.plan import plan

        sys.stdout.write(json_log(json.dumps(plan(cfg), indent=2)) + "\n")
        sys.exit(0)
    if kinds:
        kept = [c for c in cfg.checks if c.kind in kinds]
        if not kept:  # exit 2, never a pass of zero checks
            raise UsageError(f"nothing to check: --kind {', '.join(kinds)}, but the config declares only "
                             f"{', '.join(sorted({c.kind for c in cfg.checks}))} checks")
        cfg.checks = kept
    st = cfg.settings
    in_actions = os.environ.get("GITHUB_ACTIONS") == "true"
    json_out, junit, sarif = json_out or st.get("json"), junit or st.get("junit"), sarif or st.get("sarif")
    summary = summary or st.get("summary")
    step_summary = os.environ.get("GITHUB_STEP_SUMMARY") or None
    if summary and step_summary and os.path.abspath(summary) == os.path.abspath(step_summary):
        summary = None  # the runner's own file: appended to below, like every step's summary
    for out in (json_out, junit, sarif, summary):
        if out and out != "-" and out in (st.get("json"), st.get("junit"), st.get("sarif"), st.get("summary")):
            Path(out).parent.mkdir(parents=True, exist_ok=True)  # inside the config's tree (checked on load)
    refuse_stdout({"--junit": junit, "--sarif": sarif, "--summary": summary})
    inputs = [config_path] + [v for c in cfg.checks for v in c.options.values() if isinstance(v, str)]
    check_outputs((json_out, junit, sarif, summary), inputs, force)  # none twice, none an input, even with --force
    if result:
        _check_fresh(result)
    if step_summary:
        _check_appendable(step_summary)
    if fail_on == "warning" or st.get("fail_on"):
        for c in cfg.checks:
            if c.kind == "lint":
                c.options["fail_on"] = "warning" if fail_on == "warning" else c.options.get("fail_on", st["fail_on"])
    replay, why = replay_runner()
    rep = run_gate(cfg, Runners(lint_runner, compare_runner, replay, why), only)
    written = {k: str(v) for k, v in (("json", json_out), ("junit", junit), ("sarif", sarif), ("summary", summary),
                                      ("step_summary", step_summary)) if v and v != "-"}
    rep = rep.model_copy(update={"outputs": written})  # what this run writes, for a CI step to read back
    data = rep.model_dump(mode="json")
    if json_out == "-":
        sys.stdout.write(json_log(json.dumps(data, indent=2)) + "\n")
    elif json_out:
        write_text_atomic(json_out, json.dumps(data, indent=2) + "\n", force=force)
    if junit:
        write_text_atomic(junit, junit_xml(data), force=force)
    if sarif:
        write_text_atomic(sarif, json.dumps(_sarif(data), indent=2) + "\n", force=force)
    out = sys.stderr if json_out == "-" else sys.stdout
    if annotations is None:  # under Actions the runner's annotations are not the config's to turn off
        annotations = in_actions or bool(st.get("annotations", False))
        if in_actions and st.get("annotations") is False:
            click.echo("note: [gate] annotations = false is ignored under GitHub Actions (pass --no-annotations "
                       "on the command line)", file=out)
    if annotations:
        for line in github_annotations(data, Path.cwd()):
            click.echo(line, file=out)
    md = markdown_summary(data)
    if summary:
        write_text_atomic(summary, md, force=force)
    if step_summary:
        _append(step_summary, md)
    if result:
        write_text_atomic(result, json.dumps(data, indent=2) + "\n")
    if not quiet:
        for chk in rep.checks:
            click.echo(f"{chk.verdict.upper():5s} {chk.kind}/{term(chk.name)}: {term(chk.summary)}", file=out)
    click.echo(f"{rep.verdict.upper()}  {term(rep.summary)}", file=out)
    sys.exit(rep.exit_code)


def _check_fresh(path: str) -> None:
    """``--result`` names a file this run creates: one that exists (committed, left over) is
    refused, so what a CI step reads back can only be this run's verdict."""
    from consistency.errors import InputError

    p = Path(path)
    if p.exists() or p.is_symlink():
        raise InputError(p, "--result: exists; the result file must be new (only this run may have written it)")
    if not p.parent.is_dir():
        raise InputError(p, f"--result: directory {p.parent} does not exist")


def _check_appendable(path: str) -> None:
    """$GITHUB_STEP_SUMMARY is appended to (the runner's file: earlier steps wrote to it); it
    must be a regular file or absent, in an existing directory: never a FIFO or a device."""
    from consistency.errors import InputError

    p = Path(path)
    if p.exists() and not p.is_file():
        raise InputError(p, "GITHUB_STEP_SUMMARY: not a regular file (a directory, FIFO, device or socket); refused")
    if not p.parent.is_dir():
        raise InputError(p, f"GITHUB_STEP_SUMMARY: directory {p.parent} does not exist")


def _append(path: str, text: str) -> None:
    import stat

    from consistency.errors import InputError

    try:  # O_NONBLOCK: a FIFO swapped in after the check fails here instead of hanging the job
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0), 0o666)
    except OSError as exc:
        raise InputError(path, f"GITHUB_STEP_SUMMARY: cannot write: {exc.strerror or exc}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise InputError(path, "GITHUB_STEP_SUMMARY: not a regular file; refused as an output")
        data = memoryview(text.encode("utf-8"))
        while data:
            data = data[os.write(fd, data):]
    finally:
        os.close(fd)


def _sarif(data: dict[str, Any]) -> dict[str, Any]:
    """One SARIF log, one run per lint check."""
    from consistency.report.sarif import lint_sarif

    runs = []
    for chk in data["checks"]:
        if chk["kind"] == "lint" and chk.get("report"):
            run = lint_sarif(chk["report"], Path.cwd())["runs"][0]
            run["automationDetails"] = {"id": f"consistency/lint/{chk['name']}"}
            runs.append(run)
    log = lint_sarif({}, Path.cwd())
    log["runs"] = runs
    return log
