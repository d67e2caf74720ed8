"""Capture what a live SGLang/vLLM model feeds its EAGLE-3 draft, with or without editing files.

Two ways in, one set of calls, so both record the same tensors under the same names:

* the file patches in ``patches/`` add one import and one call per captured point to the
  engine's model file (:func:`capture_input_ids` at the top of the model's forward,
  :func:`capture_aux` where the loop appends ``hidden_states + residual``, or
  :func:`capture_aux_states` before a boundary-style model returns its collector);
* :func:`install` applies the same capture to a loaded model without editing anything:
  hooks on the inner model (its input ids, and the aux list it returns) and, for decoder
  layers that take ``(hidden_states, residual)``, on the layers the loop captures at
  (the two components, so RESIDUAL_MISSING can be proven).

Everything is inert unless ``CONSISTENCY_RECORD`` names an output file (or a
:class:`~consistency.record.recorder.Recorder` is active): the calls return after one
check, and :func:`install` installs nothing. Knobs (environment):
``CONSISTENCY_RECORD_COMPONENTS=1`` also records ``aux.{i}.hidden_states`` and
``aux.{i}.residual``; ``CONSISTENCY_RECORD_TOKENS=T`` records only forwards of exactly T
tokens (skips warm-up, profiling and decode steps). Tensors are copied to the host when
captured, so later in-place kernels (SGLang's fused add+norm) cannot change them.

Every forward pass that records slots also records ``input_ids``, ``positions`` (the
engine's own ``positions`` argument) and, on SGLang, ``request_ids`` (per token, from
``forward_batch.rids`` or ``forward_batch.req_pool_indices``), as ``#k`` captures, so
:mod:`consistency.dump.stitch` can join chunked prefill, decode steps and batched requests.
vLLM's model forward has no request ids at hand: its passes are segmented by positions.
"""

from __future__ import annotations

import inspect
import os
import threading
from dataclasses import dataclass, field
from typing import Any

from consistency.record import graphs, recorder
from consistency.record.fallback import env_count
from consistency.record.recorder import ENV_PATH, capture
from consistency.record.requests import request_keys as request_keys  # re-exported for patch users
from consistency.record.requests import request_numbers

ENV_COMPONENTS = "CONSISTENCY_RECORD_COMPONENTS"
ENV_TOKENS = "CONSISTENCY_RECORD_TOKENS"
CAPTURE_ATTRS = ("layers_to_capture", "aux_hidden_state_layers")  # SGLang, vLLM: stream ids

_state = threading.local()  # per forward thread: the pending input ids
_forced_components = False  # set by install(components=True): hooks may run on another thread


def recording() -> bool:
    """True when captures go somewhere: an active Recorder or ``CONSISTENCY_RECORD``."""
    return recorder.active() is not None or bool(os.environ.get(ENV_PATH))


def components_on() -> bool:
    return _forced_components or os.environ.get(ENV_COMPONENTS, "") not in ("", "0")


def _rows(t: Any) -> int | None:
    shape = getattr(t, "shape", None)
    if shape is None or len(shape) == 0:
        return None
    n = 1
    for d in shape[:-1] if len(shape) > 1 else shape:
        n *= int(d)
    return n


def _skip(value: Any) -> bool:
    """Forwards we do not record: other token counts than asked, and CUDA-graph capture."""
    if graphs.capturing():  # graph-safe mode buffers it; ENV_TOKENS is applied to each replay's real rows
        return False
    want = env_count(ENV_TOKENS)
    if want is not None and _rows(value) != want:
        return True
    return graphs.stream_capturing()


def _env_recorder() -> Any:
    """The recorder CONSISTENCY_RECORD created (not a Recorder someone opened in code)."""
    rec, path = recorder.active(), os.environ.get(ENV_PATH)
    if rec is None or not path or rec.path != recorder.rank_path(path, rec.rank, rec.world):
        return None
    return rec


def _done() -> bool:
    """With CONSISTENCY_RECORD_TOKENS the first matching forward is the dump: once written, stop."""
    rec = _env_recorder()
    return rec is not None and rec.written is not None


def _finish_forward() -> None:
    """A forward that recorded slots is over: write it now (a server need not exit for it)."""
    rec = _env_recorder()
    if rec is not None and env_count(ENV_TOKENS) is not None and rec.has_captures() and rec.written is None:
        rec.save()


def capture_input_ids(input_ids: Any, positions: Any = None, forward_batch: Any = None) -> None:
    """Remember this forward's token ids (and positions, request ids); they are recorded with
    its first aux slot, as ``input_ids#k``, ``positions#k`` and ``request_ids#k``, so the
    captures of a chunked prefill, its decode steps and a batch's requests can be stitched
    (:mod:`consistency.dump.stitch`)."""
    if not recording():
        return
    _finish_forward()  # the previous forward is complete
    _state.pending_ids = input_ids
    _state.pending_positions = positions
    _state.pending_batch = forward_batch


def _capture_layout(ids: Any) -> None:
    """positions#k and request_ids#k of the pass whose input_ids#k was just captured."""
    positions = getattr(_state, "pending_positions", None)
    batch = getattr(_state, "pending_batch", None)
    _state.pending_positions = _state.pending_batch = None
    tokens = _rows(ids) or 0
    if positions is not None and _rows(positions) == tokens and not getattr(positions, "is_floating_point", lambda: True)():
        capture("positions", positions.reshape(-1), producer="positions")
    else:
        positions = None
    if graphs.capturing():  # no host read inside a CUDA graph: the runner hook gives them at each replay
        keys = graphs.defer("request_ids") if batch is not None else None
    else:
        keys = request_keys(batch, tokens)
    if keys is not None and len(keys) == tokens:
        capture("request_ids", request_numbers(keys, positions, _state), producer="request_ids")


def capture_aux(slot: int, value: Any, hidden_states: Any = None, residual: Any = None) -> None:
    """One aux slot as the model loop appends it (classic fused-residual loops).

    ``value`` is the tensor appended to ``aux_hidden_states`` (what the draft receives);
    ``hidden_states``/``residual`` are its two parts, recorded when components are on.
    """
    if not recording() or _skip(value) or _done():
        return
    if slot == 0:
        ids = getattr(_state, "pending_ids", None)
        _state.pending_ids = None
        if ids is not None:
            capture("input_ids", ids, producer="input_ids")
            _capture_layout(ids)
    capture(f"aux.{slot}", value, producer="runtime")
    if components_on():
        if hidden_states is not None:
            capture(f"aux.{slot}.hidden_states", hidden_states, producer="component")
        if residual is not None:
            capture(f"aux.{slot}.residual", residual, producer="component")


def capture_aux_states(aux: Any, num: int | None = None) -> None:
    """Every slot of a collected aux list, packed tensor or packer, right before it is returned.

    Boundary-style models (SGLang >= 0.5.22 llama.py, >= 0.5.21 deepseek_v2.py) capture
    inside the layer boundary; what they return is exactly what the draft receives. A
    packed ``[T, K*H]`` tensor is split into ``num`` slots (a packer knows its count).
    """
    if not recording():
        return
    for k, t in enumerate(_slots(aux, num)):
        capture_aux(k, t)
    _finish_forward()


def _slots(aux: Any, num: int | None) -> list[Any]:
    if aux is None:
        return []
    if hasattr(aux, "finalize") and not isinstance(aux, (list, tuple)):  # SGLang AuxHiddenStatePacker
        count = len(aux)
        try:
            aux = aux.finalize()
        except RuntimeError:  # incomplete capture: upstream raises on its own next line
            return []
        num = num or count
    if isinstance(aux, (list, tuple)):
        return list(aux)
    if hasattr(aux, "chunk") and num:
        return list(aux.chunk(num, dim=-1))
    return [aux] if aux is not None else []


# -- the monkey patch -------------------------------------------------------------------------

@dataclass
class Installed:
    """Handles of an :func:`install`; :meth:`remove` restores the model."""

    inner: Any
    attr: str
    handles: list[Any] = field(default_factory=list)
    components: bool = False

    def remove(self) -> None:
        global _forced_components
        for h in self.handles:
            h.remove()
        self.handles.clear()
        _forced_components = False


def find_inner(model: Any) -> tuple[Any, str]:
    """The module that owns the decoder layers and the capture list (SGLang or vLLM)."""
    candidates = [model] + [m for _n, m in getattr(model, "named_modules", list)()]
    for m in candidates:
        layers = getattr(m, "layers", None)
        if layers is None or not hasattr(layers, "__len__"):
            continue
        for attr in CAPTURE_ATTRS:
            if hasattr(m, attr):
                return m, attr
    raise ValueError("no module with decoder `layers` and `layers_to_capture` (SGLang) or "
                     "`aux_hidden_state_layers` (vLLM) found; is this an EAGLE-3 capable target model?")


def _takes_residual(layer: Any) -> bool:
    try:
        return "residual" in inspect.signature(layer.forward).parameters
    except (TypeError, ValueError):
        return False


def install(model: Any, components: bool | None = None, force: bool = False) -> Installed | None:
    """Hook ``model`` (an SGLang/vLLM ``*ForCausalLM`` or its inner model) to record its aux states.

    Does nothing and returns None unless ``CONSISTENCY_RECORD`` is set (or ``force``).
    The aux values are taken from what the inner model returns, so they are exactly what
    the draft receives; input ids from its first argument; the components (classic loops
    only) from the inputs of the layers it captures before, cloned at that moment.
    """
    global _forced_components
    if not (force or os.environ.get(ENV_PATH)):
        return None
    inner, attr = find_inner(model)
    inst = Installed(inner, attr, components=bool(components) if components is not None else components_on())
    _forced_components = inst.components
    layers = inner.layers
    n = len(layers)
    pending: list[tuple[int, Any, Any]] = []  # (stream, hidden_states, residual) seen this forward

    def caps() -> set[int]:
        return {int(s) for s in (getattr(inner, attr, None) or ())}

    def before(_m: Any, args: tuple, kwargs: dict) -> None:
        pending.clear()
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None and getattr(ids, "dtype", None) is not None and not ids.dtype.is_floating_point:
            try:
                bound = inspect.signature(inner.forward).bind_partial(*args, **kwargs).arguments
            except TypeError:
                bound = {}
            if "positions" not in bound:  # a forward(*args, **kwargs) wrapper: the engines' order
                bound = {"positions": kwargs.get("positions", args[1] if len(args) > 1 else None),
                         "forward_batch": kwargs.get("forward_batch", args[2] if len(args) > 2 else None)}
            batch = bound.get("forward_batch")
            capture_input_ids(ids, bound.get("positions"), batch if hasattr(batch, "forward_mode") else None)

    def after(_m: Any, _args: tuple, _kwargs: dict, out: Any) -> None:
        aux = out[1] if isinstance(out, tuple) and len(out) == 2 else None
        if aux is None or not recording():
            return
        num = len(caps()) if hasattr(aux, "chunk") else None
        slots = _slots(aux, num)
        parts = sorted(pending, key=lambda p: p[0])
        for k, t in enumerate(slots):
            h, r = (parts[k][1], parts[k][2]) if inst.components and k < len(parts) else (None, None)
            capture_aux(k, t, h, r)
        pending.clear()
        if slots and not _skip(slots[0]):
            _claim_streams(sorted(caps())[: len(slots)], attr, inner)
        _finish_forward()

    def clone(t: Any) -> Any:
        return None if t is None else t.detach().clone()

    def layer_pre(s: int) -> Any:
        def hook(layer: Any, args: tuple, kwargs: dict) -> None:
            if s in caps():
                bound = inspect.signature(layer.forward).bind_partial(*args, **kwargs).arguments
                h = bound.get("hidden_states")
                if h is not None and not _skip(h) and not _done():  # clone only what will be recorded
                    pending.append((s, clone(h), clone(bound.get("residual"))))
        return hook

    def last_post(layer: Any, _args: tuple, _kwargs: dict, out: Any) -> None:
        if n in caps() and attr == "aux_hidden_state_layers" and isinstance(out, tuple) and len(out) >= 2 \
                and not _skip(out[0]) and not _done():
            pending.append((n, clone(out[0]), clone(out[1])))  # vLLM appends stream N after the loop

    inst.handles.append(inner.register_forward_pre_hook(before, with_kwargs=True))
    inst.handles.append(inner.register_forward_hook(after, with_kwargs=True))
    if inst.components:
        for s, layer in enumerate(layers):
            if _takes_residual(layer):
                inst.handles.append(layer.register_forward_pre_hook(layer_pre(s), with_kwargs=True))
        if n and _takes_residual(layers[n - 1]):
            inst.handles.append(layers[n - 1].register_forward_hook(last_post, with_kwargs=True))
    return inst


def _claim_streams(streams: list[int], attr: str, inner: Any) -> None:
    """Say in the dump which streams the runtime captured (its capture list is in stream ids)."""
    rec = recorder.active()
    if rec is None or rec.metadata.aux is not None:
        return
    from consistency.record.recorder import aux_info, model_info

    rec.metadata.aux = aux_info(streams, convention="sglang-internal" if attr == "layers_to_capture" else "vllm")
    cfg = getattr(inner, "config", None)
    if cfg is not None and rec.metadata.model is None:
        rec.metadata.model = model_info(cfg)


# -- no edit, no code: patch the engine's classes as they are imported ---------------------------

ENV_CLASSES = "CONSISTENCY_RECORD_CLASSES"
# module -> inner model classes that own `layers` and the capture list (SGLang, vLLM)
TARGETS: dict[str, tuple[str, ...]] = {
    "sglang.srt.models.llama": ("LlamaModel",),
    "sglang.srt.models.deepseek_v2": ("DeepseekV2Model",),
    "sglang.srt.models.qwen2": ("Qwen2Model",),
    "sglang.srt.models.qwen3": ("Qwen3Model",),
    "sglang.srt.models.qwen3_moe": ("Qwen3MoeModel",),
    "vllm.model_executor.models.llama": ("LlamaModel",),
    "vllm.model_executor.models.deepseek_v2": ("DeepseekV2Model",),
    "vllm.model_executor.models.qwen2": ("Qwen2Model",),
    "vllm.model_executor.models.qwen3": ("Qwen3Model",),
}


def patch_class(cls: type) -> type:
    """Make every instance of ``cls`` call :func:`install` on itself right after ``__init__``."""
    if "_consistency_patched" in cls.__dict__:
        return cls
    init = cls.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        if "_consistency_hooks" not in self.__dict__:  # once per instance, whatever the class chain
            self.__dict__["_consistency_hooks"] = install(self)

    __init__.__wrapped__ = init  # type: ignore[attr-defined]
    cls.__init__ = __init__  # type: ignore[method-assign]
    cls._consistency_patched = True  # type: ignore[attr-defined]
    return cls


def targets() -> dict[str, tuple[str, ...]]:
    """TARGETS plus ``CONSISTENCY_RECORD_CLASSES=module:Class,module:Class``."""
    out = dict(TARGETS)
    for item in filter(None, os.environ.get(ENV_CLASSES, "").split(",")):
        mod, _, cls = item.strip().partition(":")
        out[mod] = (*out.get(mod, ()), cls)
    return out


def auto() -> None:
    """Patch the target classes when their modules are imported (inert without CONSISTENCY_RECORD).

    Called from ``sitecustomize`` (``consistency/record/autopatch/``), so it also runs in
    the worker processes SGLang and vLLM spawn, which import the model files themselves.
    """
    from consistency.record.import_hook import install as on_import

    if not os.environ.get(ENV_PATH):
        return
    wanted = targets()

    def patch_module(mod: Any) -> None:
        for name in wanted.get(mod.__name__, ()):
            cls = getattr(mod, name, None)
            if isinstance(cls, type):
                patch_class(cls)

    on_import(__name__, wanted, patch_module)
