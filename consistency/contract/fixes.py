"""A fix as data: which file, which key, the value found and the value to write.

Every door that diagnoses a train/serve mismatch (lint, compare, replay) ends in the same
edit of the same draft config, so the edit is computed here, once, from the two things that
decide it: the streams training fed the draft, and the runtime release that will serve it
(which key it reads, what an id means there, what its model files can capture). A fix
whose answer depends on an input nobody gave is never guessed: it is returned as
``ambiguous`` naming that input, and one the release cannot serve as ``impossible``
naming the release that can. Writers (``lint --fix``) apply only ``determined`` fixes;
CI shows them and never applies them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from consistency.contract.conventions import NESTED_IDS, TOP_IDS
from consistency.contract.resolve import streams_of
from consistency.contract.runtime_model import capture_limit, id_source, range_label, version_points, vllm_runner
from consistency.contract.versions import Version, parse_version, vtext

SERVE = "--serve"  # the `file` of an edit to the serving command line (printed, never run)


class Edit(BaseModel):
    """One change: ``key`` (a dotted JSON path, or a flag when ``file`` is ``--serve``)
    goes from ``old`` (None: absent) to ``new``, or is removed."""

    model_config = ConfigDict(frozen=True)
    file: str = Field(description="The draft's config.json, or '--serve' for the serving command line")
    key: str = Field(description="Dotted config key (eagle_config.eagle_aux_hidden_state_layer_ids) or a flag")
    old: Any = Field(None, description="The value found; null: the key is absent")
    new: Any = Field(None, description="The value to write (ignored when remove is true)")
    remove: bool = False


class Fix(BaseModel):
    """What to change for one finding, and whether it may be applied.

    ``determined``: the edits are the fix (``lint --fix`` writes them). ``ambiguous``: the
    fix depends on ``decided_by``, an input that was not given. ``impossible``: no edit of
    these files makes this release serve what training used (``summary`` says what would)."""

    model_config = ConfigDict(frozen=True)
    status: Literal["determined", "ambiguous", "impossible"]
    summary: str = Field(description="One line: the edit, or why none is applied")
    edits: list[Edit] = Field(default_factory=list)
    decided_by: str | None = Field(None, description="The input that would settle an ambiguous fix")


# --- the aux-id edit: training streams -> the ids and key a runtime release reads -----------

@dataclass(frozen=True)
class IdsAnswer:
    key: str | None  # the config key the release reads the ids from
    ids: list[int] | None  # the ids that make it feed the streams (None: no id list does)
    label: str  # "sglang@0.5.12"
    meaning: str  # what an id means there (the convention's one line)
    blocked: str | None = None  # why this release cannot feed the streams at all


def _spec(runtime: str, version: Version | None) -> str:
    return f"{runtime}@{vtext(version)}" if version else runtime


def _upgrade(runtime: str, version: Version | None, arch: str | None, first: bool) -> Version | None:
    """The first release after ``version`` whose model file captures stream 0 (``first``) or stream N."""
    for lo, _hi, rep in version_points(runtime):
        if lo is None or (version is not None and lo <= version):
            continue
        lim = capture_limit(runtime, rep, arch)
        if lim is not None and (lim.first if first else lim.last) == "ok":
            return lo
    return None


def ids_for(runtime: str, version: Version | None, n: int, arch: str | None, streams: list[int],
            runner: str = "") -> IdsAnswer:
    """The ids (and key) that make ``runtime@version`` feed ``streams`` on an ``n``-layer ``arch`` target."""
    spec = _spec(runtime, version)
    conv = streams_of(None, spec, None, arch).convention
    if runtime == "vllm" and not runner:
        runner = vllm_runner(version, arch, None)[0]
    src = id_source(runtime, version, runner)
    key = src.keys[0] if src else (NESTED_IDS if runtime == "sglang" else TOP_IDS)
    label = spec if version else f"{runtime} (newest known rules)"
    want = sorted(set(streams))
    ids = conv.from_streams(want, n)
    lim = capture_limit(runtime, version, arch)
    blocked = []
    if lim is not None and 0 in want and lim.first != "ok":
        up = _upgrade(runtime, version, arch, True)
        how = "cannot capture the embedding" if lim.first == "error" else "is not known to capture the embedding"
        blocked.append(f"this release {how} (stream 0; {lim.source}): "
                       + (f"use {runtime} >= {vtext(up)} or retrain" if up else
                          f"no known {runtime} release does for this model file: retrain") + f" on streams 1..{n - 1}")
    if lim is not None and n in want and lim.last != "ok":
        up = _upgrade(runtime, version, arch, False)
        blocked.append(f"this release {'drops' if lim.last == 'dropped' else 'raises on'} stream {n} (the last "
                       f"layer's output; {lim.source}): "
                       + (f"use {runtime} >= {vtext(up)} or retrain" if up else
                          f"no known {runtime} release captures it for this model file: retrain")
                       + f" on streams 0..{n - 1}")
    if ids is None and not blocked:
        blocked.append(f"no id list makes {label} feed streams {want} ({conv.meaning})")
    return IdsAnswer(key, ids, label, conv.meaning, "; ".join(blocked) or None)


def ids_fix(file: str, current: dict[str, Any], runtime: str, version: Version | None, n: int, arch: str | None,
            streams: list[int], runner: str = "") -> Fix:
    """The draft-config edit that makes the runtime feed ``streams`` (training's, slot order).

    Unpinned version: every known release range is tried; the fix is determined only when
    they all write the same ids under the same key."""
    if list(streams) != sorted(set(streams)):
        return Fix(status="impossible", summary=f"training's slot order {list(streams)} is not ascending (or "
                   "repeats a stream): every server fills slots in layer order, so no id list reproduces it; retrain "
                   "with ascending ids")
    if version is None:
        answers: dict[tuple[Any, ...], list[list[Version | None]]] = {}
        for lo, hi, rep in version_points(runtime):
            a = ids_for(runtime, rep, n, arch, streams)
            spans = answers.setdefault((a.key, () if a.blocked else tuple(a.ids or ()), a.blocked), [])
            if spans and spans[-1][1] == lo:
                spans[-1][1] = hi  # adjacent ranges with one answer read as one range
            else:
                spans.append([lo, hi])
        if len(answers) > 1:
            said = "; ".join(", ".join(range_label(lo, hi) for lo, hi in r) + ": " + (b or f"{k} = {list(i)}")
                             for (k, i, b), r in answers.items())
            return Fix(status="ambiguous", summary=f"the ids to write depend on the {runtime} release: {said}",
                       decided_by=f"--runtime {runtime}@VERSION (the release that serves the draft)")
    a = ids_for(runtime, version, n, arch, streams, runner)
    if a.blocked or a.ids is None or a.key is None:
        return Fix(status="impossible", summary=a.blocked or f"no id list serves streams {streams} on {a.label}")
    parent = a.key.rpartition(".")[0]
    if parent and parent in current and not isinstance(get_key(current, parent), dict):
        return Fix(status="impossible", summary=f"{parent} in the draft's config is not a JSON object: {a.label} reads "
                   f"{a.key}; fix {parent} by hand (ids {a.ids} there), nothing is rewritten over it")
    old = get_key(current, a.key)
    if old == a.ids:
        return Fix(status="determined", summary=f"{a.key} already reads {a.ids} on {a.label}")
    return Fix(status="determined", summary=f"set `{a.key}: {a.ids}` in the draft's config.json ({a.label} reads ids "
               f"from {a.key} as: {a.meaning}; streams {sorted(streams)})",
               edits=[Edit(file=file, key=a.key, old=old, new=a.ids)])


def get_key(cfg: Any, dotted: str) -> Any:
    """The value at a dotted key of a JSON object, or None when any part is absent."""
    cur = cfg
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return None
        cur = cur[part]
    return cur


_FAMILIES = (None, "DeepseekV3ForCausalLM", "GptOssForCausalLM")  # model files whose id rule differs


def served_fix(runtime_spec: str | None, n: int | None, arch: str | None, streams: list[int]) -> Fix | None:
    """For compare/replay: the config edit that makes the candidate's runtime feed the
    reference's ``streams`` (None when the runtime is not a serving runtime we model)."""
    if not runtime_spec or n is None or not streams:
        return None
    name, _, ver = runtime_spec.partition("@")
    if name not in ("sglang", "vllm"):
        return None
    try:
        version = parse_version(ver) if ver else None
    except ValueError:
        version = None
    if arch is not None:
        return ids_fix("config.json", {}, name, version, n, arch, streams)
    fixes = {f.model_dump_json(): f for f in (ids_fix("config.json", {}, name, version, n, a, streams)
                                              for a in _FAMILIES)}
    if len(fixes) == 1:
        return next(iter(fixes.values()))
    return Fix(status="ambiguous", summary=f"the ids to write on {runtime_spec} depend on the target's model file "
               "(Llama-family, DeepSeek/Kimi, gpt-oss read ids differently)",
               decided_by="the target's architecture (the dump's model.architecture, or lint --target)")


def replay_fix(ref_streams: list[int] | None, cand_streams: list[int] | None, meta: Any) -> Fix | None:
    """For replay's acceptance drop: when the candidate (a serving capture whose metadata names
    its runtime) claims other streams than the reference holds, the edit that makes that
    runtime feed the reference's. Claims only: the summary says so, and compare checks values."""
    if not ref_streams or not cand_streams or sorted(set(ref_streams)) == sorted(set(cand_streams)) or meta is None:
        return None
    rt, model = getattr(meta, "runtime", None), getattr(meta, "model", None)
    if rt is None or not rt.name or model is None:
        return None
    spec = rt.name + (f"@{rt.version}" if rt.version else "")
    fx = served_fix(spec, model.num_layers, model.architecture, list(ref_streams))
    if fx is None:
        return None
    why = (f"the candidate's capture claims streams {list(cand_streams)} where the reference holds "
           f"{list(ref_streams)} (claims: `consistency compare` checks them on the values)")
    return fx.model_copy(update={"summary": f"{why}; {fx.summary}"})
