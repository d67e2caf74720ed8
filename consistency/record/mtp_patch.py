"""The calls the MTP patches add to SGLang/vLLM draft model files (patches/*mtp*, *nextn*).

One import and one call per captured point, inert unless ``CONSISTENCY_RECORD`` is set
(or a :class:`~consistency.record.recorder.Recorder` is active), like
:mod:`consistency.record.patch`. A draft pass is one forward of the MTP module; which
step it is comes from, in order:

1. the runtime's own step index when it is > 0 (vLLM ``spec_step_idx``, where passed);
2. SGLang's ``forward_batch.forward_mode``: a decode pass continues the chain, an extend
   or draft-extend pass is step 0 (``eagle_worker.py``: draft extend, then decode steps);
3. otherwise a target forward in between (its ``capture_input_ids`` from the target's
   patch, or :func:`consistency.record.patch.install`) starts a new chain at step 0, and
   a pass right after another draft pass continues it (vLLM's propose loop);
4. ``CONSISTENCY_DRAFT_STEPS=K`` bounds a chain at K steps when the target is not patched.

Step 0 records ``aux.0`` (the target state the draft reads), later steps ``recycle.{k}``;
each also records ``draft_ids.k``, ``draft_embed.k`` (after position-0 masking),
``draft_cat.k`` and, where the file has them, ``draft_out.k`` / ``draft_norm.k``. Each
tensor's ``token_index`` holds the draft row (anchor) r of each row, the reference row it
is: the pass's positions minus k (step k of anchor r runs at position r + k in every
runtime: positions stay the target's and advance one per step), so ``recycle.k`` rows meet
the ``draft_norm.{k-1}`` rows they came from at equal r. Step 0 also records the target's ``input_ids``/``positions`` when its
patch left them pending. ``CONSISTENCY_RECORD_TOKENS=T`` records the first chain whose
step 0 has T rows (the prefill) and the later steps of that chain only.

Under CUDA graphs (graph-safe mode, :mod:`consistency.record.graphs`) a pass inside a graph
capture runs its Python once, at capture, so the step is decided from what is known then
and nothing a replay computes is read on the host:

a. the runtime's step index when it is > 0 (a graph captured for that step);
b. SGLang's forward mode, fixed per graph: the draft-extend graph is step 0, and the draft
   graph (``EAGLEDraftCudaGraphRunner``: ``draft_forward`` runs steps 1..N-1 in one capture)
   numbers its decode passes 1, 2, ... in capture order, which every replay repeats;
c. nothing else: a graph replayed for several steps with no index (vLLM's proposer, one
   graph per size for every step >= 1) has no step at capture; its passes are counted under
   the dump's ``cuda_graphs.not_recorded``, never recorded under a guessed name.

The anchors are computed on the device inside the graph (``positions - k``, int64, a
buffer each replay refreshes beside the pass's captures) and become each drained capture's
``token_index`` after the replay, read without a wait when the dump is written.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from consistency.dump import names
from consistency.record import graphs, patch, recorder
from consistency.record.fallback import env_count
from consistency.record.draft import CONSUMER_KEY, capture_draft_step

ENV_STEPS = "CONSISTENCY_DRAFT_STEPS"
MAX_INDEX = 1 << 16  # token_index is metadata (the file's JSON header): positions of longer passes are not kept
UNKNOWN_STEP = "MTP draft step not known at capture (no step index, no forward mode)"


@dataclass
class _Pass:
    step: int | None = None  # the step of the pass in progress; None: this pass is not recorded
    last: int | None = None  # the step of the previous draft pass
    chain: bool = False  # the current chain's step 0 was recorded (so its later steps are too)
    index: Any = None  # the anchors: a host list, or under a graph capture a device tensor


_state = _Pass()


def reset() -> None:
    """Forget the chain (tests; a server restart starts from a fresh process anyway)."""
    global _state
    _state = _Pass()


def _rows(t: Any) -> int:
    shape = getattr(t, "shape", None)
    return int(shape[0]) if shape is not None and len(shape) else 0


def _capturing_graph() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
    except ImportError:  # pragma: no cover - engines always have torch
        return False


def _decide(hint: Any, forward_batch: Any, new_target: bool) -> int:
    """The step of this pass (module docstring: runtime index, forward mode, target pass)."""
    if isinstance(hint, int) and hint > 0:
        return hint
    mode = getattr(forward_batch, "forward_mode", None)
    if mode is not None and hasattr(mode, "is_decode"):
        return _state.last + 1 if mode.is_decode() and _state.last is not None else 0
    if new_target or _state.last is None:
        return 0
    k = _state.last + 1
    bound = env_count(ENV_STEPS)
    return k % bound if bound else k


def _decide_in_graph(hint: Any, forward_batch: Any) -> int | None:
    """The step of a pass inside a graph capture (module docstring, a-c), from capture-time facts only."""
    passes = graphs.draft_pass() or 0  # counted for every pass, so the numbering never depends on which rule
    if isinstance(hint, int) and hint > 0:
        return hint
    mode = getattr(forward_batch, "forward_mode", None)
    if mode is not None and hasattr(mode, "is_decode"):
        return 1 + passes if mode.is_decode() else 0
    return None


def _anchors(positions: Any, rows: int, k: int) -> Any:
    """Each row's anchor, ``positions - k``, as an int64 device op (inside a graph: recorded into it)."""
    pos = positions.reshape(-1) if positions is not None and hasattr(positions, "reshape") else None
    if pos is None or pos.shape[0] != rows or rows > MAX_INDEX:
        return None
    import torch

    return pos.to(torch.int64) - k


def _begin_in_graph(hint: Any, input_ids: Any, positions: Any, hidden: Any, embeds: Any, forward_batch: Any,
                    row: str | None) -> None:
    """A pass inside a capture graph-safe mode plans: buffers and device anchors, no host reads."""
    k = _decide_in_graph(hint, forward_batch)
    _state.step = None
    rows = _rows(hidden)
    if rows == 0:
        return
    if k is None:
        graphs.not_recorded(UNKNOWN_STEP, "aux.0/recycle.k")
        return
    _state.step, _state.index = k, _anchors(positions, rows, k)
    if k == 0:
        _claim(row)
    ids = input_ids.reshape(-1) if input_ids is not None and hasattr(input_ids, "reshape") else None
    capture_draft_step(None, k, hidden_in=hidden, ids=ids if ids is not None and _rows(ids) == rows else None,
                       embed=embeds, token_index=_state.index, producer="runtime")


def _begin(hint: Any, input_ids: Any, positions: Any, hidden: Any, embeds: Any, forward_batch: Any,
           row: str | None) -> None:
    if patch.recording() and graphs.capturing():
        _begin_in_graph(hint, input_ids, positions, hidden, embeds, forward_batch, row)
        return
    if not patch.recording() or _capturing_graph():
        _state.step = None
        return
    pending = getattr(patch._state, "pending_ids", None)
    positions_pending = getattr(patch._state, "pending_positions", None)
    if pending is not None:  # a target forward ran since the last draft pass; its ids are ours now
        patch._state.pending_ids = None
    k = _decide(hint, forward_batch, pending is not None)
    _state.last, _state.step = k, None
    rows = _rows(hidden)
    if rows == 0 or patch._done():
        return
    if k == 0:
        want = env_count(patch.ENV_TOKENS)
        _state.chain = not (want is not None and rows != want)
    if not _state.chain:
        return
    _state.step = k
    pos = positions.reshape(-1) if positions is not None and hasattr(positions, "reshape") else None
    # the draft row (anchor) of each row: position - k (MTP keeps the target's positions, +1 per step)
    _state.index = [p - k for p in pos.tolist()] if pos is not None and pos.shape[0] == rows and rows <= MAX_INDEX \
        else None
    if k == 0:
        if pending is not None and _rows(pending.reshape(-1)) == rows:
            recorder.capture(names.INPUT_IDS, pending, producer="input_ids")
            patch._state.pending_positions = positions_pending
            patch._capture_layout(pending)
        _claim(row)
    ids = input_ids.reshape(-1) if input_ids is not None and hasattr(input_ids, "reshape") else None
    capture_draft_step(None, k, hidden_in=hidden, ids=ids if ids is not None and _rows(ids) == rows else None,
                       embed=embeds, token_index=_state.index, producer="runtime")


def _claim(row: str | None) -> None:
    """Say which runtime behaviour (contract/consumers.py row) produced this dump."""
    rec = recorder.active()
    if rec is None or row is None or CONSUMER_KEY in rec.metadata.extra:
        return
    from consistency.contract.consumers import ROWS

    for r in ROWS:
        if r.code == row:
            rec.metadata.extra[CONSUMER_KEY] = r.spec().model_dump(mode="json")
            rec.metadata.extra["consumer_row"] = row
            return


def capture_mtp_input(input_ids: Any, positions: Any, previous_hidden_states: Any, inputs_embeds: Any = None,
                      step: Any = None, row: str | None = None) -> None:
    """Top of a vLLM MTP pass: the ids it embeds, the hidden state it is fed (``aux.0`` at
    step 0, ``recycle.k`` after) and, when already known, the embedding rows."""
    _begin(step, input_ids, positions, previous_hidden_states, inputs_embeds, None, row)


def capture_nextn_input(input_ids: Any, positions: Any, forward_batch: Any, input_embeds: Any = None,
                        row: str | None = "sglang-deepseek-nextn") -> None:
    """Top of an SGLang NextN pass: the fed state is ``forward_batch.spec_info.hidden_states``."""
    if not patch.recording():
        return
    mode = getattr(forward_batch, "forward_mode", None)
    if mode is not None and hasattr(mode, "is_idle") and mode.is_idle():
        _state.step = None
        return
    hidden = getattr(getattr(forward_batch, "spec_info", None), "hidden_states", None)
    _begin(None, input_ids, positions, hidden, input_embeds, forward_batch, row)


def _put(**kw: Any) -> None:
    if _state.step is None or not patch.recording():
        return
    capture_draft_step(None, _state.step, token_index=_state.index, producer="runtime", **kw)


def capture_mtp_embed(inputs_embeds: Any) -> None:
    """The embedding rows after position-0 masking (vLLM DeepSeek/GLM/MiMo), before enorm."""
    _put(embed=inputs_embeds)


def capture_mtp_cat(*parts: Any) -> None:
    """What the input projection reads: the concatenation, or its parts (concatenated here,
    only when recording, so the patched line costs nothing otherwise)."""
    if _state.step is None or not parts:
        return
    if len(parts) == 1:
        _put(cat=parts[0])
        return
    import torch

    _put(cat=torch.cat(list(parts), dim=-1))


def capture_mtp_output(d_raw: Any = None, d_norm: Any = None, norm: Any = None) -> None:
    """The pass's output: before (``draft_out.k``) and after (``draft_norm.k``) the draft's
    own final norm; ``norm`` (a module) computes the latter from ``d_raw`` when recording."""
    if _state.step is None or not patch.recording():
        return
    if not hasattr(d_raw, "shape"):
        d_raw = None
    if d_norm is None and d_raw is not None and norm is not None:
        d_norm = norm(d_raw)
    if not hasattr(d_norm, "shape"):  # a PP stage returns IntermediateTensors
        d_norm = None
    _put(out=d_raw, out_norm=d_norm)
    _state.step = None


def capture_nextn_output(hidden_states: Any, forward_batch: Any = None) -> None:
    """SGLang NextN's return value: after ``shared_head.norm``, ``draft_norm.k``."""
    capture_mtp_output(d_norm=hidden_states)
