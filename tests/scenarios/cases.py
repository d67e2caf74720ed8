"""The scenario tables: exhaustive over the small axes, sampled over the large ones.

``table()`` is what CI runs as parametrized tests (bounded: a few hundred cases);
``strategy()`` is the hypothesis strategy over every axis (its example count comes from
``CONSISTENCY_SCENARIOS``).
"""

from __future__ import annotations

import itertools
import os
from dataclasses import replace

from tests.scenarios import containers as C
from tests.scenarios.build import FAMILIES, SMOL
from tests.scenarios.faults import SIDED, variant_of, SLOT_FAULTS, STRUCTURE_FAULTS, THICKNESS, VARIANTS, Scenario
from tests.scenarios.run import valid

ALL_FAULTS = SLOT_FAULTS + STRUCTURE_FAULTS
TINY = tuple(FAMILIES)


def _variants(fault: str) -> tuple[str, ...]:
    return VARIANTS.get(fault, ("",))


def _sides(fault: str) -> tuple[str, ...]:
    return ("cand", "ref") if fault in SIDED else ("cand",)


def every_fault(arch: str, **kw: object) -> list[Scenario]:
    """Every fault x variant x thickness x side on one architecture."""
    out = []
    for fault in ALL_FAULTS:
        for v, th, side in itertools.product(_variants(fault), THICKNESS, _sides(fault)):
            cc = "upcast" if v == "fortran" else "safetensors"
            sc = variant_of(Scenario(arch, fault, variant=v, thickness=th, side=side, cand_container=cc,
                                     **kw))  # type: ignore[arg-type]
            if valid(sc):
                out.append(sc)
    return out


CORE = ("benign", "slot_shift", "layer_offset", "residual_missing", "norm_final", "zero_column")


def containers_dtypes(arch: str) -> list[Scenario]:
    """Container x dtype on the faults whose floors and identity depend on them."""
    out = []
    for rc, cc in itertools.product(C.CONTAINERS, C.CONTAINERS):
        for rd, cd in itertools.product(C.DTYPES, C.DTYPES):
            if (rd, cd) not in (("float32", "bfloat16"), ("bfloat16", "bfloat16"), ("float32", "float16"),
                                ("float16", "float16"), ("bfloat16", "float32"), ("float32", "float32")):
                continue
            diag = rc == cc or "upcast" in (rc, cc)
            main_dt = (rd, cd) in (("float32", "bfloat16"), ("bfloat16", "bfloat16"), ("float16", "float16"))
            for fault in CORE if (diag and main_dt) else ("benign",):
                th = "aux" if fault != "norm_final" else "aux_last"
                sc = Scenario(arch, fault, thickness=th, ref_dtype=rd, cand_dtype=cd, ref_container=rc,
                              cand_container=cc, variant=_variants(fault)[0])
                if valid(sc):
                    out.append(sc)
    return out


SPEC_FAULTS = ("benign", "slot_shift", "layer_offset", "layer_mismatch", "order", "residual_missing", "scale",
               "tokens", "zero_slot")


def speculators(arch: str, tokens: int = 64) -> list[Scenario]:
    """speculators' hs_*.safetensors as the reference: float8 (per-token scales) or bf16,
    read with or without the appended last id."""
    out = []
    for dt, last, fault in itertools.product((C.FP8, "bfloat16"), (True, False), SPEC_FAULTS):
        sc = Scenario(arch, fault, thickness="aux_last", ref_container="speculators", ref_dtype=dt,
                      cand_dtype="bfloat16", ids_with_last=last, variant=_variants(fault)[0], tokens=tokens)
        if valid(sc):
            out.append(sc)
    return out


def across_archs() -> list[Scenario]:
    """The slot-list stories and the norm/scale directions on every tiny family."""
    out = []
    for arch in TINY[1:]:
        for fault in ("benign", "slot_shift", "layer_offset", "order", "residual_missing", "norm_final",
                      "norm_input", "scale", "token_scale", "token_shift", "zero_column", "propagate", "drift",
                      "swapped"):
            ths = ("full", "aux") if fault in ("slot_shift", "norm_final", "norm_input", "scale", "residual_missing") \
                else ("aux",) if fault != "propagate" else ("full",)
            for th, side in itertools.product(ths, _sides(fault)):
                sc = variant_of(Scenario(arch, fault, thickness=th, side=side))
                if valid(sc):
                    out.append(sc)
    return out


def real_bf16(archs: tuple[str, ...] = TINY, tokens: int = 64) -> list[Scenario]:
    """The candidate from a real bf16 forward (accumulated rounding at depth, not synthetic noise)."""
    out = []
    for arch in archs:
        for fault in ("benign", "slot_shift", "layer_offset", "residual_missing", "norm_final", "tokens"):
            for th in ("aux", "aux_last") if arch != SMOL else ("full", "aux", "aux_last"):
                sc = variant_of(Scenario(arch, fault, thickness=th, forward="bfloat16", tokens=tokens))
                if valid(sc):
                    out.append(sc)
        for fault in ("benign", "layer_offset"):
            sc = Scenario(arch, fault, thickness="aux_last", ref_container="speculators", ref_dtype=C.FP8,
                          forward="bfloat16", tokens=tokens)
            if valid(sc):
                out.append(sc)
    return out


def table() -> list[Scenario]:
    from tests.scenarios import arch_faults

    cases = (every_fault(TINY[0]) + across_archs() + containers_dtypes("qwen2") + speculators("qwen3")
             + real_bf16() + arch_faults.table())
    seen, out = set(), []
    for sc in cases:
        if sc not in seen:
            seen.add(sc)
            out.append(sc)
    return out


def pretrained_table(big: bool | None = None) -> list[Scenario]:
    """SmolLM2-135M (real weights: massive activations, adjacent streams 1.5e-2 apart, a learned
    final-norm weight). CI runs the speculators float8 files, a real bf16 forward and the core
    faults on a thin reference; ``CONSISTENCY_SCENARIOS`` > 500 runs every fault."""
    big = n_examples() > 500 if big is None else big
    full_ok = ("benign", "slot_shift", "layer_offset", "residual_missing", "norm_final", "norm_input", "propagate",
               "streams_only", "spec_cand", "scale")
    out = [sc for sc in every_fault(SMOL, tokens=96)
           if (sc.thickness != "full" or sc.fault in full_ok)
           and sc.variant in ("", "zero2", "garbage_first", "claims", "agree", "weights", "width", "meta",
                              "slots_wrong", "other", "dup", "fewer", "batch")]
    if not big:
        core = ("benign", "slot_shift", "layer_offset", "layer_mismatch", "residual_missing", "norm_final", "scale",
                "tokens", "zero_column", "nothing")
        out = [sc for sc in out if sc.thickness == "aux" and sc.fault in core]
    spec = [sc for sc in speculators(SMOL, tokens=96) if big or sc.ref_dtype == C.FP8]
    out += spec + real_bf16((SMOL,), tokens=96)
    if big:
        out += [replace(sc, arch=SMOL, tokens=96) for sc in containers_dtypes("x")
                if sc.fault in ("benign", "layer_offset")]
    return [sc for sc in dict.fromkeys(out) if valid(sc)]


def n_examples() -> int:
    return int(os.environ.get("CONSISTENCY_SCENARIOS", "100"))


def strategy():  # noqa: ANN201
    """Every axis at once (tiny families): hypothesis draws and shrinks over these."""
    from hypothesis import strategies as st

    @st.composite
    def scenario(draw):  # noqa: ANN001, ANN202
        fault = draw(st.sampled_from(ALL_FAULTS))
        spec = draw(st.booleans()) and fault in SPEC_FAULTS
        sc = Scenario(
            arch=draw(st.sampled_from(TINY)), fault=fault, variant=draw(st.sampled_from(_variants(fault))),
            thickness="aux_last" if spec else draw(st.sampled_from(THICKNESS)),
            side=draw(st.sampled_from(_sides(fault))),
            ref_dtype=draw(st.sampled_from((C.FP8, "bfloat16") if spec else C.DTYPES)),
            cand_dtype=draw(st.sampled_from(C.DTYPES)),
            ref_container="speculators" if spec else draw(st.sampled_from(C.CONTAINERS)),
            cand_container=draw(st.sampled_from(C.CONTAINERS)),
            tokens=draw(st.sampled_from((16, 64, 200))), ids_with_last=draw(st.booleans()),
            forward=draw(st.sampled_from(("float32", "bfloat16"))),
            seed=draw(st.integers(0, 2**16)))
        return variant_of(sc)

    return scenario().filter(valid)
