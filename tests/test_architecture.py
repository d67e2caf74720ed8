"""The package layering stays one-way, modules stay small (docs/architecture.md)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

from tests.conftest import ROOT

PKG = ROOT / "consistency"
# who may import whom (top-level subpackages); bottom layer: escape <- errors <- contract <- dump
ALLOWED: dict[str, set[str]] = {
    "__main__": {"cli"},
    "api": {"contract", "diagnose", "dump", "errors", "escape", "lint", "record", "replay"},
    "testing": {"api", "contract", "escape", "report"},
    "cli": {"compare", "contract", "diagnose", "dump", "errors", "escape", "gate", "lint", "record", "replay",
            "report", "interop"},
    "gate": {"compare", "contract", "diagnose", "dump", "errors", "escape", "lint", "replay", "report"},
    "diagnose": {"compare", "contract", "dump", "errors", "escape"},
    "replay": {"compare", "contract", "dump", "errors", "escape", "record"},
    "interop": {"contract", "dump", "errors", "escape", "record"},
    "compare": {"contract", "dump", "errors", "escape"},
    "lint": {"contract", "dump", "errors", "escape"},
    "record": {"contract", "dump", "errors", "escape"},
    "report": {"contract", "dump", "errors", "escape"},
    "dump": {"contract", "errors", "escape"},
    "contract": {"errors", "escape"},
    "errors": {"escape"},
    "escape": set(),  # the bottom: renders untrusted strings inert for every layer, imports nothing
    "__init__": set(),
}
MAX_LINES = 400


def _edges() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = defaultdict(set)
    for f in PKG.rglob("*.py"):
        parts = f.relative_to(PKG).parts
        src = parts[0] if len(parts) > 1 else parts[0][:-3]
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
            for m in mods:
                if m.startswith("consistency."):
                    dst = m.split(".")[1]
                    if dst != src:
                        edges[src].add(dst)
    return edges


def test_imports_follow_the_layering():
    for src, dsts in _edges().items():
        assert src in ALLOWED, f"new top-level module {src}: add it to the layering (docs/architecture.md)"
        bad = dsts - ALLOWED[src]
        assert not bad, f"consistency.{src} imports {sorted(bad)}, against the one-way flow"


def test_no_cycles_between_packages():
    edges = _edges()
    seen: dict[str, int] = {}

    def visit(n: str, path: list[str]) -> None:
        seen[n] = 1
        for m in edges.get(n, ()):
            assert seen.get(m) != 1, f"import cycle: {' -> '.join(path + [m])}"
            if m not in seen:
                visit(m, path + [m])
        seen[n] = 2

    for n in list(edges):
        if n not in seen:
            visit(n, [n])


def test_no_module_past_400_lines():
    long = {str(f.relative_to(ROOT)): n for f in PKG.rglob("*.py") if (n := len(f.read_text().splitlines())) > MAX_LINES}
    assert not long, long
