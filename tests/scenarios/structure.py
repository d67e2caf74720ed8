"""Whole-dump scenarios: what is in each file, rather than what one slot holds.

Nothing comparable, a concatenated ``aux`` beside ``aux.{i}``, a reference of streams only,
an expected stream the reference lacks, a divergence that propagates through every later
stream, and a speculators file as the candidate against a full reference.
"""

from __future__ import annotations

import numpy as np

from tests.scenarios import faults as F
from tests.scenarios.expect import ANY, Expect, SlotExpect


def f_nothing(st, sc, train, t, rng):  # noqa: ANN001, ANN201
    b = F.f_benign(st, sc, train, t, rng)
    h = st.hidden_size
    if sc.variant == "weights":  # a checkpoint given as the reference
        w = lambda *s: (rng.standard_normal(s) * 0.02).astype(np.float32)  # noqa: E731
        b.ref = {"model.embed_tokens.weight": w(64, h), "model.layers.0.self_attn.q_proj.weight": w(h, h),
                 "model.layers.0.mlp.up_proj.weight": w(2 * h, h), "model.norm.weight": np.ones(h, np.float32),
                 "lm_head.weight": w(64, h)}
    elif sc.variant == "disjoint":
        b.ref = {"something_else": st.hidden[3][:t], "other.thing": st.hidden[5][:t]}
    else:  # two empty tensors of different widths
        b.ref = {"aux.0": np.zeros((0, h), np.float32)}
        b.cand = {"aux.0": np.zeros((0, h // 2), np.float32)}
        b.cand_labels = {"aux.0": ("empty",)}
        b.cand_claims = None
    b.ref_labels = {k: ("other",) for k in b.ref}
    b.ref_claims = None
    b.expect = Expect("fail", frozenset({"NOTHING_COMPARED", "SHAPE_MISMATCH"}), input_error_ok=True)
    return b


def f_concat(st, sc, train, t, rng):  # noqa: ANN001, ANN201
    """``aux`` (the concatenation) beside ``aux.{i}``: they must agree, and each must be right."""
    b = F.f_benign(st, sc, train, t, rng)
    cat_ids = list(train)
    if sc.variant == "slots_wrong":  # per-slot tensors hold the shifted list; the concatenation is right
        ids = F.shifted_ids(st, train)
        shifted, labs = F._cand(st, [("stream", s) for s in ids], t, rng)
        b.cand.update(shifted)
        b.cand_labels.update(labs)
    elif sc.variant == "concat_wrong":
        cat_ids = F.shifted_ids(st, train)
    b.cand["aux"] = np.zeros((t, 0), np.float32)  # filled by faults.build from the slots' own values
    b.cand_labels["aux"] = ("concat", tuple(cat_ids))
    b.expect = Expect("pass") if sc.variant == "agree" else Expect("fail")
    if sc.variant == "agree":
        b.expect.slots = [F.slot_expect(i, ("stream", s), b.ref_labels, sc) for i, s in enumerate(train)]
    return b


def f_streams_only(st, sc, train, t, rng):  # noqa: ANN001, ANN201
    """A reference with no aux slots: hidden.0..N only (recorded without --aux-layers)."""
    ref = {"input_ids": st.ids[:t]} | {f"hidden.{s}": st.hidden[s][:t] for s in range(st.n + 1)}
    rl = {"input_ids": ("ids",)} | {f"hidden.{s}": ("stream", s) for s in range(st.n + 1)}
    ids = F.shifted_ids(st, train)
    labels = [("stream", s) for s in ids]
    claims: list[int] | None = list(train)  # serving believes it feeds the trained list
    layer_ids = None
    exp = Expect("fail", forbidden=frozenset({"NUMERIC_DRIFT"}))
    if sc.variant == "layer_ids":  # nothing in the files says which streams: the user says so
        claims, layer_ids = None, list(train)
    elif sc.variant == "delta_slot":  # no claims at all; one slot is a block delta, not a stream
        claims = None
        labels = [("stream", s) for s in train]
        labels[1] = ("mlp", train[1] - 1)
    elif sc.variant == "agree":  # the candidate claims what it holds: a side never certifies itself (issue 24)
        labels = [("stream", s) for s in train]
        exp = Expect("fail", frozenset({"EXPECTATION_UNKNOWN"}))
    cand, cl = F._cand(st, labels, t, rng)
    exp.slots = [F.slot_expect(i, lab, rl, sc, not_ok=exp.verdict == "fail" and lab != ("stream", train[i]))
                 for i, lab in enumerate(labels)]
    b = F.Built(ref, rl, None, cand, cl, claims, exp)
    b.layer_ids, b.convention = (layer_ids, "stream") if layer_ids else (None, None)
    return b


def f_missing_stream(st, sc, train, t, rng):  # noqa: ANN001, ANN201
    """Metadata (or --layer-ids) names stream train[-1]; the reference holds only the others."""
    ref = {"input_ids": st.ids[:t]} | {f"hidden.{s}": st.hidden[s][:t] for s in train[:-1]}
    rl = {"input_ids": ("ids",)} | {f"hidden.{s}": ("stream", s) for s in train[:-1]}
    cand, cl = F._cand(st, [("stream", s) for s in train], t, rng)
    exp = Expect("fail", slots=[SlotExpect(len(train) - 1, frozenset(), ANY, False, True)])
    b = F.Built(ref, rl, list(train), cand, cl, list(train), exp)
    if sc.variant == "layer_ids":
        b.ref_claims, b.cand_claims = None, None
        b.layer_ids, b.convention = list(train), "stream"
    return b


def f_propagate(st, sc, train, t, rng):  # noqa: ANN001, ANN201
    """Every stream from s on carries the same error (a missing all-reduce early in the model)."""
    s0 = int(rng.integers(1, st.n - 1))
    ref, rl = F.reference(st, F.Scenario(sc.arch, "benign", thickness="full"), train, t)
    x = st.hidden[s0][:t]
    d = rng.standard_normal(x.shape).astype(np.float32)
    d *= 0.3 * np.linalg.norm(x, axis=1, keepdims=True) / np.linalg.norm(d, axis=1, keepdims=True)
    cand = {"input_ids": st.ids[:t]}
    cl: dict = {"input_ids": ("ids",)}
    for s in range(st.n + 1):
        cand[f"hidden.{s}"] = st.hidden[s][:t] + (d if s >= s0 else 0)
        cl[f"hidden.{s}"] = ("stream", s) if s < s0 else ("perturbed", s)
    for i, s in enumerate(train):
        cand[f"aux.{i}"], cl[f"aux.{i}"] = cand[f"hidden.{s}"], cl[f"hidden.{s}"]
    exp = Expect("fail", root=f"hidden.{s0}",
                 clean=frozenset(f"hidden.{s}" for s in range(s0)) | {"input_ids"})
    return F.Built(ref, rl, list(train), cand, cl, list(train), exp)


def f_spec_cand(st, sc, train, t, rng):  # noqa: ANN001, ANN201
    """A speculators file (aux slots + the appended last state) checked against a full reference:
    its hidden.N must not turn the reference's other hidden.k into MISSING errors."""
    full = F.Scenario(sc.arch, "benign", thickness="full", ref_container=sc.ref_container)
    ref, rl = F.reference(st, full, train, t)
    ids = F.shifted_ids(st, train) if sc.variant == "slot_shift" else list(train)
    cand, cl = F._cand(st, [("stream", s) for s in ids], t, rng)
    cand[f"hidden.{st.n}"], cl[f"hidden.{st.n}"] = st.hidden[st.n][:t], ("stream", st.n)
    exp = Expect("fail", frozenset({"SLOT_SHIFT"})) if sc.variant == "slot_shift" else Expect("pass")
    exp.slots = [F.slot_expect(i, ("stream", s), rl, full, not_ok=s != train[i]) for i, s in enumerate(ids)]
    if sc.variant in ("agree", "global_ids"):
        exp.forbidden = frozenset({"MISSING"})
    if sc.variant == "global_ids":  # one --layer-ids for both files: work, or say how to give per-file ids
        exp.input_error_if = r"--cand-layer-ids|--ref-layer-ids|convert"
    b = F.Built(ref, rl, list(train), cand, cl, None, exp)
    b.cand_order = [f"aux.{i}" for i in range(len(ids))] + [f"hidden.{st.n}"]
    b.layer_ids, b.convention = list(train) + [st.n], "speculators"
    return b


def f_swapped(st, sc, train, t, rng):  # noqa: ANN001, ANN201
    """The arguments swapped: the serving dump given as the reference (its metadata says so)."""
    b = F.f_slot_shift(st, sc, train, t, rng)
    b.ref, b.cand = b.cand, b.ref
    b.ref_labels, b.cand_labels = b.cand_labels, b.ref_labels
    b.ref_claims, b.cand_claims = b.cand_claims, b.ref_claims
    b.swapped = True
    b.expect = Expect("fail", mentions=r"swap|serving side|serving dump|reversed|the other way")
    return b


def f_loose_tolerance(st, sc, train, t, rng):  # noqa: ANN001, ANN201
    """--tolerance 'aux.*=1' on the seed story: identity is judged against noise, never against a
    tolerance (issue 24), so slots positively identified as other streams fail whatever the
    tolerance allows, and the slot table and summary still say what each slot holds."""
    b = F.f_slot_shift(st, sc, train, t, rng)
    b.expect = Expect("fail", slots=b.expect.slots,
                      not_mentions=r"as training expects|hold(s)? streams \[" + ", ".join(map(str, train)) + r"\]")
    for se in b.expect.slots:
        se.not_ok = False
    return b


STRUCTURE = {n[2:]: fn for n, fn in list(globals().items()) if n.startswith("f_") and callable(fn)}
