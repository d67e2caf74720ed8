"""pytest helper: ``assert_consistent(reference, candidate)`` for training and serving test suites.

Like ``torch.testing.assert_close``, it is silent when the two sides agree and raises
``AssertionError`` when they do not, with a message that says what differs: the verdict
and summary, the aux-slot table (what each slot should hold, what it holds, how far) and,
for every error, how many elements are off, by how much and where. The verdict is the
compare pipeline's (the one ``consistency compare`` prints), so a test and the CLI never
disagree. Docs: docs/api.md#pytest.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from consistency.contract.findings import CompareReport, Finding

MAX_FINDINGS = 20  # a message past this many errors is truncated (the JSON report has them all)


def assert_consistent(reference: Any, candidate: Any, **options: Any) -> CompareReport:
    """Raise ``AssertionError`` unless CANDIDATE is consistent with REFERENCE.

    Sides and options are those of :func:`consistency.api.compare` (paths, dicts of numpy
    arrays or torch tensors; ``rtol``/``atol`` make any element outside fail, as in
    ``assert_close``). Returns the report when it passes, for further checks.
    """
    __tracebackhide__ = True  # pytest shows the caller's line, not ours
    from consistency.api import compare

    rep = compare(reference, candidate, **options)
    if rep.verdict != "pass":
        raise AssertionError(message(rep))
    return rep


def message(rep: CompareReport) -> str:
    """The failure text: summary, slot table, then each error with its numbers."""
    from consistency.contract.findings import Severity
    from consistency.escape import term

    lines = [f"{term(rep.reference.path)} and {term(rep.candidate.path)} are not consistent: {term(rep.summary)}"]
    if rep.slots:
        rows = [("slot", "tensor", "expected", "holds", "token rel_diff", "code")]
        for s in rep.slots:
            rows.append((str(s.slot), term(s.tensor), _stream(s.expected, s.expected_stream),
                         _stream(s.identified_as, s.identified_stream),
                         "-" if s.token_rel_diff is None else f"{s.token_rel_diff:.3g}", term(s.code)))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines.append("")
        lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    errors = [f for f in rep.findings if f.severity == Severity.error]
    if errors:
        lines.append("")
    for f in errors[:MAX_FINDINGS]:
        lines.append(f"{term(f.code)} {term(f.tensor or '')}: {term(f.message)}".replace("  ", " "))
        detail = _numbers(f)
        if detail:
            lines.append(f"    {detail}")
        if f.fix:
            lines.append(f"    fix: {term(f.fix)}")
    if len(errors) > MAX_FINDINGS:
        lines.append(f"... {len(errors) - MAX_FINDINGS} more errors (see the report's findings)")
    for a in rep.assumptions:
        lines.append(f"note: {term(a)}")
    return "\n".join(lines)


def _stream(name: str | None, stream: int | None) -> str:
    from consistency.escape import term

    if name is None:
        return "-"
    name = term(name)
    return name if stream is None or name.startswith("hidden.") else f"{name} (stream {stream})"


def _numbers(f: Finding) -> str:
    """torch.testing-style: how many elements, how far, where (from the finding's metrics)."""
    m = f.metrics or {}
    parts = []
    if m.get("numel"):
        n, bad = m["numel"], m.get("mismatched", 0)
        parts.append(f"Mismatched elements: {bad} / {n} ({100.0 * bad / n:.1f}%)")
    if m.get("max_abs_diff") is not None:
        at = m.get("max_abs_at")
        where = f" at index {tuple(at)}" if isinstance(at, list) else ""
        vals = ""
        if m.get("ref_value") is not None and m.get("cand_value") is not None:
            vals = f" (reference {m['ref_value']:.4g}, candidate {m['cand_value']:.4g})"
        parts.append(f"greatest absolute difference {m['max_abs_diff']:.3g}{where}{vals}")
    if m.get("token_rel_diff") is not None:
        worst = f", worst token {m['worst_token']} ({m['worst_token_rel_diff']:.3g})" \
            if m.get("worst_token") is not None and m.get("worst_token_rel_diff") is not None else ""
        parts.append(f"token rel_diff {m['token_rel_diff']:.3g}{worst}")
    if m.get("rtol") is not None and m.get("atol") is not None:
        parts.append(f"rtol {m['rtol']:.3g}, atol {m['atol']:.3g}")
    return "; ".join(parts)
