"""Write a scenario's two files and compare them with the library pipeline (what the CLI calls)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import numpy as np

from tests.scenarios import containers as C
from tests.scenarios.build import record
from tests.scenarios.expect import Miss, check
from tests.scenarios.faults import Built, Scenario, build, variant_of


def valid(sc: Scenario) -> bool:
    """Combinations that describe a real pair of files (and that the construction decides)."""
    if sc.ref_container == "speculators" and (sc.thickness != "aux_last" or sc.fault in
                                             ("norm_final", "hf_states", "nothing", "streams_only", "missing_stream",
                                              "propagate", "spec_cand")):
        return False
    if sc.ref_dtype == C.FP8 and sc.ref_container != "speculators":
        return False
    if sc.fault in ("streams_only", "missing_stream", "propagate", "spec_cand", "swapped",
                    "loose_tolerance") and sc.thickness == "aux_last":
        return False
    if sc.fault in ("streams_only", "missing_stream", "propagate", "spec_cand", "hf_states") \
            and sc.thickness != "full":
        return False
    if sc.fault == "missing_stream" and sc.variant == "meta" and "upcast" in (sc.ref_container, sc.cand_container):
        return False  # the claim lives in metadata, which an upcast npz has none of
    if sc.fault == "streams_only" and sc.variant == "claims" and sc.cand_container == "upcast":
        return False
    if sc.fault == "spec_cand" and sc.ref_container == "upcast":
        return False
    if sc.side == "ref" and sc.fault not in ("norm_final", "norm_input", "scale", "tokens", "header_magic"):
        return False
    if sc.forward == "bfloat16" and sc.arch == "deepseek_v3":
        return False  # MoE routing flips in bf16: deep streams differ per token up to 9e-2 (not "the same stream")
    if sc.fault == "layer_offset" and sc.variant == "minus" and sc.arch != "smollm2":
        return False  # the tiny list starts at stream 0
    if sc.fault == "ref_claim_wrong" and (sc.thickness != "full" or sc.ref_container in ("upcast", "speculators")):
        return False  # only a full reference can show the claim is wrong
    if sc.fault == "layout" and sc.variant == "fortran" and sc.cand_container != "upcast":
        return False
    if sc.fault == "header_magic" and (sc.ref_container if sc.side == "ref" else sc.cand_container) != "safetensors":
        return False
    if (sc.fault == "drift") != bool(sc.threshold) or (sc.fault == "loose_tolerance") != bool(sc.tolerance):
        return False
    if sc.fault == "swapped" and "upcast" in (sc.ref_container, sc.cand_container):
        return False  # which side is which lives in metadata
    if sc.fault == "nonfinite" and sc.cand_dtype not in ("float32", "bfloat16", "float16"):
        return False
    return True


def write(b: Built, sc: Scenario, st: Any, d: Path) -> tuple[Path, Path]:
    if sc.ref_container == "speculators":
        ref = C.write_speculators(d / "ref", [b.ref[n] for n in b.ref_order or []], b.ref["input_ids"], sc.ref_dtype)
    else:
        ref = C.write_side(d / "ref", b.ref, sc.ref_dtype, sc.ref_container,
                           C.SideMeta("training", b.ref_claims, st.n, st.hidden_size))
    if b.cand_order:
        cand = C.write_speculators(d / "cand", [b.cand[n] for n in b.cand_order], b.cand["input_ids"], sc.cand_dtype)
    else:
        cand = C.write_side(d / "cand", b.cand, sc.cand_dtype, sc.cand_container,
                            C.SideMeta("training" if b.swapped else "serving", b.cand_claims, st.n, st.hidden_size),
                            magic=b.magic if sc.side == "cand" else "", fortran=b.layout == "fortran")
    return ref, cand


def run(sc: Scenario, d: Path) -> tuple[Any, BaseException | None, list[Miss], Built]:
    compare = entry_point()
    sc = variant_of(sc)
    st = record(sc.arch)
    b = build(st, sc)
    d.mkdir(parents=True, exist_ok=True)
    ref, cand = write(b, sc, st, d)
    report, exc = None, None
    try:
        kw = ids_kwargs(compare, b, sc)
        if sc.tolerance:
            kw["tolerance"] = [sc.tolerance]
        if sc.threshold:
            kw["threshold"] = sc.threshold
        report = compare(str(ref), str(cand), **kw)
    except Exception as e:  # noqa: BLE001  (judged by check: exit 2 vs crash)
        exc = e
    return report, exc, check(report, exc, b.expect), b


def entry_point() -> Any:
    """The library compare front door (what the CLI calls), taking loose options."""
    from consistency.pipeline.compare import compare

    return compare


def ids_kwargs(fn: Any, b: Built, sc: Scenario) -> dict[str, Any]:
    """--layer-ids for the file that needs them: per file where the pipeline takes per-file ids."""
    import inspect

    if b.layer_ids is None:
        return {}
    params = inspect.signature(fn).parameters
    foreign = "cand" if b.cand_order else "ref" if sc.ref_container == "speculators" else None
    if foreign and f"{foreign}_layer_ids" in params and sc.variant != "global_ids":
        return {f"{foreign}_layer_ids": b.layer_ids, "convention": b.convention}
    return {"layer_ids": b.layer_ids, "convention": b.convention}


def parse(argv: list[str]) -> Scenario:
    kw: dict[str, Any] = {}
    types = {f.name: f.type for f in dataclasses.fields(Scenario)}
    for a in argv:
        k, _, v = a.partition("=")
        t = types[k]
        kw[k] = (int(v) if t in ("int", int) else float(v) if t in ("float", float)
                 else (v == "True") if t in ("bool", bool) else v)
    return Scenario(**kw)


def main(argv: list[str]) -> int:
    """python -m tests.scenarios arch=llama fault=slot_shift thickness=aux  (prints the diagnosis)."""
    import tempfile

    sc = parse(argv)
    with tempfile.TemporaryDirectory() as tmp:
        report, exc, misses, b = run(sc, Path(tmp))
    print(f"scenario: {sc.args()}")
    if exc is not None:
        print(f"raised {type(exc).__name__}: {exc}")
    else:
        print(f"verdict {report.verdict}: {report.summary}")
        for s in report.slots:
            print(f"  slot {s.slot} {s.tensor}: {s.code} identified {s.identified_as} (stream {s.identified_stream})")
        for f in report.findings:
            if getattr(f.severity, "value", f.severity) != "info":
                print(f"  {f.code} [{getattr(f.severity, 'value', f.severity)}] {f.tensor}: {f.message[:200]}")
    print(f"expected: verdict {b.expect.verdict}, codes {sorted(b.expect.codes)}")
    for m in misses:
        print(f"MISS {m.kind}: {m.detail}")
    return 1 if misses else 0


if __name__ == "__main__":
    np.seterr(all="ignore")
    sys.exit(main(sys.argv[1:]))
