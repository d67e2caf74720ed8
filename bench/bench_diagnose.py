"""Diagnosis time of a 30-layer target with 3 aux slots (the issue's bar: well under 1 s).

    python bench/bench_diagnose.py [--tokens 256] [--repeat 5]

Uses the pretrained SmolLM2-135M (30 layers, hidden 576) when its offline package is
installed, else a seeded 30-layer Llama of the same shape. Both dumps are recorded once
(the seed's shifted slots, bf16 serving against fp32 training); then, in one process,
``compare`` + ``explain`` (pairing, fingerprints, identification, full metrics, every
hypothesis, the report) is timed against a plain read of the same two files.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def model(tokens: int):  # noqa: ANN201
    from fixtures import zoo

    if zoo.smollm2_dir() is not None:
        return "SmolLM2-135M", zoo.load_smollm2(), zoo.smol_prompt_ids(tokens)
    import numpy as np
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                      num_key_value_heads=3, vocab_size=49152)
    return "random 30-layer Llama (576 wide)", LlamaForCausalLM(cfg).eval(), \
        np.random.default_rng(0).integers(0, 49152, tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    import copy

    from consistency.compare.engine import compare
    from consistency.diagnose.engine import explain
    from consistency.diagnose.report import build
    from consistency.dump.reader import open_dump
    from consistency.record.api import record_reference, record_serving

    name, m, ids = model(args.tokens)
    n = m.config.num_hidden_layers
    train, serve = [0, 3, n // 2 + 1], [3, n // 2 + 1, n - 2]
    ref = record_reference(m, ids, args.out / "diag-train.safetensors", train, force=True)
    cand = record_serving(copy.deepcopy(m), ids, args.out / "diag-serve.safetensors", serve, dtype="bfloat16",
                          force=True)

    def diagnose() -> str:
        with open_dump(ref) as r, open_dump(cand) as c:
            cmp = compare(r, c)
            findings, summary = explain(cmp)
            build(cmp, findings, summary)
            return summary

    def read() -> None:
        for p in (ref, cand):
            p.read_bytes()

    summary = diagnose()  # warm: page cache and first-call costs
    t_diag, t_read = [], []
    for _ in range(args.repeat):
        t = time.perf_counter()
        diagnose()
        t_diag.append(time.perf_counter() - t)
        t = time.perf_counter()
        read()
        t_read.append(time.perf_counter() - t)
    d, r = statistics.median(t_diag), statistics.median(t_read)
    size = ref.stat().st_size + cand.stat().st_size
    print(f"target: {name}, {n} layers, {args.tokens} tokens; dumps {size / 1e6:.1f} MB")
    print(f"summary: {summary}")
    print(f"diagnosis (compare + explain + report, in-process): median {d * 1000:.0f} ms over {args.repeat} runs")
    print(f"plain read of both files: median {r * 1000:.1f} ms; ratio {d / r:.0f}x")


if __name__ == "__main__":
    main()
