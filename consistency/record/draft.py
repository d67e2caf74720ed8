"""Record what an MTP / EAGLE-1 draft receives and produces, step by step (issue 19).

An EAGLE-3 draft reads aux streams once; an MTP or EAGLE-1 draft reads the target's last
state at step 0 and then recycles a state of its own at every later step, and the bugs
live in those later steps (vllm #45895: the pre-norm draft state recycled where the post-
norm one is expected) and in how the draft pairs hidden rows with tokens. So a dump of a
draft holds, per step k (names: consistency/dump/names.py):

``aux.0`` (k = 0) / ``recycle.{k}`` (k >= 1)  the hidden state the draft is fed
``draft_ids.{k}``, ``draft_embed.{k}``         the tokens it embeds, their rows (after any masking)
``draft_cat.{k}``                              what its input projection (eh_proj / fc) reads
``draft_out.{k}`` / ``draft_norm.{k}``         its output before / after its own final norm

Two ways in: :func:`capture_draft_step` (one call per step from a training loop or a
runtime patch) and :class:`DraftHooks` (hooks on a draft module found by attribute names:
DeepSeek ``enorm/hnorm/eh_proj/shared_head.norm``, Qwen3-Next ``pre_fc_norm_*/fc/norm``,
MiMo ``token_layernorm/hidden_layernorm/input_proj/final_layernorm``, EAGLE-1 ``fc``).
Rows: under ``shift`` pairing row r of step k pairs hidden row r with token r+1+k, so a
reference step k has T-1-k rows (:func:`shift_rows`); a serving capture keeps whatever
rows the runtime had. Norm states are claimed only where the capture point guarantees
them (``draft_out``: none; ``draft_norm``: the draft's own norm, ``other``); the state of
``aux.0`` is what the caller says (``hidden_norm``), since finding it out is the point.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from consistency.contract.models import AuxInfo, ConcatOrder, ConsumerSpec, DumpMetadata, NormState
from consistency.dump import names
from consistency.errors import UsageError
from consistency.record.recorder import Recorder, capture

CONSUMER_KEY = "consumer"  # DumpMetadata.extra[CONSUMER_KEY] = ConsumerSpec.model_dump(mode="json")


def input_name(step: int) -> str:
    """What the draft is fed at ``step``: ``aux.0`` at step 0, ``recycle.{k}`` after."""
    if step < 0:
        raise UsageError(f"draft step {step} is negative")
    return names.aux(0) if step == 0 else names.recycle(step)


def shift_rows(tokens: int, step: int) -> int:
    """Rows of step ``step`` under shift pairing for a T-token sequence: T-1-step (never < 0)."""
    return max(int(tokens) - 1 - int(step), 0)


def set_consumer(rec: Recorder, spec: ConsumerSpec, overwrite: bool = True, *, stream: int | None = None,
                 step0_norm: NormState | str | None = None) -> None:
    """Say in the dump how its draft consumes hidden states (compare reads it back).

    ``stream`` (N for an MTP / EAGLE-1 draft: one slot, the last stream) and ``step0_norm``
    also fill ``metadata.aux``, the slot list an EAGLE-3 dump declares the same way."""
    if overwrite or CONSUMER_KEY not in rec.metadata.extra:
        rec.metadata.extra[CONSUMER_KEY] = ConsumerSpec.model_validate(spec).model_dump(mode="json")
    if stream is not None:
        rec.metadata.aux = AuxInfo(stream_ids=[int(stream)],
                                   norm=NormState(step0_norm) if step0_norm is not None else NormState.none)


def consumer_of(meta: DumpMetadata) -> ConsumerSpec | None:
    """The consumer a dump declares, or None (a dump written before issue 19 says nothing)."""
    raw = meta.extra.get(CONSUMER_KEY)
    return ConsumerSpec.model_validate(raw) if isinstance(raw, dict) else None


def _squeeze(t: Any) -> Any:
    """[1, T, H] -> [T, H] and [1, T] ids -> [T]: one sequence is stored without its batch dim
    (a [1, H] float tensor is one row, kept as it is)."""
    shape = getattr(t, "shape", None)
    if shape is None or len(shape) < 2 or shape[0] != 1:
        return t
    is_float = getattr(t, "is_floating_point", None)
    floating = is_float() if callable(is_float) else getattr(getattr(t, "dtype", None), "kind", "f") == "f"
    return t[0] if len(shape) >= 3 or not floating else t


def _detach(t: Any) -> Any:
    return t.detach() if hasattr(t, "detach") else t


def capture_draft_step(rec: Recorder | None, step: int, *, hidden_in: Any = None, ids: Any = None,
                       embed: Any = None, cat: Any = None, out: Any = None, out_norm: Any = None,
                       rows: int | None = None, hidden_norm: NormState | str | None = None,
                       token_index: Any = None, producer: str = "draft") -> list[str]:
    """Record one draft step under the per-step names; returns the names written.

    ``rec`` None writes to the active recorder (or ``CONSISTENCY_RECORD``), like
    :func:`~consistency.record.recorder.capture`. ``rows`` keeps the first ``rows`` rows of
    every tensor (a loop that computes on all T rows: pass ``shift_rows(T, step)``); a
    tensor with fewer rows than asked is refused, since that would misalign the steps.
    ``hidden_norm`` is the norm state of what ``hidden_in`` is (``final_norm`` for a
    reference fed the target's post-norm last state). ``token_index``: each row's anchor, a
    list, or a device tensor (inside a CUDA-graph capture: graph-safe mode keeps it in a
    buffer each replay refreshes, record/graphs.py).
    """
    items = [(input_name(step), hidden_in, {"norm": NormState(hidden_norm)} if hidden_norm is not None else {}),
             (names.draft(names.DRAFT_IDS, step), ids, {}),
             (names.draft(names.DRAFT_EMBED, step), embed, {}),
             (names.draft(names.DRAFT_CAT, step), cat, {}),
             (names.draft(names.DRAFT_OUT, step), out, {"norm": NormState.none}),
             (names.draft(names.DRAFT_NORM, step), out_norm, {"norm": NormState.other})]
    written: list[str] = []
    for name, t, meta in items:
        if t is None:
            continue
        t = _squeeze(_detach(t))
        if rows is not None:
            have = t.shape[0] if len(getattr(t, "shape", ())) else 0
            if have < rows:
                raise UsageError(f"{name}: {have} rows, but step {step} should have {rows}")
            t = t[:rows]
        if hasattr(token_index, "copy_"):  # device anchors of a graph capture: rows as the pass's
            meta = {**meta, "token_index": token_index[: t.shape[0]]}
        elif token_index is not None:
            meta = {**meta, "token_index": [int(i) for i in token_index][: t.shape[0]]}
        if rec is not None:
            rec.capture(name, t, producer=producer, **meta)
        else:
            capture(name, t, producer=producer, **meta)
        written.append(name)
    return written


# -- hooks on a draft module, by attribute names ---------------------------------------------------

@dataclass(frozen=True)
class DraftLayout:
    """Where a draft family keeps its parts (attribute paths under the draft module)."""

    family: str
    embed_norm: str | None  # its input is draft_embed.k (after any position-0 masking)
    hidden_norm: str | None  # its input is aux.0 / recycle.k
    proj: str  # its input is draft_cat.k
    out_norm: str | None  # its input is draft_out.k (x + residual when fused), its output draft_norm.k
    order: ConcatOrder = ConcatOrder.embed_hidden


LAYOUTS: tuple[DraftLayout, ...] = (
    DraftLayout("deepseek", "enorm", "hnorm", "eh_proj", "shared_head.norm"),  # DeepSeek-V3 / GLM NextN
    DraftLayout("qwen3_next", "pre_fc_norm_embedding", "pre_fc_norm_hidden", "fc", "norm"),
    DraftLayout("mimo", "token_layernorm", "hidden_layernorm", "input_proj", "final_layernorm",
                ConcatOrder.hidden_embed),
    DraftLayout("eagle1", None, None, "fc", None),  # SafeAILab EAGLE v1 cnets.py: fc(cat(emb, h)), no norms
)


def _get(module: Any, path: str | None) -> Any:
    if path is None:
        return None
    obj = module
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj if hasattr(obj, "register_forward_hook") else None


def find_layout(module: Any, family: str | None = None) -> DraftLayout:
    """The first layout whose parts the module has (or the named ``family``)."""
    for lay in LAYOUTS:
        if family is not None and lay.family != family:
            continue
        parts = [lay.embed_norm, lay.hidden_norm, lay.proj, lay.out_norm]
        if all(p is None or _get(module, p) is not None for p in parts):
            return lay
    known = ", ".join(lay.family for lay in LAYOUTS)
    raise UsageError(f"no draft layout ({family or known}) matches this module: expected attributes like "
                     "enorm/hnorm/eh_proj/shared_head.norm (DeepSeek) or fc (EAGLE-1)")


def _first(x: Any) -> Any:
    return x[0] if isinstance(x, (tuple, list)) else x


class DraftHooks:
    """Hooks that record a draft's steps while a training loop (or a replay) runs it.

    Each forward of the draft module is one step: step 0 first, then 1, 2, ... (or the
    step given by :meth:`step`, which also records the ids it embeds). ``reset()`` starts a
    new chain (a new batch). Under a fused-residual runtime the final norm is called as
    ``norm(x, residual)``: ``draft_out`` is then ``x + residual``, as it reads in SGLang/vLLM.
    """

    def __init__(self, module: Any, rec: Recorder | None = None, family: str | None = None, *,
                 hidden_norm: NormState | str | None = None, consumer: ConsumerSpec | None = None) -> None:
        self.module, self.rec = module, rec
        self.layout = find_layout(module, family)
        self.hidden_norm = hidden_norm
        self.next_step = 0
        self._step: int | None = None  # set inside ``with hooks.step(k)``
        self._rows: int | None = None
        self.handles: list[Any] = []
        if rec is not None and consumer is not None:
            set_consumer(rec, consumer)
        lay = self.layout
        for path, fn in ((lay.embed_norm, self._embed), (lay.hidden_norm, self._hidden), (lay.proj, self._cat)):
            mod = _get(module, path)
            if mod is not None:
                self.handles.append(mod.register_forward_pre_hook(fn, with_kwargs=True))
        norm = _get(module, lay.out_norm)
        if norm is not None:
            self.handles.append(norm.register_forward_pre_hook(self._out, with_kwargs=True))
            self.handles.append(norm.register_forward_hook(self._normed, with_kwargs=True))
        else:  # EAGLE-1: the module's own output is d_raw
            self.handles.append(module.register_forward_hook(self._raw_out, with_kwargs=True))

    @property
    def current(self) -> int:
        return self._step if self._step is not None else self.next_step

    @contextmanager
    def step(self, k: int, ids: Any = None, rows: int | None = None) -> Iterator[DraftHooks]:
        """Record the forwards inside as step ``k``; ``ids`` are the tokens it embeds."""
        self._step, self._rows = int(k), rows
        try:
            if ids is not None:
                self._put(ids=ids)
            yield self
        finally:
            self._step, self._rows = None, None
            self.next_step = int(k) + 1

    def reset(self) -> None:
        self.next_step = 0

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def _put(self, **kw: Any) -> None:
        step0_input = "hidden_in" in kw and self.current == 0  # hidden_norm describes what step 0 reads
        norm = self.hidden_norm if step0_input else None
        capture_draft_step(self.rec, self.current, rows=self._rows, hidden_norm=norm, producer="hook", **kw)

    def _arg(self, args: tuple, kwargs: dict, *keys: str) -> Any:
        if args:
            return args[0]
        for k in keys:
            if k in kwargs:
                return kwargs[k]
        return next(iter(kwargs.values()), None)

    def _embed(self, _m: Any, args: tuple, kwargs: dict) -> None:
        self._put(embed=self._arg(args, kwargs, "hidden_states", "x", "input"))

    def _hidden(self, _m: Any, args: tuple, kwargs: dict) -> None:
        self._put(hidden_in=self._arg(args, kwargs, "hidden_states", "x", "input"))

    def _cat(self, _m: Any, args: tuple, kwargs: dict) -> None:
        cat = self._arg(args, kwargs, "input", "x", "hidden_states")
        self._put(cat=cat)
        lay = self.layout
        if lay.embed_norm is None and lay.hidden_norm is None and cat is not None:  # halves are the raw inputs
            h = cat.shape[-1] // 2
            first, second = cat[..., :h], cat[..., h:]
            emb, hid = (first, second) if lay.order == ConcatOrder.embed_hidden else (second, first)
            self._put(embed=emb)
            self._put(hidden_in=hid)

    def _out(self, _m: Any, args: tuple, kwargs: dict) -> None:
        x = self._arg(args, kwargs, "hidden_states", "x", "input")
        residual = args[1] if len(args) > 1 else kwargs.get("residual")
        if x is not None:
            self._put(out=x if residual is None else x + residual)

    def _normed(self, _m: Any, _args: tuple, _kwargs: dict, out: Any) -> None:
        self._put(out_norm=_first(out))
        if self._step is None:
            self.next_step += 1

    def _raw_out(self, _m: Any, _args: tuple, _kwargs: dict, out: Any) -> None:
        self._put(out=_first(out))
        if self._step is None:
            self.next_step += 1
