"""``consistency demo``: the seed story in miniature, on an embedded tiny Llama.

The seed: a draft trained on ``cat([embed, layer3_out, layer31_out])`` (streams 0, 3, 31
of a 61-layer target) was served by SGLang with config ids [2, 30, 58], which the
runtime reads as layer outputs (+1): streams 3, 31, 59. Here the target has 12 layers:
training streams [0, 3, 7]; the server's ids [2, 6, 9] become streams [3, 7, 10].
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import click

TRAIN_STREAMS = [0, 3, 7]
SERVE_IDS = [2, 6, 9]  # what the draft config says (SGLang adds 1: streams 3, 7, 10)
FIXED_IDS = [-1, 2, 6]  # the seed's fix: -1 + 1 = 0, the embedding
RUNTIME = "sglang@0.5.5"
MODEL = "tiny-llama"


@click.command("demo")
@click.option("--fixed", is_flag=True, help="Serve the streams the draft was trained on: the passing run.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path),
              help="Keep the dumps (and report) in this directory instead of a temporary one.")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="Also write the JSON report here.")
@click.option("--no-replay", is_flag=True, help="Skip the acceptance replay step.")
def demo(fixed: bool, out_dir: Path | None, json_out: str | None, no_replay: bool) -> None:
    """Record a training dump and a serving dump of an embedded 12-layer Llama, compare
    them and print the diagnosis (no download, no GPU, a few seconds on a CPU)."""
    from consistency.cli.compare_cmd import run_compare
    from consistency.contract.conventions import resolve
    from consistency.dump.atomic import write_text_atomic
    from consistency.record.api import record_reference, record_serving
    from consistency.record.models import DEMO_PROMPT, load_model, tokenize
    from consistency.report.text import console, render

    con = console()
    tmp = None
    if out_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="consistency-demo-")
        out_dir = Path(tmp.name)
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        model = load_model(MODEL)
        ids = tokenize(model, MODEL, DEMO_PROMPT)
        n = model.config.num_hidden_layers
        conv = resolve(RUNTIME, model.config.architectures[0]).convention
        serve_ids = FIXED_IDS if fixed else SERVE_IDS
        serve_streams = conv.to_streams(serve_ids, n)
        con.print(f"target   {MODEL}: {n} layers, hidden {model.config.hidden_size}, {len(ids)} prompt tokens",
                  markup=False)
        con.print(f"training fed the draft streams {TRAIN_STREAMS}: cat([embed, layer2_out, layer6_out]) in fp32",
                  markup=False)
        con.print(f"serving  {RUNTIME} reads draft-config ids {serve_ids} as layer outputs ({conv.code}: +1), so it "
                  f"feeds streams {serve_streams} (bf16, fused residual)", markup=False)
        train = out_dir / "train.safetensors"
        serve = out_dir / ("serve_fixed.safetensors" if fixed else "serve.safetensors")
        record_reference(model, ids, train, TRAIN_STREAMS, convention="stream", force=True)
        import copy

        record_serving(copy.deepcopy(model), ids, serve, serve_streams, native_ids=serve_ids, convention=RUNTIME,
                       runtime=RUNTIME, dtype="bfloat16", force=True)
        con.print(f"\n$ consistency compare {train.name} {serve.name}")
        rep = run_compare(str(train), str(serve))
        render(rep, con)
        if json_out:
            write_text_atomic(json_out, rep.model_dump_json(indent=2) + "\n", force=True)
        if not no_replay:
            _replay(con, out_dir, train, serve)
        if not fixed:
            con.print("\nfix: write the ids in the serving runtime's convention "
                      f"(here {FIXED_IDS}, so that {RUNTIME} feeds streams {TRAIN_STREAMS}), then "
                      "`consistency demo --fixed` shows the passing run.", markup=False)
    finally:
        if tmp is not None:
            tmp.cleanup()
    sys.exit(0)


def _replay(con, out_dir: Path, train: Path, serve: Path) -> None:  # noqa: ANN001
    """The acceptance it costs, when the replay package is installed (issue: replay)."""
    try:
        from consistency.replay.demo import demo_replay
    except ImportError:
        return
    demo_replay(con, out_dir, train, serve)
