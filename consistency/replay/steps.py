"""K draft steps of a draft that reads one hidden state and one token per row (MTP, EAGLE-1/2).

Row r of step k is draft position r: it pairs a hidden state with the token ``x[r+1+k]``
(``shift`` pairing, conventions-beyond-eagle3.md section 2.10) and proposes ``x[r+2+k]``.
Step 0 reads the target's last state ``h[r]`` (``aux.0`` = fnorm(s=N)); step k >= 1 reads
what the consumer recycles (``ConsumerSpec.recycle``): the draft's own output of step k-1
after its final norm (``d_norm``: SGLang ``deepseek_nextn.py``, vLLM after #45895,
Megatron, speculators), before it (``d_raw``: EAGLE-1/2, vLLM ``deepseek_mtp.py`` before
#45895), or the target's state ``h[r+k]`` (``target``: a non-chain runtime).

Two attention regimes, both exact for what they model:

* ``chain`` (what a runtime's KV cache gives a topk-1 chain, used by replay): step k of
  anchor r attends to the step-0 rows 0..r and to its own earlier chain rows; its RoPE
  position is ``r + k``. Every step keeps T-1 rows so anchors advance together.
* ``causal`` (teacher-forced training: speculators ``models/mtp/core.py``, Megatron
  ``multi_token_prediction.py``): each step is a fresh causal pass over its own rows.

The tensors come back under the dump names (consistency/dump/names.py): ``draft_ids.k``,
``draft_embed.k``, ``draft_cat.k``, ``draft_out.k``, ``draft_norm.k`` and ``recycle.k``
(k >= 1), step k holding the T-1-k rows that have a token.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from consistency.contract.models import Recycle
from consistency.dump import names


@dataclass
class StepTensors:
    """One step's tensors for every row (batch dim 1 kept off): [n, H] / [n, V]."""

    embed: torch.Tensor  # embedding rows after any position-0 masking, before enorm
    cat: torch.Tensor  # the input projection's input
    out: torch.Tensor  # d_raw: the block's output (hidden + residual)
    norm: torch.Tensor | None  # d_norm: after the draft's final norm (None: the draft has none)
    logits: torch.Tensor


class EmbeddingDims:
    """A step draft's hidden size and vocabulary, read from its own embedding table [V, H]:
    every draft here owns one (MTP, EAGLE-1/2), and the loaded weights' shapes are what count."""

    embed_tokens: Any

    @property
    def hidden_size(self) -> int:
        return int(self.embed_tokens.weight.shape[1])

    @property
    def vocab_size(self) -> int:
        return int(self.embed_tokens.weight.shape[0])


class StepDraft(Protocol):
    """What :func:`run_steps` needs of a draft module."""

    def step(self, hidden: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
             cache: KVCache, at0: torch.Tensor) -> StepTensors: ...


ATTENTION = "consistency_blocked"  # config._attn_implementation of the blocks replay builds
QUERY_BLOCK = 256  # query rows per score block: memory heads x block x keys, not heads x rows x keys


def blocked_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' ``eager_attention_forward`` (repeat_kv, additive mask, fp32 softmax), one
    block of query rows at a time: a chain over T rows and K steps never holds all
    heads x T x K·T scores at once. Returns [b, q, heads, d_v] as the eager function does."""
    groups = int(getattr(module, "num_key_value_groups", 1) or 1)
    if groups > 1:
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    q_len, kv_len = query.shape[2], key.shape[2]
    outs = []
    for s in range(0, q_len, QUERY_BLOCK):
        e = min(q_len, s + QUERY_BLOCK)
        w = torch.matmul(query[:, :, s:e], key.transpose(2, 3)) * scaling
        if attention_mask is not None:
            w = w + attention_mask[:, :, s:e, :kv_len]
        outs.append(torch.matmul(torch.softmax(w, dim=-1, dtype=torch.float32).to(query.dtype), value))
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, blocked_attention)


_register()


class KVCache:
    """The part of transformers' ``Cache`` an attention layer calls: ``update`` appends this
    step's keys/values (MLA: its compressed latents) per layer and returns all of them."""

    def __init__(self) -> None:
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(self, k: torch.Tensor, v: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_idx in self.kv:
            k0, v0 = self.kv[layer_idx]
            k, v = torch.cat([k0, k], dim=-2), torch.cat([v0, v], dim=-2)
        self.kv[layer_idx] = (k, v)
        return k, v


def chain_mask(n: int, k: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Additive mask [1, 1, n, (k+1)n] of step k: causal over the step-0 block, then one
    diagonal per chained step (speculators' TTT mask, what a KV cache gives a topk-1 chain)."""
    neg = torch.finfo(dtype).min
    idx = torch.arange(n)
    blocks = [torch.where(idx[None, :] <= idx[:, None], 0.0, neg)]
    eye = torch.where(idx[None, :] == idx[:, None], 0.0, neg)
    blocks += [eye] * k
    return torch.cat(blocks, dim=-1).to(dtype)[None, None]


def causal_mask(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return chain_mask(n, 0, dtype)


@dataclass
class StepsOutput:
    steps: int
    rows: int  # T-1: draft positions of step 0
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # dump names, step k: T-1-k rows
    logits: list[torch.Tensor] = field(default_factory=list)  # per step [rows_k, V]
    proposals: torch.Tensor | None = None  # [K, T-1] argmax per anchor (rows past T-1-k: a padded chain)
    recycle_source: dict[int, str] = field(default_factory=dict)  # step -> "d_norm" | "d_raw" | "target" | "recorded"


@torch.no_grad()
def run_steps(draft: StepDraft, hidden: torch.Tensor, ids: torch.Tensor, steps: int,
              recycle: Recycle | str = Recycle.d_norm, attention: str = "causal", feed: str = "teacher", recorded: Mapping[int, torch.Tensor] | None = None,
              step0_ids: torch.Tensor | None = None, rope_offset: bool = True) -> StepsOutput:
    """Run ``steps`` draft steps on one sequence.

    ``hidden`` [T, H] is the target state the draft reads at step 0 (``aux.0``), ``ids`` [T]
    the tokens. ``feed``: ``teacher`` embeds the recorded token ``x[r+1+k]`` at step k
    (training), ``own`` the token step k-1 proposed (a runtime; equal on accepted prefixes of
    greedy text). ``recorded`` {k: [rows, H]} replaces the recycled state of step k by what a
    dump says was fed (``recycle.k``); ``step0_ids`` replaces step 0's tokens (``draft_ids.0``).
    ``rope_offset``: position of row r at step k is ``r + k`` (a runtime); False keeps ``r``
    (speculators' training loop; RoPE is relative, so only rounding differs in ``causal``).
    """
    rec = Recycle(recycle)
    if attention not in ("chain", "causal"):
        raise ValueError(f"attention must be 'chain' or 'causal', got {attention!r}")
    if feed not in ("teacher", "own"):
        raise ValueError(f"feed must be 'teacher' or 'own', got {feed!r}")
    t = int(ids.shape[0])
    n = t - 1
    if n < 1 or hidden.shape[0] != t:
        raise ValueError(f"need >= 2 tokens and one hidden row per token, got {t} tokens and {hidden.shape[0]} rows")
    dtype = hidden.dtype
    out = StepsOutput(steps=steps, rows=n)
    cache = KVCache() if attention == "chain" else None
    proposals = torch.full((steps, n), -1, dtype=torch.long)
    h_in = hidden[:n]
    tok = (step0_ids if step0_ids is not None else ids[1:]).long()
    prev: StepTensors | None = None
    for k in range(steps):
        rows = n if attention == "chain" else n - k
        if rows < 1:
            break
        if k >= 1:
            assert prev is not None
            h_in, src = _recycled(rec, prev, hidden, k, n, recorded, out.recycle_source)
            out.recycle_source[k] = src
            tok = _tokens(feed, ids, k, n, proposals[k - 1])
        base = torch.arange(rows)
        positions = (base + k if rope_offset else base)[None]
        at0 = (base + k == 0)[None]  # the true position 0: step 0's row 0 (vLLM masks positions == 0)
        if attention == "chain":
            assert cache is not None
            st = draft.step(h_in[None], tok[None], positions, chain_mask(n, k, dtype), cache, at0)
        else:
            st = draft.step(h_in[:rows][None], tok[:rows][None], positions, causal_mask(rows, dtype), KVCache(), at0)
        proposals[k, :rows] = st.logits.argmax(-1)
        keep = n - k
        out.tensors[names.draft(names.DRAFT_IDS, k)] = tok[:keep].clone()
        out.tensors[names.draft(names.DRAFT_EMBED, k)] = st.embed[:keep]
        out.tensors[names.draft(names.DRAFT_CAT, k)] = st.cat[:keep]
        out.tensors[names.draft(names.DRAFT_OUT, k)] = st.out[:keep]
        if st.norm is not None:
            out.tensors[names.draft(names.DRAFT_NORM, k)] = st.norm[:keep]
        if k >= 1:
            out.tensors[names.recycle(k)] = h_in[:keep].clone()
        out.logits.append(st.logits[:keep])
        prev = st
    out.proposals = proposals
    return out


def _recycled(rec: Recycle, prev: StepTensors, hidden: torch.Tensor, k: int, n: int,
              recorded: Mapping[int, torch.Tensor] | None, sources: dict[int, str]) -> tuple[torch.Tensor, str]:
    """The hidden state step k is fed, [n, H] (rows past what exists padded with zeros)."""
    if recorded is not None and k in recorded:
        r = recorded[k].to(hidden.dtype)
        return _pad(r, n), "recorded"
    if rec == Recycle.d_norm:
        if prev.norm is None:
            raise ValueError("recycle d_norm needs a draft with a final norm")
        return _pad(prev.norm, n), "d_norm"
    if rec == Recycle.d_raw:
        return _pad(prev.out, n), "d_raw"
    if rec == Recycle.target:
        return _pad(hidden[k:k + n], n), "target"
    raise ValueError(f"recycle {rec.value!r} is not a multi-step hidden feed")


def _tokens(feed: str, ids: torch.Tensor, k: int, n: int, last: torch.Tensor) -> torch.Tensor:
    if feed == "own":
        return last.clamp_min(0)
    return _pad(ids[1 + k:1 + k + n], n).long()


def _pad(x: torch.Tensor, n: int) -> torch.Tensor:
    if x.shape[0] >= n:
        return x[:n]
    return torch.cat([x, x.new_zeros((n - x.shape[0], *x.shape[1:]))])
