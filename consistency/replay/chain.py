"""Chained draft steps for every position of a sequence at once, with the runtimes' attention.

Anchor i is the moment the target has verified tokens up to ``x[i+1]``. Step 1 of its chain
is the row (token ``x[i+1]``, aux ``g[i]``) -- the extend pass SGLang runs after verification.
Step k+1 is fed the token step k proposed (topk 1, mapped to the target vocab by the offset
rule) and the hidden state step k produced (conventions.md point 5): never the target's aux
again, since the target has not seen those tokens yet.

Attention is what a KV cache gives a chain with topk 1: step k of anchor i attends to the
extend rows 0..i and to its own earlier chain rows (one per earlier step, diagonal). That is
speculators' TTT mask (``models/eagle3/attention.py``: causal over the first block, then one
diagonal block per step), so all anchors advance together: K steps cost K passes over T rows,
and step-k queries never attend to another anchor's chain.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from consistency.replay.draft import Eagle3Draft

QUERY_BLOCK = 512  # query rows per attention block: memory O(block x T), not O(T x T)


@dataclass
class ChainCache:
    """Per layer: the extend block's keys/values, then one (k, v) per chained step."""

    extend: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    steps: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)
    valid: torch.Tensor | None = None  # [b, t] bool: False for padding rows (never attended)
    windows: dict[int, int] = field(default_factory=dict)  # layer -> sliding window (speculators' layer_types)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The attention of the current step; the first call per layer is the extend block."""
        if layer not in self.extend:
            self.extend[layer] = (k, v)
            self.steps[layer] = []
        else:
            self.steps[layer].append((k, v))
        k0, v0 = self.extend[layer]
        diag = self.steps[layer]
        return chain_attention(q, k0, v0, diag, self.valid, self.windows.get(layer))


def chain_attention(q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor, diag: list[tuple[torch.Tensor, torch.Tensor]],
                    valid: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
    """softmax over [causal keys of the extend block, this row's key of each chained step];
    a sliding ``window`` keeps extend keys ``j > i - window`` (speculators' mask_mod)."""
    b, hq, t, d = q.shape
    g = hq // k0.shape[1]
    if g > 1:  # grouped-query attention: each kv head serves g query heads
        k0, v0 = k0.repeat_interleave(g, 1), v0.repeat_interleave(g, 1)
        diag = [(kk.repeat_interleave(g, 1), vv.repeat_interleave(g, 1)) for kk, vv in diag]
    if not diag and valid is None and window is None:
        return F.scaled_dot_product_attention(q, k0, v0, is_causal=True)
    scale = d ** -0.5
    kd = torch.stack([kk for kk, _ in diag], dim=-2) if diag else None  # [b, h, t, m, d]
    vd = torch.stack([vv for _, vv in diag], dim=-2) if diag else None
    idx = torch.arange(t, device=q.device)
    out = []
    for s in range(0, t, QUERY_BLOCK):
        e = min(t, s + QUERY_BLOCK)
        qs = q[:, :, s:e]
        s0 = torch.matmul(qs, k0.transpose(-1, -2)) * scale  # [b, h, n, t]
        blocked = idx[None, :] > idx[s:e, None]  # future rows of the extend block
        if window is not None:
            blocked = blocked | (idx[None, :] <= idx[s:e, None] - window)
        if valid is not None:
            s0 = s0.masked_fill(blocked[None, None] | ~valid[:, None, None, :], float("-inf"))
        else:
            s0 = s0.masked_fill(blocked, float("-inf"))
        if kd is None or vd is None:
            out.append(torch.matmul(torch.softmax(s0.float(), dim=-1).to(q.dtype), v0))
            continue
        sd = (qs.unsqueeze(-2) * kd[:, :, s:e]).sum(-1) * scale  # [b, h, n, m]
        p = torch.softmax(torch.cat([s0, sd], dim=-1).float(), dim=-1).to(q.dtype)
        o = torch.matmul(p[..., :t], v0) + (p[..., t:].unsqueeze(-1) * vd[:, :, s:e]).sum(-2)
        out.append(o)
    return torch.cat(out, dim=2)


@dataclass
class ChainOutput:
    tokens: torch.Tensor  # [steps, b, t] proposed target ids
    logits: list[torch.Tensor]  # per step [b, t, draft_vocab] (kept only when asked)


def run_chain(draft: Eagle3Draft, aux: torch.Tensor, next_tokens: torch.Tensor, steps: int,
              feed: str = "own", teacher: torch.Tensor | None = None, keep_logits: bool = False,
              first_position: int = 1, valid: torch.Tensor | None = None) -> ChainOutput:
    """Run ``steps`` chained draft steps for every anchor row.

    ``aux`` [b, t, n·H_t] holds ``g[i]`` and ``next_tokens`` [b, t] holds ``x[i+1]`` (already
    paired, as speculators' ``shift_batch`` does). ``feed="own"`` feeds each step the token
    the previous step proposed (what runtimes do); ``feed="teacher"`` feeds ``teacher[:, :, k]``
    instead (speculators' TTT training, used by the parity test). Positions start at
    ``first_position`` (speculators: 1; RoPE is relative, so the offset does not matter).
    """
    if aux.dim() == 2:
        aux, next_tokens = aux[None], next_tokens[None]
        if teacher is not None:
            teacher = teacher[None]
        if valid is not None:
            valid = valid[None]
    b, t, _ = aux.shape
    cache = ChainCache(valid=valid, windows=draft.windows)
    positions = first_position + torch.arange(t, device=aux.device)
    hidden = draft.combine(aux)
    tokens = next_tokens
    out, kept = [], []
    for k in range(steps):
        logits, hidden = draft.step(hidden, tokens, positions + k, cache.attend)
        proposal = draft.to_target(logits.argmax(-1))
        out.append(proposal)
        if keep_logits:
            kept.append(logits)
        if feed == "teacher":
            if teacher is None or k >= teacher.shape[-1]:
                break
            tokens = teacher[..., k]
        else:
            tokens = proposal
    return ChainOutput(torch.stack(out), kept)
