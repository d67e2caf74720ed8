"""What the draft was trained on: ``--trained-with`` (a dump, a contract, or
``FRAMEWORK:IDS``), else the draft config read with its training framework's convention.

Everything ends as stream indices, slot by slot, the one unit every rule compares in.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from consistency.contract import conventions
from consistency.contract.ids import parse_ids as _parse_ids
from consistency.contract.ids import split_appended
from consistency.contract.models import ModelInfo
from consistency.contract.resolve import (Reading, check_spec, check_streams, possible, specforge_readings,
                                         streams_of, transformers_evidence)
from consistency.errors import InputError, UsageError
from consistency.lint.draft import DraftInfo

_FRAMEWORK = re.compile(r"^(?P<name>[A-Za-z][\w.-]*(?:@[\w.+-]+)?):(?P<ids>.*)$")
DRAFT_FRAMEWORK = {"speculators": "speculators", "sglang": "specforge", "modelopt": "modelopt"}
_ID_KEY = {"speculators": conventions.TOP_IDS, "specforge": conventions.NESTED_IDS, "modelopt": conventions.NESTED_IDS}


@dataclass
class TrainingInfo:
    streams: list[int] | None  # None: the ids are a default that needs N, and N is unknown
    source: str  # a sentence: where these streams come from
    explicit: bool  # given by the user (--trained-with) rather than assumed from the draft config
    convention: str | None = None
    native_ids: list[int] | None = None
    model: ModelInfo | None = None  # what a dump or a contract says about the target
    assumed: str | None = None  # which reading of a version-dependent convention was assumed
    readings: list[Reading] = field(default_factory=list)  # >1: the streams depend on what trained it
    evidence: str | None = None  # what in the draft narrowed the readings (or why nothing did)
    appended: str | None = None  # the verifier's last state split off the ids (contract/ids.py split_appended)

    @property
    def ambiguous(self) -> bool:
        return len(self.readings) > 1


def parse_ids(text: str) -> list[int] | None:
    return _parse_ids(text, "--trained-with", "ids")


def parse_trained_with(spec: str, num_layers: int | None, architecture: str | None = None,
                       stamp: str | None = None, slots: int | None = None) -> TrainingInfo:
    """A file (our dump, a speculators/SpecForge training file, a contract .json/.yaml) or
    FRAMEWORK[@VER]:IDS, read for the target's ``architecture`` where the framework's
    reading depends on the model file (SpecForge through SGLang, docs/conventions.md).
    An unpinned ``specforge`` keeps one reading per capture backend (narrowed by the
    draft's transformers ``stamp``); ids outside the target's streams are a usage error."""
    p = Path(spec)
    try:
        is_file = p.exists()
    except OSError:  # a FRAMEWORK:IDS spec past the file-name length limit (ENAMETOOLONG)
        is_file = False
    if is_file:
        return _from_file(p)
    m = _FRAMEWORK.match(spec.strip())
    if not m:
        raise InputError(spec[:200], "--trained-with: no such file, and not FRAMEWORK:IDS (e.g. specforge:1,29,57)")
    if not m.group("ids").strip():  # `stream:$IDS` with IDS unset must not become "training used the default"
        raise UsageError(f"--trained-with {spec!r}: no ids after ':'; give them (e.g. {m.group('name')}:2,30,58), "
                         f"or {m.group('name')}:default for that framework's default ids")
    name, ids = m.group("name"), parse_ids(m.group("ids"))
    res = check_spec(name, "--trained-with", architecture)
    appended = ""
    if ids is not None:  # speculators' data-generation ids end with N, the verifier's last state (contract/ids.py)
        ids, _last, appended = split_appended(ids, num_layers, name, slots)
    streams = streams_of(ids, name, num_layers, architecture).streams
    if ids is not None and streams is not None:
        check_streams(ids, streams, num_layers, what=f"--trained-with {spec}:", spec=name)
    info = TrainingInfo(streams, f"--trained-with {spec} ({res.convention.meaning})" + (
        f"; {appended}" if appended else ""), True, name, ids, assumed=res.assumed, appended=appended or None)
    if name.strip().lower() == "specforge":
        _specforge(info, ids, num_layers, architecture, stamp)
    return info


def _specforge(info: TrainingInfo, ids: list[int] | None, n: int | None, arch: str | None, stamp: str | None) -> None:
    """Replace the one assumed SpecForge reading by every reading the draft leaves open."""
    readings, why = specforge_readings(ids, n, arch, stamp)
    info.readings, info.evidence = readings, why
    if not readings:
        info.streams, info.assumed = None, None
        info.source += (f"; training unknown: no SpecForge reading of {ids} gives streams inside 0..{n} on this "
                        "target, so none is a reading")
        return
    if len(readings) == 1:
        info.streams = readings[0].streams
        narrowed = why is not None and transformers_evidence(stamp)[0] is not None
        info.assumed = f"read as {readings[0].label}" + (f", chosen by {why}" if narrowed else
                                                          " (every capture backend gives these streams here"
                                                          + (f"; {why})" if why else ")"))
        info.source += f"; {info.assumed}"
    else:
        info.assumed = None
        info.streams = readings[-1].streams  # the slot count is the same under every reading
        head = info.source.split(" (", 1)[0] if info.explicit else "assumed from the draft config"
        info.source = (f"{head}: SpecForge ids mean what the SGLang that produced the training data makes of them, "
                       "and nothing here says which: " + "; ".join(f"{r.label}: {r.streams}" for r in readings)
                       + (f" ({why})" if why else ""))


CONTRACT_SUFFIXES = (".json", ".yaml", ".yml")


def _from_file(p: Path) -> TrainingInfo:
    """Anything but a contract is opened the way ``compare`` opens a side (open_side): our
    dumps, rank sets, speculators ``hs_*.safetensors``, SpecForge ``.ckpt``/``.ckpt.gz``."""
    if p.suffix.lower() not in CONTRACT_SUFFIXES:
        from consistency.dump.sets import open_side

        with open_side(p, row_bound=False) as d:
            meta = d.metadata
            fmt = getattr(d, "format", None)
        if meta is None or meta.aux is None or not meta.aux.stream_ids:
            foreign = f"{fmt} training data, which does not record its layer ids" if fmt in ("speculators",
                                                                                             "specforge") else None
            raise InputError(p, f"{foreign or 'the dump records no aux stream ids (metadata aux.stream_ids)'}; "
                                "pass --trained-with FRAMEWORK[@VER]:IDS with the ids of that training run instead")
        return TrainingInfo(list(meta.aux.stream_ids), f"training dump {p.name} (metadata aux.stream_ids)", True,
                            meta.aux.convention, meta.aux.native_ids, meta.model)
    from consistency.contract.io import read_contract

    c = read_contract(p)
    native = c.native
    return TrainingInfo(c.stream_ids, f"contract {p.name}", True, native.convention if native else None,
                        native.ids if native else None, c.target)


def from_draft(draft: DraftInfo, num_layers: int | None, architecture: str | None = None) -> TrainingInfo | None:
    """The draft config's own ids, read with the convention of the framework that writes
    that format (speculators: stream ids; SpecForge: as its SGLang reads them; ModelOpt: +1)."""
    framework = DRAFT_FRAMEWORK.get(draft.format)
    if framework is None or not draft.config:
        return None
    key = _ID_KEY[framework]
    ids = draft.ids(key)
    res = streams_of(ids, framework, num_layers, architecture)
    conv = res.convention
    what = f"{key} = {ids}" if ids is not None else f"no {key}, so {framework}'s default"
    info = TrainingInfo(res.streams, f"assumed from the draft config ({what}, read as {framework} writes it: "
                        f"{conv.meaning}); pass --trained-with to state what training used", False, framework, ids,
                        assumed=res.assumed if ids is not None else None)
    if framework == "specforge":
        stamp = draft.config.get("transformers_version")
        _specforge(info, ids, num_layers, architecture, stamp if isinstance(stamp, str) else None)
    elif not possible(info.streams, num_layers):
        # e.g. ModelOpt's +1 on ids that already reach N: no training run fed a stream past N, so this
        # is no reading of what training used (training unknown), not a mismatch to report
        info.source = (f"training unknown: the draft config's {what} read as {framework} writes it ({conv.meaning}) "
                       f"gives streams {info.streams}, outside 0..{num_layers} for a {num_layers}-layer target, which "
                       "no training run can have fed; pass --trained-with to state what training used")
        info.streams, info.assumed = None, None
    return info
