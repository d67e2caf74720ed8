"""Assemble the machine-readable compare report from a comparison and its findings."""

from __future__ import annotations

from typing import Any

from consistency import __version__
from consistency.contract.codes import C
from consistency.diagnose import metadiff
from consistency.compare.engine import Comparison
from consistency.compare.types import Note
from consistency.contract.findings import (CompareReport, DumpSummary, Finding, Severity, SimilarityMatrix, SlotReport,
                                           verdict_of)
from consistency.diagnose import story as story_mod
from consistency.diagnose import summary as summary_mod
from consistency.diagnose import words
from consistency.dump import names
from consistency.dump.reader import Dump

MAX_PER_TOKEN = 2048


def _summary(d: Dump, claimed: list[int] | None, runtime: str | None) -> DumpSummary:
    return DumpSummary(path=str(d.path), format=d.format, tensors=len(d.tensors), runtime=runtime, claimed_streams=claimed)


def build(cmp: Comparison, findings: list[Finding], st: story_mod.Story | None = None, alignment: Any = None,
          notes: list[str | Note] | None = None) -> CompareReport:
    """The report; its headline is written here, once, from the final findings.

    ``alignment``: the token alignment (compare.tokens.TokenAlignment) when one was made;
    ``notes``: what the caller assumed before compare ran (ids applied, ...), as sentences
    or as notes (data) worded here."""
    slots = []
    by_tensor = {}
    for f in findings:
        if f.tensor and (f.tensor not in by_tensor or f.severity == Severity.error):
            by_tensor[f.tensor] = f.code
    for r in sorted((r for r in cmp.results if r.slot is not None), key=lambda r: r.slot or 0):
        slots.append(SlotReport(
            slot=r.slot or 0, tensor=r.name, expected=r.identity.canonical, expected_stream=r.expected_stream,
            identified_as=r.holds, identified_stream=r.holds_stream,
            token_rel_diff=float(f"{r.metrics.token_rel_diff:.4g}") if r.metrics else None,
            confidence=None if not r.ident or r.ident.confidence is None else float(f"{min(r.ident.confidence, 1e12):.4g}"),
            runner_up=r.ident.runner_up.name if r.ident and r.ident.runner_up else None,
            code=by_tensor.get(r.name, C.OK)))
    findings = concrete_fixes(cmp, findings, slots)
    pairs = {r.name: r.expected for r in cmp.results if r.expected}
    mdiff = metadiff.diff(cmp.ref.metadata, cmp.cand.metadata, pairs)
    if any(d.change.startswith("layout only") for d in mdiff):
        n = sum(d.change.startswith("layout only") for d in mdiff)
        findings = findings + [Finding.make(C.LAYOUT_ONLY, f"{n} metadata difference{'s' if n != 1 else ''} in memory "
                                            f"layout only (stride, contiguity, device, clone vs add): these do not "
                                            f"change values")]
    for d in mdiff:
        if d.severity == Severity.warning:
            findings = findings + [Finding.make(C.METADATA_DIFF, f"metadata {d.path}: reference {d.reference!r}, "
                                                f"candidate {d.candidate!r}")]
    token_errors = [f for f in findings if f.code in (C.NO_COMMON_TOKENS, C.CONTEXT_DIFFERS, C.TOKENS_EXTRA,
                                                       C.TOKENS_MISSING, C.TOKENS_REPLACED)
                    and f.severity == Severity.error]
    demoted = alignment is not None and alignment.context_differs and not alignment.only_same_context
    summary = summary_mod.summarize(cmp, findings, st, token_errors[0] if token_errors else None, demoted)
    if alignment is not None and verdict_of(findings) == "pass":
        summary += _tokens_compared(alignment)
    counts: dict[str, int] = {}
    for f in findings:  # every finding, the metadata ones included
        counts[f.code] = counts.get(f.code, 0) + 1
    per_token = {r.name: _downsample(r.metrics.per_row.tolist()) for r in cmp.results
                 if r.metrics is not None and r.metrics.per_row is not None and r.status != "ok"}
    token_notes = [words.note(n) for n in (alignment.notes if alignment is not None else ())]
    assumptions = [x if isinstance(x, str) else words.note(x) for x in notes or []] + token_notes
    assumptions += [words.note(n) for n in cmp.plan.notes + cmp.notes]
    rep = CompareReport(
        version=__version__, verdict=verdict_of(findings), summary=summary,
        reference=_summary(cmp.ref, cmp.plan.ref.claimed_streams, cmp.plan.ref.runtime),
        candidate=_summary(cmp.cand, cmp.plan.cand.claimed_streams, cmp.plan.cand.runtime),
        slots=slots, findings=findings, metadata_diff=mdiff, counts=counts,
        assumptions=assumptions, seconds=round(cmp.seconds, 4),
        similarity=similarity(cmp), per_token=per_token,
        not_compared=len(cmp.plan.not_compared),
        alignment={**alignment.summary(), "notes": token_notes} if alignment is not None else None)
    return rep


def _downsample(xs: list[float]) -> list[float]:
    if len(xs) <= MAX_PER_TOKEN:
        return [float(f"{x:.4g}") for x in xs]
    step = len(xs) / MAX_PER_TOKEN
    return [float(f"{max(xs[int(i * step):int((i + 1) * step)] or [0.0]):.4g}") for i in range(MAX_PER_TOKEN)]


def similarity(cmp: Comparison) -> SimilarityMatrix | None:
    """Token rel_diff of every candidate slot against every reference stream (the heatmap)."""
    slots = sorted((r for r in cmp.results if r.slot is not None), key=lambda r: r.slot or 0)
    if not slots:
        return None
    key = (slots[0].cand.rows, slots[0].cand.cols)
    rfp, cfp = cmp.ref_fp.get(key), cmp.cand_fp.get(key)
    if rfp is None or cfp is None:
        return None
    cols = sorted((n for n in rfp.names if names.parse(n).kind == names.HIDDEN), key=names.sort_key)
    if not cols:
        cols = sorted(rfp.names, key=names.sort_key)
    rows = [r.name for r in slots if r.cand.name in cfp and (r.cand.rows, r.cand.cols) == key]
    values = [[float(f"{cfp.distance(rn, c, rfp):.4g}") for c in cols] for rn in rows]
    by = {r.name: r for r in slots}
    exp = [_as_col(cmp, by[rn].expected, by[rn].expected_stream, cols) for rn in rows]
    ident = [_as_col(cmp, by[rn].identified, cmp.stream_by_values(by[rn].identified), cols) for rn in rows]  # the raw ranking
    return SimilarityMatrix(rows=rows, cols=cols, values=values, expected=exp, identified=ident,
                            metric="token_rel_diff")


def _as_col(cmp: Comparison, name: str | None, stream: int | None, cols: list[str]) -> str | None:
    if name in cols:
        return name
    if stream is not None and names.hidden(stream) in cols:
        return names.hidden(stream)
    return None


_ID_CODES = (C.LAYER_MISMATCH, C.LAYER_OFFSET, C.SLOT_SHIFT)


def concrete_fixes(cmp: Comparison, findings: list[Finding], slots: list[SlotReport]) -> list[Finding]:
    """A slot holding another stream, with the candidate's runtime known: the fix names the
    ids to write, in that release's convention (contract/fixes.py, the same edit lint --fix writes)."""
    if not any(f.code in _ID_CODES for f in findings):
        return findings
    from consistency.contract.fixes import served_fix

    want = [s.expected_stream for s in slots]
    if not want or any(w is None for w in want):
        return findings
    arch = next((m.model.architecture for m in (cmp.cand.metadata, cmp.ref.metadata)
                 if m is not None and getattr(m, "model", None) is not None and m.model.architecture), None)
    fx = served_fix(cmp.plan.cand.runtime, cmp.plan.num_layers, arch, [int(w) for w in want if w is not None])
    if fx is None:
        return findings
    said = fx.summary + (f" (decided by {fx.decided_by})" if fx.decided_by else "")
    return [f.model_copy(update={"autofix": fx, "fix": said if fx.status == "determined" else
                                 f"{f.fix}; {cmp.plan.cand.runtime}: {said}"})
            if f.code in _ID_CODES else f for f in findings]


def _tokens_compared(alignment: Any) -> str:
    """A pass says on how many of the reference's tokens it was verified when not all of them
    were compared (a continuation that went on differently, a prefix-cache suffix, tokens one
    side lacks): what was not checked is said, never implied by 'pass'."""
    total, done = alignment.ref_tokens, alignment.compared
    if not isinstance(total, int) or not isinstance(done, int) or total <= 0 or done >= total:
        return ""
    return f"; verified on {done} of {total} reference tokens (the other {total - done} are not on both sides)"
