"""Replay a draft on both dumps, score it against the target, and judge the difference.

Scoring, for anchors i (the target has verified ``x[..i+1]``): step k (1-based) of the
chain proposes the token at ``i+k+1`` and is accepted when it equals the target's own next
token there, ``y[i+k]``; a chain stops at its first rejection (greedy verification, topk 1).
The mean accepted length counts the bonus token the target adds at every verification,
as SGLang's ``accept length`` and the EAGLE papers' tau do: 1 + accepted drafts, 1..K+1,
averaged over the anchors a chain server verifies at (replay/walk.py), not over every anchor.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from consistency.contract.codes import C
from consistency.contract.fixes import replay_fix
from consistency.errors import InputError, UsageError
from consistency.replay.chain import run_chain
from consistency.replay.load import LoadedDraft, TargetParts, load_draft
from consistency.replay.report import ReplayReport
from consistency.replay.scoring import (Scored, build_report, choose_feed, drafted_positions, load_target,  # noqa: F401
                                        pass_summary, score, summarize_draft)  # re-exported: callers of the old home
from consistency.replay.checks import check_sides, common_tokens
from consistency.replay.sides import Side, read_side, truncate

DEFAULT_STEPS = 3


@torch.no_grad()
def replay_side(draft: LoadedDraft, side: Side, steps: int, feed: str = "own",
                drafted: torch.Tensor | None = None) -> Scored:
    aux, nxt = side.aux[:-1], side.ids[1:]
    teacher = None
    if feed == "teacher":
        t = len(nxt)
        teacher = torch.stack([torch.cat([side.ids[2 + k:], side.ids.new_zeros(1 + k)])[:t] for k in range(steps)], -1)
    vt = draft.model.target_vocab
    if int(side.ids.max()) >= vt or int(side.ids.min()) < 0:
        raise InputError(side.path, f"token ids outside the draft's target vocabulary 0..{vt - 1}")
    out = run_chain(draft.model, aux, nxt, steps, feed=feed, teacher=teacher)
    return score(out.tokens[:, 0], side.labels, drafted, side.segments)


def run_replay(draft: str | Path, target: str | Any | None, reference: str | Path, candidate: str | Path,
               steps: int | None = None, max_drop_points: float = 5.0, feed: str = "auto", labels: str = "auto",
               overrides: dict[str, bool] | None = None, min_acceptance: float | None = None,
               layer_ids: Sequence[int] | None = None, convention: str | None = None, method: str = "auto") -> ReplayReport:
    """Library entry (CLI, demo, gate). ``target`` is a spec (built-in name or local HF dir),
    an already loaded HF model, or None when the draft and dumps carry everything.
    ``layer_ids``/``convention``: for training files that do not record their streams, as
    ``compare`` takes them. Refused (UsageError) before any score: a target the dumps were not
    recorded on, reference and candidate swapped, dumps of different text (replay/checks.py).
    ``method``: ``auto`` tells an MTP or EAGLE-1 draft from an EAGLE-3 one (replay/multistep.py)."""
    t0 = time.perf_counter()
    if feed not in ("auto", "own", "teacher"):
        raise UsageError(f"--feed must be 'auto', 'own' or 'teacher', got {feed!r}")
    if min_acceptance is not None and not 0.0 <= min_acceptance <= 1.0:
        raise UsageError(f"min_acceptance is a fraction between 0 and 1, got {min_acceptance}")
    if not 0.0 <= max_drop_points < float("inf"):  # NaN compares False: a drop could never fail
        raise UsageError(f"max_drop is a finite number of points >= 0, got {max_drop_points}")
    from consistency.replay import multistep

    if method not in multistep.METHODS:
        raise UsageError(f"--method must be one of {', '.join(multistep.METHODS)}, got {method!r}")
    kind = multistep.detect_method(draft) if method == "auto" else method
    if kind != "eagle3":
        if overrides:
            raise UsageError(f"--set flags are EAGLE-3 draft flags; an {kind} draft has none")
        return multistep.replay_multistep(kind, draft, target, reference, candidate, steps, max_drop_points, feed,
                                          labels, min_acceptance, layer_ids, convention)
    if isinstance(target, (str, Path)) or target is None:
        tmodel, tname = load_target(None if target is None else str(target)), None if target is None else str(target)
    else:
        tmodel, tname = target, getattr(target.config, "_name_or_path", None) or type(target).__name__
    parts = TargetParts.from_model(tmodel, tname) if tmodel is not None else None
    d = load_draft(draft, parts, overrides)
    k = steps if steps is not None else (d.config.speculative_tokens or DEFAULT_STEPS)
    if k < 1 or k > 64:
        raise UsageError(f"--steps must be between 1 and 64, got {k}")
    width = d.model.target_hidden
    cache: dict[bytes, torch.Tensor] = {}
    ids = list(layer_ids) if layer_ids is not None else None
    ref = read_side(reference, d.model.num_aux, width, tmodel, labels, cache, ids, convention, tname)
    cand = read_side(candidate, d.model.num_aux, width, tmodel, labels, cache, ids, convention, tname)
    check_sides(reference, ref.meta, candidate, cand.meta)
    r0, c0, shared = common_tokens(ref.ids, cand.ids, reference, candidate, ref.segments, cand.segments)
    cut = [f"{s.path.name} holds {len(s.ids)} tokens: replayed on the {shared} both dumps share "
           f"(its tokens [{start}, {start + shared}))" for s, start in ((ref, r0), (cand, c0)) if len(s.ids) > shared]
    if r0 != c0:
        cut.append(f"the shared tokens sit at position {r0} in the reference and {c0} in the candidate: if the "
                   "candidate's capture did not start at the prompt (a prefix-cache suffix), its states saw the same "
                   "context; if extra tokens came first (a chat template), they did not, and acceptance reflects that")
    ref, cand = truncate(ref, shared, r0), truncate(cand, shared, c0)
    if r0 != c0 and cand.label_source != "logits":
        # the candidate's tokens sit elsewhere in its capture (a prefix-cache suffix, a template in
        # front): the target's next tokens depend on context, so both sides are scored on the
        # reference's labels, computed on the whole prompt
        cand = replace(cand, labels=ref.labels, label_source=ref.label_source)
    feed, why = choose_feed(feed, (ref, cand))
    mask, scored_on, where = drafted_positions(ref, cand)
    rs, cs = replay_side(d, ref, k, feed, mask), replay_side(d, cand, k, feed, mask)
    rep = build_report(d, tname, ref, cand, rs, cs, k, feed, max_drop_points, time.perf_counter() - t0, min_acceptance,
                       scored_on=scored_on)
    fx = replay_fix(ref.claimed, cand.claimed, cand.meta)  # the aux-id edit, when the streams claimed differ
    if fx is not None:
        rep.findings = [f.model_copy(update={"autofix": fx, "fix": fx.summary}) if f.code == C.ACCEPTANCE_DROP else f
                        for f in rep.findings]
    if where:
        rep.notes.insert(0, where)
    if why:
        rep.notes.insert(0, why)
    rep.notes[:0] = cut
    return rep


