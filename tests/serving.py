"""A speculative server emulated on a real tiny transformers model: one KV cache, forward
passes as a runtime runs them, each recorded as the next ``#k`` capture (record.hf.record_pass).

* :func:`greedy` is the target's own greedy continuation (what verification accepts);
* :func:`verify_loop` runs a prefill, then target-verify passes of ``k`` drafted tokens each:
  pass i holds [the last verified token, d1..dk] at consecutive positions, the first
  ``accept[i]`` drafts are the target's greedy tokens (accepted), the next one is wrong
  (rejected, and so is everything after it); the cache is cropped to the accepted prefix
  (``DynamicCache.crop``) and the next pass starts at the bonus token, exactly as SGLang's
  ``eagle_worker.py`` verify and vLLM's rejection sampler leave it;
* :func:`decode` runs plain decode steps of given tokens (a sampled continuation).

What stitching must keep, supersede and drop follows from the construction
(:class:`Emulated`), never from the code under test.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from consistency.record import Recorder
from consistency.record.hf import record_pass


@torch.no_grad()
def greedy(model, ids: np.ndarray, n: int) -> np.ndarray:  # noqa: ANN001
    """The target's next ``n`` greedy tokens after ``ids``."""
    x = torch.as_tensor(ids, dtype=torch.long)[None]
    out = model.generate(x, max_new_tokens=n, do_sample=False, min_new_tokens=n, pad_token_id=0,
                         eos_token_id=None)
    return out[0, len(ids):].numpy().astype(np.int64)


@dataclass
class Emulated:
    path: Path
    tokens: np.ndarray  # every token whose row the server kept and confirmed, in position order
    superseded: int = 0  # rows of rejected drafts a later pass recomputed
    unconfirmed: int = 0  # drafted rows of the last verify pass
    rewinds: int = 0
    passes: list[tuple[int, int]] = field(default_factory=list)  # (first position, rows) of each pass
    generated_from: int | None = None  # first position of the first verify pass (the first generated token)


def verify_loop(model, prompt: np.ndarray, accept: list[int], k: int, path: Path, slots: list[int],  # noqa: ANN001
                chunks: int = 1, request: int | None = None, rec: Recorder | None = None,
                continuation: np.ndarray | None = None) -> Emulated:
    """Prefill ``prompt`` (in ``chunks`` passes), then one verify pass per entry of ``accept``.
    ``continuation``: the answer the server ends up generating (default: the target's greedy one)."""
    n_gen = sum(a + 1 for a in accept) + k + 1
    gen = greedy(model, prompt, n_gen) if continuation is None else np.asarray(continuation, np.int64)
    if len(gen) < n_gen:
        raise ValueError(f"a continuation of {len(gen)} tokens is too short for these passes ({n_gen})")
    vocab = model.config.vocab_size
    own = rec is None
    rec = rec if rec is not None else Recorder(path, force=True)
    req = None if request is None else [request]
    em = Emulated(path, np.zeros(0, np.int64))
    cache = None
    for c in np.array_split(np.arange(len(prompt)), chunks):
        cache = record_pass(model, prompt[c], rec, slots, cache=cache, request_ids=req)
        em.passes.append((int(c[0]), len(c)))
    s = len(prompt)  # position of the last verified token (the target's first sampled one)
    em.generated_from = s
    for i, a in enumerate(accept):
        base = s - len(prompt)
        drafts = gen[base + 1: base + 1 + k].copy()
        if a < k:
            drafts[a] = (drafts[a] + 1 + i) % vocab  # the first rejected draft: not the target's token
            drafts[a + 1:] = (drafts[a + 1:] + 7) % vocab  # what the draft built on it
        cache = record_pass(model, np.concatenate([[gen[base]], drafts]), rec, slots, cache=cache, request_ids=req)
        em.passes.append((s, k + 1))
        last = i == len(accept) - 1
        if not last:
            cache.crop(-(cache.get_seq_length() - (s + a + 1))) if a < k else None  # keep the accepted prefix
            if a < k:
                em.superseded += k - a
                em.rewinds += 1
            s += a + 1
    em.unconfirmed = k if em.rewinds else 0
    em.tokens = np.concatenate([prompt, gen[:s - len(prompt) + 1]])
    if own:
        rec.save()
    return em


def decode(model, prompt: np.ndarray, tokens: np.ndarray, path: Path, slots: list[int],  # noqa: ANN001
           chunks: int = 1) -> Path:
    """Prefill ``prompt``, then one decode step per token of ``tokens`` (whatever was sampled)."""
    with Recorder(path, force=True) as rec:
        cache = None
        for c in np.array_split(np.arange(len(prompt)), chunks):
            cache = record_pass(model, prompt[c], rec, slots, cache=cache)
        for t in tokens:
            cache = record_pass(model, np.asarray([t]), rec, slots, cache=cache)
    return path


def drop_layout(path: Path, names: tuple[str, ...] = ("positions",)) -> Path:
    """The same capture without its positions (``capture()`` makes them optional)."""
    from consistency.dump.reader import open_dump
    from consistency.dump.writer import write_dump

    with open_dump(path) as d:
        keep = {n: (d[n].read_all(), d[n].dtype) for n in d.tensors
                if not any(n == x or n.startswith(x + "#") for x in names)}
        meta = d.metadata.model_copy(deep=True) if d.metadata else None
    if meta is not None:
        meta.tensors = {k: v for k, v in meta.tensors.items() if k in keep}
    out = path.with_name(path.stem + ".nopos.safetensors")
    write_dump(out, keep, meta, force=True)
    return out
