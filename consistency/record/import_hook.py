"""Run a patch on modules as they are imported, and on those already imported.

The runtime patches (layers, MTP heads, graph runners) all need the same hook: the server's
worker processes import their model files themselves, after ``sitecustomize`` ran, so a
meta-path finder wraps the loader of each target module and patches it once it executed.
One finder per ``tag``: calling :func:`install` again (``sitecustomize`` and an explicit
``auto()``) never stacks a second one.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Collection
from typing import Any


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, tag: str, targets: Collection[str], patch_module: Callable[[Any], None]) -> None:
        self.tag, self.targets, self.patch_module = tag, targets, patch_module

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in self.targets:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run: Callable[[Any], None] = spec.loader.exec_module
        patch = self.patch_module

        def exec_module(module: Any) -> None:
            run(module)
            patch(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install(tag: str, targets: Collection[str], patch_module: Callable[[Any], None]) -> None:
    """Patch ``targets`` (module names) already imported now, the others when imported."""
    for name in targets:
        if name in sys.modules:
            patch_module(sys.modules[name])
    if not any(getattr(f, "tag", None) == tag and isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder(tag, targets, patch_module))
