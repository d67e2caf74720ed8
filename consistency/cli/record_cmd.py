"""``consistency record``: dump a model's streams the training way or the serving way."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
import numpy as np

from consistency.errors import InputError, UsageError


def parse_ids(text: str | None) -> list[int] | None:
    """'2,30,58' or '[2, 30, 58]' -> [2, 30, 58]; 'default' or '' -> None (runtime default)."""
    if text is None or text.strip().lower() in ("", "default", "none"):
        return None
    try:
        return [int(x) for x in text.strip().strip("[]").replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise UsageError(f"cannot parse layer ids {text!r}: expected comma-separated integers") from None


def read_input_ids(path: str) -> np.ndarray:
    """Token ids from .npy/.npz/.safetensors (member input_ids)/.json/.txt; never unpickles."""
    p = Path(path)
    if not p.is_file():
        raise InputError(p, "no such file")
    if p.suffix == ".npy":
        try:
            arr = np.load(p, allow_pickle=False)
        except (ValueError, OSError) as exc:
            raise InputError(p, f"not a readable .npy of integers ({exc})") from None
    elif p.suffix in (".npz", ".safetensors"):
        from consistency.dump.reader import open_dump

        with open_dump(p) as d:
            key = "input_ids" if "input_ids" in d else ("token_ids" if "token_ids" in d else None)
            if key is None:
                raise InputError(p, "has no input_ids (or token_ids) tensor")
            arr = d[key].read_all()
    else:
        text = p.read_text(encoding="utf-8", errors="replace")
        try:
            arr = np.asarray(json.loads(text) if p.suffix == ".json" else text.split(), dtype=np.int64)
        except (ValueError, TypeError):
            raise InputError(p, "expected a list of integer token ids") from None
    if arr.dtype.kind not in "iu":
        raise InputError(p, f"token ids must be integers, got {arr.dtype}")
    arr = arr.astype(np.int64).reshape(-1)
    if arr.size == 0:
        raise InputError(p, "no token ids")
    return arr


@click.command("record")
@click.option("--model", "model_spec", required=True, help="Built-in tiny model name or a local HF model directory.")
@click.option("--gguf-file", help="GGUF file inside --model (loads a quantized checkpoint offline).")
@click.option("--prompt", help="Text to run (tokenizer of the model dir, else UTF-8 bytes).")
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
    from consistency.dump.atomic import check_writable

    check_writable(output, force)
    if (prompt is None) == (ids_file is None):
        raise UsageError("give exactly one of --prompt and --input-ids")
    if dtype not in ("float32", "bfloat16", "float16", "float64"):
        raise UsageError(f"--dtype {dtype!r}: expected float32, bfloat16, float16 or float64")
    ids = read_input_ids(ids_file) if ids_file else None
    status = _status(f"loading {model_spec}")
    try:
        from consistency.record.api import record_reference, record_serving, resolve_streams
        from consistency.record.models import load_model, tokenize

        model = load_model(model_spec, dtype=dtype, seed=seed, gguf_file=gguf_file)
        if ids is None:
            ids = tokenize(model, model_spec, prompt or "")
        native = parse_ids(aux_layers)
        streams, assumed = resolve_streams(model, native, convention) if (aux_layers or style == "serving") else (None, None)
        _update(status, f"recording {len(ids)} tokens")
        if style == "training":
            out = record_reference(model, ids, output, streams, native_ids=native, convention=convention,
                                   components=not no_components, logits=logits, force=force)
        else:
            assert streams is not None
            out = record_serving(model, ids, output, streams, capture_mode=capture_mode, native_ids=native,
                                 convention=convention, runtime=convention, components=components, force=force)
    finally:
        if status is not None:
            status.stop()
    if assumed:
        click.echo(f"note: {assumed}", err=True)
    click.echo(f"wrote {out}" + (f" (aux streams {streams})" if streams is not None else ""))
    sys.exit(0)


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
