"""One memory budget per input file: what a reader may allocate on a file's behalf.

Per-value bounds (a 1 GiB strided view, a 256 MiB ``data.pkl``) do not bound their sum: a
930-byte archive with three stride-0 views of 1 GiB each, or a pickle that makes K latin1
copies of one 250 MB string, stays under every per-value bound and still takes gigabytes.
So every allocation a reader makes for a file (the inflated pickle, the objects its opcodes
build, each ``_codecs.encode`` copy, each strided view copied into memory, a tensor read
whole) is charged to that file's :class:`Budget`, sized from the file's own size:
``FLOOR + FACTOR x file size``, never more than 16 GiB. A file whose reading would pass it
is refused in one line naming the file, the allocation and the budget, so a file cannot make
its reader hold more than a small multiple of what it weighs. ``CONSISTENCY_MAX_FILE_MEMORY``,
when set, is every file's budget instead (raised for a genuine file that needs more).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from consistency.contract.bounds import env_limit
from consistency.errors import InputError

FLOOR = 256 * 1024 * 1024  # what any file may cost: a small file's pickle, a few views of its storages
FACTOR = 4  # bytes of memory per byte of file: a strided copy of every storage, a float widening
MAX_FILE_MEMORY = 16 * 1024 * 1024 * 1024  # the cap for any one file; CONSISTENCY_MAX_FILE_MEMORY replaces the budget
OBJECT_BYTES = 64  # charged per pickle opcode: each builds at most one object (an empty list is 56 bytes)
MAX_DEPTH = 100  # container nesting: a tensor archive nests a few levels; later walks recurse (Python stops near 1000)


def limit_for(size: int) -> int:
    """The budget of a file of ``size`` bytes: ``FLOOR + FACTOR x size``, at most
    :data:`MAX_FILE_MEMORY`; ``CONSISTENCY_MAX_FILE_MEMORY``, when set, is every file's budget
    (raise it for a genuine file that needs more, lower it for a small job)."""
    if os.environ.get("CONSISTENCY_MAX_FILE_MEMORY", "").strip():
        return env_limit("MAX_FILE_MEMORY", MAX_FILE_MEMORY)
    return min(MAX_FILE_MEMORY, FLOOR + FACTOR * max(0, size))


@dataclass
class Budget:
    """Bytes charged against one file's budget; :meth:`charge` refuses past it."""

    path: Path
    size: int
    limit: int = 0
    used: int = field(default=0)

    def __post_init__(self) -> None:
        if not self.limit:
            self.limit = limit_for(self.size)

    @classmethod
    def of(cls, path: Path, size: int) -> Budget:
        return cls(Path(path), int(size))

    def charge(self, nbytes: int, what: str) -> None:
        """Account ``nbytes`` for ``what`` before allocating it; refuse when the total passes the limit."""
        nbytes = max(0, int(nbytes))
        if self.used + nbytes > self.limit:
            raise InputError(self.path, f"refused: {what} needs {nbytes} bytes in memory, past this {self.size}-byte "
                             f"file's budget of {self.limit} bytes ({self.used} already used; {FLOOR >> 20} MiB + "
                             f"{FACTOR} x the file size, at most 16 GiB; CONSISTENCY_MAX_FILE_MEMORY sets it)")
        self.used += nbytes

    def release(self, nbytes: int) -> None:
        """Give back a transient allocation (a storage read to copy a view from)."""
        self.used = max(0, self.used - max(0, int(nbytes)))


def tree_bounded(p: Path, obj: Any, ops: int, limit: int = MAX_DEPTH) -> None:
    """Refuse an object tree deeper than ``limit`` or with more paths than opcodes (checked
    iteratively, so a later walk, repr or comparison meets neither a RecursionError nor a
    shared list referenced twice per level, 2^n paths from 2n opcodes, nor a cycle)."""
    stack, visits = [(obj, 0)], 0
    while stack:
        o, d = stack.pop()
        visits += 1
        if d > limit:
            raise InputError(p, f"refused: the pickle nests containers more than {limit} deep")
        if visits > ops + 1:
            raise InputError(p, "refused: the pickle's containers share or contain themselves (a tree of more paths "
                             "than the pickle has opcodes)")
        if isinstance(o, dict):
            stack.extend((v, d + 1) for v in (*o.keys(), *o.values()))
        elif isinstance(o, (list, tuple)):
            stack.extend((v, d + 1) for v in o)
