"""Targets to record from: built-in tiny configs (seeded, no download) or a local HF dir.

The built-in configs live in ``consistency/record/configs/*.json`` so the demo and the
tests run anywhere in seconds; local directories are loaded offline only.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from consistency.errors import InputError, UsageError

DEFAULT_SEED = 0


def builtin_names() -> list[str]:
    return sorted(p.name[:-5] for p in resources.files("consistency.record").joinpath("configs").iterdir()
                  if p.name.endswith(".json"))


def builtin_config(name: str) -> dict[str, Any]:
    f = resources.files("consistency.record").joinpath("configs", f"{name}.json")
    if not f.is_file():
        raise UsageError(f"unknown built-in model {name!r}; built-in: {', '.join(builtin_names())}")
    return json.loads(f.read_text())


def build_builtin(name: str, seed: int = DEFAULT_SEED, dtype: str = "float32") -> Any:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg_d = dict(builtin_config(name))
    model_type = cfg_d.pop("model_type")
    cfg = AutoConfig.for_model(model_type, **cfg_d)
    cfg._name_or_path = name
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    return model.to(getattr(torch, dtype)).eval()


def check_model_spec(spec: str) -> Path | None:
    """None for a built-in name, the directory for a local model; anything else (a typo, a
    Hub id: we never download) is one line that lists the built-in names, before any
    tokenizer or model is touched."""
    names = builtin_names()
    if spec in names:
        return None
    p = Path(spec)
    if not p.is_dir():
        import difflib

        close = difflib.get_close_matches(spec, names, n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        what = "is not a directory" if p.exists() else "no such directory"
        raise InputError(p, f"not a built-in model ({', '.join(names)}) nor a local model directory ({what}; "
                            f"models are never downloaded){hint}")
    return p


def load_model(spec: str, dtype: str = "float32", seed: int = DEFAULT_SEED, gguf_file: str | None = None) -> Any:
    """A built-in tiny name, or a local Hugging Face directory (never downloads)."""
    p = check_model_spec(spec)
    if p is None:
        return build_builtin(spec, seed, dtype)
    import sys

    import torch
    from transformers import AutoModelForCausalLM

    if not sys.stderr.isatty():  # no progress bars in CI logs: stderr stays one line per problem
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    from consistency.dump.hf_dirs import SAFE_KW, check_own_classes, load_error

    check_own_classes(p, "model")
    kw: dict[str, Any] = {**SAFE_KW, "dtype": getattr(torch, dtype)}  # never the directory's own code
    if gguf_file:
        kw["gguf_file"] = gguf_file
    try:
        with _quiet_gguf(bool(gguf_file) and not sys.stderr.isatty()):
            return AutoModelForCausalLM.from_pretrained(str(p), **kw).eval()
    except (OSError, ValueError, KeyError, TypeError, ImportError) as exc:
        raise load_error(p, exc, "model") from None


@contextmanager
def _quiet_gguf(quiet: bool) -> Iterator[None]:
    """transformers' GGUF loader draws its own tqdm bar (not the one ``disable_progress_bar``
    turns off): on a pipe it is hundreds of carriage-return frames in a CI log. Off for
    this load only; the module attribute is put back."""
    mod = None
    if quiet:
        try:
            from transformers import modeling_gguf_pytorch_utils as mod  # type: ignore[no-redef]
        except ImportError:  # gguf support absent: from_pretrained says so
            mod = None
    if mod is None or not hasattr(mod, "tqdm"):
        yield
        return
    orig = mod.tqdm
    mod.tqdm = functools.partial(orig, disable=True)
    try:
        yield
    finally:
        mod.tqdm = orig


def tokenize(model: Any, spec: str, prompt: str) -> np.ndarray:
    """Token ids for ``prompt``: the model dir's tokenizer when there is one, else UTF-8
    bytes folded into the vocabulary (built-in tiny models have no tokenizer)."""
    p = Path(spec)
    if p.is_dir():
        from consistency.dump.hf_dirs import SAFE_KW, check_own_classes, check_tokenizer_size, declared_code, load_error

        check_tokenizer_size(p)
        check_own_classes(p, "tokenizer")
        try:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(str(p), **SAFE_KW)
            return np.asarray(tok(prompt)["input_ids"], dtype=np.int64)
        except (OSError, ValueError, TypeError) as exc:
            if declared_code(p):  # refused, never silently replaced by bytes
                raise load_error(p, exc, "tokenizer") from None
    vocab = int(getattr(model.config, "vocab_size", 256))
    data = prompt.encode("utf-8") or b" "
    return np.frombuffer(data, dtype=np.uint8).astype(np.int64) % vocab


DEMO_PROMPT = ("Speculative decoding drafts several tokens with a small model and verifies them with the "
               "target in one pass; the draft must see exactly the hidden states it was trained on.")
