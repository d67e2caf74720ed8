"""The walk a server takes through a sequence: which anchors it drafts at, so the prediction
averages those and no others.

A chain server (topk 1) verifies at one anchor per pass. After prefill the first drafted
anchor is the one whose fed token is the first generated token (anchor ``P-1`` for a prompt of
``P`` tokens); a pass at anchor ``i`` that accepts ``a`` drafts adds ``a + 1`` tokens (the
drafts and the target's bonus token), and the draft extends on them, so the next pass drafts
at anchor ``i + a + 1`` (SGLang ``speculative/eagle_worker.py``: ``forward_batch_generation``
-> ``draft``, ``verify``, ``forward_draft_extend_after_decode``; vLLM v1's rejection sampler
keeps the same accepted prefix plus bonus token). Averaging over every anchor instead counts
the anchors inside an accepted run, where chains are longer than average (a long accepted run
is made of anchors that accept well): that mean is too high, and more so as K grows.

Everything here is arithmetic on the hit matrix (no torch module, no words).
"""

from __future__ import annotations

import torch


def accepted_per_anchor(hits: torch.Tensor, verifiable: torch.Tensor) -> torch.Tensor:
    """[anchors] leading accepted drafts (0..K) of each verifiable anchor's chain, -1 elsewhere:
    greedy verification stops at the first rejected draft."""
    lead = torch.cumprod(hits.int(), dim=0)  # 1 while every step so far was accepted
    acc = lead.sum(0)
    return torch.where(verifiable, acc, torch.full_like(acc, -1))


def verifiable_anchors(labels: torch.Tensor, steps: int, n: int,
                       bounds: list[tuple[int, int]] | None = None) -> torch.Tensor:
    """[n] True where the whole chain of ``steps`` drafts is judged by labels of its own request:
    anchor ``i`` proposes tokens ``i+2..i+K+1``, judged by ``labels[i+1..i+K]``, so it needs
    ``i + K <= b - 1`` with ``b`` its request's end (one less when the last label is unknown)."""
    out = torch.zeros(n, dtype=torch.bool)
    for a, b in bounds or [(0, len(labels))]:
        last = b - 1 if int(labels[b - 1]) >= 0 else b - 2  # the last position with a known label
        stop = min(n, last - steps + 1)
        if stop > a:
            out[a:stop] = True
    return out


def walk(accepted: torch.Tensor, drafted: torch.Tensor, bounds: list[tuple[int, int]] | None = None) -> torch.Tensor:
    """[anchors] True at the anchors a chain server verifies at.

    Per request: start at its first drafted anchor (``drafted``: where the server drafts and the
    chain is verifiable), jump ``accepted + 1``; an anchor the server does not draft at (a user
    turn inside a loss mask) is skipped to the next drafted one, as a server resumes after it."""
    n = accepted.shape[0]
    visited = torch.zeros(n, dtype=torch.bool)
    ok = drafted & (accepted >= 0)
    acc = accepted.tolist()
    can = ok.tolist()
    for a, b in bounds or [(0, n + 1)]:
        i, end = a, min(n, b - 1)  # anchors of this request: tokens a..b-1, anchor i feeds token i+1 < b
        while i < end:
            if not can[i]:
                i += 1
                continue
            visited[i] = True
            i += acc[i] + 1
    return visited
