"""Where a rank file sits in a parallel layout: pipeline stage, TP/DP/EP group, node.

Tensor parallelism alone needs nothing beyond the file name (``rank{r}-of{w}``) and each
tensor's :class:`~consistency.contract.models.ShardSpec`. Pipeline stages and data-parallel
attention do: a stage holds only its own layer range (so the merger must know the range to
tell a *local* layer index from a global one, vLLM PR #36731), and a DP-attention rank
holds only its own tokens (so the merger must know which ones to put them back in order).
The recorder writes this as ``metadata.extra["parallel"]``; here it is validated, because
it comes from a file and is untrusted like everything else in one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from consistency.contract.models import DumpMetadata
from consistency.errors import InputError

KEY = "parallel"  # metadata.extra[KEY]


@dataclass(frozen=True)
class LayoutFact:
    """What merging a layout's rank files found (a stage with no file, ranges that overlap,
    a token no DP rank holds, ...), as data: ``code`` is the finding code diagnosis words
    it under, ``tensor`` the tensor it names, ``data`` the facts."""

    code: str
    tensor: str | None = None
    data: Mapping[str, Any] = field(default_factory=dict)

    @staticmethod
    def of(code: str, tensor: str | None = None, **data: Any) -> LayoutFact:
        return LayoutFact(code, tensor, MappingProxyType(dict(data)))
MAX_TOKENS = 10_000_000


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Group(_Strict):
    """This file's rank within one parallel group (tp, dp, ep)."""

    rank: int = Field(ge=0)
    size: int = Field(ge=1, le=1_000_000)

    @model_validator(mode="after")
    def _in_range(self) -> Group:
        if self.rank >= self.size:
            raise ValueError(f"rank {self.rank} >= size {self.size}")
        return self


class Stage(Group):
    """A pipeline stage and the global layer range [start, end) it runs."""

    layers: tuple[int, int]

    @model_validator(mode="after")
    def _range(self) -> Stage:
        lo, hi = self.layers
        if not 0 <= lo < hi <= 100_000:
            raise ValueError(f"layer range [{lo}, {hi}) is empty or out of range")
        return self


class Tokens(Group):
    """The tokens a data-parallel rank holds, one entry per row it recorded.

    ``rows``: each row's index in the logical (whole-batch) dump. Or ``requests`` (a
    request id per row) with ``positions`` (the row's position within its request): the
    logical order is then by request id, then position. ``total``: the logical token
    count, when the producer knows it (a trailing token held by no rank is only
    detectable with it).
    """

    rows: list[int] | None = Field(None, max_length=MAX_TOKENS)
    requests: list[int | str] | None = Field(None, max_length=MAX_TOKENS)
    positions: list[int] | None = Field(None, max_length=MAX_TOKENS)
    total: int | None = Field(None, ge=0, le=MAX_TOKENS)

    @model_validator(mode="after")
    def _one_scheme(self) -> Tokens:
        if (self.rows is None) == (self.requests is None):
            raise ValueError("give token ownership as rows, or as requests with positions (exactly one)")
        if self.requests is not None and (self.positions is None or len(self.positions) != len(self.requests)):
            raise ValueError("requests need one position per row")
        if any(x < 0 for x in (self.rows or []) + (self.positions or [])):
            raise ValueError("negative token index")
        return self

    def keys(self) -> list[tuple[Any, ...]]:
        """One sortable key per row: (row,) or (request, position)."""
        if self.rows is not None:
            return [(r,) for r in self.rows]
        assert self.requests is not None and self.positions is not None
        return [(_rid(q), p) for q, p in zip(self.requests, self.positions)]


def _rid(q: int | str) -> tuple[int, int | str]:
    return (0, q) if isinstance(q, int) else (1, q)  # ints before strings; each sorted naturally


class Layout(_Strict):
    pp: Stage | None = None
    tp: Group | None = None
    dp: Tokens | None = None
    ep: Group | None = None
    node: str | None = Field(None, max_length=255, description="Host that wrote the file")

    @property
    def staged(self) -> bool:
        """Needs the stage/token merger rather than plain tensor-parallel unsharding."""
        return self.pp is not None or self.dp is not None


def of(meta: DumpMetadata | None, path: Any = "metadata") -> Layout | None:
    """The layout a rank file declares, or None; a malformed one is a one-line InputError."""
    raw = meta.extra.get(KEY) if meta is not None else None
    if raw is None:
        return None
    try:
        return Layout.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first.get("loc", ())) or KEY
        raise InputError(path, f"bad parallel layout in metadata ({KEY}.{where}: {first.get('msg')})") from None


def shard_group(layout: dict[str, Any] | Layout | None, group: str) -> tuple[int, int] | None:
    """(rank, size) of ``group`` ('tp', 'dp', 'ep') in a declared layout, if declared. Reads
    the raw dict without validating the whole layout: it runs on every capture, and a DP
    rank's token list can be long (``declare`` validated it once)."""
    g = getattr(layout, group, None) if isinstance(layout, Layout) else (layout or {}).get(group)
    if g is None:
        return None
    r, n = (g.rank, g.size) if isinstance(g, Group) else (g.get("rank"), g.get("size"))
    return (r, n) if isinstance(r, int) and isinstance(n, int) and 0 <= r < n else None
