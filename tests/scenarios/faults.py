"""Scenarios: recorded streams -> (reference, candidate, expectation), by numpy alone.

Every candidate slot carries a *label* saying what its values are by construction
(``("stream", s)``, ``("mlp", k)``, ``("final_norm",)``, ...); every reference tensor
too. The expectation follows from the labels: which reference names hold a slot's values,
which stream that is, which code the construction is an instance of. Nothing here reads
the engine.
"""

from __future__ import annotations

import contextvars
import math
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from tests.scenarios.build import Streams
from tests.scenarios.expect import ANY, NORM_CODES, Expect, SlotExpect

# the slot-list stories: one construction is an instance of exactly one of them
STORIES = frozenset({"SLOT_SHIFT", "LAYER_OFFSET", "ORDER_MISMATCH", "LAYER_MISMATCH"})

Label = tuple[Any, ...]

SLOT_FAULTS = ("benign", "ref_claim_wrong", "header_magic", "layout", "slot_count", "hf_states", "layer_mismatch", "slot_shift", "layer_offset", "order", "residual_missing",
               "norm_final", "norm_input", "scale", "token_scale", "token_shift", "tokens", "zero_slot",
               "zero_column", "nonfinite", "shape", "drift")
STRUCTURE_FAULTS = ("nothing", "concat", "streams_only", "missing_stream", "propagate", "spec_cand", "swapped",
                    "loose_tolerance")
TOKEN_VARIANTS = ("zero2", "garbage_first", "swap2", "garbage20", "perturb2")
VARIANTS: dict[str, tuple[str, ...]] = {
    "tokens": TOKEN_VARIANTS, "layout": ("batch", "fortran"), "slot_shift": ("honest", "claims_trained"),
    "layer_offset": ("plus", "minus"), "layer_mismatch": ("other", "dup"),
    "slot_count": ("fewer", "more"), "shape": ("width", "rows"), "nothing": ("weights", "disjoint", "empty"),
    "concat": ("agree", "slots_wrong", "concat_wrong"),
    "streams_only": ("claims", "layer_ids", "delta_slot", "agree"), "missing_stream": ("meta", "layer_ids"),
    "spec_cand": ("agree", "slot_shift", "global_ids"),
}
SIDED = ("norm_final", "norm_input", "scale", "tokens", "header_magic")  # faults that can live on either side
THICKNESS = ("full", "aux", "aux_last")


@dataclass(frozen=True)
class Scenario:
    arch: str
    fault: str
    variant: str = ""
    thickness: str = "full"
    side: str = "cand"  # which side holds the fault (or the normed tensor)
    ref_dtype: str = "float32"
    cand_dtype: str = "bfloat16"
    ref_container: str = "safetensors"
    cand_container: str = "safetensors"
    tokens: int = 64
    ids_with_last: bool = True  # speculators reference: --layer-ids includes N
    forward: str = "float32"  # the candidate's streams: the fp32 recording (+ synthetic noise) or a bf16 forward
    tolerance: str = ""  # a user's --tolerance REGEX=FLOOR
    threshold: float = 0.0  # a user's --threshold (0: none)
    seed: int = 0

    @property
    def family(self) -> str:
        v = f"[{self.variant}]" if self.variant else ""
        side = "/ref-side" if self.side == "ref" else ""
        return f"{self.fault}{v}/{self.thickness}{side}"

    def args(self) -> str:
        """The one-line repro: ``python -m tests.scenarios KEY=VALUE ...``."""
        d = {k: v for k, v in self.__dict__.items() if v != Scenario.__dataclass_fields__[k].default}
        d = {"arch": self.arch, "fault": self.fault, **d}
        return " ".join(f"{k}={v}" for k, v in d.items())


@dataclass
class Built:
    ref: dict[str, np.ndarray]
    ref_labels: dict[str, Label]
    ref_claims: list[int] | None
    cand: dict[str, np.ndarray]
    cand_labels: dict[str, Label]
    cand_claims: list[int] | None
    expect: Expect
    layer_ids: list[int] | None = None
    convention: str | None = None
    ref_order: list[str] | None = None  # speculators: slot order of hidden_states
    cand_order: list[str] | None = None
    swapped: bool = False  # the serving dump is passed as the reference
    layout: str = ""  # "batch": candidate tensors get a leading batch dim; "fortran": Fortran order
    magic: str = ""  # write that side's safetensors header so its first byte is this format's magic
    notes: list[str] = field(default_factory=list)


def train_ids(st: Streams) -> list[int]:
    """The training slot list: the seed's [0, 3, 7] on 12 layers; speculators' default
    [2, N//2, N-3] on a pretrained target."""
    return [2, st.n // 2, st.n - 3] if st.pretrained else [0, 3, 7]


def _rms(x: np.ndarray) -> np.ndarray:
    x64 = x.astype(np.float64)
    return (x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + 1e-6)).astype(np.float32)


def content(st: Streams, label: Label, t: int, rng: np.random.Generator) -> np.ndarray:
    """The float32 [t, H] values a label stands for."""
    kind = label[0]
    if kind == "stream":
        return st.hidden[label[1]][:t]
    if kind == "mlp":
        return st.mlp_out[label[1]][:t]
    if kind == "final_norm":
        return st.final_norm[:t]
    if kind == "rms":  # a layer's input RMSNorm output (tiny models: unit weight, eps 1e-6), in the forward's dtype
        from tests.scenarios.containers import round_to

        return round_to(_rms(st.hidden[label[1]][:t]), st.dtype)
    if kind == "shifted":  # row i holds row i+1
        return st.hidden[label[1]][1:t + 1]
    raise ValueError(label)


def _noise(x: np.ndarray, dtype: str, rng: np.random.Generator) -> np.ndarray:
    """Independent rounding noise of a serving forward: ~2 units of roundoff per element."""
    u = {"float32": 2.0**-24, "bfloat16": 2.0**-8, "float16": 2.0**-11}.get(dtype, 2.0**-8)
    return (x * (1 + 2 * u * rng.standard_normal(x.shape))).astype(np.float32)


_CAND_SOURCE: contextvars.ContextVar[Streams | None] = contextvars.ContextVar("cand_source", default=None)


def build(st: Streams, sc: Scenario) -> Built:
    rng = np.random.default_rng(sc.seed * 7919 + len(sc.fault))
    t = min(sc.tokens, st.tokens - 3, (st.bf16.tokens - 3) if st.bf16 and sc.forward == "bfloat16" else st.tokens)
    train = train_ids(st)
    token = _CAND_SOURCE.set(st.bf16 if sc.forward == "bfloat16" else None)
    try:
        b = _FAULTS[sc.fault](st, sc, train, t, rng)
    finally:
        _CAND_SOURCE.reset(token)
    if sc.fault == "drift" and not sc.threshold:
        raise ValueError("drift needs a threshold (the user's --threshold)")
    if sc.fault not in ("nothing",) and sc.forward == "float32":
        for name, lab in list(b.cand_labels.items()):
            if lab and lab[0] in ("stream", "mlp", "final_norm", "rms", "shifted"):
                b.cand[name] = _noise(b.cand[name], sc.cand_dtype, rng)
    if b.layout == "batch":
        b.cand = {k: (v[None] if v.dtype.kind == "f" else v) for k, v in b.cand.items()}
    if "aux" in b.cand_labels and b.cand_labels["aux"][0] == "concat":  # one capture: the same values as aux.{i}
        by_label = {lab: b.cand[n] for n, lab in b.cand_labels.items() if n.startswith("aux.")}
        src = st.bf16 if sc.forward == "bfloat16" and st.bf16 else st
        b.cand["aux"] = np.concatenate([by_label.get(("stream", s), src.hidden[s][:t])
                                        for s in b.cand_labels["aux"][1]], axis=-1)
    if sc.ref_container == "speculators":
        b.ref_order = [n for n in b.ref if n.startswith("aux.")] + [f"hidden.{st.n}"]
        b.layer_ids = train + [st.n] if sc.ids_with_last else list(train)
        b.convention = "speculators"
        if not sc.ids_with_last:  # the last slot is then unnamed: verifier_last_hidden_states
            _rename_last(b, st)
    return b


def _rename_last(b: Built, st: Streams) -> None:
    last = f"hidden.{st.n}"
    for se in b.expect.slots:
        if last in se.holds:
            se.holds = (se.holds - {last}) | {"verifier_last_hidden_states"}
            if se.streams != ANY:
                se.streams = frozenset(se.streams) | {None}


# -- the reference ------------------------------------------------------------------------------

def reference(st: Streams, sc: Scenario, train: list[int], t: int) -> tuple[dict, dict]:
    """(tensors, labels) of a training dump of the given thickness."""
    tens: dict[str, np.ndarray] = {"input_ids": st.ids[:t]}
    labels: dict[str, Label] = {"input_ids": ("ids",)}
    if sc.thickness == "full":
        for s in range(st.n + 1):
            tens[f"hidden.{s}"], labels[f"hidden.{s}"] = st.hidden[s][:t], ("stream", s)
        for k in range(st.n):
            tens[f"attn_out.{k}"], labels[f"attn_out.{k}"] = st.attn_out[k][:t], ("attn", k)
            tens[f"mlp_out.{k}"], labels[f"mlp_out.{k}"] = st.mlp_out[k][:t], ("mlp", k)
        tens["final_norm"], labels["final_norm"] = st.final_norm[:t], ("final_norm",)
    for i, s in enumerate(train):
        tens[f"aux.{i}"], labels[f"aux.{i}"] = st.hidden[s][:t], ("stream", s)
    if sc.thickness == "aux_last":
        tens[f"hidden.{st.n}"], labels[f"hidden.{st.n}"] = st.hidden[st.n][:t], ("stream", st.n)
    return tens, labels


def _ref_knows_ids(sc: Scenario) -> bool:
    return sc.ref_container != "upcast"  # metadata claims, or --layer-ids for speculators files


def holds(ref_labels: dict[str, Label], label: Label) -> frozenset[str]:
    return frozenset(n for n, lab in ref_labels.items() if lab == label)


def slot_expect(i: int, label: Label, ref_labels: dict[str, Label], sc: Scenario, not_ok: bool = False,
                check: bool = True) -> SlotExpect:
    """What slot i's identification must say, from its label and the reference's labels."""
    h = holds(ref_labels, label)
    if not check:
        return SlotExpect(i, h, ANY, False, not_ok)
    if label[0] == "stream":
        s = label[1]
        nameable = any(n == f"hidden.{s}" for n in h) or (h and _ref_knows_ids(sc))
        return SlotExpect(i, h, frozenset({s}) if nameable else frozenset({None, s}), True, not_ok)
    if label[0] in ("mlp", "zeros"):
        return SlotExpect(i, h, frozenset({None}), bool(h), not_ok)
    return SlotExpect(i, h, ANY, bool(h), not_ok)


def _cand(st: Streams, labels: list[Label], t: int, rng: np.random.Generator) -> tuple[dict, dict]:
    st = _CAND_SOURCE.get() or st  # a bf16 forward's streams when the scenario asks for one
    tens: dict[str, np.ndarray] = {"input_ids": st.ids[:t]}
    labs: dict[str, Label] = {"input_ids": ("ids",)}
    for i, lab in enumerate(labels):
        tens[f"aux.{i}"], labs[f"aux.{i}"] = content(st, lab, t, rng), lab
    return tens, labs


def _slots_built(st: Streams, sc: Scenario, train: list[int], t: int, rng: np.random.Generator,
                 cand_labels: list[Label], claims: list[int] | None, exp: Expect, check: bool = True,
                 ref_train: list[int] | None = None) -> Built:
    ref, rl = reference(st, sc, ref_train or train, t)
    cand, cl = _cand(st, cand_labels, t, rng)
    rt = ref_train or train
    exp.slots = [slot_expect(i, lab, rl, sc, not_ok=exp.verdict == "fail" and (i >= len(rt) or lab != ("stream", rt[i])),
                             check=check) for i, lab in enumerate(cand_labels)]
    return Built(ref, rl, ref_train or train, cand, cl, claims, exp)


def _thin(sc: Scenario) -> bool:
    return sc.thickness != "full"


# -- slot faults ---------------------------------------------------------------------------------

def f_benign(st, sc, train, t, rng):  # noqa: ANN001, ANN201
    return _slots_built(st, sc, train, t, rng, [("stream", s) for s in train], train, Expect("pass"))


def f_layer_mismatch(st, sc, train, t, rng):  # noqa: ANN001, ANN201
    j = int(rng.integers(len(train)))
    others = [s for s in range(st.n + 1) if s not in train]
    if sc.variant == "dup":  # a real duplicate: another slot's stream fed twice ([3, 3, 7])
        others = [s for s in train if s != train[j]]
    s2 = int(rng.choice(others))
    ids = list(train)
    ids[j] = s2
    last_named = not (sc.ref_container == "speculators" and not sc.ids_with_last)  # else verifier_last_hidden_states
    in_ref = sc.thickness == "full" or (sc.thickness == "aux_last" and s2 == st.n and last_named) or s2 in train
    codes = {"LAYER_MISMATCH"} if in_ref else {"LAYER_MISMATCH", "UNKNOWN"}
    return _slots_built(st, sc, train, t, rng, [("stream", s) for s in ids], ids,
                        Expect("fail", frozenset(codes), forbidden=frozenset({"NUMERIC_DRIFT"}) | NORM_CODES
                               | (STORIES - {"LAYER_MISMATCH"})))


def shifted_ids(st: Streams, train: list[int]) -> list[int]:
    """The seed story: the list loses its first stream and gains one past its last."""
    nxt = min(st.n, train[-1] + (train[-1] - train[-2])) if st.pretrained else 10
    return train[1:] + [nxt]


def f_slot_shift(st, sc, train, t, rng):  # noqa: ANN001, ANN201
    ids = shifted_ids(st, train)
    claims = list(train) if sc.variant == "claims_trained" else ids  # serving may believe it feeds the trained list
    return _slots_built(st, sc, train, t, rng, [("stream", s) for s in ids], claims,
                        Expect("fail", frozenset({"SLOT_SHIFT"}),
                               forbidden=frozenset({"NUMERIC_DRIFT", "LAYER_OFFSET", "ORDER_MISMATCH"})))


def f_layer_offset(st, sc, train, t, rng):  # noqa: ANN001, ANN201
    d = -1 if sc.variant == "minus" else 1
    ids = [s + d for s in train]
    codes = {"LAYER_OFFSET"} if sc.thickness == "full" else {"LAYER_OFFSET", "LAYER_MISMATCH", "UNKNOWN"}
    return _slots_built(st, sc, train, t, rng, [("stream", s) for s in ids], ids,
                        Expect("fail", frozenset(codes), forbidden=frozenset({"NUMERIC_DRIFT", "SLOT_SHIFT",
                                                                             "ORDER_MISMATCH"}) | NORM_CODES))


def f_ref_claim_wrong(st, sc, train, t, rng):  # noqa: ANN001, ANN201
    """The training file's metadata claims another stream for slot 0 than its values hold; serving
    feeds what training really fed. Values decide (docs/format.md): slot 0 holds stream train[0],
    and the wrong claim is reported."""
    b = f_benign(st, sc, train, t, rng)
    b.ref_claims = [train[0] + 1] + list(train[1:])
    b.expect = Expect("any", slots=b.expect.slots, mentions=r"claim|stream_ids")
    return b


def f_order(st, sc, train, t, rng):  # noqa: ANN001, ANN201
    perms = [[1, 2, 0], [2, 0, 1], [1, 0, 2], [0, 2, 1], [2, 1, 0]]
    p = perms[int(rng.integers(len(perms)))]
    ids = [train[i] for i in p]
    return _slots_built(st, sc, train, t, rng, [("stream", s) for s in ids], ids,
                        Expect("fail", frozenset({"ORDER_MISMATCH"}), forbidden=frozenset({"SLOT_SHIFT", "LAYER_OFFSET"})))


def f_residual_missing(st, sc, train, t, rng):  # noqa: ANN001, ANN201
    j = int(rng.integers(1, len(train)))  # past the embedding: there clone == add
    labels: list[Label] = [("stream", s) for s in train]
    labels[j] = ("mlp", train[j] - 1)
    codes = {"RESIDUAL_MISSING"} if sc.thickness == "full" else {"RESIDUAL_MISSING", "UNKNOWN"}
    return _slots_built(st, sc, train, t, rng, labels, train,
                        Expect("fail", frozenset(codes), forbidden=frozenset({"LAYER_MISMATCH"}) | NORM_CODES))


def f_norm_final(st, sc, train, t, rng):  # noqa: ANN001, ANN201
    """HF's post-norm last state where the pre-norm stream N was meant (or the reverse)."""
    ids = train[:-1] + [st.n]
    j = len(ids) - 1
    normed, raw = ("final_norm",), ("stream", st.n)
    return _norm(st, sc, ids, t, rng, j, normed, raw)


def f_norm_input(st, sc, train, t, rng):  # noqa: ANN001, ANN201
    """A fused add+RMSNorm output (the next layer's input norm) captured instead of the stream."""
    j = 1
    return _norm(st, sc, train, t, rng, j, ("rms", train[j]), ("stream", train[j]))


def _norm(st, sc, ids, t, rng, j, normed, raw):  # noqa: ANN001, ANN202
    ref, rl = reference(st, sc, ids, t)
    labels: list[Label] = [("stream", s) for s in ids]
    if sc.side == "cand":
        labels[j] = normed
        code, forbid = "NORM_APPLIED", "NORM_MISSING"
    else:  # training fed the normed tensor (SpecForge's post-norm hidden_state); serving the raw stream
        ref[f"aux.{j}"], rl[f"aux.{j}"] = content(st, normed, t, rng), normed
        code, forbid = "NORM_MISSING", "NORM_APPLIED"
    cand, cl = _cand(st, labels, t, rng)
    exp = Expect("fail", frozenset({code}), forbidden=frozenset({forbid, "SCALE_MISMATCH"}))
    exp.slots = [slot_expect(i, lab, rl, sc, not_ok=i == j) for i, lab in enumerate(labels)]
    exp.slots[j].strict_names = bool(exp.slots[j].holds)
    return Built(ref, rl, ids, cand, cl, ids, exp)


def f_scale(st, sc, train, t, rng):  # noqa: ANN001, ANN201
    """An embedding scale sqrt(H) applied on one side only (slot 0 holds the embedding)."""
    f = math.sqrt(st.hidden_size)
    b = f_benign(st, sc, train, t, rng)
    if sc.side == "cand":
        b.cand["aux.0"] = b.cand["aux.0"] * np.float32(f)
        b.cand_labels["aux.0"] = ("scaled", train[0], f)
        factor = f
    else:
        b.ref["aux.0"] = b.ref["aux.0"] * np.float32(f)
        b.ref_labels["aux.0"] = ("scaled", train[0], f)
        factor = 1 / f
    b.expect = Expect("fail", frozenset({"SCALE_MISMATCH"}), forbidden=NORM_CODES, factor=factor,
                      slots=[SlotExpect(0, frozenset(), ANY, False, True)])
    return b


















USER_FLAGS = {"drift": {"threshold": 1e-5}, "loose_tolerance": {"tolerance": "aux.*=1"}}


def variant_of(sc: Scenario) -> Scenario:
    """A scenario with its default variant (and the user flags its fault needs) filled in."""
    if not sc.variant and sc.fault in VARIANTS:
        sc = replace(sc, variant=VARIANTS[sc.fault][0])
    for k, v in USER_FLAGS.get(sc.fault, {}).items():
        if not getattr(sc, k):
            sc = replace(sc, **{k: v})
    return sc


from tests.scenarios.damage import DAMAGE  # noqa: E402  (damaged values, layouts, slot counts)
from tests.scenarios.structure import STRUCTURE  # noqa: E402  (the whole-dump faults)
from tests.scenarios.arch_faults import ARCH  # noqa: E402  (causes beyond Llama-style pre-norm)

_FAULTS = {name[2:]: fn for name, fn in list(globals().items()) if name.startswith("f_") and callable(fn)}
_FAULTS |= DAMAGE | STRUCTURE | ARCH
