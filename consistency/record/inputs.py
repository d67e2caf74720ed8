"""What a recording runs on: token ids from a file, or a prompt tokenized by the model's own
tokenizer. Shared by every door into record (``consistency record``, ``consistency.record``)
through :mod:`consistency.record.request`, so a file and a prompt are read one way.

Token-id files come from users and other tools: each is parsed by our own strict readers
(no pickle, no ``np.load``), and anything else is one line naming the file.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import numpy as np

from consistency.errors import InputError

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
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) > np.iinfo(np.int64).max:  # not a negative id
        at = int(arr.reshape(-1).argmax())
        raise InputError(p, f"token id {int(arr.reshape(-1)[at])} at position {at} does not fit in 64 bits")
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
