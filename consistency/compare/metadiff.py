"""What differs in the two dumps' metadata, as a structured diff (deepdiff).

Each difference is classified: layout-only fields (stride, contiguity, device, how the
tensor was produced -- the seed's ``.clone()`` against an add) cannot change values and
are information, said so explicitly because users suspect them; claims that change
meaning (stream ids, convention, model shape) are warnings; bookkeeping is information.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from deepdiff import DeepDiff

import json
import re
from functools import lru_cache
from typing import Any


@lru_cache(maxsize=1)
def _deepdiff():  # noqa: ANN202
    """Import deepdiff without its optional pandas/polars support: importing pandas costs
    ~0.4 s and ~50 MB, and metadata is plain JSON (bench/bench_compare.py measures start-up)."""
    import sys

    blocked = {m: sys.modules.get(m) for m in ("pandas", "polars") if m not in sys.modules}
    for m in blocked:
        sys.modules[m] = None  # type: ignore[assignment]
    try:
        from deepdiff import DeepDiff
    finally:
        for m in blocked:
            if sys.modules.get(m) is None:
                del sys.modules[m]
    return DeepDiff

from consistency.contract.findings import MetaDiff, Severity
from consistency.contract.models import DumpMetadata

LAYOUT_FIELDS = {"stride", "contiguous", "device", "producer"}
MEANINGFUL = re.compile(r"^(aux\.(stream_ids|convention|residual|norm)|model\.(num_layers|hidden_size|vocab_size|architecture))")
IGNORED = re.compile(r"^(created|tool_version|tensors\..+\.(shape|dtype)$|side$|prompt$|extra|format)")


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
    if a and b and not _same(_unignored(a, b), _unignored(b, a)):
        out += _entries(_deepdiff()(a, b, ignore_order=False, verbose_level=2), "")
    for cname, rname in pairs.items():
        if cname in tb and rname in ta and not _same(ta[rname], tb[cname]):
            out += _entries(_deepdiff()(ta[rname], tb[cname], verbose_level=2), f"tensors.{cname}.")
    return [d for d in out if not IGNORED.match(d.path)]


def _unignored(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """``a`` without the top-level keys whose every difference IGNORED drops anyway
    (``created`` always differs between two recordings)."""
    def dropped(k: str) -> bool:
        nested = isinstance(a.get(k), dict) or isinstance(b.get(k), dict)
        return bool(IGNORED.match(k)) and (not nested or bool(IGNORED.match(k + ".x")))
    return {k: v for k, v in a.items() if not dropped(k)}


def _same(a: Any, b: Any) -> bool:
    """Equal values of equal types all the way down: DeepDiff would report nothing, so it is
    not run (it costs ~0.5 ms a call: minutes for a dump of 100,000 tensors, and its import)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(v, b[k]) for k, v in a.items())
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b) if isinstance(a, (str, int, float, bool, type(None))) else False


def _entries(dd: DeepDiff, prefix: str) -> list[MetaDiff]:
    out: list[MetaDiff] = []
    tree = dd.tree
    for kind, items in tree.items():
        for item in items:
            path = prefix + _path(item.path(output_format="list"))
            ref_v = None if kind.endswith("added") else _jsonable(item.t1)
            cand_v = None if kind.endswith("removed") else _jsonable(item.t2)
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
