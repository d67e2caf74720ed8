"""What differs in the two dumps' metadata, as a structured diff.

Each difference is classified: layout-only fields (stride, contiguity, device, how the
tensor was produced -- the seed's ``.clone()`` against an add) cannot change values and
are information, said so explicitly because users suspect them; claims that change
meaning (stream ids, convention, model shape) are warnings; bookkeeping is information.

The diff is DeepDiff's (``DeepDiff(a, b, verbose_level=2, threshold_to_diff_deeper=0)``:
its kinds, paths and values), imported only when the two trees differ: two equal
metadata blocks (every per-tensor entry of a compare with identical layouts) cost a
``json.dumps`` each, not deepdiff's import (docs/dependencies.md). Two options and one
step of post-processing keep what the report has always promised:

- ``threshold_to_diff_deeper=0``: two dicts that share few keys are still compared key by
  key. DeepDiff's default folds them into one changed value, which would hide a changed
  ``aux.stream_ids`` (a warning) inside an ``aux`` or root entry (information);
- ``ignore_private_variables=False``: a ``__key`` in someone's metadata is a difference
  like any other, not skipped;
- DeepDiff groups its entries by kind, in an order that changes with the interpreter's
  hash seed; entries are sorted into the reference's key order, what only the candidate
  has last (``_order``), so a report reads the same on every run.

Lists are made atomic strings first, so a changed id list is one difference.
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
    are atomic): DeepDiff's tree with ``verbose_level=2`` and ``threshold_to_diff_deeper=0``,
    in the reference's key order. Equal trees return at once, without importing deepdiff."""
    if _dumps(a) == _dumps(b):
        return []
    tree = _deepdiff()(a, b, verbose_level=2, threshold_to_diff_deeper=0, ignore_private_variables=False).tree
    out: list[Change] = []
    for kind, items in tree.items():
        for item in items:
            path = item.path(output_format="list")
            out.append((kind, path, None if kind.endswith("added") else item.t1,
                        None if kind.endswith("removed") else item.t2))
    return sorted(out, key=lambda c: _order(a, b, c[1]))


def _deepdiff() -> Any:
    """``deepdiff.DeepDiff``, imported without its probes for pandas and polars.

    deepdiff imports pandas (and polars) at import time, when installed, to hash DataFrames:
    0.75 s of a compare's start-up where pandas is installed (transformers' and speculators'
    environments have it), for trees that are only ever JSON here. The probe is answered
    "not installed" (a ``None`` entry in ``sys.modules`` makes that import raise ImportError)
    only while deepdiff itself is imported, and only for modules nobody has imported yet; a
    later ``import pandas`` works as usual."""
    import sys

    hidden = [m for m in ("pandas", "polars") if m not in sys.modules]
    for m in hidden:
        sys.modules[m] = None  # type: ignore[assignment]
    try:
        from deepdiff import DeepDiff
    finally:
        for m in hidden:
            if sys.modules.get(m, 0) is None:
                del sys.modules[m]
    return DeepDiff


def _dumps(v: Any) -> str:
    """A strict canonical form: 1 and 1.0, True and 1, None and a value all differ (as they
    do to DeepDiff); key order does not."""
    return json.dumps(v, sort_keys=True, allow_nan=True, default=repr)


def _order(a: Any, b: Any, path: list[Any]) -> tuple[int, ...]:
    """Where ``path`` sits in the reading order: at each level, the key's position among the
    reference's keys, else after them, at its position among the candidate's."""
    key: list[int] = []
    for k in path:
        ra = list(a) if isinstance(a, dict) else []
        rb = list(b) if isinstance(b, dict) else []
        key.append(ra.index(k) if k in ra else len(ra) + (rb.index(k) if k in rb else len(rb)))
        a = a.get(k) if isinstance(a, dict) else None
        b = b.get(k) if isinstance(b, dict) else None
    return tuple(key)


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
    diffed). The predicate is symmetric, so the same keys go from both sides."""
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
