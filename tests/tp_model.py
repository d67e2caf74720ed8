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


def weights(seed: int = 0, layers: int = LAYERS, experts: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = {"emb": torch.randn(V, H, generator=g)}
    for k in range(layers):
        w[f"w1.{k}"] = torch.randn(H, F, generator=g) / H**0.5
        w[f"w2.{k}"] = torch.randn(F, H, generator=g) / F**0.5
        if experts:  # a mixture of experts: router and one small MLP per expert
            w[f"router.{k}"] = torch.randn(H, experts, generator=g)
            w[f"e1.{k}"] = torch.randn(experts, H, F, generator=g) / H**0.5
            w[f"e2.{k}"] = torch.randn(experts, F, H, generator=g) / F**0.5
    return w


def num_layers(w: dict[str, torch.Tensor]) -> int:
    return sum(1 for k in w if k.startswith("w1."))


def input_ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (T,), generator=torch.Generator().manual_seed(seed))


def full_forward(w: dict[str, torch.Tensor], ids: torch.Tensor, aux: list[int] = AUX) -> dict[str, torch.Tensor]:
    """The single-process model: every tensor the TP ranks record, in full."""
    out = {"input_ids": ids, "hidden.0": w["emb"][ids]}
    h = out["hidden.0"]
    for k in range(num_layers(w)):
        if f"router.{k}" in w:
            p = moe(w, k, h, range(w[f"e1.{k}"].shape[0]))
            out[f"mlp_out.{k}"] = p
        else:
            a = torch.nn.functional.gelu(h @ w[f"w1.{k}"])
            p = a @ w[f"w2.{k}"]
            out[f"col_out.{k}"], out[f"row_out.{k}"] = a, p
        h = h + p
        out[f"hidden.{k + 1}"] = h
    for i, s in enumerate(aux):
        out[f"aux.{i}"] = out[f"hidden.{s}"]
    return out


def moe(w: dict[str, torch.Tensor], k: int, h: torch.Tensor, experts: range) -> torch.Tensor:
    """Top-1 MoE restricted to ``experts``: tokens routed elsewhere get zero (EP's partial)."""
    logits = h @ w[f"router.{k}"]
    gate, choice = torch.softmax(logits, -1).max(-1)
    out = torch.zeros_like(h)
    for e in experts:
        sel = choice == e
        y = torch.nn.functional.gelu(h[sel] @ w[f"e1.{k}"][e]) @ w[f"e2.{k}"][e]
        out[sel] = y * gate[sel, None]
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


def pp_forward(w: dict[str, torch.Tensor], ids: torch.Tensor, stage: int, stages: int, tp_rank: int, tp: int,
               group, capture, aux: list[int], local_index: bool = False) -> None:  # noqa: ANN001
    """One pipeline stage (layers split evenly), tensor parallel inside the stage.

    It records its input stream, its layers' outputs and the aux slots of the streams its
    layers consume (the last stage also stream N), under global ids -- or, with
    ``local_index``, under indices counted from the stage's first layer (vLLM PR #36731)."""
    n = num_layers(w)
    lo, hi = stage * n // stages, (stage + 1) * n // stages
    rank = dist.get_rank()
    sid = (lambda s: s - lo) if local_index else (lambda s: s)  # noqa: E731
    capture("input_ids", ids, "tp:replicated")
    if stage == 0:
        h = w["emb"][ids]
    else:
        h = torch.empty(len(ids), H, device=ids.device)
        dist.recv(h, src=rank - tp)
    capture(f"hidden.{sid(lo)}", h, "tp:replicated")
    streams = {lo: h}
    fs = F // tp
    for k in range(lo, hi):
        a = torch.nn.functional.gelu(h @ w[f"w1.{k}"][:, tp_rank * fs:(tp_rank + 1) * fs])
        capture(f"col_out.{sid(k)}", a, "h[tp]")
        p = a @ w[f"w2.{k}"][tp_rank * fs:(tp_rank + 1) * fs]
        capture(f"row_out.{sid(k)}", p, "tp:partial")
        p = p.clone()
        if tp > 1:
            dist.all_reduce(p, group=group)
        h = h + p
        capture(f"hidden.{sid(k + 1)}", h, "tp:replicated")
        streams[k + 1] = h
    mine = [i for i, s in enumerate(aux) if lo <= s < hi or (s == n and stage == stages - 1)]
    for j, i in enumerate(mine):
        capture(f"aux.{j if local_index else i}", streams[aux[i]], "tp:replicated")
    if stage < stages - 1:
        dist.send(h.contiguous(), dst=rank + tp)


def dp_forward(w: dict[str, torch.Tensor], ids: torch.Tensor, rows: list[int], capture) -> None:  # noqa: ANN001
    """DP attention: this rank holds ``rows`` of the batch (possibly none); the MLP runs
    tensor parallel over every rank's tokens (gathered, then scattered back), SGLang style."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = ids[torch.as_tensor(rows, dtype=torch.long, device=ids.device)]
    capture("input_ids", mine, "t[dp]")
    h = w["emb"][mine]
    capture("hidden.0", h, "t[dp]")
    streams = [h]
    counts = torch.zeros(world, dtype=torch.long, device=ids.device)
    counts[rank] = len(rows)
    dist.all_reduce(counts)
    m, fs = int(counts.max()), F // world
    for k in range(num_layers(w)):
        pad = torch.zeros(m, H, device=ids.device)
        pad[:len(rows)] = h
        got = [torch.empty_like(pad) for _ in range(world)]
        dist.all_gather(got, pad)
        x = torch.cat([g[:int(c)] for g, c in zip(got, counts)])
        a = torch.nn.functional.gelu(x @ w[f"w1.{k}"][:, rank * fs:(rank + 1) * fs])
        p = a @ w[f"w2.{k}"][rank * fs:(rank + 1) * fs]
        dist.all_reduce(p)
        start = int(counts[:rank].sum())
        h = h + p[start:start + len(rows)]
        capture(f"hidden.{k + 1}", h, "t[dp]")
        streams.append(h)
    for i, s in enumerate(AUX):
        capture(f"aux.{i}", streams[s], "t[dp]")


def ep_forward(w: dict[str, torch.Tensor], ids: torch.Tensor, capture, all_reduce: bool = True) -> None:  # noqa: ANN001
    """Expert parallel: each rank holds experts [r*E/w, (r+1)*E/w), computes their share for
    every token, and the shares are all-reduced -- the captured streams do not change."""
    rank, world = dist.get_rank(), dist.get_world_size()
    h = w["emb"][ids]
    capture("input_ids", ids, "ep:replicated")
    capture("hidden.0", h, "ep:replicated")
    streams = [h]
    for k in range(num_layers(w)):
        e = w[f"e1.{k}"].shape[0]
        p = moe(w, k, h, range(rank * e // world, (rank + 1) * e // world))
        if all_reduce:
            dist.all_reduce(p)
        capture(f"mlp_out.{k}", p, "ep:replicated")
        h = h + p
        capture(f"hidden.{k + 1}", h, "ep:replicated")
        streams.append(h)
    for i, s in enumerate(AUX):
        capture(f"aux.{i}", streams[s], "ep:replicated")


def worker(rank: int, world: int, port: int, backend: str, jobs: list[tuple[str, dict]]) -> None:
    """One process: join the group once, then record every job (one torch import for all)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        for out, job in jobs:
            _job(rank, world, out, backend, job)
            dist.barrier()
    finally:
        dist.destroy_process_group()


def _job(rank: int, world: int, out: str, backend: str, job: dict) -> None:
    from consistency.contract.models import AuxInfo, DumpMetadata, ModelInfo
    from consistency.record import Recorder, parallel

    dev = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")
    kind = job.get("kind", "tp")
    w = {k: v.to(dev) for k, v in weights(layers=job.get("layers", LAYERS), experts=job.get("experts", 0)).items()}
    aux = job.get("aux", AUX)
    meta = DumpMetadata(side="serving", model=ModelInfo(num_layers=num_layers(w), hidden_size=H, vocab_size=V),
                        aux=AuxInfo(stream_ids=aux))
    ids = input_ids().to(dev)
    with Recorder(out, meta, force=True) as rec:
        def cap(n, t, shard):  # noqa: ANN001, ANN202
            rec.capture(n, t, shard=shard) if shard else rec.capture(n, t)
        if kind == "tp":
            tp_forward(w, ids, rank, world, cap, job.get("embed_all_reduce", True))
        elif kind == "pp":
            tp, stages = job["tp"], world // job["tp"]
            stage, tp_rank = rank // tp, rank % tp
            groups = [dist.new_group(list(range(s * tp, (s + 1) * tp))) for s in range(stages)]
            n = num_layers(w)
            parallel.declare(pp=(stage, stages), layers=(stage * n // stages, (stage + 1) * n // stages),
                             tp=(tp_rank, tp), recorder=rec)
            pp_forward(w, ids, stage, stages, tp_rank, tp, groups[stage], cap, aux, job.get("local_index", False))
            if stage in job.get("silent", ()):
                rec.discard()  # a stage whose capture points never ran
        elif kind == "dp":
            rows = job["rows"][rank]
            key = job.get("requests")
            if key:  # ownership by request id and position within the request
                parallel.declare(dp=(rank, world), requests=[key[r][0] for r in rows],
                                 positions=[key[r][1] for r in rows], recorder=rec)
            else:
                parallel.declare(dp=(rank, world), rows=rows, recorder=rec)
            dp_forward(w, ids, rows, cap)
        elif kind == "ep":
            ep_forward(w, ids, cap, job.get("all_reduce", True))


def reference_dump(path: Path, layers: int = LAYERS, aux: list[int] = AUX, experts: int = 0) -> Path:
    from consistency.contract.models import AuxInfo, DumpMetadata, ModelInfo
    from consistency.dump.writer import write_dump
    from consistency.record.tensors import to_numpy

    full = full_forward(weights(layers=layers, experts=experts), input_ids(), aux)
    meta = DumpMetadata(side="training", model=ModelInfo(num_layers=layers, hidden_size=H, vocab_size=V),
                        aux=AuxInfo(stream_ids=aux))
    return write_dump(path, {k: to_numpy(v) for k, v in full.items()}, meta, force=True)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(world: int, out: Path, backend: str = "gloo", embed_all_reduce: bool = True, **job) -> list[Path]:  # noqa: ANN003
    """Spawn ``world`` processes running ``job`` (kind tp, pp, dp or ep); the rank files."""
    job.setdefault("embed_all_reduce", embed_all_reduce)
    return run_many(world, [(out, job)], backend)[0]


def run_many(world: int, jobs: list[tuple[Path, dict]], backend: str = "gloo") -> list[list[Path]]:
    """Several recordings by one set of processes (process start-up dominates on CPU)."""
    import torch.multiprocessing as mp

    mp.spawn(worker, args=(world, free_port(), backend, [(str(o), j) for o, j in jobs]), nprocs=world, join=True)
    return [[o.parent / f"{o.name[: -len(o.suffix)]}.rank{r}-of{world}{o.suffix}" for r in range(world)]
            for o, _ in jobs]


def token_rows_outside_rank(rank: int, world: int) -> list[int]:
    ids = input_ids().numpy()
    vs = V // world
    return [int(i) for i in np.flatnonzero((ids < rank * vs) | (ids >= (rank + 1) * vs))]


def expert_rows_outside_rank(rank: int, world: int, experts: int = 4, layer: int = 0) -> list[int]:
    """Token rows whose top-1 expert at ``layer`` lives on another EP rank (zero in its partial)."""
    w = weights(experts=experts)
    h = full_forward(w, input_ids())[f"hidden.{layer}"]
    choice = (h @ w[f"router.{layer}"]).argmax(-1).numpy()
    lo, hi = rank * experts // world, (rank + 1) * experts // world
    return [int(i) for i in np.flatnonzero((choice < lo) | (choice >= hi))]


PP_LAYERS, PP_AUX = 4, [1, 2, 4]


def two_rank_scenarios(d: Path, backend: str = "gloo") -> list[dict]:
    """Every layout that two ranks can run (TP, PP 2 x TP 1, DP attention, EP), correct and
    broken, recorded by one spawn and compared with the single-process model: for the NCCL
    check on two GPUs. Each row says what was expected and what was found."""
    import time

    from consistency.pipeline.compare import compare as run_compare
    from consistency.dump.sets import open_side

    refs = {"tp": reference_dump(d / "ref.safetensors"), "dp": d / "ref.safetensors",
            "pp": reference_dump(d / "ref_pp.safetensors", layers=PP_LAYERS, aux=PP_AUX),
            "ep": reference_dump(d / "ref_ep.safetensors", experts=4)}
    pp = {"kind": "pp", "tp": 1, "layers": PP_LAYERS, "aux": PP_AUX}
    ep = {"kind": "ep", "experts": 4}
    everyone = list(range(T))
    reqs = [(q, p) for q, n in enumerate((5, 9, 10)) for p in range(n)]
    cases = {  # name: (job, expected verdict, expected finding code)
        "tp_ok": ({"kind": "tp"}, "pass", None),
        "tp_no_embed_all_reduce": ({"kind": "tp", "embed_all_reduce": False}, "fail", "PARTIAL_SHARD"),
        "pp_ok": (pp, "pass", None),
        "pp_local_index": ({**pp, "local_index": True}, "fail", "STAGE_OUT_OF_RANGE"),
        "pp_silent_stage": ({**pp, "silent": [1]}, "fail", "STAGE_MISSING"),
        "dp_uneven": ({"kind": "dp", "rows": [[3, 4, 5, 10, 11], [r for r in everyone if r not in (3, 4, 5, 10, 11)]]},
                      "pass", None),
        "dp_empty_rank": ({"kind": "dp", "rows": [[], everyone]}, "pass", None),
        "dp_requests": ({"kind": "dp", "rows": [list(range(5, 14)), list(range(5)) + list(range(14, 24))],
                         "requests": reqs}, "pass", None),
        "dp_unowned": ({"kind": "dp", "rows": [list(range(10)), list(range(11, 24))]}, "fail", "TOKEN_UNOWNED"),
        "dp_duplicate": ({"kind": "dp", "rows": [list(range(13)), list(range(12, 24))]}, "fail", "TOKEN_DUPLICATE"),
        "ep_ok": (ep, "pass", None),
        "ep_no_all_reduce": ({**ep, "all_reduce": False}, "fail", "REPLICA_MISMATCH"),
    }
    t0 = time.perf_counter()
    run_many(2, [(d / f"{k}.safetensors", job) for k, (job, _, _) in cases.items()], backend)
    rows = [{"scenario": "spawn+record (all)", "seconds": round(time.perf_counter() - t0, 1)}]
    for k, (job, verdict, code) in cases.items():
        t = time.perf_counter()
        with open_side(str(d / f"{k}.safetensors")) as x:
            dump_codes = [f.code for f in getattr(x, "layout_facts", [])]
        rep = run_compare(str(refs[job["kind"]]), str(d / f"{k}.safetensors"))
        codes = sorted({f.code for f in rep.findings if f.severity.value == "error"} | set(dump_codes))
        ok = (rep.verdict == verdict or (verdict == "fail" and bool(dump_codes))) and (code is None or code in codes)
        ok = ok and (code is not None or (rep.verdict == "pass" and not dump_codes))
        rows.append({"scenario": k, "backend": backend, "verdict": rep.verdict, "codes": codes,
                     "as_expected": ok, "seconds": round(time.perf_counter() - t, 2)})
    return rows


if __name__ == "__main__":  # python tests/tp_model.py OUT_DIR [nccl|gloo] [WORLD] [all]
    import json
    import sys

    d = Path(sys.argv[1])
    d.mkdir(parents=True, exist_ok=True)
    backend = sys.argv[2] if len(sys.argv) > 2 else "gloo"
    world = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    if len(sys.argv) > 4 and sys.argv[4] == "all":
        for row in two_rank_scenarios(d, backend):
            print(json.dumps(row))
        sys.exit(0)
    reference_dump(d / "ref.safetensors")
    run(world, d / "serve.safetensors", backend)
    run(world, d / "broken.safetensors", backend, embed_all_reduce=False)
    print("\n".join(str(p) for p in sorted(d.iterdir())))
