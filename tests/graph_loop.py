"""A server's decode loop over a real transformers Llama, eager or under CUDA graphs.

What SGLang's and vLLM's graph runners do, in small: one graph per capture batch size,
static input buffers the runner fills before each replay (token ids, positions, request
ids, the cache position), batches padded up to the next captured size, and an EAGLE-style
draft in a graph of its own that reads the target's three aux states from a static buffer
the runner copies them into. The recorder's calls are where a runtime patch puts them:
``input_ids``/``positions``/``request_ids`` at the top of the target's step, ``aux.{k}`` at
the draft's input (what the draft really gets).

``graphs`` picks the mode: ``None`` runs everything eagerly (the ``--disable-cuda-graph``
server), ``"cuda"`` captures ``torch.cuda.CUDAGraph`` s, ``"emulate"`` uses
:class:`EagerGraph`, the CPU stand-in of the tests. Two runtime bugs that exist only under
graphs can be planted (:class:`Bugs`): ``stale`` (the runner refreshes the draft's input
buffer at a batch's first step only), ``padded_row`` (the runner's row index sends the first
padded row to the last real request's aux slot), ``early_layers`` (the graphs were captured
before the runtime set its capture layers: replays keep the old ones, one layer deeper here),
``swap_rows`` (the row index swaps the first two requests' rows) and ``no_residual`` (the
graph path captures the block's output without the residual added: hidden.{s} - hidden.{s-1}).
A graph-buffer budget that fits some graphs and not others is the recorder's, set by the
caller (consistency.record.graphs.enable(budget_bytes=...)). Used by tests/record/test_graphs.py,
bench/graph_proof.py and bench/graph_causes.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from consistency.record import capture, graphs


class EagerGraph:
    """torch.cuda.CUDAGraph's protocol on any device, for machines without CUDA.

    ``capture(fn)`` runs ``fn`` inside the capture hooks (as ``with torch.cuda.graph(g)``
    does); ``replay()`` re-runs it inside them again, which refreshes the plan's buffers with
    the very copies a GPU replay re-executes, then drains like a replay. Everything after the
    copy (plans, budget, trimming, tags, drain order) is the code a CUDA graph runs."""

    def __init__(self) -> None:
        self.fn: Callable[[], Any] | None = None

    def capture(self, fn: Callable[[], Any]) -> None:
        self.fn = fn
        self._run()

    def _run(self) -> None:
        assert self.fn is not None
        graphs.on_capture_begin(self)
        try:
            self.fn()
        finally:
            graphs.on_capture_end(self)

    def replay(self) -> None:
        self._run()
        if graphs.on():
            graphs.on_replay(self)


@dataclass
class Bugs:
    stale: bool = False  # draft input buffer refreshed at each batch's first step only
    padded_row: bool = False  # last real request's aux row read from the first padded row
    early_layers: bool = False  # graphs captured before the capture layers were set: each slot one layer deeper
    swap_rows: bool = False  # the row index swaps the first two requests' rows (batches of 2 or more)
    no_residual: bool = False  # the graph path captures hidden.{s} - hidden.{s-1} (the residual not added)


@dataclass
class Shape:
    """Everything static for one capture batch size."""

    bs: int
    cache: Any
    ids: torch.Tensor
    pos: torch.Tensor
    cache_pos: torch.Tensor
    rid: torch.Tensor
    next_ids: torch.Tensor
    aux_out: torch.Tensor
    draft_in: torch.Tensor
    row_index: torch.Tensor
    draft_out: torch.Tensor
    graphs: list[Any] = field(default_factory=list)


class Loop:
    def __init__(self, model: Any, draft: torch.nn.Module, aux: tuple[int, ...], capture_bs: tuple[int, ...],
                 max_len: int, graphs: str | None = None, bugs: Bugs | None = None, pad: bool = True) -> None:
        self.model, self.draft, self.aux = model, draft, aux
        self.capture_bs, self.max_len, self.mode = sorted(capture_bs), max_len, graphs
        self.bugs = bugs or Bugs()
        self.pad = pad or graphs is not None  # graphs always pad to a captured size
        self.shapes: dict[int, Shape] = {}
        self.cut = slice(None)
        self.device = next(model.parameters()).device
        self.pool = torch.cuda.graph_pool_handle() if graphs == "cuda" else None
        self.in_graph = False  # a graph body is being captured (the graph-only bugs act there)
        n = model.config.num_hidden_layers
        self.early = tuple(min(a + 1, n) for a in aux)  # the layers a graph captured too early keeps

    # -- the two graph bodies (a runtime's model forward and draft forward) -----------------------
    def target_step(self, s: Shape) -> None:
        cut = self.cut  # eager: the real rows; in a graph: every row (the drain trims the padding)
        capture("input_ids", s.ids.view(-1)[cut], producer="input_ids")
        capture("positions", s.pos.view(-1)[cut], producer="positions")
        capture("request_ids", s.rid[cut], producer="request_ids")
        out = self.model(input_ids=s.ids, position_ids=s.pos, cache_position=s.cache_pos, past_key_values=s.cache,
                         use_cache=True, output_hidden_states=True)
        hs, graph = out.hidden_states, self.in_graph
        layers = self.early if graph and self.bugs.early_layers else self.aux
        if graph and self.bugs.no_residual:
            parts = [hs[k][:, -1] - hs[k - 1][:, -1] for k in layers]
        else:
            parts = [hs[k][:, -1] for k in layers]
        s.aux_out.copy_(torch.cat(parts, dim=-1))
        s.next_ids.copy_(out.logits[:, -1:].argmax(-1))

    def draft_step(self, s: Shape, fed: torch.Tensor | None = None) -> None:
        x = fed if fed is not None else s.draft_in.index_select(0, s.row_index)
        for k, part in enumerate(x[self.cut].chunk(len(self.aux), dim=-1)):
            capture(f"aux.{k}", part, producer="runtime")
        s.draft_out.copy_(self.draft(x))

    # -- the runner -----------------------------------------------------------------------------
    def shape(self, bs: int) -> Shape:
        if bs in self.shapes:
            return self.shapes[bs]
        from transformers import StaticCache

        cfg, dev = self.model.config, self.device
        h, dt = cfg.hidden_size, self.model.dtype
        cache = StaticCache(config=cfg, max_cache_len=self.max_len)
        long = {"dtype": torch.long, "device": dev}
        s = Shape(bs, cache, torch.zeros(bs, 1, **long), torch.zeros(bs, 1, **long), torch.zeros(1, **long),
                  torch.zeros(bs, **long), torch.zeros(bs, 1, **long), torch.zeros(bs, len(self.aux) * h, dtype=dt, device=dev),
                  torch.zeros(bs, len(self.aux) * h, dtype=dt, device=dev), torch.arange(bs, device=dev),
                  torch.zeros(bs, h, dtype=dt, device=dev))
        # the cache's static tensors exist once a first pass ran (transformers allocates them lazily)
        self.model(input_ids=s.ids, position_ids=s.pos, cache_position=s.cache_pos, past_key_values=cache, use_cache=True)
        if self.mode is not None:
            s.graphs = [self._capture("loop.target", bs, lambda: self.target_step(s)),
                        self._capture("loop.draft", bs, lambda: self.draft_step(s))]
        self.shapes[bs] = s
        return s

    def _capture(self, label: str, bs: int, fn: Callable[[], None]) -> Any:
        def body() -> None:  # the graph path (captured, and re-run by EagerGraph's replays)
            self.in_graph = True
            try:
                fn()
            finally:
                self.in_graph = False

        return self._capture_graph(label, bs, body)

    def _capture_graph(self, label: str, bs: int, fn: Callable[[], None]) -> Any:
        with graphs.session(label, bs=bs, tokens=bs):
            if self.mode == "emulate":
                g = EagerGraph()
                g.capture(fn)
                return g
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # warm-up, as the runtimes do (its captures are not recorded)
                    fn()
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                fn()
            return g

    def run_batch(self, prompts: torch.Tensor, steps: int, rids: list[int]) -> torch.Tensor:
        """Prefill ``prompts`` [real, P] eagerly, then ``steps`` decode steps; the generated ids."""
        real, p = prompts.shape
        bs = next(b for b in self.capture_bs if b >= real) if self.pad else real
        s = self.shape(bs)
        s.cache.reset()
        ids = torch.zeros(bs, p, dtype=torch.long, device=self.device)
        ids[:real] = prompts  # padded requests are dummy rows of token 0
        pos = torch.arange(p, device=self.device)[None].expand(bs, -1)
        out = self.model(input_ids=ids, position_ids=pos, cache_position=torch.arange(p, device=self.device),
                         past_key_values=s.cache, use_cache=True, output_hidden_states=True)
        s.next_ids.copy_(out.logits[:, -1:].argmax(-1))
        s.rid.zero_()
        s.rid[:real] = torch.as_tensor(rids, device=self.device)
        # the prefill runs eagerly in every mode (runtimes capture decode and verify): recorded as eager passes
        capture("input_ids", ids[:real].reshape(-1), producer="input_ids")
        capture("positions", pos[:real].reshape(-1), producer="positions")
        capture("request_ids", s.rid[:real, None].expand(real, p).reshape(-1), producer="request_ids")
        fed = torch.cat([out.hidden_states[k][:real] for k in self.aux], dim=-1).reshape(real * p, -1)
        for k, part in enumerate(fed.chunk(len(self.aux), dim=-1)):
            capture(f"aux.{k}", part, producer="runtime")
        made = []
        for t in range(steps):
            s.ids.copy_(s.next_ids)
            s.pos.fill_(p + t)
            s.cache_pos.fill_(p + t)
            if self.mode is None:
                self._eager_step(s, real)
            else:
                self._graph_step(s, real, t)
            made.append(s.ids[:real, 0].clone())
        return torch.stack(made, 1)

    def _eager_step(self, s: Shape, real: int) -> None:
        self.cut = slice(0, real)
        self.target_step(s)  # the padded rows run too (a padded eager batch); trimmed views when not padded
        self.draft_step(s, fed=s.aux_out)
        self.cut = slice(None)

    def _graph_step(self, s: Shape, real: int, t: int) -> None:
        target, draft = s.graphs
        with graphs.replay_sizes(real_tokens=real, real_bs=real):
            target.replay()
            if t == 0 or not self.bugs.stale:
                s.draft_in.copy_(s.aux_out)
            s.row_index.copy_(torch.arange(s.bs, device=self.device))
            if self.bugs.padded_row and real < s.bs:
                s.row_index[real - 1] = real
            if self.bugs.swap_rows and real >= 2:
                s.row_index[:2] = torch.tensor([1, 0], device=self.device)
            draft.replay()
