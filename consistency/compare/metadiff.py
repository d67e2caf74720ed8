"""What differs in the two dumps' metadata, as a structured diff.

Each difference is classified: layout-only fields (stride, contiguity, device, how the
tensor was produced -- the seed's ``.clone()`` against an add) cannot change values and
are information, said so explicitly because users suspect them; claims that change
meaning (stream ids, convention, model shape) are warnings; bookkeeping is information.

The diff is DeepDiff's tree (``DeepDiff(a, b, verbose_level=2,
threshold_to_diff_deeper=0).tree``: the same kinds, paths and values) for the only trees
it is ever given here -- JSON objects whose lists were made atomic strings, with no NaN
(pydantic writes it as null) and no ``__private`` keys (DeepDiff would skip those) --
computed by a short walk. Unlike DeepDiff's default, two dicts that share few keys are
still compared key by key: collapsing them into one changed value would hide a changed
``aux.stream_ids`` (a warning) inside an ``aux`` or root entry (information). Importing
deepdiff cost 0.14 G instructions, 11 % of a small compare's start-up (issue 17;
docs/dependencies.md), and DeepDiff groups its kinds in an order that changes with the
interpreter's hash seed. tests/test_metadiff.py checks the walk against deepdiff itself
on random trees. Entries come in the reference's key order, what only the candidate has
last.
"""

from __future__ import annotations

import json
import re
from typing import Any

from consistency.contract.findings import MetaDiff, Severity
from consistency.contract.models import DumpMetadata

LAYOUT_FIELDS = {"stride", "contiguous", "device", "producer"}
MEANINGFUL = re.compile(r"^(aux\.(stream_ids|convention|residual|norm)|model\.(num_layers|hidden_size|vocab_size|architecture))")
IGNORED = re.compile(r"^(created|tool_version|tensors\..+\.(shape|dtype)$|side$|prompt$|extra|format)")

Change = tuple[str, list[Any], Any, Any]  # kind, path, reference value, candidate value


def changes(a: Any, b: Any) -> list[Change]:
    """Every difference between JSON trees ``a`` and ``b`` (lists and other non-dict values
    are atomic), as DeepDiff's tree reports it with ``verbose_level=2`` and
    ``threshold_to_diff_deeper=0`` (dicts are always compared key by key)."""
    out: list[Change] = []
    _walk(a, b, [], out)
    return out


def _walk(a: Any, b: Any, path: list[Any], out: list[Change]) -> None:
    if type(a) is not type(b):  # 1 vs 1.0, True vs 1, None vs a value, a dict vs a string
        out.append(("type_changes", path, a, b))
        return
    if not isinstance(a, dict):
        if a != b:
            out.append(("values_changed", path, a, b))
        return
    for k in a:  # the reference's order, then what only the candidate has
        if k in b:
            _walk(a[k], b[k], [*path, k], out)
        else:
            out.append(("dictionary_item_removed", [*path, k], a[k], None))
    out.extend(("dictionary_item_added", [*path, k], None, b[k]) for k in b if k not in a)


def _plain(meta: DumpMetadata | None) -> dict[str, Any]:
    """Metadata as plain data; lists become atomic values so a changed id list is one
    difference ([0, 3, 7] -> [3, 7, 10]), not three item edits; defaults are dropped."""
    if meta is None:
        return {}
    return _atomic(json.loads(meta.model_dump_json(exclude_none=True, exclude_defaults=True)))


def _atomic(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _atomic(x) for k, x in v.items()}
    if isinstance(v, list):
        return json.dumps(v)
    return v


def _path(p: list) -> str:
    return ".".join(str(x) for x in p)


def diff(ref: DumpMetadata | None, cand: DumpMetadata | None, pairs: dict[str, str]) -> list[MetaDiff]:
    """Differences; per-tensor entries are compared between *paired* names (cand -> ref)."""
    a, b = _plain(ref), _plain(cand)
    ta, tb = a.pop("tensors", {}), b.pop("tensors", {})
    out: list[MetaDiff] = []
    if a and b:
        out += _entries(changes(_unignored(a, b), _unignored(b, a)), "")
    for cname, rname in pairs.items():
        if cname in tb and rname in ta:
            out += _entries(changes(ta[rname], tb[cname]), f"tensors.{cname}.")
    return [d for d in out if not IGNORED.match(d.path)]


def _unignored(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """``a`` without the top-level keys whose every difference IGNORED drops anyway
    (``created`` always differs between two recordings; a free-form ``extra`` need not be
    walked). The predicate is symmetric, so the same keys go from both sides."""
    def dropped(k: str) -> bool:
        nested = isinstance(a.get(k), dict) or isinstance(b.get(k), dict)
        return bool(IGNORED.match(k)) and (not nested or bool(IGNORED.match(k + ".x")))
    return {k: v for k, v in a.items() if not dropped(k)}


def _entries(found: list[Change], prefix: str) -> list[MetaDiff]:
    out: list[MetaDiff] = []
    for kind, at, ref, cand in found:
        path = prefix + _path(at)
        ref_v = None if kind.endswith("added") else _jsonable(ref)
        cand_v = None if kind.endswith("removed") else _jsonable(cand)
        leaf = path.rsplit(".", 1)[-1]
        if path.startswith("tensors.") and leaf in LAYOUT_FIELDS:
            sev, change = Severity.info, "layout only: does not change values"
        elif MEANINGFUL.match(path):
            sev, change = Severity.warning, kind.replace("_", " ")
        else:
            sev, change = Severity.info, kind.replace("_", " ")
        out.append(MetaDiff(path=path, reference=ref_v, candidate=cand_v, change=change, severity=sev))
    return out


def _jsonable(v: Any) -> Any:
    if isinstance(v, str) and v.startswith("["):
        try:
            return json.loads(v)
        except ValueError:
            return v
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    return str(v)
