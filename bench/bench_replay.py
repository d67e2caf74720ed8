"""Replay time of a 3-slot dump pair of 2,048 tokens on CPU (the issue's bar: seconds).

    python bench/bench_replay.py [--tokens 2048] [--steps 3] [--repeat 3] [--size tiny|smol]

``tiny``: the built-in tiny-llama and its built-in draft (tiny-llama-eagle3). ``smol``: a
SmolLM2-135M-shaped target (30 layers, hidden 576, vocab 49152; the pretrained one when its
offline package is installed) with a random EAGLE-3 draft of the usual shape (hidden 576,
intermediate 1536, draft vocab 32000), written in speculators' layout and loaded through
the users' loader. Both dumps are recorded once (fp32 training streams vs the seed's
shifted bf16 serving streams); then ``run_replay`` (load draft, read both dumps, label them
with a target forward, chain K steps on each, score, report) is timed against the baseline
measured in the same run: one forward of the target over the same tokens.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def smol_setup(tmp: Path, tokens: int):  # noqa: ANN201
    import numpy as np
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from consistency.replay.draft import Eagle3Draft
    from consistency.replay.train import new_config, save_speculators

    try:
        from fixtures import zoo

        have = zoo.smollm2_dir() is not None
    except ImportError:
        have = False
    if have:
        target, name = zoo.load_smollm2(), "SmolLM2-135M"
    else:
        torch.manual_seed(0)
        target = LlamaForCausalLM(LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                              num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                                              tie_word_embeddings=False)).eval()
        name = "random 30-layer Llama (576 wide)"
    cfg = new_config(target, 32000, 1536)
    draft = Eagle3Draft(cfg, 3, 576, 1, target.config.vocab_size, 32000)
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
        draft.d2t.copy_(torch.randperm(target.config.vocab_size)[:32000].sort().values - torch.arange(32000))
    save_speculators(draft, tmp / "draft", [2, 15, 27], name)
    ids = np.random.default_rng(0).integers(0, target.config.vocab_size, tokens)
    return name, target, tmp / "draft", ids, ([2, 15, 27], [3, 16, 28])


def tiny_setup(tmp: Path, tokens: int):  # noqa: ANN201
    import numpy as np

    from consistency.record.models import load_model
    from consistency.replay.assets import builtin_dir

    target = load_model("tiny-llama")
    ids = np.random.default_rng(0).integers(0, target.config.vocab_size, tokens)
    return "tiny-llama", target, builtin_dir("tiny-llama-eagle3"), ids, ([0, 3, 7], [3, 7, 10])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--size", choices=["tiny", "smol"], default="tiny")
    args = ap.parse_args()
    import torch

    from consistency.record.api import record_reference, record_serving
    from consistency.replay.engine import run_replay

    with tempfile.TemporaryDirectory() as td:
        tmp = Path(td)
        name, target, draft, ids, (train, serve) = (smol_setup if args.size == "smol" else tiny_setup)(tmp, args.tokens)
        ref, cand = tmp / "train.safetensors", tmp / "serve.safetensors"
        record_reference(target, ids, ref, train, components=False)
        record_serving(copy.deepcopy(target), ids, cand, serve, dtype="bfloat16")
        x = torch.as_tensor(ids)[None]
        with torch.no_grad():
            target(input_ids=x)  # warm-up
        base, rep_t = [], []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            with torch.no_grad():
                target(input_ids=x)
            base.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            rep = run_replay(draft, target, ref, cand, steps=args.steps)
            rep_t.append(time.perf_counter() - t0)
        b, r = statistics.median(base), statistics.median(rep_t)
        print(f"{name}: {args.tokens} tokens, 3 slots, K={args.steps}, torch threads {torch.get_num_threads()}")
        print(f"  baseline  one target forward      {b:8.3f} s")
        print(f"  replay    both dumps, end to end  {r:8.3f} s  ({r / b:.1f}x the target forward)")
        print(f"  result    top-1 {100 * rep.reference.top1:.1f}% -> {100 * rep.candidate.top1:.1f}%, "
              f"accept length {rep.reference.accept_length:.2f} -> {rep.candidate.accept_length:.2f}")


if __name__ == "__main__":
    main()
