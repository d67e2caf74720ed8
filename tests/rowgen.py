"""A CPU scenario generator for row groups: planted graph-only causes on a subset of rows.

A server's decode loop (tests/graph_loop.py) runs a real tiny Llama eagerly for the prefill
and under (emulated) CUDA graphs for the decode steps. Each planted cause touches only the
rows a graph replay computes -- or a subset of them -- the way the bugs that exist only
under graphs do:

* ``layers``: the graphs were captured before the runtime set its capture layers, so the
  replays keep the old ones (every slot one layer later: stream s + 1);
* ``residual``: the graph path feeds the block delta (hidden.s - hidden.{s-1}): the residual
  not added there;
* ``norm``: the graph path feeds the stream after the model's norm (a fused add+norm output);
* ``swap``: the graph path swaps the first two requests' rows of a batch (the runner's row
  index), at the same position: only batches of two or more real requests;
* ``stale``: the draft's input buffer refreshed at a batch's first decode step only (the
  existing ``Bugs.stale``).

The reference is the same loop run eagerly with every stream recorded (``hidden.s``) beside
the slots, so the rows can be identified; expected answers (which rows, which cause, which
graphs) come from the construction: :func:`expected`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from consistency.contract.models import AuxInfo
from consistency.dump.reader import open_dump
from consistency.dump.writer import write_dump
from consistency.record import Recorder, capture
from tests.conftest import tiny
from tests.graph_loop import Bugs, Loop

BATCHES = (3, 1, 4, 5, 2)  # -> graphs 4, 1, 4, 8, 2
CAPTURE_BS = (1, 2, 4, 8)
STEPS, PROMPT = 3, 5
AUX = (2, 6, 9)
CAUSES = {"layers": "LAYER_MISMATCH", "residual": "RESIDUAL_MISSING", "norm": "NORM_APPLIED", "swap": "ROWS_SWAPPED",
          "stale": "STALE_ROWS"}


class Planted(Loop):
    """The loop with one cause planted in the target graph's output buffer (graph path only:
    the eager prefill never runs ``target_step``)."""

    cause: str | None = None

    def target_step(self, s) -> None:  # noqa: ANN001
        cut = self.cut
        capture("input_ids", s.ids.view(-1)[cut], producer="input_ids")
        capture("positions", s.pos.view(-1)[cut], producer="positions")
        capture("request_ids", s.rid[cut], producer="request_ids")
        out = self.model(input_ids=s.ids, position_ids=s.pos, cache_position=s.cache_pos, past_key_values=s.cache,
                         use_cache=True, output_hidden_states=True)
        hs = out.hidden_states
        if self.cause == "layers":
            parts = [hs[k + 1][:, -1] for k in self.aux]
        elif self.cause == "residual":
            parts = [(hs[k] - hs[k - 1])[:, -1] for k in self.aux]
        elif self.cause == "norm":
            parts = [self.model.model.norm(hs[k])[:, -1] for k in self.aux]
        else:
            parts = [hs[k][:, -1] for k in self.aux]
        x = torch.cat(parts, dim=-1)
        if self.cause == "swap" and self.mode is not None and s.bs >= 2:
            x = x[torch.tensor([1, 0] + list(range(2, s.bs)), device=x.device)]
        s.aux_out.copy_(x)
        s.next_ids.copy_(out.logits[:, -1:].argmax(-1))


@dataclass(frozen=True)
class Expected:
    code: str
    rows: list[int]  # stitched rows (request by request: its prompt, then its decode steps)
    sizes: list[int]  # the graphs' batch sizes the rows come from
    holds_stream: dict[int, int] | None = None  # slot -> the stream its rows hold (layers)


def _padded(real: int) -> int:
    return next(b for b in CAPTURE_BS if b >= real)


def expected(cause: str) -> Expected:
    per, rows, rid, sizes = PROMPT + STEPS, [], 0, set()
    for real in BATCHES:
        for r in range(rid, rid + real):
            if cause in ("layers", "residual", "norm"):
                steps = range(STEPS)
            elif cause == "stale":
                steps = range(1, STEPS)
            else:
                steps = range(STEPS) if r - rid < 2 and real >= 2 else range(0)
            rows += [r * per + PROMPT + t for t in steps]
            if list(steps):
                sizes.add(_padded(real))
        rid += real
    held = {i: s + 1 for i, s in enumerate(AUX)} if cause == "layers" else None
    return Expected(CAUSES[cause], sorted(rows), sorted(sizes), held)


def _model():  # noqa: ANN202
    model = tiny("tiny-llama")
    torch.manual_seed(0)
    return model


def _run(loop: Loop, path: Path) -> Path:
    g = torch.Generator().manual_seed(1)
    with Recorder(path, force=True) as rec:
        rid = 0
        for real in BATCHES:
            loop.run_batch(torch.randint(0, loop.model.config.vocab_size, (real, PROMPT), generator=g), STEPS,
                           list(range(rid, rid + real)))
            rid += real
    return rec.written


def reference(d: Path) -> Path:
    """The eager loop with every stream 0..N-1 recorded (as ``hidden.s``) and the slots."""
    model = _model()
    n, h = model.config.num_hidden_layers, model.config.hidden_size
    every = tuple(range(n))
    draft = torch.nn.Linear(len(every) * h, h)
    raw = _run(Loop(model, draft, every, CAPTURE_BS, PROMPT + STEPS + 1, graphs=None), d / "every.safetensors")
    with open_dump(raw) as dump:
        meta = dump.metadata.model_copy(deep=True)
        tens = {}
        for key, v in dump.tensors.items():
            base, _, k = key.partition("#")
            tail = f"#{k}" if k else ""
            if base.startswith("aux."):
                s = int(base[4:])
                tens[f"hidden.{s}{tail}"] = v.read_all()
                if s in AUX:
                    tens[f"aux.{AUX.index(s)}{tail}"] = v.read_all()
            else:
                tens[key] = v.read_all()
    meta.tensors = {}
    meta.side = "training"
    meta.aux = AuxInfo(stream_ids=list(AUX))
    return write_dump(d / "ref.safetensors", tens, meta, force=True)


def candidate(d: Path, cause: str) -> Path:
    """The graph loop (emulated graphs) with ``cause`` planted on the graph path."""
    model = _model()
    h = model.config.hidden_size
    torch.manual_seed(0)
    draft = torch.nn.Linear(len(AUX) * h, h)
    bugs = Bugs(stale=True) if cause == "stale" else None
    loop = Planted(model, draft, AUX, CAPTURE_BS, PROMPT + STEPS + 1, graphs="emulate", bugs=bugs)
    loop.cause = cause if cause != "stale" else None
    return _run(loop, d / f"{cause}.safetensors")

