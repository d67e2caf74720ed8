"""Decode and target-verify steps as CUDA-graph replays, for bench/bench_record_gpu.py.

What a runtime's graph runner does for one batch size: a static KV cache
(transformers' ``StaticCache``), static input buffers filled by small device ops between
replays (the next token ids, the positions, the cache positions), one graph for a decode
step ([B, 1] tokens) and one for a verify step ([B, V] tokens: the draft's proposals
checked by the target, EAGLE's target verify). The hooks that call ``capture`` run only
while a graph is captured; with graph-safe mode on, every replay then refreshes the
buffers they registered and is drained to the active recorder (consistency/record/graphs.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class GraphSteps:
    def __init__(self, model: Any, batch: int, prompt: int, extra: int, verify: int) -> None:
        from transformers import StaticCache

        self.model, self.batch, self.prompt, self.verify = model, batch, prompt, verify
        self.cache = StaticCache(config=model.config, max_cache_len=prompt + extra + verify + 1)
        dev = next(model.parameters()).device
        long = {"dtype": torch.long, "device": dev}
        self.ids, self.pos, self.cp = torch.zeros(batch, 1, **long), torch.zeros(batch, 1, **long), torch.zeros(1, **long)
        self.vids, self.vpos = torch.zeros(batch, verify, **long), torch.zeros(batch, verify, **long)
        self.vcp = torch.zeros(verify, **long)
        self.next = torch.zeros(batch, 1, **long)
        self.dev = dev

    def prefill(self, ids: torch.Tensor) -> None:
        """Eager, as the runtimes run prefill; the static buffers then point at the first decode step."""
        self.cache.reset()
        t = ids.shape[1]
        out = self.model(input_ids=ids, position_ids=torch.arange(t, device=self.dev)[None].expand(self.batch, -1),
                         cache_position=torch.arange(t, device=self.dev), past_key_values=self.cache, use_cache=True)
        self.next.copy_(out.logits[:, -1:].argmax(-1))
        self.ids.copy_(self.next)
        self.pos.fill_(t)
        self.cp.fill_(t)

    def _at(self, first: torch.Tensor) -> None:
        """Point the cache's write position at ``first`` (a device op, so inside the graph too):
        transformers 5.17's StaticLayer writes at its own counter, not at ``cache_position``,
        and every warm-up, capture and replay advances it; a verify step rewrites its slots."""
        for layer in getattr(self.cache, "layers", ()):
            n = getattr(layer, "cumulative_length", None)
            if isinstance(n, torch.Tensor) and n.device == first.device:
                n.copy_(first.reshape(n.shape))

    def decode_body(self) -> None:
        self._at(self.cp)
        out = self.model(input_ids=self.ids, position_ids=self.pos, cache_position=self.cp,
                         past_key_values=self.cache, use_cache=True)
        self.next.copy_(out.logits[:, -1:].argmax(-1))

    def verify_body(self) -> None:
        self._at(self.vcp[:1])
        self.model(input_ids=self.vids, position_ids=self.vpos, cache_position=self.vcp, past_key_values=self.cache,
                   use_cache=True)

    def advance(self) -> None:
        """Between decode replays: the sampled token becomes the next input (device ops, no sync)."""
        self.ids.copy_(self.next)
        self.pos.add_(1)
        self.cp.add_(1)

    def set_verify(self, at: int, gen: torch.Generator) -> None:
        v = self.verify
        self.vids.copy_(torch.randint(0, self.model.config.vocab_size, (self.batch, v), generator=gen).to(self.dev))
        self.vpos.copy_(torch.arange(at, at + v, device=self.dev)[None].expand(self.batch, -1))
        self.vcp.copy_(torch.arange(at, at + v, device=self.dev))

    def capture(self, body: Callable[[], None]) -> torch.cuda.CUDAGraph:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up, as the runtimes do
                body()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            body()
        return g
