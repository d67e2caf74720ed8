"""The ``consistency`` command line: a click group whose commands load on demand.

``consistency --help`` must start fast and never import torch, so each command lives in
its own module, imported only when that command runs. Errors the user can fix exit with
code 2 and one line naming the file; findings exit 1; a clean pass exits 0.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

import click

from consistency import __version__

# name -> (module, function, one-line help): help is here so listing commands imports nothing
COMMANDS: dict[str, tuple[str, str, str]] = {
    "compare": ("consistency.cli.compare_cmd", "compare", "Compare two dumps and explain every mismatch."),
    "record": ("consistency.cli.record_cmd", "record", "Record a dump from a model (training or serving style)."),
    "demo": ("consistency.cli.demo_cmd", "demo", "Run the seed story in miniature on an embedded model."),
    "lint": ("consistency.cli.lint_cmd", "lint", "Static checks of draft, target and serving settings."),
    "gate": ("consistency.cli.gate_cmd", "gate", "Run a project's declared lints, compares and replays for CI."),
    "replay": ("consistency.cli.replay_cmd", "replay", "Run the draft on both dumps and predict acceptance."),
    "convert": ("consistency.cli.convert_cmd", "convert", "Convert speculators/SpecForge training files to a dump."),
    "inspect": ("consistency.cli.inspect_cmd", "inspect", "List a dump's tensors and metadata."),
    "schema": ("consistency.cli.schema_cmd", "schema", "Write the JSON Schemas of the contract and reports."),
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return [n for n in COMMANDS if _available(n)]

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS or not _available(name):
            return None
        mod, fn, _help = COMMANDS[name]
        return getattr(importlib.import_module(mod), fn)

    def resolve_command(self, ctx: click.Context, args: list[str]) -> tuple:  # type: ignore[type-arg]
        """A mistyped command (``consistency comapre``) names the one it was probably meant to be."""
        name = args[0] if args else ""
        if args and self.get_command(ctx, name) is None and not name.startswith("-"):
            from consistency.errors import did_you_mean

            ctx.fail(f"No such command {name!r} (commands: {', '.join(self.list_commands(ctx))})"
                     f"{did_you_mean(name, self.list_commands(ctx))}")
        return super().resolve_command(ctx, args)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(n, COMMANDS[n][2]) for n in self.list_commands(ctx)]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


def _available(name: str) -> bool:
    mod = COMMANDS[name][0]
    return importlib.util.find_spec(mod) is not None  # type: ignore[attr-defined]


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="consistency")
def main() -> None:
    """consistency: train/serve consistency for speculative decoding (EAGLE-3).

    Record what the draft was trained on and what the server feeds it, compare the two
    and say what each mismatched tensor really is. Exit codes: 0 pass, 1 findings,
    2 bad usage or unreadable input.
    """


def _no_pydantic_plugin_scan() -> None:
    """Tell pydantic, through its documented switch, not to look for plugins in this process.

    On its first validation pydantic reads the entry points of every installed distribution
    to find plugins (observability hooks): a measurable share of a small ``compare``
    (docs/performance.md, "Issue 17, final figures"). The CLI validates only its own files
    and reports. ``CONSISTENCY_PYDANTIC_PLUGINS=1``, or any ``PYDANTIC_DISABLE_PLUGINS``
    value the user sets, keeps pydantic's own behaviour."""
    if not os.environ.get("CONSISTENCY_PYDANTIC_PLUGINS"):
        os.environ.setdefault("PYDANTIC_DISABLE_PLUGINS", "__all__")


def _suggest_choice(e: click.ClickException) -> None:
    """A value outside an option's choices (``--consumer eagel3``) names the choice it was
    probably meant to be, as a mistyped command or convention does."""
    import re

    from consistency.errors import did_you_mean

    choice = getattr(getattr(e, "param", None), "type", None)
    m = re.match(r"'(.*?)' is not one of", e.message) if isinstance(choice, click.Choice) else None
    if m is not None:
        e.message = e.message.rstrip(".") + did_you_mean(m.group(1), [str(c) for c in choice.choices])


def _is_path(word: str) -> bool:
    try:
        return os.path.exists(word)
    except (OSError, ValueError):  # a name too long, a NUL: not a file we were given
        return False


def run(argv: list[str] | None = None) -> None:
    """Console-script entry: map user errors to exit code 2 with one line, no traceback."""
    from consistency.errors import ConsistencyError

    _no_pydantic_plugin_scan()

    try:
        from consistency.contract.bounds import check_bound_overrides

        check_bound_overrides()
        main.main(args=argv, prog_name="consistency", standalone_mode=False)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.exceptions.Abort:
        click.echo("consistency: aborted", err=True)
        sys.exit(2)
    except click.ClickException as e:  # click echoes argv (a file name a glob found) raw: made inert
        _suggest_choice(e)

        from consistency.escape import term

        # one line, as every other refusal: click's own three (usage, "Try --help", error) folded
        ctx = getattr(e, "ctx", None)
        where = f" (see {ctx.command_path} --help)" if ctx is not None and getattr(ctx, "command_path", None) else ""
        msg = " ".join(e.format_message().split())
        click.echo(f"consistency: error: {term(msg)}{term(where)}", err=True)
        sys.exit(2)
    except ConsistencyError as e:
        from consistency.escape import term  # file names and values: one inert line

        click.echo(f"consistency: error: {term(e)}", err=True)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        click.echo("consistency: interrupted", err=True)
        sys.exit(130)
    except Exception as e:  # noqa: BLE001 - never a traceback on a user's input
        if os.environ.get("CONSISTENCY_DEBUG"):
            raise
        from consistency.errors import missing_dependency

        words = [a for a in (argv if argv is not None else sys.argv[1:]) if not a.startswith("-")]
        dep = missing_dependency(e, words[0] if words else None) if isinstance(e, ImportError) else None
        if dep is not None:  # an optional dependency missing on this command's path: the pip line
            click.echo(f"consistency: error: {dep}", err=True)  # our text only
            sys.exit(dep.exit_code)
        # the command and the files it was given, never other values (a prompt, a pattern) whole
        args = " ".join(words[:1] + [a for a in words[1:] if _is_path(a)])
        args = args if len(args) <= 200 else args[:200] + "..."
        msg = " ".join(f"{type(e).__name__}: {e}".split())
        msg = msg if len(msg) <= 400 else msg[:400] + "..."
        from consistency.escape import term

        click.echo(f"consistency: error: {term(args)}: {term(msg)} (set CONSISTENCY_DEBUG=1 for a traceback)", err=True)
        sys.exit(2)
