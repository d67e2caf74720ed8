"""Models with the SGLang/vLLM structure, running the released forward methods verbatim.

Each model's ``forward`` is the upstream method quoted in tests/test_patch_src_*.py,
compiled here either as released or with a patch from patches/ applied to it (a tiny
unified-diff applier below). Around it: plain torch modules on the weights of a tiny HF
Llama, with the upstream layer signatures -- classic layers return ``(hidden_states,
residual)`` (SGLang's fused add+norm updates ``residual`` in place, as its kernel does);
boundary layers keep the residual in ``forward_batch.residual_stream`` and capture through
the collector they are handed, like ``layer_boundary/stage.py``. Whatever upstream names a
forward needs but these tests do not exercise (PP, TBO, DSA, all-gathers) is a stub.
"""

from __future__ import annotations
import __future__

import contextlib
import itertools
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from tests.record import test_patch_src_sglang_boundary as sb
from tests.record import test_patch_src_sglang_classic as sc
from tests.record import test_patch_src_vllm as sv
from tests.conftest import tiny

PATCHES = Path(__file__).resolve().parents[2] / "patches"
CTX: dict[str, Any] = {}  # the attention context of the current forward (vLLM's forward context)


# -- applying a patch to a quoted method --------------------------------------------------------

def hunks(patch: str) -> list[tuple[list[str], list[str]]]:
    """(pre-image lines, post-image lines) of every hunk in a patch file."""
    out: list[tuple[list[str], list[str]]] = []
    for line in (PATCHES / patch).read_text().splitlines():
        if line.startswith(("--- ", "+++ ")):
            continue
        if line.startswith("@@"):
            out.append(([], []))
        elif out and line[:1] in (" ", "-", "+", ""):
            tag, text = (line[:1] or " "), line[1:]
            if tag != "+":
                out[-1][0].append(text)
            if tag != "-":
                out[-1][1].append(text)
    return out


def apply(patch: str, source: str) -> tuple[str, int]:
    """Apply the hunks whose change falls inside ``source``; context lines outside it are
    dropped from the ends first (like patch's fuzz). Returns (text, hunks applied)."""
    lines, applied = source.splitlines(), 0
    for pre, post in hunks(patch):
        lead = next(i for i, (a, b) in enumerate(itertools.zip_longest(pre, post)) if a != b)
        trail = next(i for i, (a, b) in enumerate(itertools.zip_longest(pre[::-1], post[::-1])) if a != b)
        for cut_front, cut_back in sorted(((f, b) for f in range(lead + 1) for b in range(trail + 1)), key=sum):
            want = pre[cut_front:len(pre) - cut_back]
            at = [i for i in range(len(lines) - len(want) + 1) if lines[i:i + len(want)] == want]
            if len(at) == 1 and (cut_front < lead or lead == 0) and (cut_back < trail or trail == 0):
                lines[at[0]:at[0] + len(want)] = post[cut_front:len(post) - cut_back]
                applied += 1
                break
    return "\n".join(lines) + "\n", applied


def compile_method(source: str, namespace: dict[str, Any], name: str) -> Any:
    code = compile(textwrap.dedent(source), f"<upstream {name}>", "exec",
                   flags=__future__.annotations.compiler_flag, dont_inherit=True)
    ns = dict(namespace)
    exec(code, ns)  # noqa: S102 - the quoted upstream method, nothing else
    return ns[source.split("def ", 1)[1].split("(", 1)[0]]


# -- the torch modules around the forward --------------------------------------------------------

class SglRMSNorm(nn.Module):
    """sglang RMSNorm: ``norm(x, residual)`` is fused_add_rmsnorm, updating ``residual`` in place."""

    def __init__(self, hf_norm: nn.Module) -> None:
        super().__init__()
        self.hf = hf_norm

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, **_kw: Any) -> Any:
        if residual is None:
            return self.hf(x)
        residual.add_(x)
        return self.hf(residual), residual


class VllmRMSNorm(SglRMSNorm):
    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, **_kw: Any) -> Any:
        if residual is None:
            return self.hf(x)
        s = x + residual
        return self.hf(s), s


def _attn(layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
    out = layer.hf.self_attn(hidden_states=h[None], position_embeddings=CTX["pos"], attention_mask=CTX["mask"])
    return out[0][0]


class Block(nn.Module):
    def __init__(self, hf_layer: nn.Module, norm: type[SglRMSNorm]) -> None:
        super().__init__()
        self.hf = hf_layer
        self.input_layernorm = norm(hf_layer.input_layernorm)
        self.post_attention_layernorm = norm(hf_layer.post_attention_layernorm)
        self.use_sequence_parallel_moe = False

    def classic(self, hidden_states: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """LlamaDecoderLayer.forward of sglang <= 0.5.21 / vllm 0.33 (l. 339-367 / 313-330)."""
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = _attn(self, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.hf.mlp(hidden_states), residual


class SglLayer(Block):
    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, forward_batch: Any,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.classic(hidden_states, residual)


class SglDeepseekLayer(Block):
    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, forward_batch: Any,
                residual: torch.Tensor | None, zero_allocator: Any, gemm_output_zero_allocator: Any,
                llama_4_scaling: Any, prev_topk_indices: Any = None) -> tuple[torch.Tensor, torch.Tensor, None]:
        return (*self.classic(hidden_states, residual), None)


class VllmLayer(Block):
    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None,
                *_a: Any, **_kw: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return self.classic(hidden_states, residual)


class BoundaryLayer(Block):
    """sglang >= 0.5.22: the residual lives in forward_batch.residual_stream; the attention
    boundary completes the sum and hands captures the residual (stage.py _prepare_attention)."""

    def prepare(self, h: torch.Tensor, fb: Any, capture: Any = None, capture_gathered: Any = None) -> torch.Tensor:
        stream = fb.residual_stream
        if stream.residual is None:
            if capture is not None:
                capture(h)  # the embedding: borrowed, the collector copies it
            stream.residual = h
            x = self.input_layernorm(h)
        else:
            x, stream.residual = self.input_layernorm(h, stream.residual)  # in place
            if capture is not None:
                capture(stream.residual, owned=False)
        if capture_gathered is not None:
            capture_gathered.capture(stream.residual, owned=False)
        return x

    def finish(self, h: torch.Tensor, fb: Any) -> torch.Tensor:
        h = _attn(self, h)
        h, fb.residual_stream.residual = self.post_attention_layernorm(h, fb.residual_stream.residual)
        return self.hf.mlp(h)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, forward_batch: Any,
                capture_output: Any = None) -> torch.Tensor:
        return self.finish(self.prepare(hidden_states, forward_batch, capture=capture_output), forward_batch)


class BoundaryDeepseekLayer(BoundaryLayer):
    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, forward_batch: Any, zero_allocator: Any,
                gemm_output_zero_allocator: Any, llama_4_scaling: Any, prev_topk_indices: Any = None,
                captured_last_layer_outputs: Any = None, next_full_attention_layer_id: Any = None) -> tuple:
        x = self.prepare(hidden_states, forward_batch, capture_gathered=captured_last_layer_outputs)
        return self.finish(x, forward_batch), None


class _ResidualBatch:
    """sglang layer_boundary.residual.batch, reduced to the single-rank path."""

    @staticmethod
    def start(fb: Any) -> None:
        fb.residual_stream = SimpleNamespace(residual=None)

    @staticmethod
    def complete_output(h: torch.Tensor, fb: Any) -> torch.Tensor:
        return h

    @staticmethod
    def final_norm(h: torch.Tensor, fb: Any, norm: nn.Module) -> torch.Tensor:
        return norm.hf(h + fb.residual_stream.residual)


def _one(name: str) -> Any:
    raise AssertionError(f"{name} is on a path these tests never take")


STUBS: dict[str, Any] = {
    "torch": torch, "nullcontext": contextlib.nullcontext, "islice": itertools.islice,
    "PPProxyTensors": lambda *a, **k: _one("PP"), "IntermediateTensors": lambda *a, **k: _one("PP"),
    "BumpAllocator": lambda **kw: None, "nsa_use_prefill_cp": lambda fb: False, "_get_llama_4_scaling": None,
    "get_global_server_args": lambda: SimpleNamespace(disable_piecewise_cuda_graph=False),
    "get_global_expert_distribution_recorder": lambda: _one("expert recorder"),
    "get_attention_tp_group": lambda: _one("a2a"), "model_forward_maybe_tbo": lambda **kw: _one("TBO"),
    "model_forward_stages": lambda **kw: _one("TBO"), "cp_all_gather_rerange_output": None,
    "tensor_model_parallel_all_gather": lambda *a: _one("all-gather"),
    "residual_batch": _ResidualBatch, "check_cuda_graph_backend": lambda *a: True, "Phase": SimpleNamespace(PREFILL=0),
    "Backend": SimpleNamespace(TC_PIECEWISE=0), "dsa_layer_skips_topk": lambda *a: False,
    "IndexTopKShareState": lambda fb, init: SimpleNamespace(topk_indices=init, update=lambda t: None),
    "get_pp_group": lambda: SimpleNamespace(is_first_rank=True, is_last_rank=True),
}


def _exec_class(source: str) -> type:
    ns = dict(STUBS)
    exec(compile(source, "<upstream class>", "exec", flags=__future__.annotations.compiler_flag,  # noqa: S102
                 dont_inherit=True), ns)
    return ns[source.split("class ", 1)[1].split("(", 1)[0].split(":", 1)[0]]


STUBS["AuxHiddenStateList"] = _exec_class(sb.SGLANG_0523_AUX_LIST)
STUBS["AuxHiddenStatePacker"] = _exec_class(sb.SGLANG_0523_AUX_PACKER)

# case -> (forward source, layer class, norm class, patch, extra methods {name: source})
CASES: dict[str, tuple[str, type, type, str, dict[str, str]]] = {
    "sglang-classic-llama": (sc.SGLANG_0521_LLAMA_FORWARD, SglLayer, SglRMSNorm, "sglang-classic-llama.patch", {}),
    "sglang-classic-deepseek_v2": (sc.SGLANG_05121_DEEPSEEK_FORWARD, SglDeepseekLayer, SglRMSNorm,
                                   "sglang-classic-deepseek_v2.patch", {}),
    "sglang-boundary-llama": (sb.SGLANG_0523_LLAMA_FORWARD, BoundaryLayer, SglRMSNorm, "sglang-boundary-llama.patch", {}),
    "sglang-boundary-deepseek_v2": (sb.SGLANG_0523_DEEPSEEK_FORWARD, BoundaryDeepseekLayer, SglRMSNorm,
                                    "sglang-boundary-deepseek_v2.patch", {}),
    "vllm-llama": (sv.VLLM_0330_LLAMA_FORWARD, VllmLayer, VllmRMSNorm, "vllm-llama.patch",
                   {"_maybe_add_hidden_state": sv.VLLM_0330_MAYBE_ADD}),
    "vllm-deepseek_v2": (sv.VLLM_0330_DEEPSEEK_FORWARD, VllmLayer, VllmRMSNorm, "vllm-deepseek_v2.patch", {}),
}


class InnerModel(nn.Module):
    """The engine's inner model (LlamaModel / DeepseekV2Model) around the quoted forward."""

    def __init__(self, case: str, patched: bool, capture: list[int], dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        src, layer_cls, norm_cls, patch, extra = CASES[case]
        hf = tiny("tiny-llama").to(dtype)
        self.hf_model = hf
        self.embed_tokens = hf.model.embed_tokens
        self.layers = nn.ModuleList(layer_cls(layer, norm_cls) for layer in hf.model.layers)
        self.norm = norm_cls(hf.model.norm)
        self.config = hf.config
        self.start_layer, self.end_layer = 0, len(self.layers)
        self.pp_group = SimpleNamespace(is_first_rank=True, is_last_rank=True)
        self.hidden_size = hf.config.hidden_size
        self.llama_4_scaling_config, self.first_k_dense_replace, self.enable_a2a_moe, self.use_dsa = None, 0, False, False
        self.next_full_attention_layer_id: dict[int, int] = {}
        if case.startswith("vllm"):
            self.aux_hidden_state_layers = tuple(sorted(set(capture)))  # EagleModelMixin._set_aux_hidden_state_layers
        else:
            self.layers_to_capture = list(capture)
        self.applied = 0
        methods = {"forward": src, **extra}
        for name, text in methods.items():
            if patched:
                text, n = apply(patch, text)
                self.applied += n
            setattr(self, f"_{name}", compile_method(text, STUBS, name).__get__(self))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward(*args, **kwargs)

    def _maybe_add_hidden_state(self, *a: Any) -> Any:  # vLLM: the quoted EagleModelMixin method
        return self.__dict__["__maybe_add_hidden_state"](*a)

    # what the quoted forwards call on self
    def embed_input_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids)

    def collect_remote_aux_hidden_states(self, _it: Any) -> list:
        return []

    def _dsa_forward_uses_topk(self) -> bool:
        return False


def engine_args(model: InnerModel, ids: torch.Tensor) -> tuple:
    """Set the attention context of one prefill; the forward's arguments as the engine passes them."""
    t = ids.shape[0]
    positions = torch.arange(t)
    dt = model.embed_tokens.weight.dtype
    CTX["pos"] = model.hf_model.model.rotary_emb(torch.zeros(1, t, 1, dtype=dt), positions[None])
    CTX["mask"] = torch.full((t, t), float("-inf"), dtype=dt).triu(1)[None, None]
    if "intermediate_tensors" in model._forward.__code__.co_varnames[:5]:  # vLLM
        return ids, positions, None
    return ids, positions, SimpleNamespace(can_run_tbo=False, forward_mode=SimpleNamespace(is_idle=lambda: False))


def run(model: InnerModel, ids: torch.Tensor) -> Any:
    """One prefill, called as the engine calls its inner model."""
    with torch.no_grad():
        return model(*engine_args(model, ids))
