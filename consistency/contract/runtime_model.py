"""The runtime model: what a runtime release does with an aux id list on one target.

:mod:`consistency.contract.conventions` holds the tables (what an id means, where it is
read, what a model file can capture); this module combines them into answers that every
command shares, so the linter's plan and the demo's simulated server can never disagree
(:func:`served_streams`), which config key a release reads (:func:`id_source`), what its
model files capture (:func:`capture_limit`), which vLLM runner runs (:func:`vllm_runner`)
and which class SGLang loads as the draft (:func:`sglang_draft_class`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from consistency.contract import sglang_drafts as SD
from consistency.contract.conventions import (CAPTURE_LIMITS, ID_SOURCES, REGISTRY, VLLM_V2_DEFAULTS, VLLM_V2_FIRST,
                                              CaptureLimit, Convention, IdSource)
from consistency.contract.resolve import streams_of
from consistency.contract.versions import Version, VersionRange, just_below, parse_spec, vtext


@dataclass(frozen=True)
class Served:
    """What a runtime release does with an id list on one target: the one model of the
    runtime that the linter's plan and the demo's simulated server both use."""

    convention: Convention
    limit: CaptureLimit | None
    config_order: list[int]  # stream of each id, in the order the config lists them
    streams: list[int]  # the slots the draft is fed, in capture order (missing ones left out)
    missing: list[int]  # requested streams the runtime never captures (outside 0..N, or stream N dropped)
    crashes: list[str]  # why the server fails at the first step (e.g. stream 0 on an old llama.py)
    assumed: str | None = None


def served_streams(spec: str, ids: Sequence[int] | None, num_layers: int, architecture: str | None = None) -> Served:
    """``sglang@0.5.5`` + ids + N (+ the target's architecture, i.e. its model file) -> which
    stream each slot holds, which requested streams never arrive, and what crashes."""
    res = streams_of(ids, spec, num_layers, architecture)
    conv = res.convention
    version = parse_spec(spec, frozenset({"specforge"})).version if conv.runtime in ("sglang", "vllm") else None
    limit = capture_limit(conv.runtime, version, architecture) if conv.runtime in ("sglang", "vllm") else None
    raw = list(res.streams or [])
    order = sorted(set(raw)) if conv.sorts else list(raw)
    drop_last = limit is not None and limit.last == "dropped"
    missing = [s for s in order if not 0 <= s <= num_layers or (drop_last and s == num_layers)]
    crashes = []
    if limit is not None and 0 in order and limit.first == "error":
        crashes.append(f"stream 0 (the embedding) cannot be captured: {limit.source}")
    if limit is not None and num_layers in order and limit.last == "error":
        crashes.append(f"stream {num_layers} (the last layer) raises: {limit.source}")
    return Served(conv, limit, raw, [s for s in order if s not in missing], missing, crashes, res.assumed)


def version_points(runtime: str) -> list[tuple[tuple[int, ...] | None, tuple[int, ...] | None, tuple[int, ...] | None]]:
    """(lo, hi, representative) for each range between the version boundaries this module
    knows for ``runtime``: what a linter evaluates when no version is pinned. The last
    range's representative is None, which every table reads as "the newest release"."""
    cuts: set[tuple[int, ...]] = set()
    for c in (*REGISTRY, *ID_SOURCES, *CAPTURE_LIMITS):
        if c.runtime == runtime:
            cuts.update(v for v in (c.min_version, c.max_version) if v)
    if runtime == "vllm":
        cuts.update(r.min_version for r in VLLM_V2_DEFAULTS)
    edges = sorted(cuts)
    out: list[tuple[Version | None, Version | None, Version | None]] = []
    for i, b in enumerate(edges):
        out.append((edges[i - 1] if i else None, b, just_below(b)))  # 0.5.13 -> 0.5.12.1000000
    out.append((edges[-1] if edges else None, None, None))
    return out


def range_label(lo: Version | None, hi: Version | None) -> str:
    """'>=0.5.13,<0.5.17', '<0.5.13', '>=0.5.22' or 'any'."""
    return VersionRange(lo, hi).label()


# --- lookups into the tables of contract/conventions.py --------------------------------------

def id_source(runtime: str, version: Version | None, runner: str = "") -> IdSource | None:
    for s in ID_SOURCES:
        ok_runner = not s.runner or s.runner == runner
        if s.runtime == runtime and ok_runner and s.range.covers(version):
            return s
    return None


def capture_limit(runtime: str, version: Version | None, architecture: str | None) -> CaptureLimit | None:
    rows = [c for c in CAPTURE_LIMITS if c.runtime == runtime and c.range.covers(version)]
    specific = [c for c in rows if architecture is not None and architecture in c.architectures]
    return (specific or [c for c in rows if not c.architectures] or [None])[0]


def vllm_runner(version: Version | None, architecture: str | None, is_moe: bool | None,
                env: str | None = None, v1_only_feature: str | None = None,
                quantized: bool | None = None) -> tuple[str, str]:
    """('v1'|'v2', why) for a vLLM version, target and command line (env = VLLM_USE_V2_MODEL_RUNNER).

    Each release's rule is read from its wheel (conventions.VLLM_V2_DEFAULTS): from 0.22 some
    architectures default to V2, whose EAGLE-3 path reads only the top-level ids before 0.28."""
    if env is not None and env.strip() != "":
        on = env.strip().lower() in ("1", "true", "yes", "on")
        return ("v2" if on else "v1"), f"VLLM_USE_V2_MODEL_RUNNER={env}"
    if version is not None and version < VLLM_V2_FIRST:
        return "v1", "V1 is the default for every model before vllm 0.22"
    if v1_only_feature:
        return "v1", f"the V2 runner does not support {v1_only_feature}"
    row = [r for r in VLLM_V2_DEFAULTS if version is None or version >= r.min_version][-1]
    at = f"vllm {vtext(version)}" if version else "the newest vllm"
    listed = architecture in row.archs
    if row.rule == "all":
        return "v2", f"V2 is the default for every model on {at} ({row.source})"
    if row.rule == "dense_or_listed":
        if listed:
            return "v2", f"{architecture} is on {at}'s default-V2 list ({row.source})"
        if is_moe is None:
            return "v2", f"V2 is the default for dense models on {at} ({row.source}); target MoE-ness unknown"
        return ("v1", f"MoE targets off the default-V2 list stay on V1 on {at} ({row.source})") if is_moe else \
            ("v2", f"V2 is the default for dense models on {at} ({row.source})")
    if not listed:
        return "v1", f"{architecture or 'the target (architecture unknown)'} is not on {at}'s default-V2 list " \
                     f"({', '.join(sorted(row.archs))}; {row.source})"
    if row.rule == "listed_dense" and (is_moe or quantized):
        return "v1", f"{at} keeps {'MoE' if is_moe else 'quantized'} targets on V1 ({row.source})"
    tail = "; quantization unknown (a quantized target stays on V1)" if row.rule == "listed_dense" and \
        quantized is None else ""
    return "v2", f"{architecture} is on {at}'s default-V2 list ({row.source}){tail}"


@dataclass(frozen=True)
class DraftClass:
    """The class SGLang loads as the draft for a checkpoint of architecture ``arch``."""

    served: str | None  # the rewritten class; None: not rewritten (loaded as it is), or not known
    known: bool  # False: the release predates the rewrites read here (sglang_drafts.CHECKED)
    source: str


def sglang_draft_class(arch: str | None, version: Version | None) -> DraftClass:
    """What ``ModelConfig._config_draft_model`` makes of a draft checkpoint of ``arch`` at ``version``."""
    if not SD.CHECKED.covers(version):
        return DraftClass(None, False, f"sglang {vtext(version)} predates the rewrite tables read here "
                                       f"({SD.CHECKED.label()})")
    row = next((r for r in SD.REWRITES if r.arch == arch and r.versions.covers(version)), None)
    if row is None:
        return DraftClass(None, True, f"{SD.SOURCE}: no rewrite for {arch} at sglang {vtext(version) or 'newest'}")
    return DraftClass(row.served, True, row.source)
