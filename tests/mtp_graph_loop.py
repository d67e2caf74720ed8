"""An SGLang-shaped MTP draft runner, eager or under CUDA graphs (issue 36 item 4).

What SGLang's EAGLE/MTP worker does with a NextN draft, in small, around the released
``DeepseekModelNextN.forward`` with its patch applied (tests/record/test_patch_mtp.py
``sglang_nextn``): per batch, a prefill round whose draft extend (step 0 over every prompt
row, forward mode EXTEND) runs eagerly, then decode rounds. Each decode round the target
accepts ``width`` tokens per request; the draft-extend graph
(``EAGLEDraftExtendCudaGraphRunner``: DRAFT_EXTEND, ``width`` rows per request, batches
padded to a captured size) runs step 0 over them, and the draft graph
(``EAGLEDraftCudaGraphRunner``: ``draft_forward``, DECODE) runs steps 1..K-1 in one capture,
advancing its positions buffer in place before each step and restoring it after, on the
last row's post-norm state. Both runners follow SGLang's protocol (:class:`Runner`) and are
wrapped by consistency/record/graph_runners.py, as the released classes are. Requests have
prompts of different lengths, so the rows of one pass stand at different anchors. The
recorder's calls are the patch's: nothing here records.

``graphs`` picks the mode as in tests/graph_loop.py: ``None`` eager (the real rows only, as a
``--disable-cuda-graph`` server runs them), ``"cuda"`` ``torch.cuda.CUDAGraph`` s, ``"emulate"`` its CPU stand-in
:class:`~tests.graph_loop.EagerGraph`. Graph-only runner bugs (:class:`Bugs`): ``stale``
(the draft graph's hidden-state buffer refreshed at a batch's prefill round only: every
decode round's draft graph reads the prefill's state) and
``frozen_positions`` (the draft graph's positions advanced on the host at capture, not in
the graph: every replayed step runs at the extend's last position, so its anchors are k too
low). Used by tests/record/test_graphs_mtp.py and bench/graph_mtp.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from consistency.record import Recorder, graph_runners, mtp_patch
from tests.graph_loop import EagerGraph


@dataclass
class Bugs:
    stale: bool = False  # the draft graph's hidden input refreshed at a batch's prefill round only
    frozen_positions: bool = False  # the draft graph's steps all run at the extend's last position


def batch(mode: str, hidden: torch.Tensor) -> Any:
    """The fields of SGLang's ForwardBatch the NextN forward (and the recorder) read."""
    fm = SimpleNamespace(is_idle=lambda: False, is_decode=lambda: mode == "decode",
                         is_extend=lambda **kw: mode != "decode")
    return SimpleNamespace(forward_mode=fm, spec_info=SimpleNamespace(hidden_states=hidden))


class Runner:
    """SGLang's EAGLE draft runners' protocol (0.5.17+, tests/record/test_graph_runners.py reads it
    from the releases): ``capture_one_shape(size, forward)`` per batch size, and
    ``execute(forward_batch)`` setting ``bs``, ``raw_bs`` and ``raw_num_token`` before the
    replay; ``captured_req_width`` rows a request. Wrapped by
    consistency/record/graph_runners.py as the runtime's classes are (labels, warm-ups not
    recorded, the drain trimmed to the real rows the runner computed)."""

    def __init__(self, make: Callable[[Callable[[], None]], Any], width: int) -> None:
        self.make, self.captured_req_width, self.graphs = make, width, {}

    def capture_one_shape(self, size: int, forward: Callable[[], None]) -> None:
        self.graphs[size] = self.make(forward)

    def execute(self, forward_batch: Any) -> None:
        self.raw_bs, self.bs = forward_batch.raw_bs, forward_batch.bs
        self.raw_num_token = self.raw_bs * self.captured_req_width
        self.graphs[self.bs].replay()


class EAGLEDraftExtendCudaGraphRunner(Runner):
    """The draft extend (step 0) over the accepted rows, ``width`` a request."""


class EAGLEDraftCudaGraphRunner(Runner):
    """``draft_forward``: steps 1..K-1 in one graph, one row a request (top-k 1)."""


graph_runners.patch_runner(Runner, graph_runners.SGLANG_CAPTURE, graph_runners.SGLANG_REPLAY, (), runtime="sglang")


@dataclass
class Shape:
    """The static buffers of one captured batch size (both graphs read and write them)."""

    bs: int
    ext_ids: torch.Tensor  # [bs * width] the ids the draft extend embeds
    ext_pos: torch.Tensor  # [bs * width]
    ext_hidden: torch.Tensor  # [bs * width, H] the target's post-norm states
    last_hidden: torch.Tensor  # [bs, H] the extend's last row per request (its output)
    last_ids: torch.Tensor  # [bs]
    last_pos: torch.Tensor  # [bs]
    dec_hidden: torch.Tensor  # [bs, H] the draft graph's input buffer (the runner copies last_* in)
    dec_ids: torch.Tensor
    dec_pos: torch.Tensor
    drafted: torch.Tensor  # [K-1, bs] the draft tokens of steps 1..K-1


class MtpLoop:
    def __init__(self, target: Any, nextn: torch.nn.Module, embed: torch.nn.Embedding, capture_bs: tuple[int, ...],
                 steps: int, width: int, graphs: str | None = None, bugs: Bugs | None = None) -> None:
        self.target, self.nextn, self.embed = target, nextn, embed
        self.capture_bs, self.steps, self.width, self.mode = sorted(capture_bs), steps, width, graphs
        self.bugs = bugs or Bugs()
        self.shapes: dict[int, Shape] = {}
        self.device = embed.weight.device
        self.dtype = embed.weight.dtype
        self.pool = torch.cuda.graph_pool_handle() if graphs == "cuda" else None
        self.on_round: Callable[[int], None] | None = None  # called as each round (one draft chain) starts
        self.runners = (EAGLEDraftExtendCudaGraphRunner(self._graph, width), EAGLEDraftCudaGraphRunner(self._graph, 1))

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """The draft token of each row (tied embedding as the LM head, greedy)."""
        return (h @ self.embed.weight.T).argmax(-1)

    # -- the two graph bodies ---------------------------------------------------------------------
    def extend_step(self, s: Shape, rows: int | None = None) -> None:
        """Step 0 over ``width`` rows per request (DRAFT_EXTEND); its last rows feed the draft graph."""
        n = (rows or s.bs) * self.width
        out = self.nextn(s.ext_ids[:n], s.ext_pos[:n], batch("draft_extend", s.ext_hidden[:n]))
        last = out.view(-1, self.width, out.shape[-1])[:, -1]
        m = last.shape[0]
        s.last_hidden[:m].copy_(last)
        s.last_ids[:m].copy_(self.head(last))
        s.last_pos[:m].copy_(s.ext_pos[:n].view(-1, self.width)[:, -1])

    def draft_step(self, s: Shape, rows: int | None = None) -> None:
        """Steps 1..K-1 (SGLang ``draft_forward``): positions advanced in place, restored after."""
        m = rows or s.bs
        h, ids, pos = s.dec_hidden[:m], s.dec_ids[:m], s.dec_pos[:m]
        move = not (self.bugs.frozen_positions and self.mode is not None)
        for i in range(self.steps - 1):
            if move:
                pos.add_(1)
            h = self.nextn(ids, pos, batch("decode", h))
            ids = self.head(h)
            s.drafted[i, :m].copy_(ids)
        if move:
            pos.sub_(self.steps - 1)

    # -- the runner -----------------------------------------------------------------------------
    def shape(self, bs: int) -> Shape:
        if bs in self.shapes:
            return self.shapes[bs]
        h, w, dev = self.embed.weight.shape[1], self.width, self.device
        long = {"dtype": torch.long, "device": dev}
        flt = {"dtype": self.dtype, "device": dev}
        s = Shape(bs, torch.zeros(bs * w, **long), torch.zeros(bs * w, **long), torch.zeros(bs * w, h, **flt),
                  torch.zeros(bs, h, **flt), torch.zeros(bs, **long), torch.zeros(bs, **long),
                  torch.zeros(bs, h, **flt), torch.zeros(bs, **long), torch.zeros(bs, **long),
                  torch.zeros(max(self.steps - 1, 1), bs, **long))
        if self.mode is not None:
            self.runners[0].capture_one_shape(bs, lambda: self.extend_step(s))
            self.runners[1].capture_one_shape(bs, lambda: self.draft_step(s))
        self.shapes[bs] = s
        return s

    def _graph(self, fn: Callable[[], None]) -> Any:
        """A runner's capture of one shape: two eager warm-ups (not recorded: the runner
        hook's session), then the graph."""
        if self.mode == "emulate":
            g = EagerGraph()
            g.capture(fn)
            return g
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool):
            fn()
        return g

    def _states(self, seq: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The target's post-norm states of a whole sequence and its greedy next token."""
        out = self.target(seq[None], output_hidden_states=True)
        return out.hidden_states[-1][0].to(self.dtype), int(out.logits[0, -1].argmax())

    def run_batch(self, prompts: list[torch.Tensor], rounds: int, gen: torch.Generator) -> list[torch.Tensor]:
        """A prefill round and ``rounds`` decode rounds over requests of their own lengths;
        returns each request's final sequence (the tokens the target accepted)."""
        real = len(prompts)
        bs = next(b for b in self.capture_bs if b >= real)
        s = self.shape(bs)
        seqs = [p.to(self.device) for p in prompts]
        if self.on_round is not None:
            self.on_round(0)
        # the prefill's draft extend: eager in every mode, over every prompt row (ids shifted, the sampled token last)
        states = [self._states(x) for x in seqs]
        ids = torch.cat([torch.cat([x[1:], x.new_tensor([nxt])]) for x, (_, nxt) in zip(seqs, states)])
        pos = torch.cat([torch.arange(len(x), device=self.device) for x in seqs])
        out = self.nextn(ids, pos, batch("extend", torch.cat([fn for fn, _ in states])))
        ends = torch.tensor([len(x) for x in seqs], device=self.device).cumsum(0) - 1
        last = out[ends]
        self._feed(s, real, last, self.head(last), pos[ends])
        self._decode(s, real)
        vocab = self.embed.weight.shape[0]
        for r in range(rounds):
            if self.on_round is not None:
                self.on_round(r + 1)
            accepted = torch.randint(0, vocab, (real, self.width), generator=gen).to(self.device)
            seqs = [torch.cat([x, a]) for x, a in zip(seqs, accepted)]
            states = [self._states(x) for x in seqs]
            w = self.width
            s.ext_ids.zero_()
            s.ext_pos.zero_()
            s.ext_hidden.zero_()
            for i, (x, (fn, nxt)) in enumerate(zip(seqs, states)):  # the runner fills the static buffers
                s.ext_ids[i * w:(i + 1) * w] = torch.cat([x[len(x) - w + 1:], x.new_tensor([nxt])])
                s.ext_pos[i * w:(i + 1) * w] = torch.arange(len(x) - w, len(x), device=self.device)
                s.ext_hidden[i * w:(i + 1) * w] = fn[-w:]
            if self.mode is None:
                self.extend_step(s, real)  # eager: the real rows only (a --disable-cuda-graph server)
            else:
                self.runners[0].execute(SimpleNamespace(raw_bs=real, bs=s.bs))
            self._feed(s, real, s.last_hidden[:real], s.last_ids[:real], s.last_pos[:real], first=False)
            self._decode(s, real)
        return seqs

    def _feed(self, s: Shape, real: int, hidden: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor,
              first: bool = True) -> None:
        """The runner copies the extend's last rows into the draft graph's static buffers."""
        if first or not (self.bugs.stale and self.mode is not None):
            s.dec_hidden[:real] = hidden
        s.dec_ids[:real] = ids
        s.dec_pos[:real] = pos

    def _decode(self, s: Shape, real: int) -> None:
        if self.steps < 2:
            return
        if self.mode is None:
            self.draft_step(s, real)
            return
        self.runners[1].execute(SimpleNamespace(raw_bs=real, bs=s.bs))


# -- recording a run: one dump per draft chain ---------------------------------------------------
class PerChain:
    """One recorder per draft chain (the loop's ``on_round``: compare stitches a name's
    captures as one forward pass each, and a chain's steps have rows of their own); the
    first is open before the graphs are captured, as a server's recorder is."""

    def __init__(self, d: Path, rec_cls: type = Recorder) -> None:
        self.d, self.rec_cls, self.rec, self.paths = d, rec_cls, None, []
        d.mkdir(parents=True, exist_ok=True)
        self.open()

    def open(self) -> None:
        self.rec = self.rec_cls(self.d / f"chain{len(self.paths):02d}.safetensors", force=True)
        self.rec.__enter__()

    def __call__(self, _round: int) -> None:
        if self.rec.tensors or getattr(self.rec, "_layouts", None):  # the first one holds nothing till a round ran
            self.close()
            self.open()

    def close(self) -> None:
        self.rec.__exit__(None, None, None)
        self.paths.append(self.rec.written)


def build(device: str = "cpu", dtype: torch.dtype = torch.float32, patched: bool = True) -> tuple[Any, Any]:
    """tests/record/test_record_mtp.py's seeded tiny DeepSeek-V3 target and NextN draft (its
    embedding tied), and the released SGLang forward over the draft: patched, or released
    with consistency/record/mtp_install.py's hooks (the monkey patch) on it."""
    from tests.record.test_patch_mtp import sglang_nextn
    from tests.record.test_record_mtp import MTP, target

    model = target()
    mtp = MTP(model.get_input_embeddings(), fused=True)
    if device != "cpu" or dtype != torch.float32:
        import copy

        model = copy.deepcopy(model).to(device, dtype)
        mtp = MTP(model.get_input_embeddings(), fused=True).to(device, dtype)
    nextn = sglang_nextn(mtp, patched)
    if not patched:
        from consistency.record import mtp_install

        mtp_install.install(nextn, force=True)
    return model, (mtp, nextn)


def record(d: Path, mode: str | None, lens: tuple[tuple[int, ...], ...], capture_bs: tuple[int, ...], steps: int,
           width: int, rounds: int, bugs: Bugs | None = None, device: str = "cpu",
           dtype: torch.dtype = torch.float32, rec_cls: type = Recorder, patched: bool = True) -> list[Path]:
    """One run (batches of requests with these prompt lengths), a dump per chain, in order."""
    mtp_patch.reset()
    model, (mtp, nextn) = build(device, dtype, patched)
    loop = MtpLoop(model, nextn, mtp.embed, capture_bs, steps, width, graphs=mode, bugs=bugs)
    chains = PerChain(d, rec_cls)
    loop.on_round = chains
    g, gp = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    vocab = mtp.embed.weight.shape[0]
    with torch.no_grad():
        for sizes in lens:
            loop.run_batch([torch.randint(0, vocab, (n,), generator=gp) for n in sizes], rounds, g)
    chains.close()
    return chains.paths


def chains(lens: tuple[tuple[int, ...], ...], rounds: int) -> list[tuple[tuple[int, ...], int]]:
    """(prompt lengths, round) of each chain, in recording order."""
    return [(sizes, r) for sizes in lens for r in range(1 + rounds)]


def anchors(sizes: tuple[int, ...], r: int, k: int, width: int) -> list[int]:
    """From the construction: step 0 of the prefill round stands at every prompt row; of a
    decode round at the ``width`` rows just accepted; step k >= 1 at each request's last row."""
    ends = [n + r * width for n in sizes]  # the sequence lengths after round r
    if k > 0:
        return [e - 1 for e in ends]
    if r == 0:
        return [p for n in sizes for p in range(n)]
    return [p for e in ends for p in range(e - width, e)]


def step_of(name: str) -> int:
    base = name.split("#")[0]
    return 0 if base == "aux.0" else int(base.rsplit(".", 1)[1])
