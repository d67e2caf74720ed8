"""The claims axis (issue 24): what each side *says* against what its values hold, and the
verdict the evidence model's precedence gives, derived from the construction alone.

A case fixes the truth (which streams the reference's values hold, which the candidate's
do) and, independently, what each side's metadata claims (true / false / absent), what the
user declares (absent / agreeing / conflicting, as a contract or as ``--ref-layer-ids``),
which slots each side holds (all / a suffix / one extra) and, for last-state drafts (MTP,
EAGLE-1, Medusa), the norm state claimed and the consumer declared. The expected verdict
follows from the rule, never from the engine:

* the reference's values decide what slot i should be when the reference has slot i; else
  its claim (stream and norm state); else the user's declaration; else a reference consumer
  that reads the last state; else nothing, and nothing verified is never PASS;
* a declaration that disagrees with a stronger source is CONTRACT_CONFLICT (an error);
* the candidate's claims never change the verdict (a serving dump never certifies itself);
* a slot the candidate lacks is MISSING; one past the reference's slots is an error.

``python -m tests.scenarios.claims KEY=VALUE ...`` runs one case and prints the diagnosis.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tests.scenarios import containers as C
from tests.scenarios.build import FAMILIES, Streams, record
from tests.scenarios.expect import ANY, Expect, Miss, SlotExpect, check
from tests.scenarios.file_claims import ANCHORS, RANKS, file_claims, with_file_claims  # noqa: F401 - issue 34's axes

META = ("true", "false", "absent")
DECLARE = ("absent", "agree", "conflict")
HOW = ("contract", "ids")  # the declaration as a contract file or as --ref-layer-ids
REF_SHAPES = ("full", "thin", "streams")  # every stream + slots / slots only / every stream, no slots
CAND_SLOTS = ("all", "suffix", "extra")
FAULTS = ("benign", "slot_shift", "layer_offset", "layer_mismatch")
LAST_FAULTS = ("benign", "prenorm", "layer")  # a last-state draft: fnorm(s=N) / stream N / stream N-1
CONSUMER = ("none", "ref", "cand", "both")
NOTHING = frozenset({"EXPECTATION_UNKNOWN", "UNMATCHED", "NOT_VERIFIED"})
VALUE_CODES = frozenset({"SLOT_SHIFT", "LAYER_OFFSET", "LAYER_MISMATCH", "ORDER_MISMATCH", "UNKNOWN", "NOT_VERIFIED",
                         "NORM_MISSING", "NORM_APPLIED", "UNMATCHED", "EXPECTATION_UNKNOWN"})


@dataclass(frozen=True)
class Case:
    arch: str = "llama"
    method: str = "eagle3"  # eagle3 (three aux slots) or last (one slot: the target's last state)
    fault: str = "benign"
    ref_shape: str = "full"
    ref_meta: str = "true"
    cand_meta: str = "true"
    declare: str = "absent"
    how: str = "contract"
    cand_slots: str = "all"
    consumer: str = "none"
    anchors: str = "absent"
    ranks: str = "one"
    tokens: int = 32
    seed: int = 0

    def args(self) -> str:
        d = {k: v for k, v in dataclasses.asdict(self).items() if v != Case.__dataclass_fields__[k].default}
        return " ".join(f"{k}={v}" for k, v in {"arch": self.arch, **d}.items())


def valid(c: Case) -> bool:
    faults = FAULTS if c.method == "eagle3" else LAST_FAULTS
    if c.fault not in faults:
        return False
    if c.method == "eagle3" and c.consumer != "none":
        return False  # the consumer axis is about last-state drafts
    if c.method == "last" and c.cand_slots != "all":
        return False  # one slot: no suffix, an extra slot is the EAGLE-3 case
    if c.declare == "absent" and c.how != "contract":
        return False  # one spelling of "nothing declared"
    if c.method == "last" and c.how == "ids":
        return False  # ids carry no norm state: a last-state declaration is a contract
    return True


# -- construction ------------------------------------------------------------------------------

def _train(st: Streams) -> list[int]:
    return [0, 3, 7]


def _serve(st: Streams, c: Case, train: list[int]) -> list[int]:
    if c.fault == "slot_shift":
        return train[1:] + [10]
    if c.fault == "layer_offset":
        return [s + 1 for s in train]
    if c.fault == "layer_mismatch":
        return [train[0], 5, train[2]]
    return list(train)


def _noise(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    return (x * (1 + 2 * 2.0**-8 * rng.standard_normal(x.shape))).astype(np.float32)


def _other(ids: list[int], n: int) -> list[int]:
    """A claim that is not the truth: every id one layer later (still inside 0..n)."""
    return [min(n, s + 1) if s + 1 <= n else s - 1 for s in ids]


@dataclass
class Built:
    ref: dict[str, np.ndarray]
    ref_claims: list[int] | None
    ref_norm: str | None
    ref_consumer: str | None
    cand: dict[str, np.ndarray]
    cand_claims: list[int] | None
    cand_consumer: str | None
    declared: list[tuple[int, str]] | None  # (stream, norm) per slot, or None
    expect: Expect
    anchors: dict[str, list[int]] = dataclasses.field(default_factory=dict)  # the candidate's token_index claims


def build(st: Streams, c: Case) -> Built:
    rng = np.random.default_rng(c.seed * 7919 + 17)
    t = c.tokens
    if c.method == "last":
        return _build_last(st, c, t, rng)
    n = st.n
    train = _train(st)
    serve = _serve(st, c, train)
    ref: dict[str, np.ndarray] = {"input_ids": st.ids[:t]}
    if c.ref_shape in ("full", "streams"):
        ref |= {f"hidden.{s}": st.hidden[s][:t] for s in range(n + 1)}
        ref["final_norm"] = st.final_norm[:t]
    if c.ref_shape in ("full", "thin"):
        ref |= {f"aux.{i}": st.hidden[s][:t] for i, s in enumerate(train)}
    ref_claims = {"true": list(train), "false": _other(train, n), "absent": None}[c.ref_meta]
    cand_claims = {"true": list(serve), "false": _other(serve, n), "absent": None}[c.cand_meta]
    slots = list(range(3))
    if c.cand_slots == "suffix":
        slots = [1, 2]
    elif c.cand_slots == "extra":
        slots = [0, 1, 2, 3]
        serve = serve + [min(n, serve[-1] + 1)]
        cand_claims = cand_claims + [serve[-1]] if cand_claims is not None else None
    cand: dict[str, np.ndarray] = {"input_ids": st.ids[:t]}
    cand |= {f"aux.{i}": _noise(st.hidden[serve[i]][:t], rng) for i in slots}
    # what the reference's strongest source says slot i is (the evidence model), and the declaration
    if c.ref_shape in ("full", "thin") and not (c.ref_shape == "thin" and ref_claims is not None):
        strongest: list[int] | None = list(train)  # the values (a thin reference's are unnamed, see below)
    else:
        strongest = ref_claims
    if c.ref_shape == "thin" and ref_claims is None:
        strongest = None  # thin, unclaimed: the values are compared, their streams unnamed
    agreeing = strongest if strongest is not None else list(train)
    declared = None
    if c.declare == "agree":
        declared = [(s, "none") for s in agreeing]
    elif c.declare == "conflict":
        declared = [(s, "none") for s in _other(agreeing, n)]
    b = Built(ref, ref_claims, None, None, cand, cand_claims, None, declared, Expect("any"))
    b.expect = _expect_eagle3(st, c, train, serve, slots, ref_claims, strongest, declared)
    return with_file_claims(b, c, st)


def _expect_eagle3(st: Streams, c: Case, train: list[int], serve: list[int], slots: list[int],
                   ref_claims: list[int] | None, strongest: list[int] | None,
                   declared: list[tuple[int, str]] | None) -> Expect:
    has_slots = c.ref_shape in ("full", "thin")
    conflict = declared is not None and strongest is not None and [s for s, _ in declared] != strongest
    if has_slots:
        want: list[int] | None = list(train)  # compared with the reference's slot values, whatever anyone says
    elif ref_claims is not None:
        want = ref_claims
    elif declared is not None:
        want = [s for s, _ in declared]
    else:
        want = None
    exp_slots = [SlotExpect(i, frozenset(), ANY) for i in slots]
    if c.ref_shape != "thin":
        for se in exp_slots:  # a full reference names every candidate slot by its values
            se.streams = frozenset({serve[se.slot]})
    if conflict:
        return Expect("fail", frozenset({"CONTRACT_CONFLICT"}), slots=exp_slots)
    if want is None:  # nothing says what any slot should hold (nor how many there are)
        return Expect("fail", NOTHING, slots=exp_slots)
    if c.cand_slots == "suffix":
        return Expect("fail", frozenset({"MISSING"}), slots=exp_slots)
    if c.cand_slots == "extra" and (has_slots or ref_claims is not None):
        return Expect("fail", frozenset({"EXTRA"}) | VALUE_CODES, slots=exp_slots)
    if c.cand_slots == "extra":
        return Expect("fail", frozenset({"EXTRA", "CONTRACT_CONFLICT"}) | NOTHING, slots=exp_slots)
    if [serve[i] for i in slots] != want:
        return Expect("fail", VALUE_CODES, slots=exp_slots)
    return Expect("pass", slots=exp_slots)


def _build_last(st: Streams, c: Case, t: int, rng: np.random.Generator) -> Built:
    """One slot, the target's last state after the final norm (MTP / EAGLE-1 / Medusa)."""
    n = st.n
    ref: dict[str, np.ndarray] = {"input_ids": st.ids[:t]}
    if c.ref_shape in ("full", "streams"):
        ref |= {f"hidden.{s}": st.hidden[s][:t] for s in range(n + 1)}
        ref["final_norm"] = st.final_norm[:t]
    if c.ref_shape in ("full", "thin"):
        ref["aux.0"] = st.final_norm[:t]
    held = {"benign": st.final_norm, "prenorm": st.hidden[n], "layer": st.hidden[n - 1]}[c.fault]
    cand = {"input_ids": st.ids[:t], "aux.0": _noise(held[:t], rng)}
    ref_claims = [n] if c.ref_meta != "absent" else None
    ref_norm = {"true": "final_norm", "false": "none", "absent": None}[c.ref_meta]
    cand_claims = [n if c.fault != "layer" else n - 1] if c.cand_meta != "absent" else None
    rc = "mtp" if c.consumer in ("ref", "both") else None
    cc = "mtp" if c.consumer in ("cand", "both") else None
    # the strongest source on what slot 0 is
    if c.ref_shape == "full":
        strongest: tuple[int, str] | None = (n, "final_norm")  # the values
    elif ref_claims is not None:
        strongest = (n, ref_norm or "none")
    elif c.ref_shape == "streams" and rc is not None:
        strongest = (n, "final_norm")  # the reference's consumer reads fnorm(s=N)
    else:
        strongest = None
    truth = (n, "final_norm")
    agreeing = strongest if strongest is not None else truth
    declared = None
    if c.declare == "agree":
        declared = [agreeing]
    elif c.declare == "conflict":
        declared = [(agreeing[0], "none" if agreeing[1] == "final_norm" else "final_norm")]
    b = Built(ref, ref_claims, ref_norm, rc, cand, cand_claims, cc, declared, Expect("any"))
    _last_expect(b, c, n, strongest, declared, ref_claims, ref_norm)
    return with_file_claims(b, c, st)


def _last_expect(b: Built, c: Case, n: int, strongest: tuple[int, str] | None, declared: list | None,
                 ref_claims: list[int] | None, ref_norm: str | None) -> None:
    truth = (n, "final_norm")
    conflict = declared is not None and strongest is not None and declared[0] != strongest
    if c.ref_shape in ("full", "thin"):
        want: tuple[int, str] | None = truth  # the slot's values (fnorm), whatever is claimed
    else:
        want = strongest if strongest is not None else (declared[0] if declared else None)
    held_as = {"benign": (n, "final_norm"), "prenorm": (n, "none"), "layer": (n - 1, "none")}[c.fault]
    if c.ref_shape == "thin" and ref_claims is not None and ref_norm == "none" and declared is None:
        pass  # a thin slot claimed pre-norm: its values still decide the comparison
    if conflict:
        b.expect = Expect("fail", frozenset({"CONTRACT_CONFLICT"}))
    elif want is None:
        b.expect = Expect("fail", NOTHING)
    elif held_as != want:
        b.expect = Expect("fail", VALUE_CODES)
    else:
        b.expect = Expect("pass")


# -- writing and running ------------------------------------------------------------------------

def _contract(path: Path, st: Streams, declared: list[tuple[int, str]]) -> Path:
    doc = {"target": {"num_layers": st.n, "hidden_size": st.hidden_size},
           "slots": [{"stream": s, "norm": norm} for s, norm in declared]}
    path.write_text(json.dumps(doc))
    return path


def write(b: Built, c: Case, st: Streams, d: Path) -> tuple[Path, Path, dict[str, Any]]:
    from consistency.contract.models import AuxInfo, DumpMetadata, ModelInfo
    from consistency.dump.writer import write_dump

    d.mkdir(parents=True, exist_ok=True)

    def side(name: str, tensors: dict, side_: str, claims: list[int] | None, norm: str | None, consumer: str | None,
             dtype: str, anchors: dict[str, list[int]] | None = None, rank: int | None = None,
             lossy: bool = False) -> Path:
        from consistency.contract.models import TensorMeta

        aux = None
        if claims is not None:
            aux = AuxInfo(stream_ids=claims, **({"norm": norm} if norm else {}))
        extra: dict[str, Any] = {"consumer": consumer} if consumer else {}
        if lossy:
            extra["dropped_captures"] = {"aux.1": 2}
        md = DumpMetadata(side=side_, aux=aux, model=ModelInfo(num_layers=st.n, hidden_size=st.hidden_size),
                          extra=extra, tensors={k: TensorMeta(token_index=a) for k, a in (anchors or {}).items()},
                          **({"rank": rank, "world_size": 2} if rank is not None else {}))
        arrays = {k: (v if v.dtype.kind in "iub" else C._storage(v, dtype)) for k, v in tensors.items()}
        p = d / (f"{name}.safetensors" if rank is None else f"{name}.rank{rank}-of2.safetensors")
        write_dump(p, arrays, md, force=True)
        return p

    ref = side("ref", b.ref, "training", b.ref_claims, b.ref_norm, b.ref_consumer, "float32")
    if c.ranks == "one":
        cand = side("cand", b.cand, "serving", b.cand_claims, None, b.cand_consumer, "bfloat16", b.anchors)
    else:  # two ranks of one replicated capture; "lossy{r}": rank r's recorder says it dropped captures
        for r in range(2):
            side("cand", b.cand, "serving", b.cand_claims, None, b.cand_consumer, "bfloat16", b.anchors, rank=r,
                 lossy=c.ranks == f"lossy{r}")
        cand = d / "cand.rank*-of2.safetensors"
    kw: dict[str, Any] = {}
    if b.declared is not None:
        if c.how == "contract":
            kw["contract"] = str(_contract(d / "contract.json", st, b.declared))
        else:
            kw["ref_layer_ids"] = ",".join(str(s) for s, _ in b.declared)
    return ref, cand, kw


def run(c: Case, d: Path) -> tuple[Any, BaseException | None, list[Miss]]:
    from consistency.pipeline.compare import compare

    st = record(c.arch)
    b = build(st, c)
    ref, cand, kw = write(b, c, st, d)
    report, exc = None, None
    try:
        report = compare(str(ref), str(cand), **kw)
    except Exception as e:  # noqa: BLE001 - judged by check (exit 2 vs crash)
        exc = e
    return report, exc, check(report, exc, b.expect)


# -- the tables ------------------------------------------------------------------------------------

def every(arch: str = "llama", method: str = "eagle3") -> list[Case]:
    """Every combination of the small axes for one architecture."""
    faults = FAULTS if method == "eagle3" else LAST_FAULTS
    consumers = ("none",) if method == "eagle3" else CONSUMER
    out = []
    for f, rs, rm, cm, dc, how, cs, co in itertools.product(faults, REF_SHAPES, META, META, DECLARE, HOW, CAND_SLOTS,
                                                             consumers):
        c = Case(arch, method, f, rs, rm, cm, dc, how, cs, co)
        if valid(c):
            out.append(c)
    return out


def table(n_sampled: int = 600, seed: int = 24) -> list[Case]:
    """CI's table: every combination on Llama (both methods), and a seeded sample of the
    same axes on every other tiny family."""
    out = every("llama", "eagle3") + every("llama", "last")
    rng = random.Random(seed)
    others = [a for a in FAMILIES if a != "llama"]
    pool = [dataclasses.replace(c, arch=a) for a in others for m in ("eagle3", "last") for c in every("llama", m)]
    out += rng.sample(pool, min(n_sampled, len(pool)))
    return out


def main(argv: list[str]) -> int:
    import tempfile

    if argv[:1] == ["--sweep"]:
        which = argv[1] if len(argv) > 1 else "table"
        cases = table() if which == "table" else every(*which.split(":"))
        return 1 if sweep(cases)[0] else 0
    kw: dict[str, Any] = {}
    types = {f.name: f.type for f in dataclasses.fields(Case)}
    for a in argv:
        k, _, v = a.partition("=")
        if k not in types:
            print(f"unknown axis {k!r}; axes: {', '.join(types)}")
            return 2
        kw[k] = int(v) if types[k] in ("int", int) else v
    c = Case(**kw)
    if not valid(c):
        print(f"not a valid case: {c.args()}")
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        report, exc, misses = run(c, Path(tmp))
    print(f"case: {c.args()}")
    if exc is not None:
        print(f"raised {type(exc).__name__}: {exc}")
    else:
        print(f"verdict {report.verdict}: {report.summary[:300]}")
        for f in report.findings:
            if f.severity.value != "info":
                print(f"  {f.code} [{f.severity.value}] {f.tensor}: {f.message[:200]}")
    for m in misses:
        print(f"MISS {m.kind}: {m.detail}")
    return 1 if misses else 0



def sweep(cases: list[Case], out: Any = None) -> tuple[int, dict[str, int]]:
    """Run cases in one process; print each miss; return (misses, per-kind counts)."""
    import tempfile
    import time
    from collections import Counter

    kinds: Counter[str] = Counter()
    n_miss = 0
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for i, c in enumerate(cases):
            _r, _e, misses = run(c, Path(tmp) / str(i % 8))
            for m in misses:
                print(f"{m.kind:10} {c.args()}: {m.detail[:240]}", file=out, flush=True)
                kinds[m.kind] += 1
            n_miss += bool(misses)
    print(f"{len(cases)} cases, {n_miss} with misses, {time.perf_counter() - t0:.1f} s", file=out)
    return n_miss, dict(kinds)


if __name__ == "__main__":
    import sys

    np.seterr(all="ignore")
    sys.exit(main(sys.argv[1:]))
