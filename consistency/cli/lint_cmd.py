"""``consistency lint``: static checks of draft, target and serving settings (no torch)."""

from __future__ import annotations

import sys

import click


@click.command("lint")
@click.option("--draft", help="Draft directory (config.json + safetensors), its config.json, or a .safetensors file.")
@click.option("--target", help="Target model config.json (or its directory).")
@click.option("--serve", "serve", metavar="\"COMMAND LINE\"",
              help="The serving command: `python -m sglang.launch_server ...` or `vllm serve ...` (quoted).")
@click.option("--runtime", help="Runtime and version the command runs on: sglang@0.5.12, vllm@0.33.0.")
@click.option("--trained-with", "trained_with", metavar="SOURCE",
              help="What training used: a dump, a contract file, or FRAMEWORK:IDS (specforge:1,29,57).")
@click.option("--format", "fmt", type=click.Choice(["text", "json", "sarif"]), default="text", show_default=True)
@click.option("--output", "-o", "output", metavar="PATH", help="Write the report here instead of stdout.")
@click.option("--select", multiple=True, metavar="CODES",
              help="Rule codes or prefixes to run (IDS,SHP001); repeatable.")
@click.option("--ignore", multiple=True, metavar="CODES", help="Rule codes or prefixes to skip; repeatable.")
@click.option("--fail-on", type=click.Choice(["error", "warning"]), default="error", show_default=True,
              help="Lowest severity that fails the run (exit 1).")
@click.option("--quiet", "-q", is_flag=True, help="Text format: print only the verdict line.")
@click.option("--no-info", is_flag=True, help="Text format: hide info findings (rules not evaluated).")
@click.option("--force", is_flag=True, help="Overwrite an existing --output file (with --fix: an existing backup).")
@click.option("--diff", "show_diff", is_flag=True,
              help="Print the fixes as a unified diff and the corrected serving command; change nothing.")
@click.option("--fix", "apply_fix", is_flag=True,
              help="Write the determined fixes into the draft's config.json (backup: config.json.orig), print the "
                   "corrected serving command (never run), and lint the fixed setup again (exit 0 only if it passes).")
@click.option("--explain", metavar="CODE", help="Print a rule's page (MTP001, or its name) and exit.")
def lint(draft: str | None, target: str | None, serve: str | None, runtime: str | None, trained_with: str | None,
         fmt: str, output: str | None, select: tuple[str, ...], ignore: tuple[str, ...], fail_on: str, quiet: bool,
         no_info: bool, force: bool, explain: str | None = None, show_diff: bool = False,
         apply_fix: bool = False) -> None:
    """Check a draft, its target and the serving settings before anything runs.

    States what the server will feed the draft, slot by slot, in stream indices, next to
    what training used. Exit code 0 when no finding reaches --fail-on, 1 otherwise, 2 for
    bad usage or unreadable input. --diff shows the fixes the inputs determine; --fix writes
    them into the draft's config.json and exits by the fixed setup's lint. Rules and fixes:
    docs/lint.md, docs/rules/.
    """
    if explain:
        from consistency.lint.explain import explain as _explain

        sys.stdout.write(_explain(explain))
        sys.exit(0)
    from consistency.dump.atomic import check_outputs, refuse_stdout, write_text_atomic
    from consistency.lint.engine import LintRequest, run_lint

    refuse_stdout({"--output": output})
    if output:
        check_outputs([output], (draft, target, serve, trained_with), force)
    req = LintRequest(draft=draft, target=target, serve=serve, runtime=runtime, trained_with=trained_with,
                      select=select, ignore=ignore, fail_on=fail_on)
    rep = run_lint(req)
    if show_diff or apply_fix:
        from consistency.cli.lint_fix import diff_or_fix

        rep = diff_or_fix(req, rep, apply_fix, force, to_stderr=fmt != "text" and not output)
    if fmt == "text" and (show_diff or apply_fix) and not output:
        pass  # the diff (and, after --fix, the fixed setup's verdict) is the output, as ruff --diff does
    elif fmt == "text":
        from consistency.lint.render import render
        from consistency.report.text import console

        if output:
            import io

            buf = io.StringIO()
            from rich.console import Console

            render(rep, Console(file=buf, width=140, highlight=False, no_color=True), quiet, not no_info)
            from consistency.dump.atomic import TEXT_TRAILER

            write_text_atomic(output, buf.getvalue() + TEXT_TRAILER.format(kind="lint") + "\n", force=force)
        else:
            render(rep, console(), quiet, not no_info)
    else:
        if fmt == "json":
            text = rep.model_dump_json(indent=2)
        else:
            import json

            from consistency.report.sarif import lint_sarif

            text = json.dumps(lint_sarif(rep.model_dump(mode="json")), indent=2)
        if output:
            write_text_atomic(output, text + "\n", force=force)
        else:
            from consistency.escape import json_log

            sys.stdout.write(json_log(text) + "\n")
    sys.exit(0 if rep.verdict == "pass" else 1)
