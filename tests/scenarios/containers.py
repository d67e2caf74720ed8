"""Write one side of a scenario the way real producers write it.

Rounding to a dtype goes through torch (not the project's bit tricks), so a container is an
independent producer: ``safetensors`` and ``npz`` are our format with metadata (bf16 in an
npz is its uint16 bit pattern, as docs/format.md documents); ``upcast`` is a user's
``np.savez(name=t.float().numpy())`` -- low-precision values stored as float32 with no
metadata; ``speculators`` is vLLM's hidden-state connector file (``hidden_states`` [T, n, H],
``token_ids``; float8 with per-token ``hidden_states_scales`` as hs_connectors writes it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

CONTAINERS = ("safetensors", "npz", "upcast")
REF_CONTAINERS = (*CONTAINERS, "speculators")
DTYPES = ("float32", "bfloat16", "float16")
FP8 = "float8_e4m3fn"
FP8_MAX = 448.0


def _torch_dtype(name: str):  # noqa: ANN202
    import torch

    return getattr(torch, name)


def round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    """The float32 values a tensor of ``dtype`` holds after rounding ``x`` (NaN kept)."""
    if dtype == "float32":
        return np.asarray(x, np.float32)
    import torch

    return torch.from_numpy(np.ascontiguousarray(x, np.float32)).to(_torch_dtype(dtype)).float().numpy()


def fp8_per_token(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(float8 tensor as torch, per-token scales [T, 1, 1]) for x of shape [T, n, H]."""
    import torch

    t = torch.from_numpy(np.ascontiguousarray(x, np.float32))
    amax = t.abs().flatten(1).amax(1).clamp_min(1e-12)
    scale = (amax / FP8_MAX).reshape(-1, 1, 1)
    return (t / scale).to(torch.float8_e4m3fn), scale.float()


def fp8_roundtrip(x: np.ndarray) -> np.ndarray:
    q, s = fp8_per_token(x)
    return (q.float() * s).numpy()


@dataclass
class SideMeta:
    """What a producer says about its side (written only where the container has metadata)."""

    side: str  # "training" | "serving"
    claims: list[int] | None = None  # aux.stream_ids
    num_layers: int | None = None
    hidden_size: int | None = None


def _storage(x: np.ndarray, dtype: str):  # noqa: ANN202
    """What our writer takes for ``dtype``: a numpy array or (bits, dtype name)."""
    import torch

    if x.dtype.kind in "iub":
        return x
    if dtype == "float32":
        return np.asarray(x, np.float32)
    if dtype == "float16":
        return np.asarray(x, np.float32).astype(np.float16)
    if dtype == "bfloat16":
        bits = torch.from_numpy(np.ascontiguousarray(x, np.float32)).to(torch.bfloat16).view(torch.int16)
        return (bits.numpy().view(np.uint16), "bfloat16")
    raise ValueError(dtype)


# A safetensors file starts with its header length (u64 little-endian): a valid file's first
# bytes can equal another format's magic. 0x80 is pickle's (1 file in 256); 0x8b1f gzip's.
HEADER_MAGIC = {"pickle": (0x80, 0xFF), "gzip": (0x8B1F, 0xFFFF)}


def header_length(path: Path) -> int:
    with open(path, "rb") as fh:
        return int.from_bytes(fh.read(8), "little")


def write_side(path: Path, tensors: dict[str, np.ndarray], dtype: str, container: str, meta: SideMeta,
               magic: str = "", fortran: bool = False) -> Path:
    """Write ``tensors`` (float32 logical values; integer arrays kept) as ``container``."""
    if container == "upcast":
        path = path.with_suffix(".npz")
        arrays = {k: (v if v.dtype.kind in "iub" else round_to(v, dtype)) for k, v in tensors.items()}
        if fortran:  # what np.savez writes for a transposed view: fortran_order True in the .npy header
            arrays = {k: np.asfortranarray(v) for k, v in arrays.items()}
        np.savez(path, **arrays)
        return path
    from consistency.contract.models import AuxInfo, DumpMetadata, ModelInfo
    from consistency.dump.writer import write_dump

    path = path.with_suffix(".npz" if container == "npz" else ".safetensors")
    md = DumpMetadata(side=meta.side, aux=AuxInfo(stream_ids=meta.claims) if meta.claims is not None else None,
                      model=ModelInfo(num_layers=meta.num_layers, hidden_size=meta.hidden_size)
                      if meta.num_layers else None)
    arrays = {k: _storage(v, dtype) for k, v in tensors.items()}
    write_dump(path, arrays, md, force=True)
    if magic and container == "safetensors":  # pad the header (an extra string entry) to hit the magic
        want, mask = HEADER_MAGIC[magic]
        write_dump(path, arrays, md, force=True, extra_header={"pad": ""})
        k = (want - header_length(path)) & mask
        for n in range(k, k + 16):  # a writer may pad the header to an alignment
            write_dump(path, arrays, md, force=True, extra_header={"pad": "x" * n})
            if header_length(path) & mask == want:
                break
        else:
            raise ValueError(f"cannot make a header length that starts with the {magic} magic")
    return path


def write_speculators(path: Path, slots: list[np.ndarray], ids: np.ndarray, dtype: str) -> Path:
    """vLLM's ExampleHiddenStatesConnector file (FP8HiddenStatesConnector for float8)."""
    import torch
    from safetensors.torch import save_file

    path = path.with_suffix(".safetensors")
    stacked = np.stack(slots, axis=1).astype(np.float32)  # [T, n, H]
    out = {"token_ids": torch.from_numpy(np.asarray(ids, np.int64))}
    if dtype == FP8:
        q, s = fp8_per_token(stacked)
        out["hidden_states"], out["hidden_states_scales"] = q.contiguous(), s.contiguous()
    else:
        out["hidden_states"] = torch.from_numpy(stacked).to(_torch_dtype(dtype)).contiguous()
    save_file(out, str(path))
    return path
