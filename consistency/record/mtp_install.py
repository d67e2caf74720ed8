"""Record an SGLang/vLLM MTP draft without editing its file: hooks that make the patches' calls.

The same calls as patches/{sglang-deepseek_nextn,vllm-deepseek_mtp,vllm-qwen3_next_mtp}.patch
(consistency/record/mtp_patch.py), made from forward hooks on the loaded draft, so both
ways record the same names (tests/record/test_patch_mtp.py checks they record the same tensors):

* the draft module's pre-hook: what it is fed (``aux.0`` / ``recycle.k``), its ids, its step;
* the embedding norm's pre-hook (``enorm`` / ``pre_fc_norm_embedding``): the embedding rows
  after any position-0 masking;
* the input projection's pre-hook (``eh_proj`` / ``fc``): the concatenation;
* the layer's (or module's) forward hook: its output, before and/or after its final norm.

SGLang's CUDA path fuses ``enorm``/``hnorm`` into one kernel (``fused_eh_norm``), so the
embedding is taken from ``embed_tokens`` in the pre-hook there. Inert unless
``CONSISTENCY_RECORD`` is set; :func:`auto` patches the classes as they are imported (the
``sitecustomize`` in consistency/record/autopatch calls it).
"""

from __future__ import annotations

import inspect
import os
from typing import Any

from consistency.record import mtp_patch
from consistency.record.patch import Installed, recording
from consistency.record.recorder import ENV_PATH

# module -> classes whose instances get :func:`install` after __init__
TARGETS: dict[str, tuple[str, ...]] = {
    "sglang.srt.models.deepseek_nextn": ("DeepseekModelNextN",),
    "vllm.model_executor.models.deepseek_mtp": ("DeepSeekMultiTokenPredictor",),
    "vllm.model_executor.models.qwen3_next_mtp": ("Qwen3NextMultiTokenPredictor",),
}


def _bound(fn: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    try:
        return dict(inspect.signature(fn).bind_partial(*args, **kwargs).arguments)
    except (TypeError, ValueError):
        return dict(kwargs)


def _first(args: tuple, kwargs: dict) -> Any:
    return args[0] if args else next(iter(kwargs.values()), None)


def _kind(m: Any) -> str:
    if hasattr(m, "eh_proj") and hasattr(m, "decoder") and hasattr(m, "shared_head"):
        return "sglang-nextn"
    if hasattr(m, "pre_fc_norm_embedding") and hasattr(m, "fc"):
        return "vllm-qwen3-next"
    layers = getattr(m, "layers", None)
    if layers is not None and hasattr(layers, "values") and all(hasattr(v, "eh_proj") for v in layers.values()):
        return "vllm-deepseek"
    raise ValueError("not an MTP draft module this knows: expected SGLang DeepseekModelNextN (enorm, eh_proj, "
                     "decoder, shared_head), vLLM DeepSeekMultiTokenPredictor or Qwen3NextMultiTokenPredictor")


def install(model: Any, force: bool = False) -> Installed | None:
    """Hook an MTP draft module; None (nothing installed) unless ``CONSISTENCY_RECORD`` is set."""
    if not (force or os.environ.get(ENV_PATH)):
        return None
    kind = _kind(model)
    inst = Installed(model, kind)
    add = inst.handles.append

    def pre(fn: Any) -> Any:
        return lambda _m, args, kwargs: fn(args, kwargs)

    def on_cat(args: tuple, kwargs: dict) -> None:
        mtp_patch.capture_mtp_cat(_first(args, kwargs))

    def on_embed(args: tuple, kwargs: dict) -> None:
        mtp_patch.capture_mtp_embed(_first(args, kwargs))

    if kind == "sglang-nextn":
        def begin(args: tuple, kwargs: dict) -> None:
            b = _bound(model.forward, args, kwargs)
            ids, emb = b.get("input_ids"), b.get("input_embeds")
            if emb is None and ids is not None and recording() and hasattr(model, "embed_tokens"):
                emb = model.embed_tokens(ids)
            mtp_patch.capture_nextn_input(ids, b.get("positions"), b.get("forward_batch"), emb)

        add(model.register_forward_pre_hook(pre(begin), with_kwargs=True))
        add(model.eh_proj.register_forward_pre_hook(pre(on_cat), with_kwargs=True))
        add(model.register_forward_hook(lambda _m, _a, out: mtp_patch.capture_nextn_output(out)))
        return inst

    def begin_vllm(args: tuple, kwargs: dict) -> None:
        b = _bound(model.forward, args, kwargs)
        hidden = b.get("previous_hidden_states", b.get("hidden_states"))
        row = "vllm-deepseek-mtp" if kind == "vllm-deepseek" else "vllm-qwen3-next-mtp"
        mtp_patch.capture_mtp_input(b.get("input_ids"), b.get("positions"), hidden, None,
                                    step=b.get("spec_step_idx"), row=row)

    add(model.register_forward_pre_hook(pre(begin_vllm), with_kwargs=True))
    if kind == "vllm-qwen3-next":
        add(model.pre_fc_norm_embedding.register_forward_pre_hook(pre(on_embed), with_kwargs=True))
        add(model.fc.register_forward_pre_hook(pre(on_cat), with_kwargs=True))
        add(model.register_forward_hook(lambda _m, _a, out: mtp_patch.capture_mtp_output(d_norm=out)))
        return inst
    for layer in model.layers.values():
        add(layer.enorm.register_forward_pre_hook(pre(on_embed), with_kwargs=True))
        add(layer.eh_proj.register_forward_pre_hook(pre(on_cat), with_kwargs=True))

        def done(lay: Any, _a: Any, out: Any) -> None:
            if isinstance(out, tuple) and len(out) == 2:  # since vllm #45895: (pre-norm, post-norm)
                mtp_patch.capture_mtp_output(out[0], out[1])
            else:  # before it: the pre-norm state only, also what was recycled
                mtp_patch.capture_mtp_output(out, norm=getattr(lay, "shared_head", None))

        add(layer.register_forward_hook(done))
    return inst


def patch_class(cls: type) -> type:
    """Every instance of ``cls`` calls :func:`install` on itself right after ``__init__``."""
    if "_consistency_mtp_patched" in cls.__dict__:
        return cls
    init = cls.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        if "_consistency_mtp_hooks" not in self.__dict__:
            try:
                self.__dict__["_consistency_mtp_hooks"] = install(self)
            except ValueError as exc:  # a release that moved the parts: say so, never stop the server
                self.__dict__["_consistency_mtp_hooks"] = None
                from consistency.escape import term
                from consistency.record.fallback import emit

                emit(f"consistency: {type(self).__name__} not recorded: {term(exc)}")

    __init__.__wrapped__ = init  # type: ignore[attr-defined]
    cls.__init__ = __init__  # type: ignore[method-assign]
    cls._consistency_mtp_patched = True  # type: ignore[attr-defined]
    return cls


def auto() -> None:
    """Patch the MTP classes of TARGETS when their modules are imported (inert without CONSISTENCY_RECORD)."""
    from consistency.record.import_hook import install as on_import

    if not os.environ.get(ENV_PATH):
        return

    def patch_module(mod: Any) -> None:
        for name in TARGETS.get(mod.__name__, ()):
            cls = getattr(mod, name, None)
            if isinstance(cls, type):
                patch_class(cls)

    on_import(__name__, TARGETS, patch_module)
