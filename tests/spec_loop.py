"""A real chain speculative-decoding loop (EAGLE-3, topk 1, greedy) on a transformers target
and a replay draft module, with real KV caches on both sides: what replay's accept length
predicts is measured here, never computed from replay's own hit matrix.

Written from SGLang ``python/sglang/srt/speculative/eagle_worker.py`` (sgl-project/sglang,
commit 00559ea; the release trees under /root/.cache/consistency-upstream/ hold only the
CUDA-graph runners of that directory): ``EAGLEWorker.forward_batch_generation`` runs

* prefill: ``forward_target_extend`` (the target on the prompt, full hidden states), then
  ``forward_draft_extend``: the draft on the prompt shifted by one (``x[1..P]`` with the
  aux of ``x[0..P-1]``) plus the sampled token, which fills the draft's KV cache;
* each decode round: ``draft`` (topk 1: K chained draft steps, each fed the previous step's
  token and hidden state, appending to the draft's KV cache), ``verify`` (the target on
  ``[root, d1..dK]``; greedy: accept the drafts while they equal the target's argmax, then the
  target's own token at the first mismatch or after the last draft -- the bonus), the target's
  KV cache rolled back to the accepted prefix, and ``forward_draft_extend_after_decode`` (the
  draft re-run on the accepted tokens with the verify pass's hidden states, overwriting its
  chain's KV entries).

vLLM v1 keeps the same greedy accepted prefix plus bonus token (``v1/sample/rejection_sampler.py``).
The draft module is replay's (:class:`consistency.replay.draft.Eagle3Draft`, proven equal to
speculators' forward in tests/replay/test_replay_forward.py); only its attention goes through the
KV cache below, so which positions it sees is this loop's, not replay's chain mask.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from consistency.dump import names


class DraftKV:
    """Per layer keys/values in cache order; ``keep(n)`` rolls back to the first n rows."""

    def __init__(self) -> None:
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def keep(self, n: int) -> None:
        for layer in self.k:
            self.k[layer], self.v[layer] = self.k[layer][:, :, :n], self.v[layer][:, :, :n]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if layer in self.k:
            k, v = torch.cat([self.k[layer], k], 2), torch.cat([self.v[layer], v], 2)
        self.k[layer], self.v[layer] = k, v
        g = q.shape[1] // k.shape[1]
        if g > 1:
            k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        t, n = q.shape[2], k.shape[2]
        allowed = torch.arange(n)[None, :] <= (n - t + torch.arange(t))[:, None]  # causal over the cache
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)


@dataclass
class LoopResult:
    tokens: np.ndarray  # prompt + every token the loop committed
    prompt: int
    passes: list[tuple[int, int]] = field(default_factory=list)  # (anchor, accepted drafts) per verify pass

    def accept_length(self, last_anchor: int | None = None) -> float:
        """Mean tokens per verify pass (accepted drafts + the bonus), over passes at anchors
        <= ``last_anchor`` (the passes a dump of fewer tokens can judge)."""
        got = [a + 1 for i, a in self.passes if last_anchor is None or i <= last_anchor]
        return sum(got) / len(got)


def _target(model, ids: list[int], start: int, cache, streams: list[int]):  # noqa: ANN001, ANN202
    x = torch.tensor(ids)[None]
    pos = torch.arange(start, start + len(ids))[None]
    out = model(input_ids=x, position_ids=pos, past_key_values=cache, use_cache=True, output_hidden_states=True)
    aux = torch.cat([out.hidden_states[s][0].float() for s in streams], -1)
    return out.logits[0].float().argmax(-1), aux, [out.hidden_states[s][0] for s in streams]


@torch.no_grad()
def spec_loop(model, draft, prompt: np.ndarray, new_tokens: int, k: int, streams: list[int],  # noqa: ANN001
              rec=None) -> LoopResult:  # noqa: ANN001
    """Generate ``new_tokens`` (at least) after ``prompt`` with chain speculation of ``k``
    drafts; ``rec`` (a Recorder) captures every target pass (``input_ids`` with positions,
    ``aux.{i}``) as a server's capture would hold them."""
    from transformers import DynamicCache

    ids = [int(t) for t in prompt]
    p = len(ids)
    cache = DynamicCache()

    def capture(tokens: list[int], start: int, states: list[torch.Tensor]) -> None:
        if rec is None:
            return
        rec.capture(names.INPUT_IDS, torch.tensor(tokens), producer="input_ids",
                    positions=torch.arange(start, start + len(tokens)))
        for i, h in enumerate(states):
            rec.capture(names.aux(i), h, producer="hook")

    top, aux, states = _target(model, ids, 0, cache, streams)  # forward_target_extend
    capture(ids, 0, states)
    ids.append(int(top[-1]))
    kv = DraftKV()
    res = LoopResult(np.zeros(0, np.int64), p)
    # forward_draft_extend: rows (x[j+1], g[j]) for j = 0..P-1, at positions j
    logits, hidden = draft.step(draft.combine(aux[None]), torch.tensor(ids[1:])[None], torch.arange(p), kv.attend)
    anchor = p - 1
    while len(ids) < p + 1 + new_tokens:
        h = hidden[:, -1:]
        d = draft.to_target(logits[:, -1].argmax(-1))  # draft: step 1 from the extend's last row
        drafts = [int(d)]
        for s in range(1, k):  # steps 2..K: own token and own hidden, appended to the draft's cache
            lg, h = draft.step(h, d[:, None], torch.tensor([anchor + s]), kv.attend)
            d = draft.to_target(lg[:, -1].argmax(-1))
            drafts.append(int(d))
        root = len(ids) - 1  # verify: [root, d1..dK] at positions root..root+K
        top, vaux, states = _target(model, [ids[-1]] + drafts, root, cache, streams)
        capture([ids[-1]] + drafts, root, states)
        a = 0
        while a < k and drafts[a] == int(top[a]):
            a += 1
        res.passes.append((anchor, a))
        ids += drafts[:a] + [int(top[a])]  # accepted drafts, then the target's bonus token
        extra = cache.get_seq_length() - (root + a + 1)
        if extra:
            cache.crop(-extra)  # the target's KV: the accepted prefix only
        kv.keep(anchor + 1)  # the draft's KV: its extend rows, chain rows dropped
        # forward_draft_extend_after_decode: anchors anchor+1..anchor+a+1 with the verify states
        logits, hidden = draft.step(draft.combine(vaux[None, :a + 1]), torch.tensor(ids[-(a + 1):])[None],
                                    torch.arange(anchor + 1, anchor + a + 2), kv.attend)
        anchor += a + 1
    res.tokens = np.asarray(ids, np.int64)
    return res
