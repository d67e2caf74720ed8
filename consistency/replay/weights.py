"""Read a draft's tensors and give them one set of names, whichever tool wrote them.

Canonical names are speculators' (``fc.weight``, ``layers.{k}.*``, ``norm.weight``,
``lm_head.weight``, ``embed_tokens.weight``, ``d2t``, ``t2d``, ``input_norm.weight``,
``fc_norm.{i}.weight``). The renames are the ones the runtimes apply when they load a draft,
so a checkpoint replays exactly as it would be served; they are data, each with its source.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from consistency.errors import InputError

# (pattern, replacement, where the runtime does the same)
RENAMES: tuple[tuple[str, str, str], ...] = (
    (r"^eagle_module\.", "", "ModelOpt hf_spec_export.py strips the eagle_module. prefix"),
    (r"^model\.", "", "SGLang llama_eagle3.py load_weights matches name or model.{name}"),
    (r"^midlayer\.(\d+)\.", r"layers.\1.", "multi-layer drafts exported as a midlayer list"),
    (r"^midlayer\.(?!\d)", "layers.0.", "speculators eagle3_converter.py, SGLang and vLLM llama_eagle3.py"),
    (r"^aux_norm_low\.", "fc_norm.0.", "SGLang llama_eagle3.py legacy map"),
    (r"^aux_norm_mid\.", "fc_norm.1.", "SGLang llama_eagle3.py legacy map"),
    (r"^aux_norm_high\.", "fc_norm.2.", "SGLang llama_eagle3.py legacy map"),
    (r"^draft_id_to_target_id$", "d2t", "vLLM llama_eagle3.py renames d2t"),
)
# tensors a runtime never uses in the draft forward
IGNORED = re.compile(r"^(verifier_lm_head\.weight|verifier_norm\.weight|.*rotary_emb\.inv_freq|.*\.original_inv_freq)$")
KNOWN = re.compile(r"^(fc\.(weight|bias)|norm\.weight|lm_head\.weight|embed_tokens\.weight|d2t|t2d|input_norm\.weight"
                   r"|fc_norm\.\d+\.weight|layers\.\d+\.(hidden_norm|input_layernorm|post_attention_layernorm)\.weight"
                   r"|layers\.\d+\.self_attn\.(q|k|v|o)_proj\.(weight|bias)|layers\.\d+\.self_attn\.(q|k)_norm\.weight"
                   r"|layers\.\d+\.mlp\.(gate|up|down)_proj\.weight)$")


def weight_name(name: str) -> str:
    """A draft checkpoint's weight name in the one spelling replay reads (RENAMES)."""
    for pat, rep, _src in RENAMES:
        name = re.sub(pat, rep, name)
    return name


def weight_files(d: Path) -> list[Path]:
    st = sorted(p for p in d.glob("*.safetensors") if p.is_file())
    if st:
        return st
    pt = sorted(p for p in d.iterdir() if p.is_file() and p.suffix in (".bin", ".pt", ".pth"))
    if pt:
        return pt
    raise InputError(d, "no draft weights (*.safetensors, or *.bin/*.pt) in the directory")


def read_tensors(files: list[Path]) -> dict[str, Any]:
    """All tensors of the files (torch, CPU); pickle files only through weights_only."""
    import torch

    out: dict[str, Any] = {}
    for f in files:
        if f.suffix == ".safetensors":
            from safetensors import SafetensorError
            from safetensors.torch import load_file

            try:
                part = load_file(str(f), device="cpu")
            except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
                raise InputError(f, f"cannot read safetensors ({' '.join(str(exc).split())})") from None
        else:
            try:
                part = torch.load(str(f), map_location="cpu", weights_only=True)
            except Exception as exc:  # noqa: BLE001 - unpickling errors come in many types
                raise InputError(f, f"cannot read with torch.load(weights_only=True) ({type(exc).__name__})") from None
            if isinstance(part, dict) and "state_dict" in part and isinstance(part["state_dict"], dict):
                part = part["state_dict"]
            if not isinstance(part, dict) or not all(isinstance(v, torch.Tensor) for v in part.values()):
                raise InputError(f, "is not a flat state dict of tensors")
        for k, v in part.items():
            if k in out:
                raise InputError(f, f"tensor {k!r} appears in two weight files")
            out[k] = v
    return out


def normalize(path: Path, raw: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """(canonical name -> tensor, names that were ignored or unknown)."""
    out: dict[str, Any] = {}
    dropped: list[str] = []
    for name, t in raw.items():
        c = weight_name(name)
        if IGNORED.match(c):
            continue
        if not KNOWN.match(c):
            dropped.append(name)
            continue
        if c in out:
            raise InputError(path, f"tensors {name!r} and another both map to {c!r}")
        out[c] = t
    return out, dropped


def num_layers(w: Mapping[str, Any]) -> int:
    ks = {int(m.group(1)) for n in w if (m := re.match(r"^layers\.(\d+)\.", n))}
    return max(ks) + 1 if ks else 0
