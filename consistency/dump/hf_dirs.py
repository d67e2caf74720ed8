"""Local Hugging Face directories (a model, a tokenizer) read as the untrusted inputs they are.

A model or tokenizer directory can declare its own Python classes (``auto_map`` in
``config.json`` or ``tokenizer_config.json``, beside a ``.py`` file). transformers runs that
code when ``trust_remote_code`` is true, and when it is left unset it *asks on stdin* (and
runs it on ``y``), which in CI hangs a job or pollutes ``--json -``. Every load here passes
``trust_remote_code=False`` and ``local_files_only=True``: transformers then uses its own
class for a known ``model_type`` and refuses otherwise, which becomes one line naming the
directory. Tokenizer files are bounded in size before the tokenizers library parses them
(a 44 MB ``tokenizer.json`` took 1.6 GB of memory).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from consistency.contract.bounds import env_limit
from consistency.errors import InputError

# transformers' own switches: never download, never run code from the directory
SAFE_KW: dict[str, Any] = {"local_files_only": True, "trust_remote_code": False}
# Gemma 3's tokenizer.json (33 MB) is the largest we know of; CONSISTENCY_MAX_TOKENIZER_BYTES raises it
MAX_TOKENIZER_BYTES = 40 * 1024 * 1024
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt", "merges.txt",
                   "tokenizer_config.json", "added_tokens.json", "special_tokens_map.json")
CODE_CONFIGS = ("config.json", "tokenizer_config.json")


def check_tokenizer_size(d: Path) -> None:
    """Refuse a tokenizer directory whose files pass the bound (each and all together)."""
    limit = env_limit("MAX_TOKENIZER_BYTES", MAX_TOKENIZER_BYTES)
    total = 0
    for name in TOKENIZER_FILES:
        f = d / name
        try:
            if not f.is_file():
                continue
            size = f.stat().st_size
        except OSError:
            continue
        total += size
        if total > limit:
            raise InputError(d, f"tokenizer files are over {limit} bytes ({name}: {size} bytes); refused before "
                                "parsing (CONSISTENCY_MAX_TOKENIZER_BYTES raises the bound)")


def declared_code(d: Path, names: tuple[str, ...] = CODE_CONFIGS) -> str | None:
    """Where a directory declares classes of its own (``auto_map``), or None."""
    from consistency.contract.io import read_config_json

    for name in names:
        f = d / name
        if not f.is_file():
            continue
        try:
            cfg = read_config_json(f, 16 * 1024 * 1024, name)
        except InputError:
            continue  # transformers reports an unreadable config itself
        amap = cfg.get("auto_map")
        if amap:
            shown = ", ".join(sorted(amap)) if isinstance(amap, dict) else str(amap)[:80]
            return f"{name} auto_map ({shown[:120]})"
    return None


def check_own_classes(d: Path, what: str) -> None:
    """Refuse, before transformers sees it, a directory whose classes exist only in its own
    code: a ``model_type`` or ``tokenizer_class`` transformers does not know, with an
    ``auto_map`` that points at the directory's ``.py`` files. (A known type with an
    ``auto_map`` beside it loads with transformers' own class; the code is ignored.)"""
    code = declared_code(d)
    if code is None:
        return
    import transformers
    from transformers import CONFIG_MAPPING

    from consistency.contract.io import read_config_json

    unknown, where = [], []
    for name, key in (("config.json", "model_type"), ("tokenizer_config.json", "tokenizer_class")):
        f = d / name
        if not f.is_file():
            continue
        try:
            value = read_config_json(f, 16 * 1024 * 1024, name).get(key)
        except InputError:
            continue
        if not isinstance(value, str):
            continue
        known = value in CONFIG_MAPPING if key == "model_type" else hasattr(transformers, value)
        if not known:
            unknown.append(f"{key} {value!r}")
            here = declared_code(d, (name,))  # the auto_map beside the unknown class, when there is one
            if here and here not in where:
                where.append(here)
    if unknown:
        raise InputError(d, f"the {what}'s {' and '.join(unknown)} exists only in the directory's own Python code "
                            f"({'; '.join(where) or code}); consistency never runs code from a model or tokenizer "
                            "directory")


def load_error(d: Path, exc: BaseException, what: str) -> InputError:
    """One line for a failed load; a directory that needs its own code says so."""
    code = declared_code(d) if d.is_dir() else None
    text = " ".join(str(exc).split())
    if code and ("remote_code" in text or "custom code" in text or "auto_map" in text or isinstance(exc, ValueError)):
        return InputError(d, f"cannot load the {what} without running the directory's own Python code ({code}); "
                             "consistency never runs code from a model or tokenizer directory")
    first = text[:200] or type(exc).__name__
    return InputError(d, f"cannot load the {what}: {type(exc).__name__}: {first}")
