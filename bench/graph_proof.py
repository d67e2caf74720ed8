"""Graph-safe capture on a GPU: what the draft gets under CUDA graphs equals the eager run.

    python bench/graph_proof.py --out results.json [--texts DIR]     # on a CUDA machine (H200 here)
    python bench/graph_proof.py --device cpu --graphs emulate --small  # the same checks on a CPU

A real transformers Llama (random weights, seeded; nothing is downloaded) decodes batches
of several sizes the way a server does (tests/graph_loop.py): graphs captured per batch
size (1, 2, 4, 8), real batches padded up to them, several replays per graph with different
tokens, an EAGLE-style draft in its own graph reading three aux states from a static buffer.
Per dtype (fp32, bf16), recorded:

  eager_padded    eager, the same padded batches (the shapes the graphs run)
  eager           eager, unpadded (what a server with --disable-cuda-graph runs)
  graph           graph-safe capture of the graph replays
  graph_stale     planted bug: the draft's input buffer refreshed at a batch's first step only
  graph_padrow    planted bug: the last real request's aux row read from the first padded row
  graph_budget    a graph-buffer budget too small for the draft's slots

and checked: graph == eager_padded bit for bit (every capture of every replay, padded rows
trimmed, tags right); graph vs eager within the eager-vs-eager noise floor (eager_padded vs
eager: the same tokens, other batch shapes); ``consistency compare`` passes graph against
both and fails each planted bug naming the rows; the budget case says so on stderr and in
the dump, and compare refuses it (the captures' counts differ) instead of passing.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from consistency.pipeline.compare import compare  # noqa: E402
from consistency.dump.reader import open_dump  # noqa: E402
from consistency.record import Recorder, graphs  # noqa: E402
from consistency.record.async_capture import AsyncRecorder  # noqa: E402
from tests.graph_loop import Bugs, Loop  # noqa: E402

BATCHES = (3, 1, 4, 5, 8, 2, 7, 3)  # real requests per batch; graphs at 1, 2, 4, 8
CAPTURE_BS = (1, 2, 4, 8)


def build(dtype: torch.dtype, device: str, small: bool):  # noqa: ANN201
    from transformers import LlamaConfig, LlamaForCausalLM

    if small:
        cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)
    else:
        cfg = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=12, num_attention_heads=16,
                          num_key_value_heads=4, vocab_size=32000, max_position_embeddings=512)
    torch.manual_seed(0)
    torch.set_default_dtype(dtype)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).eval()
        draft = torch.nn.Linear(3 * cfg.hidden_size, cfg.hidden_size)
    torch.set_default_dtype(torch.float32)
    n = cfg.num_hidden_layers
    return model, draft, (2, n // 2, n - 3)


def record(model, draft, aux, path: Path, mode: str | None, pad: bool, steps: int, prompt: int,  # noqa: ANN001
           bugs: Bugs | None = None, asynchronous: bool = True) -> dict:
    loop = Loop(model, draft, aux, CAPTURE_BS, prompt + steps + 1, graphs=mode, bugs=bugs, pad=pad)
    g = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    rec_cls = AsyncRecorder if asynchronous and loop.device.type == "cuda" else Recorder
    err = io.StringIO()
    t0 = time.perf_counter()
    with torch.no_grad(), contextlib.redirect_stderr(err), rec_cls(path, force=True) as rec:
        rid = 0
        for real in BATCHES:
            prompts = torch.randint(0, vocab, (real, prompt), generator=g).to(loop.device)
            loop.run_batch(prompts, steps, list(range(rid, rid + real)))
            rid += real
    return {"path": str(path), "seconds": round(time.perf_counter() - t0, 3), "stderr": err.getvalue().strip(),
            "captures": len(rec.tensors), "cuda_graphs": rec.metadata.extra.get("cuda_graphs")}


def tensors(path: str) -> dict[str, np.ndarray]:
    with open_dump(path) as d:
        return {n: d[n].read_all() for n in d.tensors}


def tags(path: str) -> dict[str, dict]:
    with open_dump(path) as d:
        return {n: (m.graph.model_dump() if m.graph else None) for n, m in d.metadata.tensors.items()}


def as_float(a: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return a.astype(np.float64)


def diff(a: dict, b: dict, dtype: str) -> dict:
    """Per aux tensor: max |a-b| and token rel_diff; ids/positions must be equal."""
    out = {"same_names": sorted(a) == sorted(b), "equal": 0, "differ": [], "max_abs": 0.0, "max_token_rel": 0.0}
    for n in sorted(set(a) & set(b)):
        if np.array_equal(a[n], b[n]):
            out["equal"] += 1
            continue
        if not n.startswith("aux."):
            out["differ"].append(n)
            continue
        x, y = as_float(a[n], dtype), as_float(b[n], dtype)
        if x.shape != y.shape:
            out["differ"].append(n)
            continue
        d = x - y
        rel = (d * d).sum(-1) / np.maximum((x * x).sum(-1) + (y * y).sum(-1), 1e-300)
        out["max_abs"] = max(out["max_abs"], float(np.abs(d).max()))
        out["max_token_rel"] = max(out["max_token_rel"], float(rel.max()))
        out["differ"].append(n)
    out["differ_count"] = len(out.pop("differ")) if len(out["differ"]) > 8 else out["differ"]
    return out


def verdict(ref: str, cand: str) -> dict:
    try:
        rep = compare(ref, cand)
    except Exception as exc:  # an InputError is a refusal, the expected answer for a budget gap
        return {"verdict": "error", "error": f"{type(exc).__name__}: {exc}"}
    errs = [f for f in rep.findings if f.severity.value == "error"]
    return {"verdict": rep.verdict, "codes": sorted({f.code for f in errs}),
            "messages": [f.message for f in errs][:3],
            "rows": sorted({r for f in errs for r in ((f.evidence or {}).get("stale_rows") or
                                                      (f.evidence or {}).get("token_rows") or [])})[:512]}


def expected_padrow_rows(steps: int, prompt: int) -> list[int]:
    """Stitched rows (request by request: its prompt, then its decode steps) of the last real
    request of every batch padded past its size, at every decode step: what the padded-row
    bug corrupts (the prefill is eager, so its rows are right)."""
    rows, rid, per = [], 0, prompt + steps
    for real in BATCHES:
        bs = next(b for b in CAPTURE_BS if b >= real)
        if real < bs:
            r = rid + real - 1
            rows += list(range(r * per + prompt, (r + 1) * per))
        rid += real
    return rows


def expected_stale_rows(steps: int, prompt: int) -> list[int]:
    """Every decode row but each request's first step (the buffer is refreshed there)."""
    per = prompt + steps
    return [r * per + prompt + t for r in range(sum(BATCHES)) for t in range(1, steps)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--graphs", default="cuda", choices=["cuda", "emulate"])
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=10)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--tmp", type=Path, default=Path("/tmp/graph_proof"))
    ap.add_argument("--out", type=Path)
    ap.add_argument("--texts", type=Path, help="append `consistency compare` outputs to this file")
    args = ap.parse_args()
    args.tmp.mkdir(parents=True, exist_ok=True)
    graphs.enable(hook_torch=args.graphs == "cuda")
    res: dict = {"device": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
                 "torch": torch.__version__, "batches": BATCHES, "capture_bs": CAPTURE_BS, "steps": args.steps,
                 "prompt": args.prompt, "dtypes": {}}
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        model, draft, aux = build(dtype, args.device, args.small)
        res.update(layers=model.config.num_hidden_layers, hidden=model.config.hidden_size, aux_streams=aux)
        p = {k: args.tmp / f"{name}-{k}.safetensors" for k in
             ("eager_padded", "eager", "graph", "graph_stale", "graph_padrow", "graph_budget")}
        runs = {"eager_padded": record(model, draft, aux, p["eager_padded"], None, True, args.steps, args.prompt),
                "eager": record(model, draft, aux, p["eager"], None, False, args.steps, args.prompt)}
        mode = args.graphs
        runs["graph"] = record(model, draft, aux, p["graph"], mode, True, args.steps, args.prompt)
        runs["graph_stale"] = record(model, draft, aux, p["graph_stale"], mode, True, args.steps, args.prompt, Bugs(stale=True))
        runs["graph_padrow"] = record(model, draft, aux, p["graph_padrow"], mode, True, args.steps, args.prompt,
                                      Bugs(padded_row=True))
        import gc

        gc.collect()  # earlier loops' graphs (and their buffers) leave the budget
        h = model.config.hidden_size * torch.finfo(dtype).bits // 8
        graphs.budget().limit = graphs.budget().used + 8 * 2 * h  # room for a bs-8 draft's two slots, not three
        runs["graph_budget"] = record(model, draft, aux, p["graph_budget"], mode, True, args.steps, args.prompt)
        graphs.budget().limit = graphs.DEFAULT_BYTES
        A, B, C = (tensors(str(p[k])) for k in ("eager_padded", "eager", "graph"))
        t = {k: v for k, v in tags(str(p["graph"])).items() if v is not None}  # the prefill is eager: untagged
        ok_tags = len(t) == len(BATCHES) * args.steps * 6 and all(
            v["real_batch_size"] <= v["batch_size"] and v["kept"] == v["real_tokens"] for v in t.values())
        out = {"runs": runs, "graph_vs_eager_padded": diff(A, C, name), "graph_vs_eager": diff(B, C, name),
               "noise_floor_eager_padded_vs_eager": diff(A, B, name), "tags_ok": ok_tags,
               "tag_example": t.get("aux.0#7"), "replays": {k: v["replays"] for k, v in
                                                            (runs["graph"]["cuda_graphs"] or {}).get("graphs", {}).items()},
               # the bugs against the same loop recorded eagerly (the same tokens: rows are the candidate's
               # own stitched rows) and against the unpadded eager run (bf16 argmax may pick other tokens there:
               # compare then leaves those tokens out and numbers the rows it compared)
               "compare": {"graph_vs_eager_padded": verdict(str(p["eager_padded"]), str(p["graph"])),
                           "graph_vs_eager": verdict(str(p["eager"]), str(p["graph"])),
                           "stale_vs_eager_padded": verdict(str(p["eager_padded"]), str(p["graph_stale"])),
                           "padrow_vs_eager_padded": verdict(str(p["eager_padded"]), str(p["graph_padrow"])),
                           "stale_vs_eager": verdict(str(p["eager"]), str(p["graph_stale"])),
                           "padrow_vs_eager": verdict(str(p["eager"]), str(p["graph_padrow"])),
                           "budget_vs_eager": verdict(str(p["eager"]), str(p["graph_budget"]))},
               "expected_rows": {"stale": expected_stale_rows(args.steps, args.prompt),
                                 "padrow": expected_padrow_rows(args.steps, args.prompt)}}
        out["graph_bit_identical_to_eager_padded"] = out["graph_vs_eager_padded"]["equal"] == len(A) == len(C)
        for bug, key in (("stale", "stale_vs_eager_padded"), ("padrow", "padrow_vs_eager_padded")):
            named, want = set(out["compare"][key].get("rows") or []), set(out["expected_rows"][bug])
            out[f"{bug}_rows_named_are_corrupted_rows"] = bool(named) and named <= want
            out[f"{bug}_rows_named"] = f"{len(named)} of {len(want)}"
            out[f"{bug}_rows_exact"] = named == want
        res["dtypes"][name] = out
        if args.texts:  # one file: what `consistency compare` prints, per case
            with open(args.texts, "a") as fh:
                for k in ("graph", "graph_stale", "graph_padrow", "graph_budget"):
                    r = subprocess.run([sys.executable, "-m", "consistency", "compare", str(p["eager"]), str(p[k])],
                                       capture_output=True, text=True, env={"COLUMNS": "160", "PATH": "/usr/bin:/bin",
                                                                            "PYTHONPATH": ":".join(sys.path)})
                    fh.write(f"\n$ consistency compare {name}-eager {name}-{k}   (exit {r.returncode})\n{r.stdout}{r.stderr}")
        del model, draft
    text = json.dumps(res, indent=1, default=str)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
