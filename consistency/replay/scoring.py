"""Scoring a replay and writing its report: shared by the EAGLE-3 chain (replay.engine)
and the per-step drafts (replay.multistep), so neither imports the other."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from consistency.contract.codes import C
from consistency import __version__
from consistency.contract.findings import Finding, verdict_of
from consistency.replay.load import LoadedDraft
from consistency.replay.report import DraftSummary, Drop, Figures, ReplayReport, SideReplay, StepStats
from consistency.replay.checks import same_input
from consistency.replay.sides import Side
from consistency.replay.walk import accepted_per_anchor, verifiable_anchors, walk

WEAK_TOP1 = 0.2  # below this on the reference, a drop means little
MIN_DRAFTED = 8  # scored drafted anchors below which (and below 100 / max_drop) they cannot pass a drop alone
GREEDY_EXACT = 0.9


@dataclass
class Scored:
    """A side's figures. The top-level ones are the prediction: the anchors a chain server
    verifies at (replay.walk). ``anchor_mean`` averages every drafted anchor instead (what
    replay reported before the walk: too high, more so as K grows); ``overall`` every position,
    the prompt included, when ``drafted`` narrowed the anchors."""

    hits: torch.Tensor  # [K, anchors] bool (False where not verifiable)
    top1: float
    rate: float
    length: float
    per_step: list[StepStats]
    anchors: int
    overall: Scored | None = None  # every position (prompt included), when ``drafted`` narrowed it
    scored: int = 0  # anchors whose top-1 was scored (the resolution of ``top1``: one token is 100/scored points)
    anchor_mean: Scored | None = None  # the mean over every drafted anchor, not only the walked ones
    walked_all: bool = False  # no drafted anchor had a verifiable chain: the walk went over every position


def score(proposals: torch.Tensor, labels: torch.Tensor, drafted: torch.Tensor | None = None,
          bounds: list[tuple[int, int]] | None = None) -> Scored:
    """``proposals`` [K, T-1] target ids per anchor; ``labels`` [T] (-1 = unknown).

    ``drafted`` [T] (True where the token is one the server generated, e.g. a loss mask):
    anchor i feeds token i+1 and proposes i+2, so it is drafted where ``drafted[i+1]`` -- what
    a server drafts on (speculators' ``shift_batch`` aligns (x1, g0, l1) the same way). The
    prediction walks each request (``bounds``, one when None) from its first drafted anchor as
    a server does (replay.walk); the mean over every drafted anchor and over every position
    ride along."""
    k_steps, n = proposals.shape
    hits = torch.zeros(k_steps, n, dtype=torch.bool)
    for k in range(k_steps):
        m = n - k  # anchors i with i + k + 1 <= t - 1
        if m > 0:
            y = labels[k + 1: k + 1 + m]
            hits[k, :m] = (proposals[k, :m] == y) & (y >= 0)
    verifiable = verifiable_anchors(labels, k_steps, n, bounds)
    accepted = accepted_per_anchor(hits, verifiable)
    sel = drafted.reshape(-1)[1:n + 1].bool() if drafted is not None else torch.ones(n, dtype=torch.bool)
    mean = _figures(hits, labels, accepted, sel)
    visited = walk(accepted, sel & verifiable, bounds)
    fallback = drafted is not None and not bool(visited.any())
    if fallback:  # no drafted anchor has a verifiable chain (a few decode rows): walk every position, said
        visited = walk(accepted, verifiable, bounds)
    out = _figures(hits, labels, accepted, visited, walked=True)
    out.walked_all = fallback
    out.anchor_mean = mean
    if drafted is not None:
        out.overall = _figures(hits, labels, accepted, torch.ones(n, dtype=torch.bool))
    return out


def _figures(hits: torch.Tensor, labels: torch.Tensor, accepted: torch.Tensor, sel: torch.Tensor,
             walked: bool = False) -> Scored:
    """Figures over the anchors ``sel``: top-1 over those with a label, chain figures over
    those whose whole chain is verifiable (``accepted >= 0``)."""
    k_steps = hits.shape[0]
    y1 = labels[1:hits.shape[1] + 1]
    valid1 = (y1 >= 0) & sel if not walked else sel & (accepted >= 0)
    top1 = float(hits[0][valid1].float().mean()) if valid1.any() else 0.0
    keep = sel & (accepted >= 0)
    acc = accepted[keep].float()
    n_full = int(keep.sum())
    per_step, reached = [], n_full
    for k in range(k_steps):
        got = int((acc > k).sum())
        per_step.append(StepStats(step=k + 1, reached=reached, accepted=got,
                                  conditional=got / reached if reached else None,
                                  cumulative=got / n_full if n_full else None))
        reached = got
    rate = float(acc.mean()) / k_steps if n_full else 0.0
    length = 1.0 + float(acc.mean()) if n_full else 1.0
    return Scored(hits, top1, rate, length, per_step, n_full, scored=int(valid1.sum()))


def inconclusive(ref: Side, cand: Side, rs: Scored, cs: Scored, vocab: int) -> Finding | None:
    """REPLAY_INCONCLUSIVE when the scores cannot tell a good candidate from a bad one: no
    position was scored on a side, or the draft's step-1 hits on the reference are within
    what guessing uniformly over its ``vocab`` would give (n/V plus three standard deviations
    of that count): a drop from chance is no evidence."""
    for side, sc in ((ref, rs), (cand, cs)):
        if sc.scored == 0:
            return Finding.make(C.REPLAY_INCONCLUSIVE, f"{side.path.name}: no drafted position has a verifiable chain "
                                f"({len(side.ids)} tokens), so nothing was scored", tensor=str(side.path))
    wide = rs.anchor_mean or rs
    hits, expected = round(wide.top1 * wide.scored), wide.scored / max(1, vocab)
    if hits <= expected + 3 * math.sqrt(expected):
        return Finding.make(C.REPLAY_INCONCLUSIVE, f"the draft scores at chance on the reference: {hits} step-1 hits "
                            f"in {wide.scored} positions, where guessing over its {vocab}-token vocabulary gets "
                            f"{expected:.1f}; a drop from there says nothing", tensor=str(ref.path))
    return None


def summarize_draft(d: LoadedDraft) -> DraftSummary:
    c, m = d.config, d.model
    return DraftSummary(path=str(d.path), layout=c.layout, hidden_size=c.hidden_size, target_hidden_size=m.target_hidden,
                        num_aux=m.num_aux, num_layers=len(m.layers), draft_vocab_size=m.draft_vocab,
                        target_vocab_size=m.target_vocab, norm_before_residual=c.norm_before_residual,
                        norm_before_fc=c.norm_before_fc, fc_norm=c.fc_norm, norm_output=c.norm_output,
                        aux_layer_ids=c.aux_layer_ids, aux_ids_meaning=c.aux_ids_meaning, sources=d.sources)


def _figs(o: Scored | None) -> Figures | None:
    return Figures(top1=o.top1, acceptance_rate=o.rate, accept_length=o.length, anchors=o.anchors) if o else None


def side_report(side: Side, s: Scored, scored_on: str = "all") -> SideReplay:
    return SideReplay(path=str(side.path), tokens=len(side.ids), anchors=s.anchors, slots=side.slots,
                      scored_on=scored_on, all_positions=_figs(s.overall), every_anchor=_figs(s.anchor_mean),
                      claimed_streams=side.claimed, aux_dtype=side.aux_dtype, label_source=side.label_source,  # type: ignore[arg-type]
                      label_dtype=side.label_dtype, label_changed=side.label_changed,
                      greedy_agreement=side.greedy_agreement, top1=s.top1, acceptance_rate=s.rate,
                      accept_length=s.length, per_step=s.per_step, hits=[int(x) for x in s.hits[0].tolist()])


def _loses(points: float) -> str:
    if points > 0.05:
        return f"loses {points:.1f} points"
    if points < -0.05:
        return f"gains {-points:.1f} points"
    return "loses nothing"


def load_target(spec: str | None) -> Any | None:
    if spec is None:
        return None
    from transformers.utils import logging as hf_logging

    from consistency.record.models import load_model

    hf_logging.disable_progress_bar()  # stderr stays one line per problem (CI logs)
    return load_model(spec)


def choose_feed(feed: str, sides: tuple[Side, ...]) -> tuple[str, str | None]:
    """``auto``: the draft's own proposals when every dump is the target's own greedy text
    (then own and recorded tokens coincide on every accepted prefix, so the result is what a
    runtime gets), else the recorded tokens, the only choice whose labels match the context."""
    if feed != "auto":
        return feed, None
    greedy = all(s.label_source == "input_ids" or (s.greedy_agreement or 0.0) >= GREEDY_EXACT for s in sides)
    if greedy:
        return "own", None
    worst = min(s.greedy_agreement or 0.0 for s in sides)
    return "teacher", (f"only {100 * worst:.0f}% of the recorded next tokens are the target's own, so chained steps "
                       "were fed the recorded tokens (the context the target's labels were computed on); on greedily "
                       "generated text this equals feeding the draft's own proposals, as runtimes do")


def drafted_positions(ref: Side, cand: Side) -> tuple[torch.Tensor | None, str, str | None]:
    """Where a server drafts, over the tokens both sides share: the reference's loss mask (the
    positions training scored), else the candidate's decode/verify rows (what the capture says
    the server generated), else every position (said in a note). Both sides are scored there."""
    for side, what in ((ref, "loss_mask"), (cand, "loss_mask"), (cand, "response"), (ref, "response")):
        m = side.drafted if side.drafted_source == what else None
        if m is not None and len(m) == len(side.ids) and bool(m[1:-1].any()):  # anchor i at token i+1; the last has no label
            words = ("the reference's loss mask" if side is ref else "the candidate's loss mask") if what == "loss_mask" \
                else ("the candidate's decode and verify rows" if side is cand else "the reference's decode rows")
            return m, what, f"scored on the positions a server drafts ({words}: {int(m.sum())} of {len(m)} tokens); " \
                "the all-position figures are reported beside them"
    return None, "all", ("no loss mask and no decode rows say where the server drafts: scored on every position, the "
                         "prompt included (a prompt the draft predicts well or badly dilutes a drop on the response)")


def pass_summary(worst: float, max_drop: float, rate: float, min_acceptance: float | None) -> str:
    """What a passing replay passed: the drop in points within its limit (or a gain), and
    the floor the candidate's acceptance cleared when one was set."""
    if worst >= 0.05:
        text = f"drop of {worst:.1f} points, within {max_drop:g}"
    elif worst > -0.05:
        text = f"no drop (within {max_drop:g} points)"
    else:
        text = f"no drop: the candidate gains {-worst:.1f} points (limit {max_drop:g})"
    if min_acceptance is not None:
        text += f"; acceptance {100 * rate:.1f}% clears the floor of {100 * min_acceptance:.0f}%"
    return text


def build_report(d: LoadedDraft | Any, tname: str | None, ref: Side, cand: Side, rs: Scored, cs: Scored, k: int, feed: str,
                 max_drop: float, seconds: float, min_acceptance: float | None = None,
                 draft_summary: DraftSummary | None = None, scored_on: str = "all") -> ReplayReport:
    n = min(rs.hits.shape[1], cs.hits.shape[1])
    same_tokens = len(ref.ids) == len(cand.ids) and torch.equal(ref.ids, cand.ids)
    lost = int((rs.hits[0, :n] & ~cs.hits[0, :n]).sum()) if same_tokens else 0
    gained = int((~rs.hits[0, :n] & cs.hits[0, :n]).sum()) if same_tokens else 0
    drop = Drop(top1_points=100 * (rs.top1 - cs.top1), acceptance_points=100 * (rs.rate - cs.rate),
                accept_length=rs.length - cs.length, speedup_ratio=cs.length / rs.length if rs.length else None,
                lost=lost, gained=gained)
    if rs.overall is not None and cs.overall is not None:
        drop.all_top1_points = 100 * (rs.overall.top1 - cs.overall.top1)
        drop.all_acceptance_points = 100 * (rs.overall.rate - cs.overall.rate)
    findings: list[Finding] = []
    notes = list(d.notes)
    for s in (ref, cand):
        if len(s.ids) <= k + 1:
            notes.append(f"{s.path.name} has {len(s.ids)} tokens: too few for a chain of {k} verifiable steps")
    if not same_tokens:
        notes.append("the dumps hold different tokens: accuracies are compared as totals, not position by position")
    worst = max(drop.top1_points, drop.acceptance_points)
    need = max(MIN_DRAFTED, math.ceil(100 / max_drop)) if max_drop > 0 else MIN_DRAFTED
    if min(rs.scored, cs.scored) < need:
        # one verify pass is more than the limit: the walk alone cannot say "no drop"
        wider = [(a.top1, a.rate, b.top1, b.rate) for a, b in ((rs.anchor_mean, cs.anchor_mean), (rs.overall, cs.overall))
                 if a is not None and b is not None]
        worst = max([worst] + [100 * max(t1 - t2, r1 - r2) for t1, r1, t2, r2 in wider])
        notes.append(f"only {min(rs.scored, cs.scored)} verify passes were walked (one is "
                     f"{100 / max(1, min(rs.scored, cs.scored)):.0f} points, fewer than the {need} a {max_drop:g}-point "
                     "limit needs): the verdict takes the larger of the walked, every-anchor and all-position drops")
    line = (f"top-1 {100 * rs.top1:.1f}% -> {100 * cs.top1:.1f}%, acceptance {100 * rs.rate:.1f}% -> {100 * cs.rate:.1f}%, "
            f"accept length {rs.length:.2f} -> {cs.length:.2f} (K={k}, walked: {rs.anchors} | {cs.anchors} verify passes")
    if rs.anchor_mean is not None and cs.anchor_mean is not None:
        line += (f"; every-anchor mean {rs.anchor_mean.length:.2f} -> {cs.anchor_mean.length:.2f}, not what a server "
                 "measures")
    line += ")"
    if rs.overall is not None and cs.overall is not None:
        o_r, o_c = rs.overall, cs.overall
        line = (f"on the positions a server drafts: {line}; over all {o_r.anchors} positions: top-1 "
                f"{100 * o_r.top1:.1f}% -> {100 * o_c.top1:.1f}%, acceptance {100 * o_r.rate:.1f}% -> "
                f"{100 * o_c.rate:.1f}%")
    for s in (ref, cand):
        if s.label_changed is not None:
            notes.append(f"{s.path.name}: labels are the target's argmax in {s.label_dtype}, the dtype its server "
                         f"verifies in; {s.label_changed} of {len(s.labels)} differ from float32's")
    for s, sc in ((ref, rs), (cand, cs)):
        if sc.walked_all:
            notes.append(f"{s.path.name}: no drafted position starts a chain of {k} verifiable steps, so the walk went "
                         "over every position, the prompt included")
    summary_of_draft = draft_summary or summarize_draft(d)
    unscored = inconclusive(ref, cand, rs, cs, summary_of_draft.draft_vocab_size)
    if same_input(ref.path, cand.path):
        unscored = Finding.make(C.SAME_INPUT, f"the reference and the candidate are the same input ({ref.path.name} and "
                                f"{cand.path.name}): the draft scores the same on both, so nothing was verified")
    if unscored:
        findings.append(unscored)
    if unscored:
        pass  # nothing the drop says is evidence: no OK, no ACCEPTANCE_DROP
    elif worst > max_drop:
        findings.append(Finding.make(
            C.ACCEPTANCE_DROP, f"replayed on the candidate, the draft loses {worst:.1f} points (limit {max_drop:g}): {line}",
            metrics=drop.model_dump()))
    else:
        findings.append(Finding.make(C.OK, f"the candidate {_loses(worst)}, within the limit of {max_drop:g} points: "
                                     f"{line}", metrics=drop.model_dump()))
    if min_acceptance is not None and cs.rate < min_acceptance:
        findings.append(Finding.make(
            C.ACCEPTANCE_LOW, f"predicted acceptance on the candidate is {100 * cs.rate:.1f}%, below the required "
            f"{100 * min_acceptance:.1f}% (accept length {cs.length:.2f}, K={k})", tensor=str(cand.path)))
    if rs.top1 < WEAK_TOP1:
        findings.append(Finding.make(
            C.DRAFT_WEAK, f"the draft's top-1 accuracy on the reference is only {100 * rs.top1:.1f}%",
            tensor=str(ref.path)))
    for s in (ref, cand):
        if feed == "own" and s.greedy_agreement is not None and s.greedy_agreement < GREEDY_EXACT and k > 1:
            findings.append(Finding.make(
                C.REPLAY_ESTIMATE, f"{s.path.name}: {100 * s.greedy_agreement:.0f}% of recorded next tokens are the "
                f"target's own; steps 2..{k} are scored against the target's choice after the recorded tokens",
                tensor=str(s.path)))
    verdict = verdict_of(findings)
    if unscored:
        summary = f"inconclusive: {unscored.message}" if unscored.code != C.SAME_INPUT else unscored.message
    elif worst > max_drop:
        summary = f"candidate loses {worst:.1f} points: {line}"
    elif verdict == "fail":
        summary = f"acceptance below the floor of {100 * (min_acceptance or 0):.0f}%: {line}"
    else:  # say what passed: how large the drop was against its limit (a 19.4-point drop is not "no drop")
        summary = pass_summary(worst, max_drop, cs.rate, min_acceptance) + f": {line}"
    return ReplayReport(version=__version__, verdict=verdict, summary=summary, steps=k, feed=feed,  # type: ignore[arg-type]
                        max_drop_points=max_drop, min_acceptance=min_acceptance,
                        draft=summary_of_draft, method=draft_summary.method if draft_summary else "eagle3",
                        target=tname,
                        reference=side_report(ref, rs, scored_on), candidate=side_report(cand, cs, scored_on), drop=drop,
                        findings=findings, notes=notes, seconds=seconds)
