"""Causes on what was recorded, beyond Llama-style pre-norm (issue 24, item 5).

Faults whose values come from the real forward (tests/scenarios/taps.py), on the families of
``build.ARCH_FAMILIES`` (parallel attention + MLP, sandwich norms, embedding multipliers) and
the Llama-style ones:

``partial_combine``  every slot past the embedding captured before its layer's all-reduce /
                     MoE combine (rank 0 of 2): PARTIAL_SHARD where the reference records the
                     layer's parts, never NUMERIC_DRIFT
``delta_missing``    a parallel block's residual not added: the slot is the whole layer's delta
                     (attention + MLP), RESIDUAL_MISSING
``post_norm``        the next layer's input norm output (the model's own norm, learned weights)
                     captured instead of the stream (variant ``cand``: NORM_APPLIED) or fed in
                     training (``ref``: NORM_MISSING)
``embed_scale``      slot 0 without the model's embedding multiplier (Gemma's sqrt(H) normalizer,
                     Granite's ``embedding_multiplier``): SCALE_MISMATCH by 1/multiplier
``head_stream``      a one-slot head (EAGLE-1, MTP) trained on fnorm(s=N) served stream N-1
                     (``prev``: LAYER_MISMATCH, never UNKNOWN) or the raw stream N (``raw``:
                     NORM_MISSING)
``offset_thin``      a constant +1 offset against a thin reference: every slot lies after the
                     stream it should hold, and the report must say so

Expectations follow from the construction, as in :mod:`tests.scenarios.faults`.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from tests.scenarios.build import ARCH_FAMILIES, FAMILIES, PARALLEL, SANDWICH, Streams
from tests.scenarios.expect import ANY, NORM_CODES, Expect, SlotExpect
from tests.scenarios.faults import (
    _CAND_SOURCE,
    STORIES,
    Built,
    Label,
    Scenario,
    _cand,
    _slots_built,
    f_layer_offset,
    reference,
    slot_expect,
)

VARIANTS = {"post_norm": ("cand", "ref"), "head_stream": ("prev", "raw")}


def _src(st: Streams) -> Streams:
    return _CAND_SOURCE.get() or st


def _value(st: Streams, label: Label, t: int) -> np.ndarray:
    """The float32 [t, H] values of this module's labels (from the forward the scenario asks for)."""
    kind, k = label[0], label[1]
    if kind == "partial":  # stream k with layer k-1's MLP replaced by rank 0's pre-combine share
        return st.hidden[k][:t] - st.mlp_out[k - 1][:t] + st.mlp_part[k - 1][:t]
    if kind == "layer_delta":  # what layer k adds to the stream: attention + MLP
        return st.attn_out[k][:t] + st.mlp_out[k][:t]
    if kind == "in_norm":  # layer k's input norm output
        return st.in_norm[k][:t]
    if kind == "unscaled":  # the embedding without the model's multiplier
        return st.hidden[0][:t] / np.float32(label[2])
    raise ValueError(label)


def _with(b: Built, st: Streams, slot: int, label: Label, t: int, side: str = "cand") -> None:
    src = _src(st) if side == "cand" else st
    tens, labs = (b.cand, b.cand_labels) if side == "cand" else (b.ref, b.ref_labels)
    tens[f"aux.{slot}"], labs[f"aux.{slot}"] = _value(src, label, t).astype(np.float32), label


def f_partial_combine(st, sc, train, t, rng):  # noqa: ANN001, ANN201
    """Each slot past the embedding holds hidden.{s-1} + attn_out.{s-1} + rank 0's share of layer
    s-1's MLP (a capture before the all-reduce / MoE combine, as with a reduce deferred into the
    next layer's fused add+norm). Slot 0 (the embedding) is right."""
    b = _slots_built(st, sc, train, t, rng, [("stream", s) for s in train], train, Expect("fail"))
    for j, s in enumerate(train):
        if s >= 1:
            _with(b, st, j, ("partial", s), t)
    full = sc.thickness == "full"
    b.expect = Expect("fail", frozenset({"PARTIAL_SHARD"} if full else {"PARTIAL_SHARD", "UNKNOWN"}),
                      forbidden=frozenset({"NUMERIC_DRIFT", "LAYER_MISMATCH", "RESIDUAL_MISSING"}) | NORM_CODES
                      | STORIES, mentions=r"all-reduce|combine" if full else None)
    b.expect.slots = [slot_expect(0, ("stream", train[0]), b.ref_labels, sc)] + \
        [SlotExpect(j, frozenset(), ANY, False, True) for j, s in enumerate(train) if s >= 1]
    return b


def f_delta_missing(st, sc, train, t, rng):  # noqa: ANN001, ANN201
    """A parallel block (x + attn(ln(x)) + mlp(ln(x))) whose one residual add was dropped: the
    slot holds the layer's whole delta, attention and MLP together."""
    j = int(rng.integers(1, len(train)))
    labels: list[Label] = [("stream", s) for s in train]
    labels[j] = ("layer_delta", train[j] - 1)
    b = _slots_built(st, sc, train, t, rng, [("stream", s) for s in train], train, Expect("fail"))
    _with(b, st, j, labels[j], t)
    b.cand_labels[f"aux.{j}"] = labels[j]
    codes = {"RESIDUAL_MISSING"} if sc.thickness == "full" else {"RESIDUAL_MISSING", "UNKNOWN"}
    b.expect = Expect("fail", frozenset(codes), forbidden=frozenset({"LAYER_MISMATCH", "NUMERIC_DRIFT"}) | NORM_CODES,
                      slots=[SlotExpect(j, frozenset(), frozenset({None}), False, True)])
    return b


def f_post_norm(st, sc, train, t, rng):  # noqa: ANN001, ANN201
    """The next layer's input norm (the model's own, with its learned weight) in slot 1: a fused
    add+norm output captured instead of the stream, on the serving side (``cand``) or in training
    (``ref``)."""
    j, s = 1, train[1]
    b = _slots_built(st, sc, train, t, rng, [("stream", x) for x in train], train, Expect("fail"))
    _with(b, st, j, ("in_norm", s), t, side=sc.variant)
    code, other = ("NORM_APPLIED", "NORM_MISSING") if sc.variant == "cand" else ("NORM_MISSING", "NORM_APPLIED")
    b.expect = Expect("fail", frozenset({code}), forbidden=frozenset({other, "SCALE_MISMATCH", "NUMERIC_DRIFT"}),
                      slots=[SlotExpect(j, frozenset(), ANY, False, True)])
    return b


EMBED_MULTIPLIER = {"gemma2": "sqrt", "gemma3": "sqrt", "granite": 12.0}


def f_embed_scale(st, sc, train, t, rng):  # noqa: ANN001, ANN201
    """Slot 0 (the embedding) looked up without the model's multiplier on the serving side."""
    m = EMBED_MULTIPLIER.get(st.arch, "sqrt")
    f = math.sqrt(st.hidden_size) if m == "sqrt" else float(m)
    b = _slots_built(st, sc, train, t, rng, [("stream", s) for s in train], train, Expect("fail"))
    _with(b, st, 0, ("unscaled", 0, f), t)
    b.expect = Expect("fail", frozenset({"SCALE_MISMATCH"}), forbidden=NORM_CODES | {"NUMERIC_DRIFT"}, factor=1 / f,
                      slots=[SlotExpect(0, frozenset(), ANY, False, True)])
    return b


def f_head_stream(st, sc, train, t, rng):  # noqa: ANN001, ANN201
    """A one-slot head trained on fnorm(s=N) (EAGLE-1 / MTP: the target's final norm applied),
    served stream N-1 (``prev``) or the raw stream N (``raw``). The reference records every
    stream, so the slot's values name what it holds."""
    ref, rl = reference(st, sc, [st.n], t)
    ref["aux.0"], rl["aux.0"] = st.final_norm[:t], ("final_norm",)
    s = st.n - 1 if sc.variant == "prev" else st.n
    cand, cl = _cand(st, [("stream", s)], t, rng)
    if sc.variant == "prev":
        exp = Expect("fail", frozenset({"LAYER_MISMATCH"}), forbidden=frozenset({"UNKNOWN", "NUMERIC_DRIFT"}) | NORM_CODES)
        exp.slots = [SlotExpect(0, frozenset({f"hidden.{s}"}), frozenset({s}), True, True)]
    else:
        exp = Expect("fail", frozenset({"NORM_MISSING"}), forbidden=frozenset({"UNKNOWN", "NUMERIC_DRIFT",
                                                                               "NORM_APPLIED", "SCALE_MISMATCH"}))
        exp.slots = [SlotExpect(0, frozenset({f"hidden.{s}"}), ANY, False, True)]
    return Built(ref, rl, None, cand, cl, None, exp)


def f_offset_thin(st, sc, train, t, rng):  # noqa: ANN001, ANN201
    """The SGLang +1 family against a thin reference: no recorded stream says by how much, but
    every slot lies after the stream it should hold, and the report says so."""
    b = f_layer_offset(st, sc, train, t, rng)
    b.expect.mentions = r"every slot lies (later|after)"
    return b


ARCH = {n[2:]: fn for n, fn in list(globals().items()) if n.startswith("f_") and callable(fn)}


def table() -> list[Scenario]:
    """The CI cases of this module (bounded: each family records once per worker)."""
    out: list[Scenario] = []
    add = lambda arch, fault, **kw: out.append(Scenario(arch, fault, **kw))  # noqa: E731
    for arch in ARCH_FAMILIES:
        for th in ("aux", "aux_last"):
            add(arch, "benign", thickness=th, forward="bfloat16")
        add(arch, "layer_mismatch", variant="other", thickness="full")
        add(arch, "offset_thin", variant="plus", thickness="aux_last")
        add(arch, "norm_final", thickness="full", forward="bfloat16")
        add(arch, "norm_final", thickness="aux_last", side="ref", forward="bfloat16")
        for v in VARIANTS["post_norm"]:
            add(arch, "post_norm", variant=v, thickness="aux", forward="bfloat16")
        add(arch, "head_stream", variant="prev", thickness="full", forward="bfloat16")
    for arch in PARALLEL:
        for th in ("full", "aux"):
            add(arch, "delta_missing", thickness=th)
    for arch, fw in itertools.product((*SANDWICH, "granite"), ("float32", "bfloat16")):
        add(arch, "embed_scale", thickness="aux", forward=fw)
    for arch in FAMILIES:
        for th in ("full", "aux"):
            add(arch, "partial_combine", thickness=th)
        add(arch, "head_stream", variant="raw" if arch == "qwen2" else "prev", thickness="full")
    add("llama", "partial_combine", thickness="full", forward="bfloat16")
    return out
