"""Export the JSON Schemas of the contract, the dump metadata and the reports.

The files under schemas/ are generated from the Pydantic models; a test regenerates them
and fails when the checked-in copies drift, so the schemas can never silently lie.
"""

from __future__ import annotations

import json

from pydantic import BaseModel

from consistency.contract.findings import CompareReport
from consistency.contract.models import AuxContract, DumpMetadata

SCHEMAS: dict[str, type[BaseModel]] = {
    "aux-contract.schema.json": AuxContract,
    "dump-metadata.schema.json": DumpMetadata,
    "compare-report.schema.json": CompareReport,
}


def register(filename: str, model: type[BaseModel]) -> None:
    """Other packages' report models (lint, replay, gate) add themselves here."""
    SCHEMAS[filename] = model


def render(model: type[BaseModel]) -> str:
    schema = model.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["$id"] = f"https://consistency.dev/schemas/{model.__name__}"
    return json.dumps(schema, indent=2, sort_keys=True) + "\n"


def all_schemas() -> dict[str, str]:
    _load_report_models()
    return {name: render(m) for name, m in sorted(SCHEMAS.items())}


def _load_report_models() -> None:
    """Import report models of other commands if installed (they call :func:`register`)."""
    import importlib

    for mod in ("consistency.lint.report", "consistency.replay.report", "consistency.gate.report"):
        try:
            importlib.import_module(mod)
        except ImportError:
            continue
