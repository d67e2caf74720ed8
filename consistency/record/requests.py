"""Which request each token of an SGLang forward pass belongs to.

SGLang's ``ForwardBatch`` carries ``rids`` (request id strings, recent releases: "for
dumper: request IDs for cross-step sequence tracking") and always ``req_pool_indices``
(a slot per running request, reused once a request finishes) with ``extend_seq_lens``
(each request's tokens in a prefill chunk; decode and verify passes hold equal shares).
The patches turn them into one integer per token, ``request_ids#k``, so stitching can
segment a continuous batch request by request. vLLM's model forward has nothing like it.
"""

from __future__ import annotations

from typing import Any

from consistency.record import recorder


def request_keys(forward_batch: Any, tokens: int) -> list[str] | None:
    """Per-token request keys of an SGLang ForwardBatch: ``rids`` (request id strings, in
    recent SGLang) else ``req_pool_indices`` (a slot per running request), spread over each
    request's tokens (``extend_seq_lens`` in prefill; equal shares in decode/verify)."""
    if forward_batch is None:
        return None
    rids = getattr(forward_batch, "rids", None)
    keys = [str(r) for r in rids] if isinstance(rids, (list, tuple)) and rids else None
    if keys is None:
        pool = getattr(forward_batch, "req_pool_indices", None)
        if pool is None or not hasattr(pool, "tolist"):
            return None
        keys = [f"slot {int(i)}" for i in pool.reshape(-1).tolist()]
    if not keys:
        return None
    lens = getattr(forward_batch, "extend_seq_lens", None)
    counts = [int(x) for x in lens.reshape(-1).tolist()] if lens is not None and hasattr(lens, "tolist") else None
    if counts is None or len(counts) != len(keys) or sum(counts) != tokens:
        if tokens % len(keys):
            return None
        counts = [tokens // len(keys)] * len(keys)
    return [k for k, n in zip(keys, counts, strict=True) for _ in range(n)]


def request_numbers(keys: list[str], positions: Any, fallback: Any) -> Any:
    """Stable integers for request keys, per recorder; a pool slot whose positions restart
    is a new request (SGLang reuses a finished request's slot)."""
    import torch

    rec = recorder.active()
    owner = rec.__dict__ if rec is not None else fallback.__dict__
    table = owner.setdefault("_request_table", {})  # key -> (number, last position)
    pos = positions.reshape(-1).tolist() if positions is not None and hasattr(positions, "tolist") else None
    out = []
    for t, key in enumerate(keys):
        num, last = table.get(key, (None, None))
        p = pos[t] if pos is not None and t < len(pos) else None
        if num is None or (p is not None and last is not None and p <= last and key.startswith("slot ")):
            num = owner.get("_request_next", 0)
            owner["_request_next"] = num + 1
            if rec is not None:
                rec.metadata.extra.setdefault("requests", {})[str(num)] = key
        table[key] = (num, p)
        out.append(num)
    return torch.as_tensor(out, dtype=torch.int64)
