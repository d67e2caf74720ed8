"""nnsight trace cache -> our names.

``with model.trace(ids) as tracer: cache = tracer.cache(include_inputs=True)`` gives one
entry per module path (``model.model.layers.3``) with its ``.output`` (and ``.inputs``).
The decoder layers are the longest run of numbered siblings; layer k's output is stream
k+1, layer 0's input stream 0, its attention/MLP outputs the two deltas, the final norm's
output ``final_norm`` and ``lm_head``'s ``logits``.

On a fused-residual runtime (nnsight on vLLM, nnsight issue #630) a layer returns
``(hidden_states, residual)``: the stream is their sum, and we add them; the first part
alone is the MLP's delta (what a ``.clone()`` bug would feed a draft). A plain mapping of
``path -> output`` (what ``.save()`` calls collect) works as well.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from consistency.dump import names

_NUMBERED = re.compile(r"^(?P<prefix>.+)\.(?P<idx>\d+)$")
_ATTN = ("self_attn", "attn", "self_attention", "attention")
_MLP = ("mlp", "feed_forward", "block_sparse_moe", "ffn")
_NORM = ("norm", "ln_f", "final_layernorm", "norm_f", "final_norm")
_EMBED = ("embed_tokens", "wte", "embeddings", "embed_in", "word_embeddings")


def _output(entry: Any) -> Any:
    return entry.output if hasattr(entry, "output") else entry


def _input(entry: Any) -> Any:
    """The hidden-states input of a layer entry, or None when inputs were not cached."""
    try:
        args, kwargs = entry.inputs
    except Exception:  # noqa: BLE001 - no inputs cached (include_inputs=False) or a plain tensor
        return None
    if "hidden_states" in kwargs:
        return kwargs["hidden_states"]
    floats = [a for a in args if _is_float_tensor(a)]
    return floats[0] if floats else None


def _is_float_tensor(x: Any) -> bool:
    return getattr(getattr(x, "dtype", None), "is_floating_point", False) and getattr(x, "dim", lambda: 0)() >= 2


def layer_paths(keys: Sequence[str]) -> tuple[str, int]:
    """(prefix, N) of the decoder layer list: the longest run ``prefix.0 .. prefix.{N-1}``."""
    runs: dict[str, set[int]] = defaultdict(set)
    for k in keys:
        m = _NUMBERED.match(k)
        if m:
            runs[m.group("prefix")].add(int(m.group("idx")))
    best = ("", 0)
    for prefix, idx in runs.items():
        n = 0
        while n in idx:
            n += 1
        if n > best[1]:
            best = (prefix, n)
    if best[1] == 0:
        raise ValueError("no numbered decoder layers (e.g. model.model.layers.0) in the cache")
    return best


def _stream(out: Any, notes: list[str], k: int) -> tuple[Any, Any]:
    """(stream, delta or None) of a layer output: fused pairs are summed."""
    if isinstance(out, (tuple, list)):
        tensors = [t for t in out if _is_float_tensor(t)]
        if len(tensors) >= 2 and tensors[0].shape == tensors[1].shape:
            if k == 0:
                notes.append("layers return (hidden_states, residual) (a fused-residual runtime): streams are their sum")
            return tensors[0] + tensors[1], tensors[0]
        return out[0], None
    return out, None


def from_nnsight_cache(cache: Any) -> tuple[dict[str, Any], list[str]]:
    """(our name -> tensor, notes) from ``tracer.cache()`` or a ``{path: output}`` mapping."""
    keys = list(cache.keys())
    prefix, n = layer_paths(keys)
    parent = prefix.rsplit(".", 1)[0] if "." in prefix else ""
    notes: list[str] = []
    named: dict[str, Any] = {}
    for k in range(n):
        entry = cache[f"{prefix}.{k}"]
        stream, delta = _stream(_output(entry), notes, k)
        named[names.hidden(k + 1)] = stream
        if delta is not None and f"{prefix}.{k}.mlp" not in keys:
            named[names.mlp_out(k)] = delta
        if k == 0:
            h0 = _input(entry)
            if h0 is not None:
                named[names.hidden(0)] = h0
        for kinds, ours in ((_ATTN, names.attn_out(k)), (_MLP, names.mlp_out(k))):
            path = next((f"{prefix}.{k}.{a}" for a in kinds if f"{prefix}.{k}.{a}" in keys), None)
            if path is not None:
                out = _output(cache[path])
                named[ours] = out[0] if isinstance(out, (tuple, list)) else out
    if names.hidden(0) not in named:
        emb = next((f"{parent}.{e}" for e in _EMBED if f"{parent}.{e}" in keys), None)
        if emb is not None:
            named[names.hidden(0)] = _output(cache[emb])
            notes.append(f"hidden.0 is {emb}'s output (layer 0's input was not cached; pass include_inputs=True): "
                         "models that scale the embedding outside that module differ")
    norm = next((f"{parent}.{a}" for a in _NORM if f"{parent}.{a}" in keys), None)
    if norm is not None:
        out = _output(cache[norm])
        named[names.FINAL_NORM] = out[0] if isinstance(out, (tuple, list)) else out
    head = next((k for k in keys if k.rsplit(".", 1)[-1] == "lm_head"), None)
    if head is not None:
        named[names.LOGITS] = _output(cache[head])
    return named, notes


def record_nnsight_cache(cache: Any, path: str | Path, *, input_ids: Any = None,
                         aux_layers: Sequence[int] | None = None, convention: str = "stream",
                         side: str = "training", force: bool = False) -> Path:
    """Write an nnsight trace cache as a dump (aux slots from ``aux_layers``)."""
    from consistency.interop.common import write_streams

    named, notes = from_nnsight_cache(cache)
    return write_streams(named, path, input_ids=input_ids, aux_layers=aux_layers, convention=convention,
                         runtime="nnsight", version=_version(), side=side, notes=notes, force=force)


def _version() -> str | None:
    try:
        from importlib.metadata import version

        return version("nnsight")
    except Exception:  # noqa: BLE001 - optional dependency
        return None

