"""``consistency record``: dump a model's streams the training way or the serving way."""

from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path

import click
import numpy as np

from consistency.contract.ids import parse_ids
from consistency.errors import InputError, UsageError


MAX_IDS_BYTES = 256 * 1024 * 1024  # a token-id file past this is not a prompt
_NPY_MAGIC = b"\x93NUMPY"
_INT_DESCR = re.compile(r"^[<>|=]?[iu][1248]$")


def read_npy_ids(p: Path) -> np.ndarray:
    """A .npy of integers, parsed here (never ``np.load``): the magic, a bounded header read
    as a Python literal, an integer dtype, a C-order shape of at most 2 dims, and a body of
    exactly shape x itemsize bytes. Anything else is one line naming the file."""
    size = p.stat().st_size
    if size > MAX_IDS_BYTES:
        raise InputError(p, f"is {size} bytes: larger than a token-id file can be ({MAX_IDS_BYTES // 2**20} MiB)")
    data = p.read_bytes()
    if not data.startswith(_NPY_MAGIC) or len(data) < 10:
        raise InputError(p, "not a .npy file (no \\x93NUMPY magic)")
    major = data[6]
    if major == 1:
        hlen, start = int.from_bytes(data[8:10], "little"), 10
    elif major in (2, 3):
        hlen, start = int.from_bytes(data[8:12], "little"), 12
    else:
        raise InputError(p, f"unsupported .npy format version {major}")
    if hlen > 4096 or start + hlen > len(data):
        raise InputError(p, "truncated or oversized .npy header")
    try:
        header = ast.literal_eval(data[start:start + hlen].decode("utf-8" if major == 3 else "latin-1"))
    except (ValueError, SyntaxError, RecursionError, MemoryError, UnicodeDecodeError):
        raise InputError(p, "unreadable .npy header") from None
    if not isinstance(header, dict) or set(header) != {"descr", "fortran_order", "shape"}:
        raise InputError(p, "the .npy header must hold exactly descr, fortran_order and shape")
    descr, shape = header["descr"], header["shape"]
    if not isinstance(descr, str) or not _INT_DESCR.match(descr):
        raise InputError(p, f"token ids must be integers, got dtype {str(descr)[:40]!r}")
    if not isinstance(shape, tuple) or len(shape) > 2 or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise InputError(p, f"shape {str(shape)[:40]} is not that of token ids ([T] or [1, T])")
    if header["fortran_order"] not in (False, True) or (header["fortran_order"] and len(shape) == 2 and shape[0] > 1):
        raise InputError(p, "Fortran-ordered .npy of several rows is not a token-id file")
    dt = np.dtype(descr)
    count = int(np.prod(shape)) if shape else 1
    body = data[start + hlen:]
    if len(body) != count * dt.itemsize:
        raise InputError(p, f"holds {len(body)} data bytes, expected {count * dt.itemsize} for shape {list(shape)} "
                            "(truncated or trailing data)")
    return np.frombuffer(body, dtype=dt, count=count).reshape(shape)


def read_input_ids(path: str) -> np.ndarray:
    """Token ids from .npy/.npz/.safetensors (member input_ids)/.json/.txt, by our own strict
    readers only: no pickle, no ``np.load``; integers >= 0, one sequence."""
    p = Path(path)
    if not p.is_file():
        raise InputError(p, "no such file" if not p.exists() else "is not a regular file")
    if p.suffix == ".npy":
        arr = read_npy_ids(p)
    elif p.suffix in (".npz", ".safetensors"):
        from consistency.dump.reader import open_dump

        with open_dump(p) as d:
            key = "input_ids" if "input_ids" in d else ("token_ids" if "token_ids" in d else None)
            if key is None:
                raise InputError(p, "has no input_ids (or token_ids) tensor")
            arr = d[key].read_all()
    else:
        if p.stat().st_size > MAX_IDS_BYTES:
            raise InputError(p, "is larger than a token-id file can be")
        text = p.read_text(encoding="utf-8", errors="replace")
        try:
            vals = json.loads(text) if p.suffix == ".json" else [int(x) for x in text.split()]
        except (ValueError, RecursionError):
            raise InputError(p, "expected a list of integer token ids") from None
        if isinstance(vals, list) and len(vals) == 1 and isinstance(vals[0], list):
            vals = vals[0]  # [[...]]: one batch row
        if not isinstance(vals, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in vals):
            raise InputError(p, "expected a list of integer token ids")
        try:
            arr = np.asarray(vals, dtype=np.int64)
        except OverflowError:
            raise InputError(p, "a token id does not fit in 64 bits") from None
    if arr.dtype.kind not in "iu":
        raise InputError(p, f"token ids must be integers, got {arr.dtype}")
    if arr.ndim > 2 or (arr.ndim == 2 and arr.shape[0] != 1):
        raise InputError(p, f"shape {list(arr.shape)}: expected one sequence ([T] or [1, T])")
    arr = arr.astype(np.int64).reshape(-1)
    if arr.size == 0:
        raise InputError(p, "no token ids")
    if int(arr.min()) < 0:
        raise InputError(p, f"negative token id {int(arr.min())}")
    return arr


def tokenize_prompt(model: object, spec: str, prompt: str, gguf_file: str | None) -> tuple[np.ndarray, str | None]:
    """(ids, note). A model directory is tokenized by its own tokenizer, loaded the way its
    weights were (``gguf_file`` included); when that fails the run stops with one line:
    token ids made of UTF-8 bytes would be recorded as if they were the prompt. Only the
    built-in tiny models, which have no tokenizer, use bytes, and the note says so."""
    from consistency.record.models import builtin_names, tokenize

    if spec in builtin_names():
        note = f"{spec} is a built-in model without a tokenizer: the prompt is recorded as UTF-8 bytes"
        return tokenize(model, spec, prompt), note
    p = Path(spec)
    from consistency.dump.hf_dirs import SAFE_KW, check_own_classes, check_tokenizer_size, declared_code, load_error

    if p.is_dir() and not gguf_file:
        check_tokenizer_size(p)
        check_own_classes(p, "tokenizer")
    try:
        from transformers import AutoTokenizer

        kw = {"gguf_file": gguf_file} if gguf_file else {}
        tok = AutoTokenizer.from_pretrained(str(p), **SAFE_KW, **kw)  # never the directory's own code
        ids = np.asarray(tok(prompt)["input_ids"], dtype=np.int64).reshape(-1)
    except ImportError as exc:
        raise InputError(p, f"cannot load its tokenizer: {exc} (pip install gguf for --gguf-file), or pass "
                            "--input-ids") from None
    except Exception as exc:  # noqa: BLE001 - transformers raises OSError, ValueError, TypeError, KeyError, ...
        if p.is_dir() and declared_code(p):
            raise load_error(p, exc, "tokenizer") from None
        first = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
        raise InputError(p, f"cannot load its tokenizer{' from ' + gguf_file if gguf_file else ''} ({first}); "
                            "pass --input-ids instead") from None
    if ids.size == 0:
        raise InputError(p, "the tokenizer turned the prompt into no tokens")
    return ids, None


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
    from consistency.dump.atomic import check_outputs
    from consistency.dump.writer import check_dump_name

    check_outputs([check_dump_name(output)], (model_spec, gguf_file, ids_file), force)
    if (prompt is None) == (ids_file is None):
        raise UsageError("give exactly one of --prompt and --input-ids")
    if dtype not in ("float32", "bfloat16", "float16", "float64"):
        raise UsageError(f"--dtype {dtype!r}: expected float32, bfloat16, float16 or float64")
    from consistency.contract.resolve import check_spec

    check_spec(convention, "--convention")  # a typo is refused whether or not ids use it
    ids = read_input_ids(ids_file) if ids_file else None
    status = _status(f"loading {model_spec}")
    try:
        from consistency.record.api import out_of_vocab, record_reference, record_serving, resolve_streams
        from consistency.record.models import check_model_spec, load_model

        note = None
        local = check_model_spec(model_spec)  # a typo is named before a tokenizer is looked for
        if ids is None and local is not None:  # a tokenizer problem stops before the model loads
            ids, note = tokenize_prompt(None, model_spec, prompt or "", gguf_file)
        model = load_model(model_spec, dtype=dtype, seed=seed, gguf_file=gguf_file)
        if ids is None:
            ids, note = tokenize_prompt(model, model_spec, prompt or "", gguf_file)
        elif problem := out_of_vocab(ids, model, f"--model {model_spec}"):
            raise InputError(ids_file, problem)
        native = parse_ids(aux_layers)
        streams, assumed = resolve_streams(model, native, convention) if (aux_layers or style == "serving") else (None, None)
        if style == "serving" and capture_mode == "add" and streams is not None and 0 in streams:
            raise UsageError(f"--capture add cannot capture stream 0 (aux streams {streams}): an add-only loop "
                             "computes hidden_states + residual, and the embedding has no residual (older "
                             "SGLang's llama.py fails there too); use --capture guarded, or aux layers past 0")
        if note:
            click.echo(f"note: {_term(note)}", err=True)
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
        click.echo(f"note: {_term(assumed)}", err=True)
    from consistency.escape import term  # the path is the user's, maybe someone else's

    click.echo(f"wrote {term(out)}" + (f" (aux streams {streams})" if streams is not None else ""))
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


def _term(s: object) -> str:
    from consistency.escape import term

    return term(s, multiline=True)
