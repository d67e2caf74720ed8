"""Errors that end a command with exit code 2 and one line naming the file.

Every loader and parser raises :class:`InputError` for input it cannot trust, so the CLI
can print ``path: problem`` without a traceback and CI logs stay one line per failure.
"""

from __future__ import annotations

from pathlib import Path


class ConsistencyError(Exception):
    """Base class: anything the user can fix; the CLI maps it to exit code 2."""

    exit_code = 2


class InputError(ConsistencyError):
    """A file (or value) that cannot be read or trusted.

    The message is always ``<path>: <problem>`` on a single line so that a CI log shows
    which input is at fault even when several files are involved.
    """

    def __init__(self, path: str | Path | None, problem: str) -> None:
        self.path = None if path is None else str(path)
        self.problem = " ".join(str(problem).split())  # one line, always
        super().__init__(self.one_line())

    def one_line(self) -> str:
        return f"{self.path}: {self.problem}" if self.path else self.problem


class UsageError(ConsistencyError):
    """Arguments that contradict each other or name nothing usable."""


class OutputExistsError(ConsistencyError):
    """Refuse to clobber an existing output without ``--force``."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        super().__init__(f"{path}: output exists; pass --force to overwrite it")
