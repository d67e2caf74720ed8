"""``consistency replay --draft DRAFT --target TARGET REFERENCE CANDIDATE``: what a mismatch costs."""

from __future__ import annotations

import sys

import click

from consistency.errors import UsageError

SETTABLE = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")


def parse_sets(values: tuple[str, ...]) -> dict[str, bool]:
    out: dict[str, bool] = {}
    for v in values:
        key, sep, val = v.partition("=")
        if not sep or key not in SETTABLE or val.lower() not in ("true", "false", "1", "0"):
            raise UsageError(f"--set {v!r}: expected FLAG=true|false with FLAG one of {', '.join(SETTABLE)}")
        out[key] = val.lower() in ("true", "1")
    return out


@click.command("replay")
@click.argument("reference", type=click.Path(dir_okay=True, path_type=str))
@click.argument("candidate", type=click.Path(dir_okay=True, path_type=str))
@click.option("--draft", required=True, metavar="DIR|NAME",
              help="EAGLE-3 draft: a directory (config.json + *.safetensors, speculators or SGLang/SpecForge layout) "
                   "or a built-in fixture draft name (tiny-llama-eagle3).")
@click.option("--target", metavar="NAME|DIR",
              help="Target model: a built-in tiny name or a local HF directory. Supplies the embedding/lm_head a draft "
                   "does not carry and the next-token labels when a dump has no logits.")
@click.option("--steps", "-k", type=int, help="Chained draft steps per verification (default: the draft's "
              "speculative_tokens, else 3); SGLang's --speculative-num-steps.")
@click.option("--max-drop-points", "--max-drop", "max_drop", type=float, default=5.0, show_default=True,
              metavar="POINTS", help="Fail (exit 1) when top-1 accuracy or acceptance rate on the walk a server takes "
              "(its verify passes) falls by more than this many points (the gate's max_drop_points; --max-drop is the "
              "same option).")
@click.option("--min-acceptance", type=float, metavar="FRACTION",
              help="Also fail when the candidate's predicted acceptance rate is below this (0..1).")
@click.option("--feed", type=click.Choice(["auto", "own", "teacher"]), default="auto", show_default=True,
              help="Chained steps get the draft's own proposals (runtimes) or the recorded tokens (speculators' TTT); "
                   "auto: own on the target's own greedy text, else recorded.")
@click.option("--labels", type=click.Choice(["auto", "logits", "target", "input_ids"]), default="auto", show_default=True,
              help="Where the target's next tokens come from: the dump's logits, a target forward, or the recorded tokens.")
@click.option("--set", "sets", multiple=True, metavar="FLAG=BOOL",
              help="Override a draft flag as a runtime would read it (e.g. norm_before_residual=false for SGLang).")
@click.option("--layer-ids", help="Aux layer ids of an input that does not record them (speculators/SpecForge "
              "training files), read as `compare --layer-ids` reads them.")
@click.option("--convention", help="What --layer-ids mean: stream, vllm, speculators, specforge[@VER], sglang@VER, ...")
@click.option("--method", type=click.Choice(["auto", "eagle3", "mtp", "eagle1"]), default="auto", show_default=True,
              help="The draft's kind: EAGLE-3, MTP (DeepSeek-V3 style NextN layer; --draft may be the target's own "
                   "checkpoint) or EAGLE-1/2/HASS; auto reads it from the checkpoint.")
@click.option("--json", "json_out", metavar="PATH|-", help="Write the JSON report to PATH, or to stdout with '-'.")
@click.option("--quiet", "-q", is_flag=True, help="Print only the verdict line.")
@click.option("--force", is_flag=True, help="Overwrite an existing report file.")
def replay(reference: str, candidate: str, draft: str, target: str | None, steps: int | None, max_drop: float,
           min_acceptance: float | None, feed: str, labels: str, sets: tuple[str, ...], layer_ids: str | None,
           convention: str | None, method: str, json_out: str | None, quiet: bool, force: bool) -> None:
    """Run the real draft on the aux states of REFERENCE (what it was trained on) and of
    CANDIDATE (what the server feeds it), score both against the target's own next tokens
    and report the predicted acceptance side by side.

    Exit code 0 when the candidate is within --max-drop-points of the reference (and above
    --min-acceptance), 1 when it is not, 2 for bad usage or unreadable input, and for inputs
    that do not belong together: a --target the dumps were not recorded on, REFERENCE and
    CANDIDATE swapped, dumps of different tokens.
    """
    from consistency.dump.atomic import check_outputs, write_text_atomic
    from consistency.replay.request import ReplayRequest, run

    req = ReplayRequest.build(draft, reference, candidate, target=target, steps=steps, max_drop_points=max_drop,
                              min_acceptance=min_acceptance, feed=feed, labels=labels, overrides=parse_sets(sets),
                              layer_ids=layer_ids, convention=convention, method=method)
    if json_out and json_out != "-":
        check_outputs([json_out], (draft, reference, candidate, target if isinstance(target, str) else None), force)
    from consistency.replay.text import render
    from consistency.report.text import console

    rep = run(req)
    text = rep.model_dump_json(indent=2)
    if json_out == "-":
        from consistency.escape import json_log

        sys.stdout.write(json_log(text) + "\n")
        render(rep, console(sys.stderr), quiet=True)
    else:
        if json_out:
            write_text_atomic(json_out, text + "\n", force=force)
        render(rep, console(), quiet=quiet)
    sys.exit(0 if rep.verdict == "pass" else 1)
