"""What the draft was trained on: ``--trained-with`` (a dump, a contract, or
``FRAMEWORK:IDS``), else the draft config read with its training framework's convention.

Everything ends as stream indices, slot by slot, the one unit every rule compares in.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from consistency.contract import conventions
from consistency.contract.models import ModelInfo
from consistency.contract.ids import parse_ids as _parse_ids
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


def parse_ids(text: str) -> list[int] | None:
    return _parse_ids(text, "--trained-with", "ids")


def parse_trained_with(spec: str, num_layers: int | None, architecture: str | None = None) -> TrainingInfo:
    """A file (our dump, a speculators/SpecForge training file, a contract .json/.yaml) or
    FRAMEWORK[@VER]:IDS, read for the target's ``architecture`` where the framework's
    reading depends on the model file (SpecForge through SGLang, docs/conventions.md)."""
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
    name, ids = m.group("name"), parse_ids(m.group("ids"))
    try:
        res = conventions.resolve(name, architecture)
    except (KeyError, ValueError) as exc:
        raise UsageError(f"--trained-with: {str(exc).strip(chr(39))}") from None
    streams = _streams(res.convention, ids, num_layers)
    return TrainingInfo(streams, f"--trained-with {spec} ({res.convention.meaning})", True, name, ids,
                        assumed=res.assumed)


def _streams(conv: conventions.Convention, ids: list[int] | None, n: int | None) -> list[int] | None:
    if ids is None and n is None:
        return None
    return conv.to_streams(ids, n)


CONTRACT_SUFFIXES = (".json", ".yaml", ".yml")


def _from_file(p: Path) -> TrainingInfo:
    """Anything but a contract is opened the way ``compare`` opens a side (open_side): our
    dumps, rank sets, speculators ``hs_*.safetensors``, SpecForge ``.ckpt``/``.ckpt.gz``."""
    if p.suffix.lower() not in CONTRACT_SUFFIXES:
        from consistency.dump.sets import open_side

        with open_side(p) as d:
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
    res = conventions.resolve(framework, architecture)
    conv = res.convention
    streams = _streams(conv, ids, num_layers)
    what = f"{key} = {ids}" if ids is not None else f"no {key}, so {framework}'s default"
    return TrainingInfo(streams, f"assumed from the draft config ({what}, read as {framework} writes it: "
                        f"{conv.meaning}); pass --trained-with to state what training used", False, framework, ids,
                        assumed=res.assumed if ids is not None else None)
