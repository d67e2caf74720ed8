"""What a recording is asked to do, validated once: ``consistency record`` and the Python API
(``consistency.record``) both build a :class:`RecordRequest` and hand it to :func:`run`, so
each refuses the same input with the same line and records the same dump from the same
inputs (they used to resolve streams and check their options each on its own).

Every field is checked in :meth:`RecordRequest.build` and nowhere else, before a model
loads: the output, the model spec, a prompt or token ids (exactly one; an empty prompt is
refused), the aux layers with their convention, the style, the capture mode, the dtype,
the seed. Messages use the command's option names, which are also the API's keyword names
(docs/api.md). What can only be checked against the loaded model (ids past its vocabulary,
aux ids past its layers, an add-only capture of stream 0) is checked by :func:`run`.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from consistency.contract.ids import parse_ids
from consistency.errors import InputError, UsageError

STYLES = ("training", "serving")
CAPTURES = ("guarded", "add", "clone")
DTYPES = ("float32", "bfloat16", "float16", "float64")


@dataclass(frozen=True)
class RecordRequest:
    model: Any  # a built-in tiny name or a local HF directory (a string), or a loaded model
    output: str | None  # the dump to write; None: a new temporary file (the API only)
    input_ids: tuple[int, ...] | None = None  # one sequence of token ids ...
    prompt: str | None = None  # ... or the text, tokenized by the model's tokenizer
    ids_file: str | None = None  # the file input_ids were read from (named in errors)
    gguf_file: str | None = None  # a GGUF checkpoint inside the model directory
    style: str = "training"  # training: every stream via HF hooks; serving: aux slots from a fused loop
    aux: bool = False  # record aux slots: ``aux_layers``, or the convention's default ids when those are None
    aux_layers: tuple[int, ...] | None = None  # as ``convention`` spells them
    convention: str = "stream"
    capture: str = "guarded"  # serving: hidden_states + residual guarded at stream 0, add-only, or the clone bug
    components: bool = True  # training: attn_out/mlp_out; serving: hidden_states and residual apart
    logits: bool = False  # training: the logits too
    dtype: str = "float32"
    seed: int = 0  # the built-in models' weights
    force: bool = False

    @property
    def spec(self) -> str | None:
        """The model as named (None for a loaded model)."""
        return self.model if isinstance(self.model, str) else None

    @classmethod
    def build(cls, model: Any, output: str | os.PathLike[str] | None = None, *, input_ids: Any = None,
              prompt: str | None = None, gguf_file: str | os.PathLike[str] | None = None, style: str = "training",
              aux_layers: str | Sequence[int] | None = None, convention: str = "stream", capture: str = "guarded",
              components: bool | None = None, logits: bool = False, dtype: str = "float32", seed: int = 0,
              force: bool = False) -> RecordRequest:
        """Validate and normalise. ``input_ids``: a sequence, array or tensor of ids, or a
        token-id file (.npy/.npz/.safetensors/.json/.txt: a path); ``aux_layers``: '2,30,58',
        a list, or 'default' (the runtime's default ids); ``components`` None: on for training,
        off for serving."""
        spec = os.fspath(model) if isinstance(model, (str, os.PathLike)) else None
        gguf = os.fspath(gguf_file) if gguf_file is not None else None
        ids_file = os.fspath(input_ids) if isinstance(input_ids, (str, os.PathLike)) else None
        if output is not None and not isinstance(output, (str, os.PathLike)):
            raise UsageError(f"output {output!r:.60}: expected a path (a .safetensors or .npz dump), got "
                             f"{type(output).__name__} (record(model, input_ids, output): swapped?)")
        out = os.fspath(output) if output is not None else None
        if out is not None:
            from consistency.dump.atomic import check_outputs
            from consistency.dump.writer import check_dump_name

            check_outputs([check_dump_name(out)], (spec, gguf, ids_file), force)
        if (prompt is None) == (input_ids is None):
            raise UsageError("give exactly one of --prompt and --input-ids")
        if prompt is not None and (not isinstance(prompt, str) or not prompt.strip()):
            # a tokenizer still returns its BOS for "", and a one-token dump compares as PASS
            raise UsageError("--prompt is empty: give the text to run (or --input-ids)")
        if style not in STYLES:
            raise UsageError(f"--style {style!r}: expected training or serving")
        if capture not in CAPTURES:
            raise UsageError(f"--capture {capture!r}: expected guarded, add or clone")
        if dtype not in DTYPES:
            raise UsageError(f"--dtype {dtype!r}: expected float32, bfloat16, float16 or float64")
        for name, switch in (("components", components), ("logits", logits), ("force", force)):
            if switch is not None and not isinstance(switch, bool):  # bool("no") is True
                raise UsageError(f"{name}: expected True or False, got {switch!r:.40}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise UsageError(f"--seed {seed!r}: expected an integer")
        if not isinstance(convention, str):
            raise UsageError(f"--convention: expected a convention name, got {type(convention).__name__}")
        from consistency.contract.resolve import check_spec

        check_spec(convention, "--convention")  # a typo is refused whether or not ids use it
        native = parse_ids(aux_layers, "--aux-layers")
        if native is not None and not native:  # the command's --aux-layers "" means the defaults; [] records no slot
            raise UsageError("--aux-layers []: no aux layer ids; give the ids, or leave the option out (serving: "
                             "the convention's default ids)")
        ids = None
        if input_ids is not None:
            ids = tuple(int(x) for x in (_read_file(ids_file) if ids_file is not None else _ids(input_ids)))
        if spec is not None:
            from consistency.record.models import check_model_spec

            if check_model_spec(spec) is None and gguf is not None:  # a typo is named before a tokenizer is looked for
                # a built-in model is built from a seed: the file would be ignored and the dump mislabelled
                raise UsageError(f"--gguf-file {gguf}: {spec} is a built-in model (built from a seed, no GGUF "
                                 "checkpoint); give --model the local directory holding the GGUF file")
        elif gguf is not None:
            raise UsageError("--gguf-file names a file inside the model directory: give the model as a path")
        return cls(spec if spec is not None else model, out, ids, prompt, ids_file, gguf, style,
                   aux_layers is not None and aux_layers != "", tuple(native) if native is not None else None,
                   convention, capture, (style == "training") if components is None else bool(components),
                   bool(logits), dtype, seed, bool(force))


@dataclass(frozen=True)
class Recorded:
    """What a recording wrote: the dump, the aux streams it holds, what it assumed."""

    path: Path
    streams: tuple[int, ...] | None
    notes: tuple[str, ...]


def run(req: RecordRequest, status: Callable[[str], None] | None = None) -> Recorded:
    """Load the model, turn the prompt into ids, resolve the aux streams and record the dump.
    ``status`` hears what is happening (a terminal spinner)."""
    from consistency.record.api import out_of_vocab, record_reference, record_serving, resolve_streams
    from consistency.record.models import load_model

    say = status or (lambda _text: None)
    notes: list[str] = []
    model, ids, spec = req.model, req.input_ids, req.spec
    if spec is not None:
        say(f"loading {spec}")
        if ids is None and _local(spec):  # a tokenizer problem stops before the model loads
            ids, note = _tokenized(None, spec, req)
            notes += [note] if note else []
        model = load_model(spec, dtype=req.dtype, seed=req.seed, gguf_file=req.gguf_file)
    if ids is None:
        ids, note = _tokenized(model, spec, req)
        notes += [note] if note else []
    elif problem := out_of_vocab(ids, model, f"--model {spec}" if spec is not None else "the model"):
        raise InputError(req.ids_file, problem) if req.ids_file is not None else UsageError(problem)
    native = list(req.aux_layers) if req.aux_layers is not None else None
    streams, assumed = resolve_streams(model, native, req.convention) if (req.aux or req.style == "serving") \
        else (None, None)
    if req.style == "serving" and req.capture == "add" and streams is not None and 0 in streams:
        raise UsageError(f"--capture add cannot capture stream 0 (aux streams {streams}): an add-only loop "
                         "computes hidden_states + residual, and the embedding has no residual (older "
                         "SGLang's llama.py fails there too); use --capture guarded, or aux layers past 0")
    output = req.output or str(Path(tempfile.mkdtemp(prefix="consistency-")) / f"{req.style}.safetensors")
    say(f"recording {len(ids)} tokens")
    if req.style == "training":
        out = record_reference(model, ids, output, streams, native_ids=native, convention=req.convention,
                               components=req.components, logits=req.logits, force=req.force)
    else:
        assert streams is not None
        out = record_serving(model, ids, output, streams, capture_mode=req.capture, native_ids=native,
                             convention=req.convention, runtime=req.convention, components=req.components,
                             force=req.force)
    notes += [assumed] if assumed else []
    return Recorded(Path(out), tuple(streams) if streams is not None else None, tuple(notes))


def _tokenized(model: Any, spec: str | None, req: RecordRequest) -> tuple[Any, str | None]:
    """The prompt's ids: by the model directory's own tokenizer, or UTF-8 bytes for a
    built-in model (record.inputs.tokenize_prompt). A loaded model is tokenized by the
    directory or built-in name it was loaded from; failing both, by bytes, and said."""
    from consistency.record.inputs import tokenize_prompt
    from consistency.record.models import builtin_names, tokenize

    assert req.prompt is not None
    if spec is None:
        name = str(getattr(getattr(model, "config", None), "_name_or_path", "") or "")
        if not name or (name not in builtin_names() and not Path(name).is_dir()):
            return tokenize(model, "<model>", req.prompt), ("the loaded model names no tokenizer: the prompt is "
                                                            "recorded as UTF-8 bytes (give input_ids to choose them)")
        spec = name
    return tokenize_prompt(model, spec, req.prompt, req.gguf_file)


def _local(spec: str) -> bool:
    from consistency.record.models import builtin_names

    return spec not in builtin_names()


def _read_file(path: str) -> Any:
    from consistency.record.inputs import read_input_ids

    return read_input_ids(path)


def _ids(value: Any) -> Any:
    """Token ids from a sequence, array or tensor: integers >= 0, one sequence ([T] or [1, T])."""
    import numpy as np

    if hasattr(value, "detach"):  # a torch tensor, on any device
        value = value.detach().cpu().numpy()
    try:
        arr = np.asarray(value)
    except (TypeError, ValueError, OverflowError):
        raise UsageError(f"--input-ids: expected a sequence of integer token ids, got {type(value).__name__}") from None
    if arr.ndim == 0 or arr.ndim > 2 or (arr.ndim == 2 and arr.shape[0] != 1):
        raise UsageError(f"--input-ids: shape {list(arr.shape)}: expected one sequence ([T] or [1, T])")
    flat = arr.reshape(-1)
    if flat.size == 0:
        raise UsageError("--input-ids: no token ids")
    if flat.dtype.kind not in "iu":
        raise UsageError(f"--input-ids: token ids must be integers, got {flat.dtype}")
    if int(flat.min()) < 0:
        raise UsageError(f"--input-ids: negative token id {int(flat.min())}")
    if flat.dtype.kind == "u" and int(flat.max()) > np.iinfo(np.int64).max:  # named before any cast rounds it
        at = int(flat.argmax())
        raise UsageError(f"--input-ids: token id {int(flat[at])} at position {at} does not fit in 64 bits")
    return flat
