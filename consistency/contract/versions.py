"""Release numbers, release ranges and ``name@version`` specs: one implementation for every table.

Every table in :mod:`consistency.contract` (id meanings, id sources, capture limits, the
consumer rows, SGLang's draft rewrites, SpecForge's eras) says for which releases a row
holds. They all ask the same two questions, "does this range cover that release" and "how
do I print it", so the answers live here once (:class:`VersionRange`); an unknown version
always means "the newest release", so a row open at the top is the one an unpinned run
gets. :func:`parse_spec` is the one reader of the ``sglang@0.5.12`` spelling that
``--runtime``, ``--convention``, ``--trained-with FRAMEWORK@VER:IDS`` and the API take.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

Version = tuple[int, ...]

# A release number, optionally with a PEP 440 pre/post/dev/local part (0.5.12.post1, 0.9.0rc2, 0.8.5+cu128);
# anything else (0.5.12@1, 0.5.x, latest) is malformed.
_VERSION_RE = re.compile(r"^v?(\d+(?:\.\d+)*)(?:[.-]?(?:post|rc|dev|a|b)\d*)*(?:\+[A-Za-z0-9.]+)?$")


def parse_version(text: str) -> Version:
    """``0.5.12`` -> (0, 5, 12); ``0.5.12.post1`` -> (0, 5, 12); malformed text is a ValueError."""
    m = _VERSION_RE.match(text.strip())
    if not m:
        raise ValueError(f"malformed version {text!r} (expected digits and dots, e.g. 0.5.12 or 0.5.12.post1)")
    return tuple(int(x) for x in m.group(1).split("."))


def vtext(v: Version | None) -> str:
    return ".".join(map(str, v)) if v else ""


@dataclass(frozen=True)
class VersionRange:
    """Releases ``lo`` (inclusive) to ``hi`` (exclusive); None at either end is open."""

    lo: Version | None = None
    hi: Version | None = None

    def covers(self, v: Version | None) -> bool:
        """Whether release ``v`` lies in the range; an unknown release counts as the newest."""
        if v is None:
            return self.hi is None
        return (self.lo is None or v >= self.lo) and (self.hi is None or v < self.hi)

    def label(self) -> str:
        """'>=0.5.13,<0.5.17', '<0.5.13', '>=0.5.22' or 'any'."""
        parts = ([f">={vtext(self.lo)}"] if self.lo else []) + ([f"<{vtext(self.hi)}"] if self.hi else [])
        return ",".join(parts) or "any"

    @property
    def bounds(self) -> tuple[Version, ...]:
        return tuple(v for v in (self.lo, self.hi) if v)


def just_below(b: Version) -> Version:
    """A release just under boundary ``b`` (0.5.13 -> 0.5.12.1000000): the representative of the range below it."""
    k = max((j for j, x in enumerate(b) if x > 0), default=0)
    return (*b[:k], b[k] - 1, 10**6)


@dataclass(frozen=True)
class RuntimeSpec:
    """``sglang@0.5.12`` as typed: the lower-cased name, the release (None: not pinned) and its text."""

    name: str
    version: Version | None = None
    text: str = ""  # the version as typed, e.g. '0.5.12.post1'; '' when not pinned

    def __str__(self) -> str:
        return f"{self.name}@{self.text}" if self.text else self.name


def parse_spec(spec: str, keep_raw: frozenset[str] = frozenset()) -> RuntimeSpec:
    """``NAME[@VERSION]`` -> RuntimeSpec. A malformed version is a ValueError; names in
    ``keep_raw`` take a free-form tail (``specforge@sglang-0.5.9``, ``specforge@hf``)."""
    name, _, ver = spec.strip().partition("@")
    key, ver = name.strip().lower(), ver.strip()
    if not key:
        raise ValueError(f"{spec!r}: no name before '@'")
    if key in keep_raw or not ver:
        return RuntimeSpec(key, None, ver)
    return RuntimeSpec(key, parse_version(ver), ver)
