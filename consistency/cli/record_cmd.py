"""``consistency record``: dump a model's streams the training way or the serving way."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import click

if TYPE_CHECKING:
    from consistency.record.request import RecordRequest


@click.command("record")
@click.option("--model", "model_spec", required=True, help="Built-in tiny model name or a local HF model directory.")
@click.option("--gguf-file", help="GGUF file inside --model (loads a quantized checkpoint offline).")
@click.option("--prompt", help="Text to run, tokenized by the model's tokenizer (with --gguf-file, the GGUF's); "
              "built-in tiny models have none and use UTF-8 bytes.")
@click.option("--input-ids", "ids_file", type=click.Path(dir_okay=False), help="Token ids (.npy/.npz/.safetensors/.json/.txt).")
@click.option("--aux-layers", help="Aux layer ids as the convention spells them, e.g. 2,30,58 ('default' = runtime default).")
@click.option("--convention", default="stream", show_default=True,
              help="What the ids mean: stream, hf, sglang[@VER], vllm, speculators, specforge, modelopt, trtllm, eagle.")
@click.option("--style", type=click.Choice(["training", "serving"]), default="training", show_default=True,
              help="training: every stream via HF hooks; serving: aux slots from a fused-residual loop.")
@click.option("--capture", "capture_mode", type=click.Choice(["guarded", "add", "clone"]), default="guarded",
              show_default=True, help="Serving capture: hidden_states + residual (guarded at stream 0), add-only, or the clone bug.")
@click.option("--components", is_flag=True, help="Serving: also record hidden_states and residual separately.")
@click.option("--no-components", "no_components", is_flag=True, help="Training: skip attn_out/mlp_out.")
@click.option("--logits", is_flag=True, help="Training: also record the logits.")
@click.option("--dtype", default="float32", show_default=True, help="Model dtype (float32, bfloat16, float16).")
@click.option("--seed", default=0, show_default=True, help="Seed of built-in model weights.")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="Dump file (.safetensors or .npz).")
@click.option("--force", is_flag=True, help="Overwrite an existing output.")
def record(model_spec: str, gguf_file: str | None, prompt: str | None, ids_file: str | None, aux_layers: str | None,
           convention: str, style: str, capture_mode: str, components: bool, no_components: bool, logits: bool,
           dtype: str, seed: int, output: str, force: bool) -> None:
    """Record a dump: training style (all streams, deltas, final norm, aux slots) or
    serving style (aux slots as a fused-residual runtime builds them)."""
    req = request(model_spec, gguf_file, prompt, ids_file, aux_layers, convention, style, capture_mode, components,
                  no_components, logits, dtype, seed, output, force)
    from consistency.record.request import run

    status = _status(f"loading {model_spec}")
    try:
        done = run(req, (lambda text: _update(status, text)) if status is not None else None)
    finally:
        if status is not None:
            status.stop()
    for note in done.notes:
        click.echo(f"note: {_term(note)}", err=True)
    from consistency.escape import term  # the path is the user's, maybe someone else's

    streams = list(done.streams) if done.streams is not None else None
    click.echo(f"wrote {term(done.path)}" + (f" (aux streams {streams})" if streams is not None else ""))
    sys.exit(0)


def request(model_spec: str, gguf_file: str | None, prompt: str | None, ids_file: str | None, aux_layers: str | None,
            convention: str, style: str, capture_mode: str, components: bool, no_components: bool, logits: bool,
            dtype: str, seed: int, output: str, force: bool) -> RecordRequest:
    """The command line as a :class:`RecordRequest` (validated there, as the API's is):
    ``--components`` is the serving style's flag, ``--no-components`` the training style's."""
    from consistency.record.request import RecordRequest

    return RecordRequest.build(model_spec, output, input_ids=ids_file, prompt=prompt, gguf_file=gguf_file,
                               style=style, aux_layers=aux_layers, convention=convention, capture=capture_mode,
                               components=(not no_components) if style == "training" else components,
                               logits=logits, dtype=dtype, seed=seed, force=force)


def _status(text: str):  # noqa: ANN202 - rich Status or None
    if not sys.stderr.isatty():
        return None
    from rich.console import Console

    st = Console(stderr=True).status(text)
    st.start()
    return st


def _update(status, text: str) -> None:  # noqa: ANN001
    if status is not None:
        status.update(text)


def _term(s: object) -> str:
    from consistency.escape import term

    return term(s, multiline=True)
