"""A seeded tiny model with massive activations and an attention-sink row built in.

Real pretrained models carry a few channels of 1e3-1e5 on every token (massive
activations) and a far larger one on the first token (the attention sink). Relative to such
rows, neighbouring tokens are close (token rel_diff ~1e-2), which is what hid a row holding
the previous token's state under the dtype floor (issue 36). Here the construction is
explicit: a large constant direction is added to every token's embedding (so every stream
carries it through the residual adds and every norm sees it), and the first token's
embedding gets a far larger one of its own. Both forward passes (fp32, bf16) are real.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

N_LAYERS, HIDDEN, VOCAB = 8, 64, 256
MASSIVE, SINK = 3.0, 600.0  # neighbouring rows ~7e-3 apart (token rel_diff), bf16 noise ~1e-5
SINK_ID = 1


ZERO_COL = 5  # every layer's MLP output is zero in this channel (down_proj's row zeroed): the model's own zero


@dataclass(frozen=True)
class Massive:
    ids: np.ndarray
    hidden: tuple[np.ndarray, ...]  # fp32 forward: streams 0..N (pre-norm)
    bf16: tuple[np.ndarray, ...]  # the same weights run in bfloat16
    parts: dict[str, np.ndarray]  # fp32 attn_out.k / mlp_out.k / final_norm
    bf16_parts: dict[str, np.ndarray]


@lru_cache(maxsize=2)
def model(seed: int = 5):  # noqa: ANN201
    """The seeded model (fp32): a massive direction on every row, a sink token, a zeroed MLP channel."""
    import torch
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=HIDDEN, intermediate_size=160, num_hidden_layers=N_LAYERS,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                   max_position_embeddings=512, tie_word_embeddings=False, initializer_range=0.05)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        w = model.model.embed_tokens.weight
        w[:, 3] += MASSIVE  # one massive channel on every row
        w[:, 17] -= MASSIVE / 2
        w[SINK_ID, 40] += SINK  # the sink token's own
        for layer in model.model.layers:
            layer.mlp.down_proj.weight[ZERO_COL] = 0
    return model


def streams(ids: np.ndarray, dtype: str = "float32", seed: int = 5) -> dict[str, np.ndarray]:
    """Every stream, block delta and the final norm of one forward pass over ``ids``."""
    import copy

    import torch

    from consistency.record.hf import capture_streams

    m = model(seed) if dtype == "float32" else copy.deepcopy(model(seed)).to(getattr(torch, dtype))
    with torch.no_grad():
        got, _notes = capture_streams(m, torch.from_numpy(np.asarray(ids, np.int64))[None])
    return {k: v[0].float().numpy().astype(np.float32) for k, v in got.items()}


@lru_cache(maxsize=4)
def massive(t: int = 96, seed: int = 5) -> Massive:
    rng = np.random.default_rng(seed)
    ids = rng.integers(2, VOCAB, size=t).astype(np.int64)
    ids[0] = SINK_ID
    out = [streams(ids, dt, seed) for dt in ("float32", "bfloat16")]
    hid = [tuple(o[f"hidden.{s}"] for s in range(N_LAYERS + 1)) for o in out]
    rest = [{k: v for k, v in o.items() if not k.startswith("hidden.")} for o in out]
    return Massive(ids, hid[0], hid[1], rest[0], rest[1])
