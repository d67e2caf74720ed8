"""consistency: a train/serve consistency linter and tensor-diff tool for speculative decoding.

The Python API (docs/api.md) is reached lazily, so ``import consistency`` stays light
(no torch, no pydantic models, nothing but this file)::

    import consistency
    report = consistency.compare("train.safetensors", {"aux.0": t0, "aux.1": t1})
    consistency.lint(draft="draft/", serve="vllm serve ...")
    consistency.replay("train.safetensors", "serve.safetensors", draft="draft/")
    consistency.record(model, input_ids, "train.safetensors")

``compare``, ``lint``, ``replay`` and ``record`` are also the names of subpackages. Python
sets a subpackage as an attribute of its parent the moment it is imported, which would
shadow a plain function of the same name; so each of those subpackages is itself callable
(:func:`_callable_package`), and calling it calls :mod:`consistency.api`'s function. Both
``consistency.compare(...)`` and ``consistency.compare.request`` therefore work, in
either import order.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

__version__ = "0.1.0"
# The distribution's name on PyPI (`pip install specdec-consistency`); the import name and the
# command stay `consistency`. `consistency` on PyPI is an unrelated project (a diffusion
# consistency-model package), so every install line we print or document names DIST.
DIST = "specdec-consistency"
HOME = "https://github.com/consistency-dev/consistency"  # pyproject.toml [project.urls]; the docs' links
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"  # a bare `pip install torch` is the multi-GB CUDA build

_API = ("compare", "lint", "replay", "record")
_MODULES = ("api", "testing")
__all__ = ["__version__", *_API, *_MODULES]


class _CallablePackage(types.ModuleType):
    """A subpackage that is also the API function of the same name (see the module doc)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        api = importlib.import_module("consistency.api")
        return getattr(api, self.__name__.rpartition(".")[2])(*args, **kwargs)


def _callable_package(name: str) -> None:
    """Called at the end of ``consistency/{compare,lint,replay,record}/__init__.py``."""
    sys.modules[name].__class__ = _CallablePackage


def __getattr__(name: str) -> Any:  # PEP 562: import the API only when it is used
    if name in _API or name in _MODULES:
        return importlib.import_module(f"consistency.{name}")
    raise AttributeError(f"module 'consistency' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
