"""TransformerLens ``ActivationCache`` -> our names.

TransformerLens (``HookedTransformer`` up to 3.x, ``TransformerBridge`` from 4.0) names the
residual stream ``blocks.{k}.hook_resid_pre`` (stream k) and ``blocks.{k}.hook_resid_post``
(stream k+1), with ``resid_mid = resid_pre + attn_out`` and ``resid_post = resid_mid +
mlp_out``: the same points as ours. The final norm's output is ``ln_final.hook_out`` on
the 4.x bridge; legacy caches only have ``ln_final.hook_normalized``, which for an RMSNorm
is taken *before* the norm's weight (and ``fold_ln`` folds that weight into the
unembedding), so it equals the model's final norm only when that weight is 1 -- we map it
to ``final_norm`` only when ``hook_out`` is absent, and say so in the dump's notes.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from consistency.dump import names

_BLOCK = re.compile(r"^blocks\.(\d+)\.hook_(resid_pre|resid_mid|resid_post|attn_out|mlp_out)$")
FINAL_OUT = "ln_final.hook_out"
FINAL_NORMALIZED = "ln_final.hook_normalized"
NOTE_NORMALIZED = ("final_norm is TransformerLens' ln_final.hook_normalized: taken before the RMSNorm weight (folded "
                   "into the unembedding with fold_ln), so it equals the model's final norm only when that weight is 1")


def tl_names(keys: Iterable[str]) -> dict[str, str]:
    """TransformerLens hook name -> our name, for the keys we map (one source per name)."""
    keys = list(keys)
    out: dict[str, str] = {}
    taken: set[str] = set()
    ranked = sorted(keys, key=lambda k: (0 if k.endswith("resid_pre") else 1, k))  # resid_pre wins over resid_post
    for key in ranked:
        m = _BLOCK.match(key)
        if not m:
            continue
        k, kind = int(m.group(1)), m.group(2)
        ours = {"resid_pre": names.hidden(k), "resid_post": names.hidden(k + 1), "resid_mid": f"{names.RESID_MID}.{k}",
                "attn_out": names.attn_out(k), "mlp_out": names.mlp_out(k)}[kind]
        if ours not in taken:
            out[key] = ours
            taken.add(ours)
    if FINAL_OUT in keys:
        out[FINAL_OUT] = names.FINAL_NORM
    elif FINAL_NORMALIZED in keys:
        out[FINAL_NORMALIZED] = names.FINAL_NORM
    return out


def from_activation_cache(cache: Any, logits: Any = None) -> tuple[dict[str, Any], list[str]]:
    """(our name -> tensor, notes) from an ``ActivationCache`` (or any mapping of hook names)."""
    mapping = tl_names(cache.keys())
    named = {ours: cache[key] for key, ours in mapping.items()}
    notes = [NOTE_NORMALIZED] if FINAL_NORMALIZED in mapping else []
    if logits is not None:
        named[names.LOGITS] = logits
    return named, notes


def record_activation_cache(cache: Any, path: str | Path, *, input_ids: Any = None, logits: Any = None,
                            aux_layers: Sequence[int] | None = None, convention: str = "stream",
                            side: str = "training", force: bool = False) -> Path:
    """Write ``model.run_with_cache(ids)``'s cache as a dump (aux slots from ``aux_layers``)."""
    from consistency.interop.common import write_streams

    named, notes = from_activation_cache(cache, logits)
    return write_streams(named, path, input_ids=input_ids, aux_layers=aux_layers, convention=convention,
                         runtime="transformerlens", version=_version(), side=side, notes=notes, force=force)


def _version() -> str | None:
    try:
        from importlib.metadata import version

        return version("transformer-lens")
    except Exception:  # noqa: BLE001 - optional dependency: no version is fine
        return None
