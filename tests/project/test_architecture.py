"""The package layering stays one-way, modules stay small (docs/architecture.md)."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

from tests.conftest import ROOT

PKG = ROOT / "consistency"
# who may import whom (top-level subpackages); bottom layer: escape <- errors <- contract <- dump
ALLOWED: dict[str, set[str]] = {
    "__main__": {"cli"},
    "api": {"compare", "contract", "dump", "errors", "escape", "lint", "pipeline", "record", "replay"},
    "testing": {"api", "contract", "escape", "report"},
    "cli": {"compare", "contract", "dump", "errors", "escape", "gate", "lint", "pipeline", "record", "replay",
            "report", "interop"},
    "gate": {"compare", "contract", "dump", "errors", "escape", "lint", "replay", "report"},
    # the compare front door: above compare (numbers) and diagnose (words), the one way to diagnose
    "pipeline": {"compare", "contract", "diagnose", "dump", "errors", "escape"},
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


def test_only_the_front_door_reaches_diagnose():
    """diagnose/ words what compare/ measured and is run by one caller, the compare front door
    (consistency/pipeline); it never calls back up into it (issue 38: the front door once lived
    in diagnose/pipeline.py, so diagnose sat both below and above compare)."""
    edges = _edges()
    assert {src for src, dsts in edges.items() if "diagnose" in dsts} == {"pipeline"}
    assert "pipeline" not in edges["diagnose"] and not (PKG / "diagnose" / "pipeline.py").exists()
    assert {src for src, dsts in edges.items() if "pipeline" in dsts} <= {"api", "cli"}  # imports inside functions too


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


def _module_of(f: Path) -> str:
    rel = f.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _file_edges() -> dict[str, set[str]]:
    """module -> modules it imports (any import, type-only ones included: a circle is a
    circle whether or not it bites at run time)."""
    mods = {_module_of(f): f for f in PKG.rglob("*.py")}
    edges: dict[str, set[str]] = defaultdict(set)
    for mod, f in mods.items():
        pkg = mod if f.name == "__init__.py" else mod.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                # ``from pkg import mod`` imports the module; ``from pkg import name`` runs pkg/__init__
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for t in targets:
                if t in mods and t != mod:  # a module importing its own package is an edge too
                    edges[mod].add(t)
    return edges


def _circle(edges: dict[str, set[str]]) -> list[str] | None:
    """The first import circle of the graph (depth-first, iterative), or None."""
    state: dict[str, int] = {}
    for start in sorted(edges):
        if start in state:
            continue
        stack: list[tuple[str, list[str]]] = [(start, sorted(edges.get(start, ())))]
        state[start] = 1
        while stack:
            n, todo = stack[-1]
            if not todo:
                state[n] = 2
                stack.pop()
                continue
            m = todo.pop(0)
            if state.get(m) == 1:
                path = [x for x, _ in stack]
                return path[path.index(m):] + [m]
            if m not in state:
                state[m] = 1
                stack.append((m, sorted(edges.get(m, ()))))
    return None


def test_no_import_circle_between_files():
    """No circle, through a package's __init__ included (a module importing the package that
    imports it is one); the checker finds the circles it is built to find."""
    assert _circle({"a": {"a.b"}, "a.b": {"c"}, "c": {"a"}}) == ["a", "a.b", "c", "a"]
    assert _circle({"a": {"a.b"}, "a.b": {"c"}, "c": set()}) is None
    edges = _file_edges()
    assert sum(len(v) for v in edges.values()) > 300 and "consistency.lint.engine" in edges  # it read the package
    assert _circle(edges) is None, "import circle: " + " -> ".join(_circle(edges) or [])


def test_compare_and_dump_never_word_findings():
    """Words only in diagnose: compare/ and dump/ return data, never contract.findings."""
    for f in list((PKG / "compare").rglob("*.py")) + list((PKG / "dump").rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(m == "consistency.contract.findings" for m in mods), \
                f"{f.relative_to(ROOT)} imports consistency.contract.findings: words belong in diagnose/"


def test_findings_page_is_generated_from_the_registry():
    """docs/findings.md is built from contract/codes.py and docs/findings/*.md; a hand edit of the
    page (or a fragment edited without regenerating) drifted once unnoticed, so CI holds it here."""
    from pathlib import Path

    from consistency.contract import codes_doc

    docs = Path(__file__).resolve().parents[2] / "docs"
    assert codes_doc.stray(docs) == []
    assert (docs / "findings.md").read_text() == codes_doc.render(docs), \
        "docs/findings.md is stale: run python -m consistency.contract.codes_doc"


# Modules another engineer is changing this round; their code literals move to C.* when they land
# (issue 38 item 3). The list only shrinks: a new module never joins it.
CODE_LITERALS_PENDING: set[str] = set()


def _emitted_code_args(tree: ast.AST) -> list[ast.expr]:
    """The expressions a finding's code comes from: ``X.make(code, ...)`` and ``code=...``."""
    out: list[ast.expr] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        if isinstance(node.func, ast.Attribute) and node.func.attr == "make" and node.args:
            out.append(node.args[0])
        out += [k.value for k in node.keywords if k.arg == "code"]
    return out


def _leaves(e: ast.expr) -> list[ast.expr]:
    if isinstance(e, ast.IfExp):
        return _leaves(e.body) + _leaves(e.orelse)
    if isinstance(e, ast.BoolOp):
        return [x for v in e.values for x in _leaves(v)]
    return [e]


def test_every_emitted_code_is_a_registry_constant():
    """A code is one row of contract/codes.py and is written ``C.NAME``: a string literal in
    ``Finding.make("...")`` or ``code="..."`` is a typo waiting for the line to run (issue 38), and
    ``C.NAME`` must name a row. In compare/ and diagnose/ no code is spelt as a string at all
    (tables of codes included)."""
    from consistency.contract.codes import CODES

    bad: list[str] = []
    for f in sorted(PKG.rglob("*.py")):
        rel = f.relative_to(ROOT).as_posix()
        if rel == "consistency/contract/codes.py" or any(rel.startswith(p) for p in CODE_LITERALS_PENDING):
            continue
        tree = ast.parse(f.read_text(), rel)
        codes_c = any(isinstance(n, ast.ImportFrom) and n.module in ("consistency.contract.codes",
                      "consistency.contract.findings") and any(a.name == "C" and not a.asname for a in n.names)
                      for n in ast.walk(tree))
        for e in _emitted_code_args(tree):
            bad += [f"{rel}:{x.lineno}: code {x.value!r} as a string literal (write C.{x.value})"
                    for x in _leaves(e) if isinstance(x, ast.Constant) and isinstance(x.value, str)]
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "C" \
                    and codes_c and node.attr not in CODES:
                bad.append(f"{rel}:{node.lineno}: C.{node.attr} is not a row of contract/codes.py")
            if rel.startswith(("consistency/compare/", "consistency/diagnose/")) and isinstance(node, ast.Constant) \
                    and isinstance(node.value, str) and node.value in CODES:
                bad.append(f"{rel}:{node.lineno}: code {node.value!r} as a string literal (write C.{node.value})")
    assert bad == [], "\n".join(bad)


def test_code_constants_are_the_rows():
    """C is generated from the rows: one constant per row, equal to its code, and a misspelt
    constant fails where it is read (never a KeyError later, in the middle of a report)."""
    import pytest

    from consistency.contract.codes import CODES, ROWS, C

    assert [c.code for c in ROWS] == list(CODES) and len(set(CODES)) == len(ROWS)
    assert all(getattr(C, code) == code for code in CODES)
    with pytest.raises(AttributeError, match="not a finding code"):
        C.LAYER_MISMATHC  # noqa: B018
    with pytest.raises(AttributeError):
        C.OK = "NOT_OK"


def test_every_rule_page_is_generated_from_its_row():
    """docs/rules/<CODE>.md is the rule's row (lint/rules/) around its hand-written text
    (lint/pages/<CODE>.md): 11 of 41 pages once disagreed with the registry (SRV007's fix in
    substance). A page of no rule, or a fragment of no rule, is stale too."""
    from consistency.lint import rules_doc
    from consistency.lint.rules import REGISTRY

    docs = ROOT / "docs"
    assert rules_doc.stale(docs) == [], "docs/rules is stale: run python -m consistency.lint.rules_doc"
    for code, rule in REGISTRY.items():
        page = (docs / "rules" / f"{code}.md").read_text(encoding="utf-8")
        assert page.startswith(f"# {code} {rule.name}\n") and f"**{rule.severity.value}**" in page
        assert " ".join(rule.fix.split())[1:] in " ".join(page.split()), code  # the row's fix, word for word
        assert (rules_doc.FRAGMENTS / f"{code}.md").is_file(), f"{code} has no hand-written why/example"


def test_every_report_link_points_at_a_page_that_exists():
    """A finding's or a rule's ``doc`` becomes a link in SARIF (helpUri), the gate's step summary
    and annotations: absolute (the user's repository has no docs/), and what it names exists here
    (the page, and for a finding code its anchor)."""
    import re

    from consistency.contract.codes import CODES
    from consistency.lint.rules import REGISTRY
    from consistency.report.ci_formats import markdown_summary
    from consistency.report.links import PUBLISHED_DOCS, published

    docs = [c.doc for c in CODES.values()] + [r.doc for r in REGISTRY.values()]
    findings_page = (ROOT / "docs" / "findings.md").read_text(encoding="utf-8")
    for doc in docs:
        url = published(doc)
        assert url is not None and url.startswith(PUBLISHED_DOCS), doc
        path, _, anchor = url[len(PUBLISHED_DOCS):].partition("#")
        assert (ROOT / "docs" / path).is_file(), doc
        assert not anchor or re.search(rf"^## {re.escape(anchor)}$", findings_page, re.M), doc
    rule = REGISTRY["SRV007"]
    md = markdown_summary({"verdict": "fail", "checks": [{"kind": "lint", "name": "draft", "verdict": "fail", "cases": [
        {"status": "failed", "name": rule.code, "message": "m", "doc": rule.doc}]}]})
    assert f"({published(rule.doc)})" in md and f"({rule.doc})" not in md


# -- words only in diagnose/ (issue 38 item 2) -------------------------------------------------

# Places in compare/ and dump/ that may still build a sentence, each with why. An entry is a
# path (a folder ends with "/") or "path::function"; the list only shrinks.
SENTENCES_ALLOWED: dict[str, str] = {
    "consistency/dump/formats/": "a foreign format reader's notes are the converted dump's own metadata "
                                 "(metadata.extra['notes'], written into the file by `convert` and read back from "
                                 "it): text stored with the data, quoted as the file's words (Note 'file_note')",
    "consistency/dump/sniff.py::looks_like": "what a file that is not a dump looks like, for the one-line InputError "
                                             "(exit code 2) reader.py raises with it",
    "consistency/dump/sniff.py::read_names": "the formats consistency reads, for the same InputError line",
    "consistency/dump/ptzip.py::_not_zip": "why a .pt file is refused, raised as an InputError by its one caller",
    "consistency/dump/writer.py::name_problem": "why a tensor name cannot be written: the caller raises it "
                                                "(UsageError / InputError at the recorder's door)",
    "consistency/dump/writer.py::dump_name_problem": "why a dump path cannot be written, raised by its callers",
    "consistency/dump/stages.py::StagedDump._from_nodes": "the tail of the InputError lines a rank merge raises",
    "consistency/dump/layout.py::Layout": "a metadata field's description in the JSON Schema (the file format's "
                                          "documentation, not a verdict)",
}
# Calls whose string arguments end up only in an error line (never in a report's notes).
ERROR_SINKS = {"charge": "dump/budget.py's memory budget names what it charges in its InputError line"}


_FLAG = __import__("re").compile(r"(?:^|[\s(])--[a-z][a-z-]+")  # a CLI flag: the API caller has none


def _plain_words(text: str) -> int:
    """Words of English in a string: letters only (``input_ids``, ``aux.{i}``, ``{x}`` are not)."""
    import re

    return sum(bool(re.fullmatch(r"[A-Za-z][a-z']+", w.strip("()[],;:.!?\"'`"))) for w in text.split())


def _sentences(tree: ast.AST) -> list[tuple[int, str, str]]:
    """(line, enclosing function, text) of each sentence (three or more words, or a CLI
    flag) a module builds outside a docstring, an error (``raise``, ``assert``, ``SomeError(...)``,
    a name the function raises, an :data:`ERROR_SINKS` call) and a comparison."""
    parents: dict[int, ast.AST] = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            parents[id(child)] = node
    skip: set[int] = set()

    def mark(n: ast.AST) -> None:
        skip.update(id(m) for m in ast.walk(n))

    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            mark(node)  # a docstring
        elif isinstance(node, (ast.Raise, ast.Assert, ast.Compare)):
            mark(node)
        elif isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name.endswith(("Error", "Exception", "Warning")) or name == "warn" or name in ERROR_SINKS:
                mark(node)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            raised = {n.id for r in ast.walk(node) if isinstance(r, ast.Raise) for n in ast.walk(r)
                      if isinstance(n, ast.Name)}
            for a in ast.walk(node):  # ``what = "..."; raise InputError(p, f"... {what}")``
                if isinstance(a, ast.Assign) and any(isinstance(t, ast.Name) and t.id in raised for t in a.targets):
                    mark(a.value)
        elif isinstance(node, ast.JoinedStr):
            skip.update(id(v) for v in node.values)  # an f-string's parts: the whole is judged

    def where(n: ast.AST) -> str:
        path: list[str] = []
        while id(n) in parents:
            n = parents[id(n)]
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                path.append(n.name)
        return ".".join(reversed(path))

    out = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
        elif isinstance(node, ast.JoinedStr):
            text = "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
        else:
            continue
        if _plain_words(text) >= 3 or _FLAG.search(text):
            out.append((node.lineno, where(node), text))
    return out


def _sentences_in(files: list[Path]) -> tuple[list[str], set[str]]:
    """(sentences not allowed, allow-list entries that allowed one)."""
    bad, used = [], set()
    for f in files:
        rel = f.relative_to(ROOT).as_posix()
        folder = next((k for k in SENTENCES_ALLOWED if k.endswith("/") and rel.startswith(k)), None)
        for line, fn, text in _sentences(ast.parse(f.read_text(), rel)):
            key = folder or f"{rel}::{fn}"
            if key in SENTENCES_ALLOWED:
                used.add(key)
            else:
                bad.append(f"{rel}:{line} ({fn or 'module'}): {text[:90]!r}")
    return bad, used


def test_no_sentence_is_built_in_compare_or_dump():
    """Words only in diagnose/: a compare or dump stage says what it found as data (a
    ``Note`` with a key and the facts, a ``Gap``, a key such as ``Verdict.skipped``), and
    diagnose/words.py words it, so one fact reads the same in every report and the API is
    never told about a CLI flag by the layer below. Error lines for bad input (an InputError,
    a UsageError, exit code 2) are not a verdict's words and stay where they are raised."""
    src = ("x = 1\nnotes = []\ndef f(p):\n    what = 'is not a dump at all'\n"
           "    if p:\n        raise ValueError(f'{p} {what}')\n    notes.append(f'kept only the {p} tokens')\n"
           "    return 'a b c' == p\n")
    assert [(ln, fn) for ln, fn, _t in _sentences(ast.parse(src))] == [(7, "f")]  # the note, not the error
    assert [ln for ln, _f, _t in _sentences(ast.parse("why = f'--threshold {x:g}'"))] == [1]
    files = sorted((PKG / "compare").rglob("*.py")) + sorted((PKG / "dump").rglob("*.py"))
    bad, used = _sentences_in(files)
    assert set(SENTENCES_ALLOWED) == used, f"stale allow-list entries: {sorted(set(SENTENCES_ALLOWED) - used)}"
    assert bad == [], "sentences built in compare/ or dump/ (return a Note and word it in diagnose/words.py):\n" \
        + "\n".join(bad)


# -- identity carried, resolved once (issue 38 item 4) -----------------------------------------

NAME_PARSERS = {"parse", "stream_of", "canonical", "spelling", "sort_key", "name_by_values", "stream_by_values"}
RESULT_NAMES = {"name", "expected", "holds", "held"}  # r.name, r.expected, r.ref.name, r.cand.name, r.holds, r.held
RESULT_VARS = {"r", "res", "result"}  # what diagnose/ calls a compare.result.Result


def _result_name(e: ast.expr) -> bool:
    """``r.name``, ``r.expected``, ``r.ref.name``, ``r.cand.name``, ``r.holds`` (``r`` one of
    :data:`RESULT_VARS`): one result's own names, which the plan resolved into ``r.identity``. Names of other
    tensors (``r.ident.best.name``: what identification ranked; a finding's tensor) are not."""
    if not isinstance(e, ast.Attribute) or e.attr not in RESULT_NAMES:
        return False
    v = e.value
    if isinstance(v, ast.Name):
        return v.id in RESULT_VARS
    return isinstance(v, ast.Attribute) and v.attr in ("ref", "cand") and isinstance(v.value, ast.Name) \
        and v.value.id in RESULT_VARS and e.attr == "name"


def _reparsed(tree: ast.AST) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
        arg = node.args[0]
        arg = arg.values[0] if isinstance(arg, ast.BoolOp) else arg  # ``names.parse(r.ref.name or "")``
        if name in NAME_PARSERS and _result_name(arg):
            out.append((node.lineno, ast.unparse(node)))
    return out


def test_diagnose_reads_identity_never_reparses_result_names():
    """The plan parses each entry's names once (``compare.plan.identity``: the candidate's
    kind and index, the expected tensor's, and what it is by the reference's values) and
    every result carries it as ``r.identity``; diagnose/ reads it. Parsing ``r.name`` or
    ``r.ref.name`` again (``names.parse``, ``stream_of``, ``name_by_values``, ...) is how
    diagnose once called ``canonical`` 15 times and parsed names 30 times."""
    src = "def f(r, cmp):\n    a = names.parse(r.name).kind\n    b = cmp.name_by_values(r.ref.name or '')\n" \
          "    c = names.parse(r.ident.best.name)\n    d = r.identity.kind\n    e = names.parse(x.name)\n"
    assert sorted(ln for ln, _c in _reparsed(ast.parse(src))) == [2, 3]
    bad = [f"{f.relative_to(ROOT)}:{ln}: {call}" for f in sorted((PKG / "diagnose").rglob("*.py"))
           for ln, call in _reparsed(ast.parse(f.read_text(), str(f)))]
    assert bad == [], "diagnose/ re-derives a result's identity (read r.identity):\n" + "\n".join(bad)


def test_one_meaning_per_word():
    """``canonical`` and ``stream_of`` are dump/names.py's, by the name (``hidden.01`` is
    ``hidden.1``; ``hidden.3`` is stream 3). What a reference tensor is by its values is
    ``name_by_values`` / ``stream_by_values`` (compare/refslots.py); no other module defines
    a function of either word."""
    defs: dict[str, list[str]] = defaultdict(list)
    for f in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in ("canonical", "stream_of"):
                defs[node.name].append(f.relative_to(ROOT).as_posix())
    assert dict(defs) == {"canonical": ["consistency/dump/names.py"], "stream_of": ["consistency/dump/names.py"]}


def test_tests_live_in_a_folder_per_package():
    """docs/architecture.md, "Where the tests are": no test file at the top of tests/, and every
    folder holding tests is named after a package of consistency/ (or project/ for the repo)."""
    tests = ROOT / "tests"
    assert not sorted(p.name for p in tests.glob("test_*.py")), "a test file at the top level: put it in its package"
    packages = {p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    folders = {p.parent.name for p in tests.glob("*/test_*.py")}
    assert folders <= packages | {"project", "api", "cli"}, sorted(folders - packages)
    assert {"compare", "diagnose", "dump", "record", "replay", "lint", "gate", "project"} <= folders
    assert not [p.name for p in tests.rglob("test_*.py") if re.search(r"review\d|round\d|issue\d", p.name)]
