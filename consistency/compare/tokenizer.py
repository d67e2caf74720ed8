"""Decode unaligned token spans for the report: a tokenizer from a local dir or a .gguf.

Optional (``--tokenizer``): without it spans are shown as ids. Never downloads, never runs
code from the directory, bounded in size (dump/hf_dirs.py). The decoded text comes from a
file and is untrusted: every renderer escapes it.
"""

from __future__ import annotations

from typing import Any


def load_tokenizer(spec: str) -> Any:
    """A transformers tokenizer from a local directory or a ``.gguf`` file (never downloads)."""
    from pathlib import Path

    from consistency.errors import InputError, MissingDependency

    p = Path(spec)
    try:
        from transformers import AutoTokenizer
    except ImportError:  # the core install: the hint names this distribution's extra (errors.install_line)
        raise MissingDependency("hf", "transformers", "--tokenizer") from None
    from consistency.dump.hf_dirs import SAFE_KW, check_own_classes, check_tokenizer_size, load_error

    if p.is_dir():
        check_tokenizer_size(p)
        check_own_classes(p, "tokenizer")
    try:  # never runs code from the directory, never asks on stdin (dump/hf_dirs.py)
        if p.is_file() and p.suffix == ".gguf":
            return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name, **SAFE_KW)
        if p.is_dir():
            return AutoTokenizer.from_pretrained(str(p), **SAFE_KW)
    except Exception as exc:  # noqa: BLE001 - any loader failure is one line about this file
        raise load_error(p if p.is_dir() else p.parent, exc, "tokenizer") from None
    raise InputError(p, "--tokenizer must be a local tokenizer directory or a .gguf file")


def decode(tokenizer: Any, ids: list[int], limit: int = 64) -> tuple[str, list[str]]:
    """(text, names of special tokens) of ``ids``; the text is the raw decode (untrusted)."""
    head = ids[:limit]
    try:
        special_ids = set(getattr(tokenizer, "all_special_ids", []) or [])
        special = [str(t) for t in tokenizer.convert_ids_to_tokens([i for i in head if i in special_ids])]
        text = tokenizer.decode(head, skip_special_tokens=False)
    except Exception:  # noqa: BLE001 - ids outside the vocabulary: no text, never a crash
        return "", []
    return text + ("..." if len(ids) > limit else ""), list(dict.fromkeys(special))
