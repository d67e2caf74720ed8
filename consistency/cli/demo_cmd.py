"""``consistency demo``: the seed story in miniature, on an embedded tiny Llama.

The seed: a draft trained on ``cat([embed, layer3_out, layer31_out])`` (streams 0, 3, 31
of a 61-layer target) was served by SGLang with config ids [2, 30, 58], which the
runtime reads as layer outputs (+1): streams 3, 31, 59. Here the target has 12 layers:
training streams [0, 3, 7]; the server's ids [2, 6, 9] become streams [3, 7, 10]. The
fixed ids [-1, 2, 6] need a release whose llama.py captures the embedding (sglang >= 0.5.22),
as ``consistency lint`` says for the same ids: both use one runtime model.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

import click

TRAIN_STREAMS = [0, 3, 7]
SERVE_IDS = [2, 6, 9]  # what the draft config says (SGLang adds 1: streams 3, 7, 10)
FIXED_IDS = [-1, 2, 6]  # the seed's fix: -1 + 1 = 0, the embedding
RUNTIME = "sglang@0.5.5"
# sglang's llama.py cannot capture the embedding before 0.5.22 (residual is None at layer 0), so
# the fixed run is served by a release that can; the runtime model (served_streams) says so too.
FIXED_RUNTIME = "sglang@0.5.23"
MODEL = "tiny-llama"


def serving_plan(fixed: bool, num_layers: int, architecture: str) -> tuple[str, Any]:
    """(runtime, Served): the simulated server is the runtime model ``consistency lint`` uses
    (``served_streams``), so the demo never serves ids the linter rejects for that release."""
    from consistency.contract.runtime_model import served_streams
    from consistency.errors import UsageError

    runtime = FIXED_RUNTIME if fixed else RUNTIME
    sv = served_streams(runtime, FIXED_IDS if fixed else SERVE_IDS, num_layers, architecture)
    if sv.crashes or sv.missing:  # a demo its own runtime could not serve is a bug, never a silent pass
        raise UsageError(f"demo: {runtime} cannot serve these ids: {'; '.join(sv.crashes) or sv.missing}")
    return runtime, sv


def _outputs(out_dir: Path, fixed: bool, json_out: str | None, force: bool) -> tuple[Path, Path]:
    """The dump paths, after the no-clobber check every command makes before any work."""
    from consistency.dump.atomic import check_writable
    from consistency.errors import InputError

    if out_dir.exists() and not out_dir.is_dir():
        raise InputError(out_dir, "is not a directory (--out)")
    out_dir.mkdir(parents=True, exist_ok=True)
    train = out_dir / "train.safetensors"
    serve = out_dir / ("serve_fixed.safetensors" if fixed else "serve.safetensors")
    for p in (train, serve, out_dir / "replay.json", *([json_out] if json_out else [])):
        check_writable(p, force)
    return train, serve


@click.command("demo")
@click.option("--fixed", is_flag=True, help="Serve the streams the draft was trained on: the passing run.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path),
              help="Keep the dumps (and report) in this directory instead of a temporary one.")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="Also write the JSON report here.")
@click.option("--no-replay", is_flag=True, help="Skip the acceptance replay step.")
@click.option("--force", is_flag=True, help="Overwrite dumps already in --out (reports consistency wrote are "
              "rewritten, as every command rewrites its own reports).")
def demo(fixed: bool, out_dir: Path | None, json_out: str | None, no_replay: bool, force: bool) -> None:
    """Record a training dump and a serving dump of an embedded 12-layer Llama, compare
    them and print the diagnosis (no download, no GPU, about ten seconds on two CPU cores)."""
    from consistency.pipeline.compare import compare as run_compare
    from consistency.dump.atomic import write_text_atomic
    from consistency.record.api import record_reference, record_serving
    from consistency.record.models import DEMO_PROMPT, load_model, tokenize
    from consistency.report.text import console, render

    con = console()
    tmp = None
    if out_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="consistency-demo-")
        out_dir = Path(tmp.name)
    train, serve = _outputs(out_dir, fixed, json_out, force)
    try:
        model = load_model(MODEL)
        ids = tokenize(model, MODEL, DEMO_PROMPT)
        n = model.config.num_hidden_layers
        runtime, sv = serving_plan(fixed, n, model.config.architectures[0])
        serve_ids = FIXED_IDS if fixed else SERVE_IDS
        con.print(f"target   {MODEL}: {n} layers, hidden {model.config.hidden_size}, {len(ids)} prompt tokens",
                  markup=False)
        con.print(f"training fed the draft streams {TRAIN_STREAMS}: cat([embed, layer2_out, layer6_out]) in fp32",
                  markup=False)
        con.print(f"serving  {runtime} reads draft-config ids {serve_ids} as layer outputs ({sv.convention.code}: "
                  f"+1), so it feeds streams {sv.streams} (bf16, fused residual)", markup=False)
        record_reference(model, ids, train, TRAIN_STREAMS, convention="stream", force=force)
        import copy

        record_serving(copy.deepcopy(model), ids, serve, sv.streams, native_ids=serve_ids, convention=runtime,
                       runtime=runtime, dtype="bfloat16", force=force)
        con.print(f"\n$ consistency compare {train.name} {serve.name}")
        rep = run_compare(str(train), str(serve))
        render(rep, con)
        if json_out:
            write_text_atomic(json_out, rep.model_dump_json(indent=2) + "\n", force=force)
        if not no_replay:
            _replay(con, out_dir, train, serve, force)
        if not fixed:
            fix = sv.convention.from_streams(TRAIN_STREAMS, n)
            con.print(f"\nfix: write the ids in the serving runtime's convention (here {fix}, read as streams "
                      f"{TRAIN_STREAMS}) and serve on a release that captures the embedding ({FIXED_RUNTIME}; "
                      f"{RUNTIME}'s llama.py cannot), then `consistency demo --fixed` shows the passing run.",
                      markup=False)
    finally:
        if tmp is not None:
            tmp.cleanup()
    sys.exit(0)


def _replay(con: Any, out_dir: Path, train: Path, serve: Path, force: bool) -> None:
    """The acceptance it costs, when the replay package is installed (issue: replay)."""
    try:
        from consistency.replay.demo import demo_replay
    except ImportError:
        return
    demo_replay(con, out_dir, train, serve, force=force)
