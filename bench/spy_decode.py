"""One mode's eager decode for a sampling profiler (py-spy) to read: what the model's thread
does per step with every stream recorded, against the same decode with nothing recorded or with
a bare copy per point (bench/decode_parts.py measures the cost; this says where it goes).

    py-spy record --native -f raw -o all.txt -- python bench/spy_decode.py --mode all
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_record_gpu import build  # noqa: E402
from bench.decode_parts import PartHooks  # noqa: E402
from consistency.record.async_capture import AsyncRecorder  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("off", "copy_all", "all"), default="all")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--small", action="store_true")
    args = ap.parse_args()
    model = build(args.small)
    n = model.config.num_hidden_layers
    hooks = PartHooks(model, list(range(n + 1)), {"copy_all": "copy", "all": "capture"}[args.mode], []) \
        if args.mode != "off" else None
    rec = AsyncRecorder("/tmp/spy.safetensors", force=True, max_host_bytes=64 << 30).prepare() if args.mode == "all" else None
    if rec is not None:
        rec.__enter__()
    ids = torch.randint(0, model.config.vocab_size, (1, 2048), device="cuda")
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        pkv, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
        for _ in range(args.steps):
            o = model(input_ids=nxt, past_key_values=pkv, use_cache=True)
            pkv, nxt = o.past_key_values, o.logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
    if rec is not None:
        rec.discard()


if __name__ == "__main__":
    main()
