"""Scenario proof for drafts beyond EAGLE-3 (issue 19): MTP, MiMo-order MTP and EAGLE-1.

Same shape as the EAGLE-3 scenarios (tests/scenarios/faults.py, expect.py): a scenario is a
point on a few axes; ``build`` runs our own draft (``mtp_build``) once per side and writes a
reference (training) and a candidate (serving) dump with the design's names; the expected
diagnosis follows from which side was built how, never from what the engine prints. The
engine is reached only through ``consistency.compare(...)`` (and the CLI in the tests).

Axes: family, consumer (which runtime row of ``contract/consumers.py`` the draft is served
under), fault x side, reference thickness (``full``: the target's streams and every per-step
tensor; ``thin``: ``aux.0`` and ``recycle.k`` only), candidate dtype, both containers, the
contract (none, ``contract_for`` written as JSON, or a hand-written YAML file), K and T.
The contract always describes the reference (what the draft was trained on).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from tests.scenarios import containers as C
from tests.scenarios.expect import Miss
from tests.scenarios.mtp_expect import STORY, MtpExpect, _sev, check, visible
from tests.scenarios.mtp_build import SideSpec, run_cached, target, target_tensors, trd

# consumer -> (row code in consistency/contract/consumers.py ROWS, our draft kind)
CONSUMERS: dict[str, tuple[str, str]] = {
    "mtp": ("sglang-deepseek-nextn", "mtp"),  # post-norm step 0, d_norm recycle, pos 0 kept
    "mtp_vllm": ("vllm-deepseek-mtp", "mtp"),  # ... pos 0 zeroed (vLLM DeepSeek/GLM after #45895)
    "mtp_legacy": ("vllm-deepseek-mtp-legacy", "mtp"),  # d_raw recycle (vLLM before #45895)
    "eagle1": ("vllm-eagle1", "eagle1"),  # fc(cat(emb, h)), d_raw recycle
    "mimo": ("sglang-mimo-mtp", "mtp"),  # [hidden, embed], pos 0 zeroed
}
FAULTS = ("benign", "prenorm", "recycle_flip", "recycle_target", "concat", "pos0", "unshifted", "missing_recycle",
          "recycle_stale")
SIDED = ("prenorm", "concat", "pos0")  # faults a reference (training) side can carry too
VARIANTS = {"recycle_target": ("next", "same")}
THICKNESS = ("full", "thin")
CONTRACTS = ("none", "api", "yaml")
CONTAINERS = ("safetensors", "npz")

@dataclass(frozen=True)
class MtpScenario:
    family: str = "deepseek_v3"
    consumer: str = "mtp"
    fault: str = "benign"
    side: str = "cand"
    variant: str = ""
    thickness: str = "full"
    cand_dtype: str = "float32"
    ref_container: str = "safetensors"
    cand_container: str = "safetensors"
    contract: str = "none"
    steps: int = 3
    tokens: int = 40
    forward: str = "float32"  # the candidate draft's forward dtype (bfloat16: a serving forward)
    aux_rows: str = "step"  # aux.0 rows on both sides: "step" (T-1, as consistency.record.draft writes) or "all" (T)
    meta: str = "none"  # what the dumps claim: "none"; "claims" (true norm states + the reference's consumer,
    # as consistency.record.draft writes them); "lies" (the candidate claims aux.0 is what the reference holds)

    def args(self) -> str:
        d = MtpScenario()
        return " ".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)
                        if getattr(self, f.name) != getattr(d, f.name) or f.name in ("family", "fault"))


@dataclass
class MtpBuilt:
    ref: dict[str, np.ndarray]
    cand: dict[str, np.ndarray]
    contract: dict[str, Any] | None
    expect: MtpExpect


def row_of(consumer: str) -> Any:
    from consistency.contract.consumers import ROWS

    code = CONSUMERS[consumer][0]
    return next(r for r in ROWS if r.code == code)


def valid(sc: MtpScenario) -> bool:
    if sc.side == "ref" and sc.fault not in SIDED:
        return False
    if sc.fault == "recycle_target" and not sc.variant:
        return False
    if sc.fault != "recycle_target" and sc.variant:
        return False
    if sc.fault == "recycle_stale" and (sc.steps < 3 or _ref_recycle_kind(sc) != "d_norm"):
        return False  # step 1 is fed step 0's state anyway; step 2 shows the stale buffer
    if sc.forward == "bfloat16" and sc.cand_dtype != "bfloat16":
        return False  # a bf16 forward writes bf16 tensors
    return 2 <= sc.steps <= 3 and sc.tokens >= 8


def _flip(v: str, a: str, b: str) -> str:
    return b if v == a else a


def side_specs(sc: MtpScenario) -> tuple[SideSpec, SideSpec]:
    """(reference, candidate) specs: both follow the consumer row, then the fault lands on one side."""
    r = row_of(sc.consumer)
    base = SideSpec(step0=r.step0_norm.value, recycle=r.recycle.value, pos0=r.pos0_embed.value,
                    order=r.concat_order.value, aux_rows=sc.aux_rows)
    faulty = base
    if sc.fault == "prenorm":
        faulty = replace(base, step0=_flip(base.step0, "final_norm", "none"))
    elif sc.fault == "recycle_flip":
        faulty = replace(base, recycle=_flip(base.recycle, "d_norm", "d_raw"))
    elif sc.fault == "recycle_target":
        faulty = replace(base, recycle="target" if sc.variant == "next" else "target_same")
    elif sc.fault == "concat":
        faulty = replace(base, order=_flip(base.order, "embed,hidden", "hidden,embed"))
    elif sc.fault == "pos0":
        faulty = replace(base, pos0=_flip(base.pos0, "kept", "zeroed"))
    elif sc.fault == "unshifted":
        faulty = replace(base, shift=False)
    elif sc.fault == "missing_recycle":
        faulty = replace(base, drop=frozenset({sc.steps - 1}))
    elif sc.fault == "recycle_stale":  # ik_llama.cpp #1718: the recycled buffer overwritten / not refreshed
        faulty = replace(base, recycle="stale")
    ref, cand = (faulty, base) if sc.side == "ref" else (base, faulty)
    return ref, replace(cand, dtype=sc.forward)


def contract_dict(sc: MtpScenario, ref_spec: SideSpec) -> dict[str, Any]:
    """The contract of the reference side, from the project's table (``contract_for``)."""
    from consistency.contract.consumers import contract_for
    from consistency.contract.models import ModelInfo

    t = target(sc.family)
    c = contract_for(row_of(sc.consumer).method, ModelInfo(num_layers=t.n, hidden_size=t.hidden_size),
                     row_of(sc.consumer), steps=sc.steps)
    d = json.loads(c.model_dump_json(exclude_none=True))
    d["slots"][0]["norm"] = ref_spec.step0
    d["consumer"] |= {"pos0_embed": ref_spec.pos0, "concat_order": ref_spec.order}
    return d


def hand_yaml(d: dict[str, Any]) -> str:
    """The same contract typed by hand (what a user writes), not produced by our serializer."""
    s, c = d["slots"][0], d["consumer"]
    return "\n".join([
        "# MTP draft contract, written by hand",
        f"contract_version: {d['contract_version']}",
        "target:",
        f"  num_layers: {d['target']['num_layers']}",
        f"  hidden_size: {d['target']['hidden_size']}",
        "slots:",
        f"  - stream: {s['stream']}",
        f"    width: {s['width']}",
        f"    norm: {s['norm']}",
        "consumer:",
        f"  kind: {c['kind']}",
        f"  pairing: {c['pairing']}",
        f"  pos0_embed: {c['pos0_embed']}",
        f"  recycle: {c['recycle']}",
        f"  concat_order: \"{c['concat_order']}\"",
        f"  steps: {c['steps']}",
        ""])


def _np(x: Any) -> np.ndarray:
    return x.numpy().copy() if hasattr(x, "numpy") else np.asarray(x)


def build(sc: MtpScenario) -> MtpBuilt:
    t = target(sc.family)
    kind = CONSUMERS[sc.consumer][1]
    ref_spec, cand_spec = side_specs(sc)
    ref_all = dict(run_cached(sc.family, kind, ref_spec, sc.steps, sc.tokens))
    cand_all = dict(run_cached(sc.family, kind, cand_spec, sc.steps, sc.tokens))
    # which tensors are equal on both sides is decided by the construction, not by bf16 noise
    cand32 = dict(run_cached(sc.family, kind, replace(cand_spec, dtype="float32"), sc.steps, sc.tokens))
    if sc.thickness == "full":
        ref = {k: _np(v) for k, v in target_tensors(t, sc.tokens).items()} | ref_all
    else:
        ref = {k: v for k, v in ref_all.items() if k == "aux.0" or k.startswith("recycle.")}
    cand = cand_all | {"input_ids": _np(t.ids[:sc.tokens])}
    return MtpBuilt(ref, cand, contract_dict(sc, ref_spec) if sc.contract != "none" else None,
                    expect(sc, ref, cand32 | {"input_ids": cand["input_ids"]}, ref_all))


def _ref_recycle_kind(sc: MtpScenario) -> str:
    return row_of(sc.consumer).recycle.value


def expect(sc: MtpScenario, ref: dict[str, np.ndarray], cand: dict[str, np.ndarray],
           ref_all: dict[str, np.ndarray]) -> MtpExpect:
    """What the report must say, from the construction: which code, on which tensor."""
    clean = frozenset(k for k in ref if k in cand and trd(ref[k], cand[k]) < 1e-9)
    # A thin reference records aux.0 itself: its values decide slot 0, whatever a contract says
    # the slot should hold (reference values outrank a declaration: docs/architecture.md, "The
    # evidence model"). Only a reference without aux.0 leaves a contract's slot 0 unverifiable.
    unverified = sc.contract != "none" and sc.meta == "none" and "aux.0" not in ref
    if unverified:
        clean -= {"aux.0"}
    if sc.fault == "benign":
        if unverified:
            return MtpExpect("fail", frozenset({"NOT_VERIFIED"}), frozenset({"aux.0"}), STORY, clean)
        return MtpExpect("pass", clean=clean)
    first = next(k for k in range(1, sc.steps) if f"recycle.{k}" in ref_all)
    full = sc.thickness == "full"
    codes: frozenset[str] = frozenset()
    on: frozenset[str] = frozenset()
    if sc.fault == "prenorm":  # the side fed s=N pre-norm; the other fnorm(s=N)
        codes = frozenset({"NORM_MISSING"}) if sc.side == "cand" else frozenset({"NORM_APPLIED"})
        on = frozenset({"aux.0"})
    elif sc.fault == "recycle_flip":
        codes = frozenset({"RECYCLE_NORM_MISSING"}) if _ref_recycle_kind(sc) == "d_norm" \
            else frozenset({"RECYCLE_NORM_APPLIED"})
        on = frozenset({f"recycle.{first}"})
    elif sc.fault == "recycle_target":
        codes = frozenset({"RECYCLE_TARGET"})
        on = frozenset({f"recycle.{first}"})
    elif sc.fault == "missing_recycle":
        codes, on = frozenset({"MISSING", "NOT_VERIFIED"}), frozenset({f"recycle.{sc.steps - 1}"})
    elif sc.fault == "recycle_stale":  # no code of its own: an error on recycle.2, and none before it
        on = frozenset({"recycle.2"})
    elif full and sc.fault == "concat":
        codes, on = frozenset({"CONCAT_ORDER"}), frozenset({"draft_cat.0"})
    elif full and sc.fault == "pos0":
        codes, on = frozenset({"POS0_EMBED"}), frozenset({"draft_embed.0"})
    elif full and sc.fault == "unshifted":
        codes, on = frozenset({"TOKEN_SHIFT"}), frozenset({"draft_ids.0", "draft_embed.0"})
    # thin + concat/pos0/unshifted: the reference holds no tensor that shows the cause, only
    # recycle.k that differs as a consequence: a failing verdict is all that is decidable, and
    # only where the consequence is beyond the documented noise floor of the candidate's dtype
    # (EAGLE-1's position-0 row moves recycle.1 by ~4% on one row: within bf16's floor).
    forbidden = STORY - codes
    if not full and sc.fault in ("concat", "pos0", "unshifted") and not visible(ref, cand, sc.cand_dtype):
        return MtpExpect("any", forbidden=forbidden, clean=clean)
    if not full and sc.fault in ("concat", "pos0", "unshifted") and not visible(ref, cand, sc.cand_dtype, margin=10.0):
        # within the documented drift band (docs/tolerance.md: NUMERIC_DRIFT up to 10x the floor)
        return MtpExpect("flagged", forbidden=forbidden, clean=clean)
    if sc.fault == "recycle_target" and sc.variant == "same":
        forbidden -= {"TOKEN_SHIFT"}  # target rows not advanced: a shift of the target stream is also true
    return MtpExpect("fail", codes, on, forbidden, clean)


def _storage(a: np.ndarray, dtype: str) -> Any:
    return a if a.dtype.kind in "iub" else C._storage(np.array(a), dtype)


def write(b: MtpBuilt, sc: MtpScenario, d: Path) -> tuple[Path, Path, Path | None]:
    """Both dumps through the project's writer (both containers), and the contract file."""
    from consistency.contract.models import DumpMetadata, ModelInfo, RuntimeInfo
    from consistency.dump.writer import write_dump

    t = target(sc.family)
    d.mkdir(parents=True, exist_ok=True)
    model = ModelInfo(num_layers=t.n, hidden_size=t.hidden_size)
    specs = side_specs(sc)
    paths = []
    for i, (name, tensors, dtype, cont, side, rt) in enumerate((
            ("ref", b.ref, "float32", sc.ref_container, "training", "hf"),
            ("cand", b.cand, sc.cand_dtype, sc.cand_container, "serving", row_of(sc.consumer).runtime))):
        p = d / f"{name}.{'npz' if cont == 'npz' else 'safetensors'}"
        md = DumpMetadata(side=side, model=model, runtime=RuntimeInfo(name=rt))
        if sc.meta != "none":
            _claims(md, sc, specs[0 if (sc.meta == "lies" and i == 1) else i], tensors, reference=i == 0)
        write_dump(p, {k: _storage(v, dtype) for k, v in tensors.items()}, md, force=True)
        paths.append(p)
    cpath = None
    if b.contract is not None:
        cpath = d / ("contract.json" if sc.contract == "api" else "contract.yaml")
        cpath.write_text(json.dumps(b.contract, indent=1) if sc.contract == "api" else hand_yaml(b.contract))
    return paths[0], paths[1], cpath


def _claims(md: Any, sc: MtpScenario, spec: SideSpec, tensors: dict[str, np.ndarray], reference: bool) -> None:
    """What consistency.record.draft writes: the norm state of aux.0 / draft_out / draft_norm,
    and on the reference the consumer it was trained as (metadata.extra)."""
    from consistency.contract.models import NormState, TensorMeta
    from consistency.record.draft import CONSUMER_KEY

    states = {"aux.0": spec.step0} | {k: "none" for k in tensors if k.startswith("draft_out.")} \
        | {k: "other" for k in tensors if k.startswith("draft_norm.")}
    md.tensors = {k: TensorMeta(norm=NormState(v)) for k, v in states.items() if k in tensors}
    if reference:
        md.extra[CONSUMER_KEY] = contract_dict(sc, spec)["consumer"]


def run(sc: MtpScenario, d: Path) -> tuple[Any, BaseException | None, list[Miss], MtpBuilt]:
    import consistency

    b = build(sc)
    ref, cand, cpath = write(b, sc, d)
    report, exc = None, None
    try:
        report = consistency.compare(str(ref), str(cand), contract=str(cpath) if cpath else None)
    except Exception as e:  # noqa: BLE001  (judged by check: exit 2 vs crash)
        exc = e
    return report, exc, check(report, exc, b.expect), b


def table() -> list[MtpScenario]:
    """The CI table (bounded): every fault x side on the DeepSeek-V3 target under the d_norm and
    the d_raw MTP consumers; the faults each other consumer changes (recycle rule, concat
    order, position-0 rule); one pass over the other axes (Qwen3 target, bf16 candidate, npz,
    thin reference, contract files, K = 2, T = 24)."""
    out: list[MtpScenario] = []
    for consumer in CONSUMERS:
        faults = FAULTS if consumer in ("mtp", "mtp_legacy") else ("benign", "recycle_flip", "concat", "pos0")
        for fault in faults:
            for side in ("cand", "ref") if fault in SIDED and consumer in ("mtp", "mtp_legacy") else ("cand",):
                for v in VARIANTS.get(fault, ("",)):
                    out.append(MtpScenario("deepseek_v3", consumer, fault, side, v))
    for fault, v in (("prenorm", ""), ("recycle_flip", ""), ("recycle_target", "next"), ("missing_recycle", "")):
        out.append(MtpScenario("deepseek_v3", "mtp", fault, variant=v, thickness="thin"))  # decidable from a thin ref
    for contract in ("api", "yaml"):  # a thin ref's aux.0 values decide slot 0, not the contract's claim
        out.append(MtpScenario("deepseek_v3", "mtp", "benign", thickness="thin", contract=contract))
    for consumer, contract in (("mtp", "api"), ("mimo", "yaml")):  # a full reference read with a contract
        for rows in ("step", "all"):
            out.append(MtpScenario("deepseek_v3", consumer, "benign", contract=contract, aux_rows=rows))
    for fault, side in (("prenorm", "cand"), ("prenorm", "ref"), ("recycle_flip", "cand")):  # aux.0 with T rows
        out.append(MtpScenario("deepseek_v3", "mtp", fault, side, aux_rows="all"))
    for fault, meta in (("benign", "claims"), ("prenorm", "claims"), ("prenorm", "lies"), ("recycle_flip", "lies")):
        out.append(MtpScenario("qwen3", "mtp_vllm", fault, meta=meta))  # claims in metadata; values decide
    for fault in ("benign", "recycle_flip", "pos0", "prenorm"):  # a real bf16 serving forward
        out.append(MtpScenario("qwen3", "mtp_vllm", fault, cand_dtype="bfloat16", forward="bfloat16"))
    axes = dict(family="qwen3", thickness="thin", cand_dtype="bfloat16", ref_container="npz",
                cand_container="npz", contract="yaml", steps=2, tokens=24)
    for i, fault in enumerate(FAULTS):
        kw = {k: v for j, (k, v) in enumerate(axes.items()) if (i + j) % 2 == 0 or k == "family"}
        kw["contract"] = CONTRACTS[i % 3]
        out.append(MtpScenario(consumer=list(CONSUMERS)[i % len(CONSUMERS)], fault=fault,
                               variant=VARIANTS.get(fault, ("",))[0], **kw))  # type: ignore[arg-type]
    return [sc for sc in dict.fromkeys(out) if valid(sc)]


def strategy():  # noqa: ANN201
    from hypothesis import strategies as st

    @st.composite
    def scenario(draw):  # noqa: ANN001, ANN202
        fault = draw(st.sampled_from(FAULTS))
        return MtpScenario(
            family=draw(st.sampled_from(("deepseek_v3", "qwen3", "llama"))),
            consumer=draw(st.sampled_from(tuple(CONSUMERS))), fault=fault,
            side=draw(st.sampled_from(("cand", "ref") if fault in SIDED else ("cand",))),
            variant=draw(st.sampled_from(VARIANTS.get(fault, ("",)))),
            thickness=draw(st.sampled_from(THICKNESS)), cand_dtype=draw(st.sampled_from(("float32", "bfloat16"))),
            ref_container=draw(st.sampled_from(CONTAINERS)), cand_container=draw(st.sampled_from(CONTAINERS)),
            contract=draw(st.sampled_from(CONTRACTS)), steps=draw(st.sampled_from((2, 3))),
            tokens=draw(st.sampled_from((16, 40, 48))), forward=draw(st.sampled_from(("float32", "bfloat16"))),
            aux_rows=draw(st.sampled_from(("step", "all"))), meta=draw(st.sampled_from(("none", "claims", "lies"))))

    return scenario().filter(valid)


def main(argv: list[str]) -> int:
    """python -m tests.scenarios.mtp family=qwen3 fault=recycle_flip consumer=mtp_legacy
    python -m tests.scenarios.mtp --sweep [N]   (the misses table)"""
    import tempfile

    if argv[:1] == ["--sweep"]:
        from tests.scenarios.mtp_sweep import sweep

        return sweep(int(argv[1]) if len(argv) > 1 else 0)

    types = {f.name: f.type for f in dataclasses.fields(MtpScenario)}
    kw: dict[str, Any] = {}
    for a in argv:
        k, eq, v = a.partition("=")
        if not eq or k not in types:
            print(f"{main.__doc__}\naxes: {', '.join(types)}", file=sys.stderr)
            return 2
        kw[k] = int(v) if types[k] in ("int", int) else v
    sc = MtpScenario(**kw)
    with tempfile.TemporaryDirectory() as tmp:
        report, exc, misses, b = run(sc, Path(tmp))
    print(f"scenario: {sc.args()}")
    if exc is not None:
        print(f"raised {type(exc).__name__}: {exc}")
    else:
        print(f"verdict {report.verdict}: {report.summary}")
        for f in report.findings:
            if _sev(f) != "info":
                print(f"  {f.code} [{_sev(f)}] {f.tensor}: {f.message[:200]}")
    e = b.expect
    print(f"expected: verdict {e.verdict}, {sorted(e.codes)} on {sorted(e.on)}")
    for m in misses:
        print(f"MISS {m.kind}: {m.detail}")
    return 1 if misses else 0


if __name__ == "__main__":
    np.seterr(all="ignore")
    sys.exit(main(sys.argv[1:]))
