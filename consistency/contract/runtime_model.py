"""The runtime model: what a runtime release does with an aux id list on one target.

:mod:`consistency.contract.conventions` holds the tables (what an id means, where it is
read, what a model file can capture); this module combines them into answers that every
command shares, so the linter's plan and the demo's simulated server can never disagree
(:func:`served_streams`), and reads SpecForge's ids through the SGLang release that
produced its hidden states (:func:`resolve_specforge`; docs/conventions.md#specforge).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from consistency.contract.conventions import (CAPTURE_LIMITS, ID_SOURCES, LATEST_KNOWN, REGISTRY, VLLM_V2_ALL,
                                              VLLM_V2_DENSE, VLLM_V2_MOE_ARCHS, CaptureLimit, Convention, Resolved,
                                              _in_range, capture_limit, check_version, parse_version, resolve)


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
    res = resolve(spec, architecture)
    conv = res.convention
    name, _, ver = spec.strip().partition("@")
    version = parse_version(ver) if ver and conv.runtime in ("sglang", "vllm") else None
    limit = capture_limit(conv.runtime, version, architecture) if conv.runtime in ("sglang", "vllm") else None
    raw = conv.to_streams(list(ids) if ids is not None else None, num_layers)
    order = sorted(set(raw)) if conv.sorts else list(raw)
    drop_last = limit is not None and limit.last == "dropped"
    missing = [s for s in order if not 0 <= s <= num_layers or (drop_last and s == num_layers)]
    crashes = []
    if limit is not None and 0 in order and limit.first == "error":
        crashes.append(f"stream 0 (the embedding) cannot be captured: {limit.source}")
    if limit is not None and num_layers in order and limit.last == "error":
        crashes.append(f"stream {num_layers} (the last layer) raises: {limit.source}")
    return Served(conv, limit, raw, [s for s in order if s not in missing], missing, crashes, res.assumed)


# --- SpecForge: its ids mean what the SGLang release it captured with makes of them -------------

@dataclass(frozen=True)
class SpecForgeEra:
    """Which backend a SpecForge release generated hidden states with (its ids' meaning follows)."""

    min_version: tuple[int, ...] | None  # SpecForge release, inclusive
    max_version: tuple[int, ...] | None  # exclusive
    sglang: str | None  # the SGLang release pinned by that era's pyproject (None: the HF backend reading)
    source: str


SPECFORGE_SGLANG_ONLY = "0.5.14"  # pinned since SpecForge went SGLang-only (mid-2026)
SPECFORGE_ERAS: tuple[SpecForgeEra, ...] = (
    SpecForgeEra(None, (0, 2, 0), None, "SpecForge 0.1.x: HF backend hooks layers[j], or SGLang <= 0.5.6 (adds 1): "
                 "id j is stream j+1"),
    SpecForgeEra((0, 2, 0), None, SPECFORGE_SGLANG_ONLY,
                 "SpecForge 0.2.0 pinned sglang 0.5.6, then 0.5.9, then 0.5.14 (pyproject.toml, 2026-07-04); since "
                 "mid-2026 hidden states come from SGLang only (config/schema.py target_backend: Literal['sglang'])"),
)


def _specforge_sglang_version(ver: str) -> tuple[str, str | None]:
    """(SGLang version to read the ids with, or 'hf'; a sentence when one was assumed)."""
    v = ver.strip().lower()
    if v in ("hf", "legacy"):
        return "hf", None
    if v.startswith("sglang-") or v.startswith("sglang="):
        sv = v[len("sglang-"):]
        parse_version(sv)
        return sv, None
    if not v:
        return SPECFORGE_SGLANG_ONLY, (f"no specforge version given: assumed current SpecForge, which captures through "
                                       f"SGLang (pinned sglang {SPECFORGE_SGLANG_ONLY}), so the ids follow that "
                                       "release's rule for the target's model file; pass specforge@sglang-VER for the "
                                       "SGLang your run used, or specforge@hf for older SpecForge (HF backend: j+1)")
    sf = parse_version(v)
    if sf >= (0, 3):
        raise ValueError(f"specforge@{ver}: SpecForge releases known here are 0.1.0-{LATEST_KNOWN['specforge']}; to "
                         f"name the SGLang release SpecForge captured with, write specforge@sglang-{ver}")
    era = next(e for e in SPECFORGE_ERAS if _in_range(sf, e.min_version, e.max_version))
    if era.sglang is None:
        return "hf", None
    note = (f"specforge {ver} spans sglang 0.5.6 to {era.sglang}: assumed sglang {era.sglang}, the release it pins "
            "now; pass specforge@sglang-VER to name the SGLang your run used")
    newer = check_version("specforge", sf)
    return era.sglang, "; ".join(x for x in (newer, note) if x)


def resolve_specforge(ver: str, architecture: str | None = None) -> Resolved:
    """SpecForge ids read as the SGLang release that produced the hidden states reads them
    (DeepSeek/Kimi on sglang >= 0.5.13: the first-id rule of PR #25454), or as j+1 for
    the HF backend and older releases. The returned convention keeps SpecForge's id keys."""
    sv, note = _specforge_sglang_version(ver)
    hf = next(c for c in REGISTRY if c.code == "specforge-hf")
    if sv == "hf":
        return Resolved(hf, ver or None, note)
    sg = resolve(f"sglang@{sv}", architecture)
    era = f"SpecForge through sglang {sv}"
    conv = replace(sg.convention, code=f"specforge-{sg.convention.code}", runtime="specforge",
                   meaning=f"{era}: {sg.convention.meaning}", source=f"{SPECFORGE_ERAS[-1].source}; {sg.convention.source}",
                   id_location=hf.id_location, captured="stream", sorts=True)
    return Resolved(conv, ver or None, "; ".join(x for x in (note, sg.assumed) if x) or None)


def version_points(runtime: str) -> list[tuple[tuple[int, ...] | None, tuple[int, ...] | None, tuple[int, ...] | None]]:
    """(lo, hi, representative) for each range between the version boundaries this module
    knows for ``runtime``: what a linter evaluates when no version is pinned. The last
    range's representative is None, which every table reads as "the newest release"."""
    cuts: set[tuple[int, ...]] = set()
    for c in (*REGISTRY, *ID_SOURCES, *CAPTURE_LIMITS):
        if c.runtime == runtime:
            cuts.update(v for v in (c.min_version, c.max_version) if v)
    if runtime == "vllm":
        cuts.update({VLLM_V2_DENSE, VLLM_V2_ALL, *(v for v, _ in VLLM_V2_MOE_ARCHS)})
    edges = sorted(cuts)
    out: list[tuple[tuple[int, ...] | None, tuple[int, ...] | None, tuple[int, ...] | None]] = []
    for i, b in enumerate(edges):
        k = max((j for j, x in enumerate(b) if x > 0), default=0)
        below = (*b[:k], b[k] - 1, 10**6)  # just under the boundary: 0.5.13 -> 0.5.12.1000000
        out.append((edges[i - 1] if i else None, b, below))
    out.append((edges[-1] if edges else None, None, None))
    return out


def range_label(lo: tuple[int, ...] | None, hi: tuple[int, ...] | None) -> str:
    """'>=0.5.13,<0.5.17', '<0.5.13', '>=0.5.22' or 'any'."""
    fmt = ".".join
    parts = ([f">={fmt(map(str, lo))}"] if lo else []) + ([f"<{fmt(map(str, hi))}"] if hi else [])
    return ",".join(parts) or "any"
