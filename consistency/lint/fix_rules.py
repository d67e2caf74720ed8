"""Which lint rule's finding has which fix: a registry from rule code to the function that
computes the fix as data (:class:`consistency.contract.fixes.Fix`) from the lint context.

The rules say what is wrong; these functions say what to write instead, and whether that
is determined by the inputs given. The aux-id fixes all come from one computation
(:func:`consistency.contract.fixes.ids_fix`, shared with compare and replay), so two
findings about one id list never propose two different lists.
"""

from __future__ import annotations

from collections.abc import Callable

from consistency.contract.fixes import Edit, Fix, get_key, ids_fix, ids_for
from consistency.contract.models import Consumer
from consistency.lint.context import Context
from consistency.lint.fix_serve import flag_edit, method_edit
from consistency.lint.kind import LABEL
from consistency.lint.rules.base import Hit

Proposer = Callable[[Context, Hit], Fix | None]


def _ids(ctx: Context, hit: Hit) -> Fix | None:
    """Write the training streams in the serving release's convention, under the key it reads."""
    d, plan, tr = ctx.draft, ctx.plan, ctx.training
    if d is None or d.config_path is None or not d.config:
        return Fix(status="ambiguous", summary="no draft config.json to edit", decided_by="--draft DIR")
    if plan is None:
        return Fix(status="ambiguous", summary="the serving runtime is unknown",
                   decided_by="--runtime sglang@VER|vllm@VER (or --serve)")
    if ctx.n is None:
        return Fix(status="ambiguous", summary="the target's layer count is unknown: ids cannot be placed",
                   decided_by="--target CONFIG")
    if tr is None or tr.streams is None or tr.ambiguous:
        said = ("; ".join(f"{r.label}: {r.streams}" for r in tr.readings) if tr is not None and tr.ambiguous
                else "unknown")
        what = f"version-dependent: {said}" if tr is not None and tr.ambiguous else "unknown"
        return _embedding_only(ctx) or Fix(
            status="ambiguous", summary=f"what training fed the draft is {what}",
            decided_by="--trained-with DUMP|CONTRACT|FRAMEWORK[@sglang-VER]:IDS")
    if not tr.explicit:
        return _embedding_only(ctx) or Fix(
            status="ambiguous", summary=f"training streams {tr.streams} are only assumed from the draft config's own "
            "ids (a claim): rewriting the config from its own claim proves nothing",
            decided_by="--trained-with DUMP|CONTRACT|FRAMEWORK:IDS")
    return ids_fix(str(d.config_path), d.config, plan.runtime, plan.version, ctx.n, plan.arch, list(tr.streams),
                   plan.runner)


def _embedding_only(ctx: Context) -> Fix | None:
    """The config asks for stream 0 (or N) and this release cannot capture it: that much is
    known without the training side, and no edit of the ids is the fix."""
    plan, n = ctx.plan, ctx.n
    if plan is None or n is None or not plan.config_order:
        return None
    lim = plan.limit
    asks = [s for s in plan.config_order if (s == 0 and lim and lim.first != "ok")
            or (s == n and lim and lim.last != "ok")]
    if not asks:
        return None
    a = ids_for(plan.runtime, plan.version, n, plan.arch, sorted(set(plan.config_order)), plan.runner)
    return Fix(status="impossible", summary=a.blocked or f"{plan.label} cannot capture streams {asks}") \
        if a.blocked else None


def _capture_disabled(ctx: Context, hit: Hit) -> Fix | None:
    d = ctx.draft
    if d is None or d.config_path is None:
        return None
    key = "eagle_config.use_aux_hidden_state"
    return Fix(status="determined", summary=f"remove `{key}: false` (an EAGLE-3 draft reads the aux states)",
               edits=[Edit(file=str(d.config_path), key=key, old=get_key(d.config, key), remove=True)])


def _budget(ctx: Context, hit: Hit) -> Fix | None:
    """SGLang topk 1: draft tokens = num_steps + 1. A cap keeps the requested draft tokens
    (raise the steps); otherwise the command states the budget SGLang really runs."""
    s = ctx.serve
    if s is None or s.num_steps is None or s.num_draft_tokens is None or s.topk != 1:
        return None
    if s.num_draft_tokens > s.num_steps + 1:
        e = flag_edit(s, "speculative-num-steps", s.num_draft_tokens - 1)
        why = f"raise --speculative-num-steps to {s.num_draft_tokens - 1} so {s.num_draft_tokens} draft tokens run"
    else:
        e = flag_edit(s, "speculative-num-draft-tokens", s.num_steps + 1)
        why = f"--speculative-num-draft-tokens {s.num_steps + 1}: what SGLang runs with {s.num_steps} steps at topk 1"
    return Fix(status="determined", summary=why, edits=[e])


_METHOD = {  # (kind the draft files are, runtime) -> the method that runs it
    (Consumer.eagle3_aux, "sglang"): "EAGLE3", (Consumer.eagle3_aux, "vllm"): "eagle3",
    (Consumer.eagle1, "sglang"): "EAGLE", (Consumer.eagle1, "vllm"): "eagle",
    (Consumer.mtp, "sglang"): "NEXTN", (Consumer.mtp, "vllm"): "mtp",
}


def _method(ctx: Context, hit: Hit) -> Fix | None:
    s, d = ctx.serve, ctx.draft
    kind = ctx.draft_kind.kind
    if kind is None and d is not None and d.is_eagle3:
        kind = Consumer.eagle3_aux
    if s is None or d is None or kind is None or (kind, s.runtime) not in _METHOD:
        return None
    want = _METHOD[(kind, s.runtime)]
    edits = method_edit(s, want, d)
    if edits is None:
        return Fix(status="ambiguous", summary=f"the command line has no --speculative-config to set \"method\": "
                   f"\"{want}\" in; its draft model and token count are the user's choice",
                   decided_by="--serve with a --speculative-config naming the draft and num_speculative_tokens")
    return Fix(status="determined", summary=f"serve the {LABEL.get(kind, kind.value)} draft with "
               + ("--speculative-algorithm " if s.runtime == "sglang" else "method ") + want, edits=edits)


FIXERS: dict[str, Proposer] = {
    "IDS001": _ids, "IDS002": _ids, "IDS003": _ids, "IDS008": _ids, "IDS009": _capture_disabled,
    "SRV001": _budget, "SRV003": _method, "MTP006": _method, "EG1001": _method,
}


def propose(code: str, ctx: Context, hit: Hit) -> Fix | None:
    """The fix for one finding of rule ``code`` (None: the rule has no fix as data)."""
    fn = FIXERS.get(code)
    if fn is None:
        return None
    fix = fn(ctx, hit)
    if fix is not None and fix.status == "determined" and not fix.edits:
        return None  # nothing to change for this finding (another finding's fix covers it)
    return fix


__all__ = ["FIXERS", "propose"]
