"""Graph-safe capture in SGLang's and vLLM's CUDA-graph runners, without editing their files.

The model patches (patches/, :mod:`consistency.record.patch`) call ``capture`` inside the
model's forward; under CUDA graphs that forward runs once per graph, at capture.
:mod:`consistency.record.graphs` turns those calls into graph buffers; what it needs from the
runtime, these hooks supply by wrapping the runner methods that every pinned release has
(tests/record/test_graph_runners.py reads them from the released wheels):

* **capture, per shape**: SGLang ``capture_one_batch_size(bs, forward, ...)`` (<= 0.5.17) /
  ``capture_one_shape(size, forward, ...)`` (>= 0.5.21) of the decode/verify runner and the
  EAGLE draft and draft-extend runners; vLLM ``GPUModelRunner._warmup_and_capture(batch_desc,
  ...)``, one batch descriptor (padded tokens, requests) at a time. Inside,
  the runtime's warm-up forwards (dummy inputs, run eagerly) are not recorded, and the
  graphs captured are labelled with the runner and batch size;
* **replay**: SGLang ``replay(forward_batch, ...)`` / ``execute(forward_batch, ...)``: the graphs
  replayed inside are drained when it returns, with the real rows the runner computed
  (``raw_num_token``, else ``raw_bs`` x tokens per request) and the request ids of
  ``forward_batch.rids`` (host strings: no device read); vLLM
  ``GPUModelRunner._get_slot_mappings(num_tokens_padded=, num_reqs_padded=, num_tokens_unpadded=)``,
  called before every forward (vLLM 0.25 - 0.33), gives the next replay its real token count.

Inert unless ``CONSISTENCY_RECORD_GRAPHS=1`` and ``CONSISTENCY_RECORD`` are set;
:func:`auto` (the autopatch ``sitecustomize``) patches the classes as they are imported.
"""

from __future__ import annotations

import functools
import os
import threading
from typing import Any

from consistency.record import graphs
from consistency.record.graph_plan import Replay

# module -> class -> (capture, replay, real-size, forward-end methods): any of each that the class defines
SGLANG_CAPTURE = ("capture_one_batch_size", "capture_one_shape")
SGLANG_REPLAY = ("replay", "execute")
Spec = tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...], tuple[str, ...]]
SGLANG: Spec = (SGLANG_CAPTURE, SGLANG_REPLAY, (), ())
TARGETS: dict[str, dict[str, Spec]] = {
    "sglang.srt.model_executor.cuda_graph_runner": {"CudaGraphRunner": SGLANG},
    "sglang.srt.model_executor.runner.decode_cuda_graph_runner": {"DecodeCudaGraphRunner": SGLANG},
    "sglang.srt.speculative.eagle_draft_cuda_graph_runner": {"EAGLEDraftCudaGraphRunner": SGLANG},
    "sglang.srt.speculative.eagle_draft_extend_cuda_graph_runner": {"EAGLEDraftExtendCudaGraphRunner": SGLANG},
    # the target forward ends in _model_forward: sizes not used by then are dropped, so the
    # drafter's graphs (replayed after it) never take the target's real token count
    "vllm.v1.worker.gpu_model_runner": {
        "GPUModelRunner": (("_warmup_and_capture",), (), ("_get_slot_mappings",), ("_model_forward",))},
}
PER_REQUEST = ("num_tokens_per_bs", "captured_req_width")  # SGLang: token rows per request in a graph

_tls = threading.local()


def per_request(runner: Any) -> int:
    for attr in PER_REQUEST:
        v = getattr(runner, attr, None)
        if isinstance(v, int) and v > 0:
            return v
    return 1


def sglang_sizes(runner: Any, forward_batch: Any) -> Replay:
    """What the runner's replay just used: its padded batch ``bs``, real ``raw_bs`` and real
    token rows ``raw_num_token`` (else ``raw_bs`` x rows per request); the padded token
    rows are each graph's own (its buffers' rows at capture)."""
    per = per_request(runner)
    bs, raw_bs = getattr(runner, "bs", None), getattr(runner, "raw_bs", None)
    raw_tokens = getattr(runner, "raw_num_token", None)
    if not isinstance(raw_tokens, int):
        raw_tokens = raw_bs * per if isinstance(raw_bs, int) else None
    return Replay(real_tokens=raw_tokens, real_bs=raw_bs if isinstance(raw_bs, int) else None,
                  padded_bs=bs if isinstance(bs, int) else None,
                  values={"request_ids": functools.partial(request_ids, forward_batch)})


def request_ids(forward_batch: Any, tokens: int | None) -> Any:
    """One integer per real token from ``forward_batch.rids`` (host strings), numbered as the
    eager path numbers them (consistency/record/requests.py); None without rids."""
    from consistency.record.requests import request_numbers

    rids = getattr(forward_batch, "rids", None)
    if not isinstance(rids, (list, tuple)) or not rids or tokens is None or tokens % len(rids):
        return None
    share = tokens // len(rids)
    return request_numbers([str(r) for r in rids for _ in range(share)], None, _tls)


def _wrap_capture(cls: type, name: str, runtime: str) -> None:
    orig = cls.__dict__[name]

    @functools.wraps(orig)
    def capture(self: Any, size: Any, *args: Any, **kwargs: Any) -> Any:
        # SGLang passes the batch size (or token count); vLLM a BatchDescriptor (num_tokens, num_reqs)
        bs = size if isinstance(size, int) else getattr(size, "num_reqs", None)
        tokens = getattr(size, "num_tokens", None) if not isinstance(size, int) else None
        with graphs.session(f"{runtime}.{type(self).__name__}", bs=bs if isinstance(bs, int) else None,
                            tokens=tokens if isinstance(tokens, int) else None):
            return orig(self, size, *args, **kwargs)

    setattr(cls, name, capture)


def _wrap_replay(cls: type, name: str, _runtime: str) -> None:
    orig = cls.__dict__[name]

    @functools.wraps(orig)
    def replay(self: Any, forward_batch: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(_tls, "replaying", False):  # a subclass's replay calling its base's: drained once
            return orig(self, forward_batch, *args, **kwargs)
        _tls.replaying = True
        try:
            with graphs.deferred() as pending:
                out = orig(self, forward_batch, *args, **kwargs)
        finally:
            _tls.replaying = False
        if pending.plans:
            pending.drain(sglang_sizes(self, forward_batch))
        return out

    setattr(cls, name, replay)


def _wrap_sizes(cls: type, name: str, _runtime: str) -> None:
    """vLLM: the method gets ``num_tokens_unpadded`` on the host right before every forward."""
    import inspect

    orig = cls.__dict__[name]
    sig = inspect.signature(orig)

    @functools.wraps(orig)
    def sizes(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            real = sig.bind(self, *args, **kwargs).arguments.get("num_tokens_unpadded")
        except TypeError:
            real = None
        if isinstance(real, int):
            graphs.expect(Replay(real_tokens=real))  # the next replay's; its padded rows are its graph's own
        return orig(self, *args, **kwargs)

    setattr(cls, name, sizes)


def _wrap_end(cls: type, name: str, _runtime: str) -> None:
    orig = cls.__dict__[name]

    @functools.wraps(orig)
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return orig(self, *args, **kwargs)
        finally:
            graphs.expect(None)

    setattr(cls, name, forward)


def patch_runner(cls: type, capture: tuple[str, ...], replay: tuple[str, ...], sizes: tuple[str, ...],
                 ends: tuple[str, ...] = (), runtime: str | None = None) -> list[str]:
    """Wrap the methods ``cls`` itself defines (a subclass's own override is wrapped on its
    class); once per class. ``runtime`` starts the graphs' labels (default: the class's
    top-level package). Returns what was wrapped."""
    runtime = runtime or cls.__module__.split(".")[0]
    if cls.__dict__.get("_consistency_graph_patched"):
        return []
    done = []
    for names, wrap in ((capture, _wrap_capture), (replay, _wrap_replay), (sizes, _wrap_sizes), (ends, _wrap_end)):
        for name in names:
            if callable(cls.__dict__.get(name)):
                wrap(cls, name, runtime)
                done.append(name)
    cls._consistency_graph_patched = True  # type: ignore[attr-defined]
    return done


def patch_module(mod: Any) -> None:
    for cls_name, spec in TARGETS.get(mod.__name__, {}).items():
        cls = getattr(mod, cls_name, None)
        if isinstance(cls, type):
            graphs.enable()  # the runtime imports torch before its runners: hook torch.cuda.CUDAGraph now
            patch_runner(cls, *spec, runtime=mod.__name__.split(".")[0])


def auto() -> None:
    """Patch the runner classes of TARGETS as their modules are imported (inert unless
    ``CONSISTENCY_RECORD`` and ``CONSISTENCY_RECORD_GRAPHS`` are set)."""
    from consistency.record.import_hook import install as on_import

    if not (os.environ.get("CONSISTENCY_RECORD") and graphs.env_on()):
        return

    on_import(__name__, TARGETS, patch_module)
