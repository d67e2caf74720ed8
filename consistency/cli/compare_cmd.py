"""``consistency compare REFERENCE CANDIDATE``: pair, measure, identify, explain."""

from __future__ import annotations

import sys
import click

from consistency.errors import UsageError, install_line
from consistency.escape import json_log, term


@click.command("compare")
@click.argument("reference", type=click.Path(dir_okay=True, readable=False, path_type=str))
@click.argument("candidate", type=click.Path(dir_okay=True, readable=False, path_type=str))
@click.option("--contract", type=click.Path(dir_okay=False, readable=False), help="Aux contract (JSON/YAML): which stream each slot must hold.")
@click.option("--json", "json_out", metavar="PATH|-", help="Write the JSON report to PATH, or to stdout with '-'.")
@click.option("--rtol", type=float, help="Element-wise relative tolerance; when given, any element outside fails.")
@click.option("--atol", type=float, help="Element-wise absolute tolerance; when given, any element outside fails.")
@click.option("--threshold", type=float, help="Token rel_diff floor for every tensor (overrides the dtype floor).")
@click.option("--tolerance", multiple=True, metavar="REGEX=FLOOR", help="Per-name token rel_diff floor (repeatable).")
@click.option("--layer-ids", help="Aux layer ids for an input that does not record them (speculators/SpecForge files).")
@click.option("--ref-layer-ids", help="Aux layer ids declared for REFERENCE only (what the file records outranks them; a disagreement is a conflict).")
@click.option("--cand-layer-ids", help="Aux layer ids of CANDIDATE only (wins over what the file records).")
@click.option("--convention", help="What --layer-ids mean: stream, vllm, speculators, specforge, sglang@VER, ...")
@click.option("--consumer", type=click.Choice(["eagle3", "mtp", "eagle1", "medusa", "dflash", "p-eagle"]),
              help="The draft that reads REFERENCE's states (a declaration: the reference's own claims outrank it); "
                   "mtp reads a speculators file's last slot.")
@click.option("--tokenizer", help="Local tokenizer (directory or .gguf) to decode token spans only one side has.")
@click.option("--html", "html_out", type=click.Path(dir_okay=False), help="Write a self-contained HTML report.")
@click.option("--png", "png_dir", type=click.Path(file_okay=False), help="Write the heatmap and per-token plots as PNG here.")
@click.option("--quiet", "-q", is_flag=True, help="Print only the verdict line.")
@click.option("--show-ok", is_flag=True, help="List passing tensors too.")
@click.option("--force", is_flag=True, help="Overwrite existing report files.")
def compare(reference: str, candidate: str, contract: str | None, json_out: str | None, rtol: float | None,
            atol: float | None, threshold: float | None, tolerance: tuple[str, ...], layer_ids: str | None,
            ref_layer_ids: str | None, cand_layer_ids: str | None, convention: str | None, consumer: str | None,
            tokenizer: str | None,
            html_out: str | None, png_dir: str | None, quiet: bool, show_ok: bool, force: bool) -> None:
    """Compare REFERENCE (what the draft was trained on) with CANDIDATE (what it is fed).

    Exit code 0 when every tensor agrees within its noise floor, 1 when something
    differs (the report says what it is), 2 for bad usage or unreadable input.
    """
    if html_out == "-" or png_dir == "-":
        from consistency.dump.atomic import refuse_stdout

        refuse_stdout({"--html": html_out, "--png": png_dir})
    files = [out for out in (json_out, html_out) if out and out != "-"]
    if files:  # dump.atomic (tempfile, socket) only when a report file is written
        from consistency.dump.atomic import check_outputs

        check_outputs(files, (reference, candidate, contract, tokenizer), force)
    if png_dir:
        try:
            from consistency.report.visual import require_png
        except ImportError as exc:
            raise UsageError(f"--png needs the report extra: {install_line('report')} ({exc})") from None
        require_png()
    from consistency.compare.request import CompareRequest
    from consistency.pipeline.compare import run

    progress = None
    if not quiet and sys.stderr.isatty():
        from consistency.report.progress import factory

        progress = factory()
    req = CompareRequest.build(reference, candidate, contract=contract, rtol=rtol, atol=atol, threshold=threshold,
                               tolerance=tolerance, layer_ids=layer_ids, ref_layer_ids=ref_layer_ids,
                               cand_layer_ids=cand_layer_ids, convention=convention, consumer=consumer, tokenizer=tokenizer,
                               progress=progress)
    rep = run(req)
    if json_out == "-":
        sys.stdout.write(json_log(rep.model_dump_json(indent=2)) + "\n")
    elif json_out:
        from consistency.dump.atomic import write_text_atomic

        write_text_atomic(json_out, rep.model_dump_json(indent=2) + "\n", force=force)
    if quiet or json_out == "-":  # one line; no rich import on the CI path
        word = click.style(rep.verdict.upper(), fg="green" if rep.verdict == "pass" else "red", bold=True)
        click.echo(f"{word}  {term(rep.summary)}", err=json_out == "-")
    else:
        from consistency.report.text import console, render

        render(rep, console(), show_ok=show_ok)
    if html_out or png_dir:  # after the verdict is shown: a report that cannot be written never hides it
        write_visual(rep, html_out, png_dir, force)
    sys.exit(0 if rep.verdict == "pass" else 1)


def write_visual(rep, html_out: str | None, png_dir: str | None, force: bool) -> None:  # noqa: ANN001
    """HTML and PNG reports (optional extra: the distribution's ``[report]``)."""
    try:
        from consistency.report import visual
    except ImportError as exc:
        raise UsageError(f"--html/--png need the report extra: {install_line('report')} ({exc})") from None
    from pathlib import Path

    import click as _click

    if html_out:
        visual.write_html(rep, Path(html_out), force=force)
        _click.echo(f"report written to {term(html_out)}", err=True)
    if png_dir:
        visual.write_pngs(rep, Path(png_dir), force=force)
        _click.echo(f"plots written to {term(png_dir)}", err=True)
