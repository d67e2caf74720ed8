"""Read and write contracts (JSON or YAML, validated), and derive one from dump metadata."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import ValidationError

from consistency.contract.models import AuxContract, DumpMetadata, SlotSpec
from consistency.errors import InputError

MAX_CONTRACT_BYTES = 4 * 1024 * 1024


def read_contract(path: str | Path) -> AuxContract:
    p = Path(path)
    if not p.is_file():
        raise InputError(p, "no such contract file" if not p.exists() else "is not a regular file")
    if p.stat().st_size > MAX_CONTRACT_BYTES:
        raise InputError(p, "contract file is too large")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(p, f"cannot read: {exc}") from None
    try:
        if p.suffix in (".yaml", ".yml"):
            import yaml

            obj = yaml.safe_load(text)
        else:
            obj = json.loads(text)
    except Exception as exc:  # noqa: BLE001 - yaml and json raise many types
        raise InputError(p, f"not valid {'YAML' if p.suffix in ('.yaml', '.yml') else 'JSON'}: {' '.join(str(exc).split())}") from None
    if not isinstance(obj, dict):
        raise InputError(p, "a contract must be a mapping")
    try:
        return AuxContract.model_validate(obj)
    except ValidationError as exc:
        e = exc.errors()[0]
        loc = ".".join(str(x) for x in e["loc"]) or "(root)"
        raise InputError(p, f"invalid contract at {loc}: {e['msg']}") from None


def from_metadata(meta: DumpMetadata) -> AuxContract | None:
    """The contract a training dump implies: its model and its aux stream ids."""
    if meta.aux is None or not meta.aux.stream_ids or meta.model is None:
        return None
    slots = [SlotSpec(stream=s, width=meta.model.hidden_size, residual=meta.aux.residual, norm=meta.aux.norm)
             for s in meta.aux.stream_ids]
    return AuxContract(target=meta.model, slots=slots)
