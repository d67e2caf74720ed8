"""Graph-only bugs on a real graph runner: one dump per planted cause, and what compare says.

    python bench/graph_causes.py --dir DIR --out causes.json --texts compare.txt   # CUDA graphs (H200 here)
    python bench/graph_causes.py --device cpu --graphs emulate --dir DIR           # the CPU stand-in

tests/graph_loop.py's runner (graphs per batch size 1/2/4/8, real batches padded up to them,
an EAGLE-style draft graph fed from a static buffer) over a tiny seeded Llama, recorded
graph-safe, once per cause:

  graph          no bug
  graph_stale    the draft's static input buffer refreshed at a batch's first step only
  graph_padrow   the last real request's aux row read from the first padded row
  graph_early    graphs captured before the capture layers were set (replays keep layers one deeper)
  graph_swap     the runner's row index swaps the first two requests' rows
  graph_noresid  the residual missing on the graph path only (hidden.{s} - hidden.{s-1})
  graph_budget   a graph-buffer budget that fits two of the four graph sizes (bs 4 and 1)

and three references of the same requests: ``eager`` (the runner with graphs off, unpadded:
a server's --disable-cuda-graph), ``eager_padded`` (the same padded batches) and
``training`` (every stream of the requests' whole sequences, HF hooks, one batch).
``expected`` says, from the construction, which stitched rows each cause touches (rows
numbered request by request: its prompt, then its decode steps); ``compare`` holds each
case's verdict, codes and rows against each reference.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.graph_proof import BATCHES, CAPTURE_BS, verdict  # noqa: E402
from consistency.record import Recorder, graphs  # noqa: E402
from consistency.record.async_capture import AsyncRecorder  # noqa: E402
from tests.graph_loop import Bugs, Loop  # noqa: E402

CASES = {"graph": Bugs(), "graph_stale": Bugs(stale=True), "graph_padrow": Bugs(padded_row=True),
         "graph_early": Bugs(early_layers=True), "graph_swap": Bugs(swap_rows=True),
         "graph_noresid": Bugs(no_residual=True), "graph_budget": Bugs()}


def build(dtype: torch.dtype, device: str, layers: int):  # noqa: ANN201
    """A tiny seeded Llama and draft; aux slots at streams 2, n/2, n-3 (distinct from 8 layers on)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)
    torch.manual_seed(0)
    torch.set_default_dtype(dtype)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).eval()
        draft = torch.nn.Linear(3 * cfg.hidden_size, cfg.hidden_size)
    torch.set_default_dtype(torch.float32)
    return model, draft, (2, layers // 2, layers - 3)


def record(model, draft, aux, path: Path, mode: str | None, pad: bool, steps: int, prompt: int,  # noqa: ANN001
           bugs: Bugs | None = None) -> tuple[dict, list[torch.Tensor]]:
    """One run of the runner; also the requests' whole sequences (prompt + decoded inputs)."""
    loop = Loop(model, draft, aux, CAPTURE_BS, prompt + steps + 1, graphs=mode, bugs=bugs, pad=pad)
    g = torch.Generator().manual_seed(1)
    rec_cls = AsyncRecorder if loop.device.type == "cuda" else Recorder
    err, seqs = io.StringIO(), []
    with torch.no_grad(), contextlib.redirect_stderr(err), rec_cls(path, force=True) as rec:
        rid = 0
        for real in BATCHES:
            prompts = torch.randint(0, model.config.vocab_size, (real, prompt), generator=g).to(loop.device)
            made = loop.run_batch(prompts, steps, list(range(rid, rid + real)))
            seqs += list(torch.cat([prompts, made], 1))
            rid += real
    return {"path": path.name, "stderr": err.getvalue().strip(), "captures": len(rec.tensors),
            "dropped": rec.metadata.extra.get("dropped_captures"),
            "cuda_graphs": rec.metadata.extra.get("cuda_graphs")}, seqs


def graph_bytes(bs: int, hidden: int, dtype: torch.dtype, slots: int) -> int:
    """Graph-buffer bytes of one batch size: the target's ids/positions/request ids (int64)
    and the draft's aux slots."""
    return 3 * 8 * bs + slots * bs * hidden * torch.finfo(dtype).bits // 8


def expected(steps: int, prompt: int) -> dict[str, list[int]]:
    """Stitched rows each cause touches, from BATCHES and CAPTURE_BS."""
    per, rows = prompt + steps, {}
    decode = [r * per + prompt + t for r in range(sum(BATCHES)) for t in range(steps)]
    rows["graph_early"] = rows["graph_noresid"] = decode
    rows["graph_stale"] = [r * per + prompt + t for r in range(sum(BATCHES)) for t in range(1, steps)]
    pad, swap, budget, rid = [], [], [], 0
    seen: list[int] = []
    for real in BATCHES:
        bs = next(b for b in CAPTURE_BS if b >= real)
        seen += [bs] if bs not in seen else []
        if real < bs:
            r = rid + real - 1
            pad += list(range(r * per + prompt, (r + 1) * per))
        if real >= 2:
            swap += [r * per + prompt + t for r in (rid, rid + 1) for t in range(steps)]
        if seen.index(bs) >= 2:  # the third and fourth graph sizes have no buffers
            budget += [r * per + prompt + t for r in range(rid, rid + real) for t in range(steps)]
        rid += real
    rows.update(graph_padrow=pad, graph_swap=swap, graph_budget=budget, graph=[])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--graphs", default="cuda", choices=["cuda", "emulate"])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=10)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dir", type=Path, required=True, help="where the dumps are written")
    ap.add_argument("--no-compare", action="store_true", help="record only (compare them on any machine later)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--texts", type=Path, help="`consistency compare` output against the eager run, per case")
    ap.add_argument("--compare-only", type=Path, metavar="JSON",
                    help="compare the dumps already in --dir (a --no-compare run's JSON); no recording")
    args = ap.parse_args()
    if args.compare_only:
        res = json.loads(args.compare_only.read_text())
        p = {k: args.dir / f"{k}.safetensors" for k in ("eager", "eager_padded", "training", *CASES)}
        return report(res, p, args)
    args.dir.mkdir(parents=True, exist_ok=True)
    dtype = getattr(torch, args.dtype)
    graphs.enable(hook_torch=args.graphs == "cuda")
    model, draft, aux = build(dtype, args.device, args.layers)
    h = model.config.hidden_size
    p = {k: args.dir / f"{k}.safetensors" for k in ("eager", "eager_padded", "training", *CASES)}
    runs: dict = {}
    runs["eager"], seqs = record(model, draft, aux, p["eager"], None, False, args.steps, args.prompt)
    runs["eager_padded"], _ = record(model, draft, aux, p["eager_padded"], None, True, args.steps, args.prompt)
    for case, bugs in CASES.items():
        if case == "graph_budget":
            gc.collect()  # earlier runners' graphs (and their buffers) leave the budget
            first_two = [b for b in dict.fromkeys(next(c for c in CAPTURE_BS if c >= r) for r in BATCHES)][:2]
            graphs.budget().limit = graphs.budget().used + sum(graph_bytes(b, h, dtype, len(aux)) for b in first_two)
        runs[case], _ = record(model, draft, aux, p[case], args.graphs, True, args.steps, args.prompt, bugs)
        graphs.budget().limit = graphs.DEFAULT_BYTES
    from consistency.record.api import record_reference

    import copy

    # the training side on the host (record_reference feeds its ids from the host), same weights and dtype
    record_reference(copy.deepcopy(model).cpu(), torch.stack(seqs).cpu(), p["training"], aux_streams=list(aux),
                     force=True)
    runs["training"] = {"path": p["training"].name, "sequences": len(seqs)}
    res: dict = {"device": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
                 "graphs": args.graphs, "torch": torch.__version__, "dtype": args.dtype, "batches": BATCHES,
                 "capture_bs": CAPTURE_BS, "steps": args.steps, "prompt": args.prompt,
                 "layers": model.config.num_hidden_layers, "hidden": h, "aux_streams": aux,
                 "early_layers": [min(a + 1, model.config.num_hidden_layers) for a in aux],
                 "runs": runs, "expected_rows": expected(args.steps, args.prompt), "compare": {}}
    if args.no_compare:
        if args.out:
            args.out.write_text(json.dumps(res, indent=1, default=str))
        return
    report(res, p, args)


def report(res: dict, p: dict[str, Path], args: argparse.Namespace) -> None:
    for case in CASES:
        res["compare"][case] = {ref: verdict(str(p[ref]), str(p[case])) for ref in ("eager", "eager_padded", "training")}
    text = json.dumps(res, indent=1, default=str)
    if args.out:
        args.out.write_text(text)
    print(json.dumps({c: {r: (v["verdict"], v.get("codes"), v.get("error")) for r, v in d.items()}
                      for c, d in res["compare"].items()}, indent=1))
    if args.texts:
        with open(args.texts, "w") as fh:
            for case in CASES:
                for ref in ("eager", "training"):
                    r = subprocess.run([sys.executable, "-m", "consistency", "compare", str(p[ref]), str(p[case])],
                                       capture_output=True, text=True, env={"COLUMNS": "160", "PATH": "/usr/bin:/bin",
                                                                            "PYTHONPATH": ":".join(sys.path)})
                    fh.write(f"\n$ consistency compare {ref} {case}   (exit {r.returncode})\n{r.stdout}{r.stderr}")


if __name__ == "__main__":
    main()
