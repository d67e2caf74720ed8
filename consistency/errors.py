"""Errors that end a command with exit code 2 and one line naming the file.

Every loader and parser raises :class:`InputError` for input it cannot trust, so the CLI
can print ``path: problem`` without a traceback and CI logs stay one line per failure.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from types import ModuleType


class ConsistencyError(Exception):
    """Base class: anything the user can fix; the CLI maps it to exit code 2.

    Messages quote file names and values from files; whoever prints one renders it inert
    for its output (``consistency.escape``; the CLI's error line uses ``term``).
    """

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


def did_you_mean(word: str, names: Iterable[str]) -> str:
    """``"; did you mean X?"`` for the closest of ``names`` to a mistyped ``word``, else "".

    Every place the command line takes a name (a subcommand, a convention, a consumer, a
    built-in model) ends its refusal with this, so a typo costs one reading, not a search."""
    import difflib

    pool = [str(n) for n in names]
    close = difflib.get_close_matches(str(word), pool, n=1, cutoff=0.6)
    if not close:  # "sglang@0.5.5" typed as "sglnag@0.5.5": match the name before the version
        head, sep, tail = str(word).partition("@")
        close = [c + sep + tail for c in difflib.get_close_matches(head, pool, n=1, cutoff=0.6)] if sep else []
    return f"; did you mean {close[0]}?" if close else ""


class OutputExistsError(ConsistencyError):
    """Refuse to clobber an existing output without ``--force``."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        super().__init__(f"{path}: output exists; pass --force to overwrite it")


def need(extra: str, module: str, what: str = "") -> ModuleType:
    """Import ``module`` for an optional feature, or raise one line with the install command.

    ``extra`` is the ``pyproject.toml`` extra that provides it (``hf``, ``torch``, ``plots``).
    Every lazy import of an optional dependency on a CLI path goes through here, so a
    missing one is never a bare ModuleNotFoundError traceback.
    """
    import importlib

    try:
        importlib.import_module(module)
    except ImportError as exc:
        top = module.split(".")[0]
        missing = getattr(exc, "name", None) or top
        raise MissingDependency(extra, module, what, missing) from None
    return importlib.import_module(module)


# extras that pull torch: pip resolves a bare torch to the multi-GB CUDA build on Linux
TORCH_EXTRAS = frozenset({"torch", "hf", "interop", "test"})


def install_line(extra: str | None = None) -> str:
    """The pip command that installs this package (with ``extra``), by its distribution name,
    with how to get the CPU wheel first when the extra pulls torch. Every install hint the
    package prints comes from here (tests/project/test_newcomer_install.py checks them against pyproject)."""
    from consistency import DIST, TORCH_CPU_INDEX

    line = f"pip install '{DIST}[{extra}]'" if extra else f"pip install {DIST}"
    if extra in TORCH_EXTRAS:
        line += f" (without a GPU, first the CPU wheel of torch: pip install torch --index-url {TORCH_CPU_INDEX})"
    return line


class MissingDependency(UsageError):
    """An optional dependency is not installed: the message carries the pip line."""

    def __init__(self, extra: str, module: str, what: str = "", missing: str | None = None) -> None:
        self.extra, self.module = extra, module
        self.install = install_line(extra)
        why = f"{what} needs {module}" if what else f"{module} is not installed"
        extra_note = f" (missing module: {missing})" if missing and missing != module.split(".")[0] else ""
        super().__init__(f"{why}{extra_note}; install it with: {self.install}")


# top-level module -> the extra that installs it (pyproject.toml [project.optional-dependencies])
EXTRAS = {"torch": "torch", "transformers": "hf", "accelerate": "hf", "safetensors": "hf", "tokenizers": "hf",
          "huggingface_hub": "hf", "matplotlib": "report", "transformer_lens": "interop", "nnsight": "interop",
          "tomli": "toml"}


# commands that run a transformers model need the hf extra whichever of its modules is missing first
COMMAND_EXTRAS = {"record": "hf", "demo": "hf", "replay": "hf"}


def missing_dependency(exc: ImportError, command: str | None = None) -> MissingDependency | None:
    """The :class:`MissingDependency` for an ImportError of an optional dependency, else None
    (a module of ours failing to import is a bug, not a missing extra)."""
    name = (getattr(exc, "name", None) or "").split(".")[0]
    if name not in EXTRAS:
        return None
    what = f"consistency {command}" if command else ""
    if command in COMMAND_EXTRAS and EXTRAS[name] in ("torch", "hf"):
        return MissingDependency(COMMAND_EXTRAS[command], name, what)
    if name == "tomli":
        err = MissingDependency("toml", "tomli", what or "reading consistency.toml on Python 3.10")
        err.install = "pip install tomli"
        err.args = (f"{what or 'reading consistency.toml on Python 3.10'} needs tomli; install it with: "
                    f"{err.install}",)
        return err
    return MissingDependency(EXTRAS[name], name, what)
