"""The newcomer's recipe of docs/architecture.md ("Adding a finding code or a lint rule"),
followed once for each: a finding code is one row and a lint rule is one row plus its check,
and everything else (constants, severity, fix, source, doc link, docs page, selection, the
checks CI runs) follows from the row."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from consistency.contract import codes, codes_doc
from consistency.contract.codes import ROWS, CodeSpec, Severity, registry, with_property
from consistency.contract.findings import Finding
from tests.conftest import ROOT
from tests.project.test_architecture import _emitted_code_args

DEMO = CodeSpec("DEMO_DRIFT", Severity.warning, "a demonstration code of the recipe", "follow the recipe",
                source="docs/architecture.md: adding a finding code", context_sensitive=True)


def test_a_finding_code_is_one_row(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    table, c = registry((*ROWS, DEMO))  # step 1: the row (in ROWS); its constant follows
    assert c.DEMO_DRIFT == "DEMO_DRIFT" and table["DEMO_DRIFT"] is DEMO
    with pytest.raises(ValueError, match="two rows"):
        registry((*ROWS, DEMO, DEMO))
    monkeypatch.setitem(codes.CODES, DEMO.code, DEMO)  # what importing the module with the row does
    f = Finding.make(c.DEMO_DRIFT, "slot 0 drifts")  # step 2: emit it by its constant
    assert (f.severity, f.fix, f.source, f.doc) == (Severity.warning, DEMO.fix, DEMO.source,
                                                      "docs/findings.md#demo-drift")
    assert DEMO.code in with_property("context_sensitive")  # later stages read its properties from the row
    # step 3: regenerate docs/findings.md; the page has the code's section from the row (+ an optional fragment)
    (tmp_path / "findings").mkdir()
    (tmp_path / "findings" / "_intro.md").write_text("# Findings\n")
    (tmp_path / "findings" / "demo-drift.md").write_text("What the demo means, with an example.\n")
    page = codes_doc.render(tmp_path)
    section = page[page.index("## demo-drift"):]
    assert "`warning` — a demonstration code of the recipe." in section and "What the demo means" in section
    assert f"**Fix in every report:** {DEMO.fix}." in section and DEMO.source in section
    assert "demoted to info when every compared token saw another context" in section
    # and the architecture test refuses the code spelt as a string
    bad = ast.parse('Finding.make("DEMO_DRIFT", "m")')
    assert [a.value for a in _emitted_code_args(bad) if isinstance(a, ast.Constant)] == ["DEMO_DRIFT"]


def test_a_lint_rule_is_one_row_and_its_check(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from consistency.lint import rules_doc
    from consistency.lint.context import Context
    from consistency.lint.engine import LintRequest, run_lint
    from consistency.lint.rules import REGISTRY
    from consistency.lint.rules.base import EAGLE3, W, Hit, rule

    @rule("DMO001", "demo-sglang-only", W, "a demonstration rule of the recipe: it flags SGLang",
          "docs/architecture.md: adding a lint rule", "serve with anything else", applies_to=EAGLE3)
    def demo(ctx: Context) -> list[Hit]:  # step 1: the row (the decorator) and its check
        return [Hit(f"served by {ctx.runtime}")] if ctx.runtime == "sglang" else []

    monkeypatch.setitem(REGISTRY, demo.code, demo)  # what importing the rule's module does
    fails = run_lint(LintRequest(runtime="sglang@0.5.23", select=("DMO",)))
    (f,) = fails.findings
    assert (f.code, f.severity, f.fix, f.source, f.doc) == ("DMO001", Severity.warning, demo.fix, demo.source,
                                                            "docs/rules/DMO001.md")
    passes = run_lint(LintRequest(runtime="vllm@0.33.0", select=("demo-sglang-only",)))
    assert [r.status for r in passes.rules] == ["pass"] and not passes.findings
    # step 2: the page. Until it is generated the CI check names it; then it is the row around the fragment
    assert "DMO001" in rules_doc.stale(ROOT / "docs")
    (tmp_path / "DMO001.md").write_text("## Why\n\nBecause.\n\n## Example\n\n```console\n$ consistency lint "
                                        "--runtime sglang@0.5.23\nwarning  DMO001 ...\n```\n")
    page = rules_doc.render(demo, tmp_path)
    assert page.startswith("# DMO001 demo-sglang-only\n") and "Default severity: **warning**" in page
    assert "Applies to: aux-stream drafts (EAGLE-3)." in page and "## Why\n\nBecause." in page
    assert "## Fix\n\nServe with anything else.\n" in page and "## Source\n\ndocs/architecture.md" in page
