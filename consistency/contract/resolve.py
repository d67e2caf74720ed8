"""Ids to streams, once: every command that turns a runtime's layer ids into stream indices calls here.

``compare --layer-ids``, ``record --aux-layers``, ``convert``, the interop readers and
``lint`` (serving plan, ``--trained-with``, the draft config's own ids) all call
:func:`streams_of`, so a spec such as ``sglang@0.5.12`` or ``specforge`` means one thing
everywhere. User-typed specs and ids are checked here too (:func:`check_spec`,
:func:`check_streams`): an unknown convention name or an id outside the target's streams is
a usage error naming what is valid, whichever command took it.

SpecForge gets one more step (:func:`specforge_readings`): its ids mean what the SGLang
release that produced its hidden states makes of them, and a draft does not say which
release that was, so an unpinned ``specforge`` has one reading per capture backend
(contract/specforge.py), narrowed by what the draft itself records.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from consistency.contract import specforge as SF
from consistency.contract.conventions import FIRST_EAGLE3, LATEST_KNOWN, REGISTRY, Convention
from consistency.contract.versions import RuntimeSpec, Version, VersionRange, parse_spec, parse_version, vtext
from consistency.errors import UsageError, did_you_mean


@dataclass(frozen=True)
class Resolved:
    convention: Convention
    version: str | None
    assumed: str | None  # a sentence when a version-dependent rule was picked without a version


@dataclass(frozen=True)
class Streams:
    """What ``ids`` under ``spec`` mean on an ``n``-layer target."""

    streams: list[int] | None  # in the order the ids are listed; None: default ids and n unknown
    convention: Convention
    assumed: str | None = None
    spec: str = ""


def names() -> list[str]:
    return sorted({c.runtime for c in REGISTRY} | {a for c in REGISTRY for a in c.aliases} | {"specforge"})


def check_version(runtime: str, version: Version | None) -> str | None:
    """Older than the first release serving EAGLE-3: ValueError (the draft cannot run there).
    Newer than the newest release the tables were checked on: plausible, so the newest
    known release's behaviour is assumed, and the returned sentence says so."""
    if version is None:
        return None
    first = FIRST_EAGLE3.get(runtime)
    if first is not None and version < first[0]:
        raise ValueError(f"{runtime} {vtext(version)} predates EAGLE-3 support (first in {runtime} "
                         f"{vtext(first[0])}: {first[1]})")
    newest = LATEST_KNOWN.get(runtime)
    if newest is not None and version > parse_version(newest):
        return (f"{runtime} {vtext(version)} is newer than any release these rules were checked on: assumed the "
                f"behaviour of {runtime} {newest}, the nearest known release")
    return None


def resolve(spec: str, architecture: str | None = None) -> Resolved:
    """``sglang@0.5.5`` -> the rule for that version (and target architecture, where the
    runtime's rule differs by model file); without a version, the newest rule, stated.
    ``specforge[@VER]`` is read through the SGLang release SpecForge captured with."""
    rs = parse_spec(spec, keep_raw=frozenset({"specforge"}))
    if rs.name == "specforge":
        return resolve_specforge(rs.text, architecture)
    exact = [c for c in REGISTRY if c.code == rs.name]
    cands = exact or [c for c in REGISTRY if c.runtime == rs.name or rs.name in c.aliases]
    if not cands:
        raise KeyError(f"unknown convention {spec!r}; known: {', '.join(names())}{did_you_mean(spec, names())}")
    v, key = rs.version, rs.name
    newer = check_version(cands[0].runtime, v)  # too old for EAGLE-3: ValueError
    if exact:
        return Resolved(exact[0], rs.text or None, newer)
    notes = [newer] if newer else []
    if v is None and any(c.min_version or c.max_version for c in cands):
        notes.append(f"no {key} version given: assumed {key}@{LATEST_KNOWN.get(key, 'latest')}'s rule; pass "
                     f"{key}@VERSION to pin it")
    if any(c.architectures for c in cands) and architecture is None:
        notes.append(f"target architecture unknown: assumed the {key} rule of Llama-family model files "
                     f"(DeepSeek/Kimi and gpt-oss targets use other rules)")
    pool = [c for c in cands if architecture is not None and architecture in c.architectures] or \
           [c for c in cands if not c.architectures]
    for c in pool:
        if c.range.covers(v):
            return Resolved(c, rs.text or None, "; ".join(notes) or None)
    raise KeyError(f"no {key} rule covers version {rs.text}")


def streams_of(ids: Sequence[int] | None, spec: str, n: int | None, arch: str | None = None) -> Streams:
    """The one place ids become streams: ``ids`` (None: the runtime's default) under ``spec``
    on an ``n``-layer target of architecture ``arch``. The streams keep the ids' order."""
    res = resolve(spec, arch)
    conv = res.convention
    if ids is None and n is None:
        return Streams(None, conv, res.assumed, spec)
    return Streams(conv.to_streams(list(ids) if ids is not None else None, n), conv, res.assumed, spec)


def depends_on_n(spec: str, ids: Sequence[int]) -> bool:
    """Whether the streams of ``ids`` under ``spec`` change with the layer count (gpt-oss, TRT-LLM -1)."""
    conv = resolve(spec).convention
    return conv.to_streams(list(ids), 0) != conv.to_streams(list(ids), 1 << 20)


# --- user-typed specs and ids: usage errors that name what is valid -------------------------

def check_spec(spec: str, flag: str = "--convention", architecture: str | None = None) -> Resolved:
    """A convention or runtime name as the user typed it, or a UsageError listing the known ones."""
    try:
        return resolve(spec, architecture)
    except (KeyError, ValueError) as exc:
        why = str(exc).strip(chr(39) + chr(34))
        said = f"{flag}: " if repr(spec) in why else f"{flag} {spec!r}: "  # the name once, not twice
        raise UsageError(said + why) from None


def _few(xs: Sequence[int], n: int = 8) -> str:
    """A list for a one-line message: the first few and how many in all."""
    xs = list(xs)
    return str(xs) if len(xs) <= n else f"[{', '.join(map(str, xs[:n]))}, ... ({len(xs)} in all)]"


def check_streams(native: Sequence[int], streams: Sequence[int], n: int | None, slots: int | None = None,
                  what: str = "--layer-ids", spec: str = "") -> None:
    """Streams a user named must exist: 0..N for an N-layer target, one per slot, none twice."""
    under = f" under {spec}" if spec else ""
    if slots is not None and len(native) < slots:  # one more (the last state, N) is what speculators records
        raise UsageError(f"{what} {_few(native)}: {len(native)} id(s) for {slots} aux slot(s); give one id per slot")
    if any(s < 0 for s in streams) or (n is not None and any(s > n for s in streams)):
        valid = f"0..{n} for a {n}-layer target" if n is not None else "0 or more"
        bad = [j for j, s in zip(native, streams) if s < 0 or (n is not None and s > n)]
        raise UsageError(f"{what} {_few(native)}{under} give streams {_few(streams)}; ids {_few(bad)} fall outside "
                         f"the valid streams ({valid})")
    if len(set(streams)) != len(streams):
        raise UsageError(f"{what} {_few(native)}{under} name the same stream twice ({_few(streams)})")


def describe_streams(streams: Sequence[int], num_layers: int | None) -> list[str]:
    """Human names of stream indices: 'embedding', 'layer 2 output', 'last layer output (pre-norm)'."""
    out = []
    for s in streams:
        if s == 0:
            out.append("the embedding")
        elif num_layers is not None and s == num_layers:
            out.append(f"layer {s - 1}'s output (the last layer, pre-norm)")
        else:
            out.append(f"layer {s - 1}'s output")
    return out


# --- SpecForge: its ids mean what the SGLang release it captured with makes of them -------------

def _backend(code: str) -> SF.CaptureBackend:
    return next(b for b in SF.BACKENDS if b.code == code)


def _specforge_backend(ver: str) -> tuple[str, str | None]:
    """(spec to read SpecForge ids with, a sentence when one was assumed) for ``specforge@ver``."""
    v = ver.strip().lower()
    if v in ("hf", "legacy"):
        return "specforge-hf", None
    if v.startswith(("sglang-", "sglang=")):
        sv = v[len("sglang-"):]
        parse_version(sv)
        return f"sglang@{sv}", None
    if not v:
        newest = _backend(SF.RELEASES[-1][1])
        return newest.spec, (f"no specforge version given: read as {newest.label}; SpecForge drafts trained through "
                             "an older SGLang read differently (lint lists each reading); pass specforge@sglang-VER "
                             "for the SGLang your run used, or specforge@hf for its HF backend")
    sf = parse_version(v)
    if sf >= (0, 3):
        raise ValueError(f"specforge@{ver}: SpecForge releases known here are 0.1.0-{LATEST_KNOWN['specforge']}; to "
                         f"name the SGLang release SpecForge captured with, write specforge@sglang-{ver}")
    code = next(c for r, c in SF.RELEASES if r.covers(sf))
    return _backend(code).spec, check_version("specforge", sf)


def resolve_specforge(ver: str, architecture: str | None = None) -> Resolved:
    """SpecForge ids read as the SGLang release that produced the hidden states reads them
    (DeepSeek/Kimi on sglang >= 0.5.13: the first-id rule of PR #25454), or as j+1 for
    the HF backend and older releases. The returned convention keeps SpecForge's id keys."""
    spec, note = _specforge_backend(ver)
    hf = next(c for c in REGISTRY if c.code == "specforge-hf")
    if spec == "specforge-hf":
        return Resolved(hf, ver or None, note)
    sg = resolve(spec, architecture)
    sv = spec.partition("@")[2]
    conv = replace(sg.convention, code=f"specforge-{sg.convention.code}", runtime="specforge",
                   meaning=f"SpecForge through sglang {sv}: {sg.convention.meaning}",
                   source=f"{_backend(SF.RELEASES[-1][1]).source}; {sg.convention.source}",
                   id_location=hf.id_location, captured="stream", sorts=True)
    return Resolved(conv, ver or None, "; ".join(x for x in (note, sg.assumed) if x) or None)


@dataclass
class Reading:
    """One plausible meaning of a training framework's ids: its streams and what it stands for."""

    label: str
    streams: list[int] | None
    specs: list[str] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)


def transformers_evidence(stamp: str | None) -> tuple[VersionRange | None, str | None]:
    """(SGLang releases pinning transformers ``stamp``, the sentence saying so), or (None, why not)."""
    if not stamp:
        return None, None
    try:
        tv = parse_version(stamp)
    except ValueError:
        return None, f"transformers_version {stamp!r} is not a release number"
    rows = [r for r, pin in SF.SGLANG_TRANSFORMERS if parse_version(pin) == tv]
    if not rows:
        return None, (f"transformers_version {stamp} in the draft config is pinned by no SGLang release 0.4.8-"
                      f"{LATEST_KNOWN['sglang']} ({SF.TRANSFORMERS_SOURCE}): it does not narrow the readings")
    rng = VersionRange(rows[0].lo, rows[-1].hi)
    return rng, (f"transformers_version {stamp} in the draft config (save_pretrained stamps it) is the exact pin of "
                 f"sglang {rng.label()} ({SF.TRANSFORMERS_SOURCE})")


def possible(streams: Sequence[int] | None, n: int | None) -> bool:
    """Whether a reading's streams can exist on an ``n``-layer target (0..N); unknown N or streams: yes."""
    return streams is None or n is None or all(0 <= s <= n for s in streams)


def specforge_readings(ids: Sequence[int] | None, n: int | None, arch: str | None,
                       stamp: str | None = None) -> tuple[list[Reading], str | None]:
    """Every distinct meaning SpecForge ids can have on this target, one per group of capture
    backends that agree, narrowed by the draft's ``transformers_version`` ``stamp`` where it
    names the SGLang beside the training run. Returns (readings, the evidence sentence)."""
    rng, why = transformers_evidence(stamp)
    specs: list[tuple[str, str, str]] = [(b.spec, b.label, b.source) for b in SF.BACKENDS]
    if rng is not None:
        kept = [s for s in specs if s[0].startswith("sglang@") and rng.covers(parse_version(s[0][7:]))]
        if rng.hi is not None and rng.hi <= (0, 5, 13):
            kept += [s for s in specs if s[0] == "specforge-hf"]
        specs = kept or [(f"sglang@{vtext(rng.lo)}", f"SpecForge beside sglang {rng.label()} (no SpecForge pin known "
                                                      "there)", SF.TRANSFORMERS_SOURCE)]
    out: list[Reading] = []
    for spec, label, source in specs:
        st = streams_of(ids, spec, n, arch).streams
        if not possible(st, n):
            continue  # a reading no training run can have fed (a stream outside 0..N) is no reading
        same = next((r for r in out if r.streams == st), None)
        if same is None:
            out.append(Reading(label, st, [spec], [source]))
        else:
            same.label += f", {label.removeprefix('SpecForge ')}"
            same.specs.append(spec)
            same.sources.append(source)
    return out, why


def parse_runtime(spec: str, allowed: Sequence[str], flag: str = "--runtime") -> RuntimeSpec:
    """``sglang@0.5.12`` for a flag that takes only ``allowed`` runtimes; anything else, a
    malformed or pre-EAGLE-3 version, is a UsageError (a newer-than-known version is kept)."""
    try:
        rs = parse_spec(spec)
    except ValueError as exc:
        raise UsageError(f"{flag} {spec!r}: {exc}") from None
    if rs.name not in allowed:
        raise UsageError(f"{flag} {spec!r}: expected {' or '.join(f'{a}@VERSION' for a in allowed)}"
                         f"{did_you_mean(spec, allowed)}")
    try:
        check_version(rs.name, rs.version)
    except ValueError as exc:
        raise UsageError(f"{flag} {spec!r}: {exc}") from None
    return rs
