"""A small tensor-parallel model for the torch.distributed tests (gloo on CPU, or NCCL).

The layers are the Megatron/SGLang building blocks: a vocab-parallel embedding (each rank
holds a slice of the vocabulary, looks up its own tokens, zeros the rest, all-reduce),
column-parallel linears (output sharded, ``h[tp]``) and row-parallel linears (partial sums
awaiting an all-reduce, ``tp:partial``). The full model on one process uses the same
weights, so rank files, once unsharded, must equal its dump.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

V, H, F, LAYERS, T = 64, 16, 32, 2, 24
AUX = [0, 1, 2]


def weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = {"emb": torch.randn(V, H, generator=g)}
    for k in range(LAYERS):
        w[f"w1.{k}"] = torch.randn(H, F, generator=g) / H**0.5
        w[f"w2.{k}"] = torch.randn(F, H, generator=g) / F**0.5
    return w


def input_ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (T,), generator=torch.Generator().manual_seed(seed))


def full_forward(w: dict[str, torch.Tensor], ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The single-process model: every tensor the TP ranks record, in full."""
    out = {"input_ids": ids, "hidden.0": w["emb"][ids]}
    h = out["hidden.0"]
    for k in range(LAYERS):
        a = torch.nn.functional.gelu(h @ w[f"w1.{k}"])
        p = a @ w[f"w2.{k}"]
        out[f"col_out.{k}"], out[f"row_out.{k}"] = a, p
        h = h + p
        out[f"hidden.{k + 1}"] = h
    for i, s in enumerate(AUX):
        out[f"aux.{i}"] = out[f"hidden.{s}"]
    return out


def tp_forward(w: dict[str, torch.Tensor], ids: torch.Tensor, rank: int, world: int, capture,  # noqa: ANN001
               embed_all_reduce: bool = True) -> None:
    """One rank's forward; ``capture(name, tensor, shard)`` records what a runtime patch would."""
    vs, fs = V // world, F // world
    lo, hi = rank * vs, (rank + 1) * vs
    capture("input_ids", ids, None)
    mask = (ids >= lo) & (ids < hi)
    x = w["emb"][lo:hi][(ids - lo).clamp(0, vs - 1)] * mask[:, None]
    if embed_all_reduce:
        dist.all_reduce(x)
    capture("hidden.0", x, "tp:replicated")
    h = x
    streams = [h]
    for k in range(LAYERS):
        a = torch.nn.functional.gelu(h @ w[f"w1.{k}"][:, rank * fs:(rank + 1) * fs])  # column parallel
        capture(f"col_out.{k}", a, "h[tp]")
        p = a @ w[f"w2.{k}"][rank * fs:(rank + 1) * fs]  # row parallel: a partial sum
        capture(f"row_out.{k}", p, "tp:partial")
        p = p.clone()
        dist.all_reduce(p)
        h = h + p
        capture(f"hidden.{k + 1}", h, "tp:replicated")
        streams.append(h)
    for i, s in enumerate(AUX):
        capture(f"aux.{i}", streams[s], "tp:replicated")


def worker(rank: int, world: int, out: str, port: int, backend: str, embed_all_reduce: bool) -> None:
    from consistency.contract.models import AuxInfo, DumpMetadata, ModelInfo
    from consistency.record import Recorder

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        dev = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")
        w = {k: v.to(dev) for k, v in weights().items()}
        meta = DumpMetadata(side="serving", model=ModelInfo(num_layers=LAYERS, hidden_size=H, vocab_size=V),
                            aux=AuxInfo(stream_ids=AUX))
        with Recorder(out, meta, force=True) as rec:
            tp_forward(w, input_ids().to(dev), rank, world,
                       lambda n, t, shard: rec.capture(n, t, shard=shard) if shard else rec.capture(n, t),
                       embed_all_reduce)
    finally:
        dist.destroy_process_group()


def reference_dump(path: Path) -> Path:
    from consistency.contract.models import AuxInfo, DumpMetadata, ModelInfo
    from consistency.dump.writer import write_dump
    from consistency.record.tensors import to_numpy

    full = full_forward(weights(), input_ids())
    meta = DumpMetadata(side="training", model=ModelInfo(num_layers=LAYERS, hidden_size=H, vocab_size=V),
                        aux=AuxInfo(stream_ids=AUX))
    return write_dump(path, {k: to_numpy(v) for k, v in full.items()}, meta, force=True)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(world: int, out: Path, backend: str = "gloo", embed_all_reduce: bool = True) -> list[Path]:
    import torch.multiprocessing as mp

    mp.spawn(worker, args=(world, str(out), free_port(), backend, embed_all_reduce), nprocs=world, join=True)
    stem, suffix = out.name[: -len(out.suffix)], out.suffix
    return [out.parent / f"{stem}.rank{r}-of{world}{suffix}" for r in range(world)]


def token_rows_outside_rank(rank: int, world: int) -> list[int]:
    ids = input_ids().numpy()
    vs = V // world
    return [int(i) for i in np.flatnonzero((ids < rank * vs) | (ids >= (rank + 1) * vs))]


if __name__ == "__main__":  # python tests/tp_model.py OUT_DIR [nccl|gloo] [WORLD]
    import sys

    d = Path(sys.argv[1])
    d.mkdir(parents=True, exist_ok=True)
    backend = sys.argv[2] if len(sys.argv) > 2 else "gloo"
    world = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    reference_dump(d / "ref.safetensors")
    run(world, d / "serve.safetensors", backend)
    run(world, d / "broken.safetensors", backend, embed_all_reduce=False)
    print("\n".join(str(p) for p in sorted(d.iterdir())))
