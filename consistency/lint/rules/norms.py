"""NRM: draft norm flags the serving runtime ignores, reads elsewhere or defaults differently.

A flag changes the draft's math; when the server does not honour it the draft still runs,
with the wrong math and a fraction of its acceptance. Where each runtime reads each flag,
and since which version, is data in :data:`READS` (docs/rules/NRM00x.md cite the lines).
"""

from __future__ import annotations

from collections.abc import Iterator

from consistency.contract.versions import VersionRange
from consistency.lint.configs import bool_at
from consistency.lint.context import Context
from consistency.lint.rules.base import EAGLE3, E, W, Hit, rule

# flag -> runtime -> [(min_version, max_version, keys read)] (first matching range wins)
READS: dict[str, dict[str, list[tuple[tuple[int, ...] | None, tuple[int, ...] | None, tuple[str, ...]]]]] = {
    "norm_before_fc": {
        "sglang": [(None, (0, 5, 17), ()), ((0, 5, 17), None, ("eagle_config.norm_before_fc", "norm_before_fc"))],
        "vllm": [(None, (0, 18), ()), ((0, 18), (0, 22), ("norm_before_fc",)),
                 ((0, 22), None, ("eagle_config.norm_before_fc", "norm_before_fc"))],
    },
    "fc_norm": {
        "sglang": [(None, None, ("fc_norm", "use_aux_norm"))],
        "vllm": [(None, (0, 22), ()), ((0, 22), None, ("fc_norm",))],
    },
}


def reads(flag: str, runtime: str, version: tuple[int, ...] | None) -> tuple[str, ...]:
    """Keys ``runtime`` reads ``flag`` from at ``version`` (None: the newest release)."""
    for lo, hi, keys in READS[flag].get(runtime, []):
        if VersionRange(lo, hi).covers(version):
            return keys
    return ()


def _effective(ctx: Context, flag: str, names: tuple[str, ...]) -> tuple[bool, str | None]:
    """(value the server uses, the key under which the draft sets the flag true, if any)."""
    d = ctx.need_config()
    keys = reads(flag, ctx.need_runtime(), ctx.version)
    set_at = next((k for name in names for k in (name, f"eagle_config.{name}")
                   if bool_at(d.config, k, d.config_path) is True), None)
    for key in keys:
        v = bool_at(d.config, key, d.config_path)
        if v is not None:
            return v, set_at
    return False, set_at


@rule("NRM001", "norm-before-residual", E, "norm_before_residual as trained differs from what the server applies",
      "sglang llama_eagle3.py (never reads it: residual = pre-norm fc output); vllm transformers_utils/configs/"
      "speculators/algos.py update_eagle3 (defaults it to True when a speculators config omits it); speculators "
      "Eagle3SpeculatorConfig (default False)",
      "serve a norm_before_residual=true draft on vLLM only, and write the key explicitly in speculators configs",
      applies_to=EAGLE3)
def norm_before_residual(ctx: Context) -> Iterator[Hit]:
    d, runtime = ctx.need_config(), ctx.need_runtime()
    value, where = d.flag("norm_before_residual")
    trained = bool(value) if d.format == "speculators" else False
    if runtime == "sglang":
        served, why = False, "sglang never reads norm_before_residual (residual = the pre-norm fc output)"
    elif d.format == "speculators":
        served = True if value is None else bool(value)
        why = ("vLLM's speculators adapter defaults it to True when the config omits it" if value is None
               else "vLLM reads it from the speculators config")
    else:
        served = bool(value)
        why = "vLLM's llama_eagle3.py reads the top-level key (default False)"
    if trained != served:
        how = ("the draft config does not set it (speculators trains with False)" if value is None and
               d.format == "speculators" else f"{where} = {str(value).lower()}"
               + ("" if d.format == "speculators"
                  else " but SpecForge/SGLang-format drafts are trained with the pre-norm residual"))
        yield Hit(f"trained with norm_before_residual={str(trained).lower()} ({how}), served with "
                  f"{str(served).lower()}: {why}", key=where or "norm_before_residual")


@rule("NRM002", "norm-before-fc", E, "norm_before_fc (input_norm over the concatenated aux states) is not honoured",
      "sglang llama_eagle3.py (0.5.17+, PR #32334: eagle_config first, then top level); vllm llama_eagle3.py "
      "(0.18-0.21 top level only, 0.22+ eagle_config first; PRs #38111, #42143)",
      "serve on a runtime version that reads the flag where the config sets it (or move it), and keep "
      "input_norm.weight and the flag together", applies_to=EAGLE3)
def norm_before_fc(ctx: Context) -> Iterator[Hit]:
    yield from _norm_flag(ctx, "norm_before_fc", ("norm_before_fc",), ("input_norm.",), ())


@rule("NRM003", "fc-norm", E, "fc_norm (per-slot norms before the fc) is not honoured, or its weights are dropped",
      "sglang llama_eagle3.py (top-level fc_norm or legacy use_aux_norm; maps aux_norm_* to fc_norm.*); vllm "
      "llama_eagle3.py (0.22+: top-level fc_norm only, no use_aux_norm, no aux_norm_* renaming)",
      "set top-level fc_norm: true and name the weights fc_norm.{i}.weight", applies_to=EAGLE3)
def fc_norm(ctx: Context) -> Iterator[Hit]:
    yield from _norm_flag(ctx, "fc_norm", ("fc_norm", "use_aux_norm"), ("fc_norm.", "aux_norm_"),
                          ("aux_norm_",) if ctx.runtime == "vllm" else ())


def _norm_flag(ctx: Context, flag: str, names: tuple[str, ...], prefixes: tuple[str, ...],
               unmapped: tuple[str, ...]) -> Iterator[Hit]:
    d = ctx.need_config()
    used, set_at = _effective(ctx, flag, names)
    label = ctx.runtime_label
    if set_at and not used:
        keys = reads(flag, ctx.runtime or "", ctx.version)
        yield Hit(f"{set_at} is true but {label} "
                  + (f"reads it only from {' or '.join(keys)}" if keys else "does not support it"), key=set_at)
    ck = d.checkpoint
    if ck is None:
        return
    weights = [t.name for p in prefixes for t in ck.with_prefix(p)]
    if weights and not used:
        yield Hit(f"the checkpoint has {weights[0]}{' and more' if len(weights) > 1 else ''} but {label} does not "
                  f"apply {flag}: the trained norm weights are dropped", file=ck.find(weights[0]).file if ck.find(
                      weights[0]) else None, key=set_at)
    elif used and not weights:
        yield Hit(f"{flag} is on but the checkpoint has no {prefixes[0]}* weights: the server uses freshly "
                  "initialised norms", W, key=set_at)
    odd = [t.name for p in unmapped for t in ck.with_prefix(p)]
    if used and odd:
        yield Hit(f"{label} does not rename {odd[0]} to fc_norm.*: those weights are not loaded", key=set_at)


_FIX_TRUE = ("if a SpecForge from before PR #879 (SpecForge 0.2.0 included) trained it, norm_output=true meant "
             "EAGLE-3 there: set norm_output to false so the server feeds back the pre-norm state it trained on; if a "
             "later SpecForge or another trainer wrote it, it is EAGLE-3.1 and right as it is")
_FIX_FALSE = ("if a SpecForge from before PR #879 (SpecForge 0.2.0 included) trained it, norm_output=false trained "
              "lm_head on the un-normed state, which no server reproduces: retrain with a SpecForge that has #879 (or "
              "with the key absent, SpecForge's old default); if a later SpecForge or another trainer wrote it, it is "
              "plain EAGLE-3 and right as it is")


@rule("NRM004", "norm-output", W, "norm_output meant something else in SpecForge before PR #879, or is nested",
      "SpecForge PR #879 (merged 2026-09-15: before it norm_output=true trained EAGLE-3 and false normed nothing; "
      "default True, specforge-0.2.0 modeling/draft/llama3_eagle.py); sglang and vllm llama_eagle3.py read "
      "top-level norm_output (default False: next step gets the pre-norm state)",
      "keep norm_output at the top level; for a SpecForge export, check which SpecForge trained it (the finding's "
      "fix says what each value needs)", applies_to=EAGLE3)
def norm_output(ctx: Context) -> Iterator[Hit]:
    d = ctx.need_config()
    value, where = d.flag("norm_output")
    if where is None:
        return
    if where.startswith("eagle_config."):
        yield Hit(f"{where} is nested; SGLang and vLLM read only the top-level norm_output, so the server uses "
                  "false (EAGLE-3)", E, key=where)
    elif d.format == "sglang":
        if not isinstance(d.config.get("transformers_version"), str):
            return  # not written by save_pretrained, so not a SpecForge export (its exporters stamp the version)
        before = "EAGLE-3 (normed lm_head input, pre-norm state fed back)" if value else \
            "no norm at all (lm_head on the un-normed state)"
        after = "EAGLE-3.1 (post-norm state fed back)" if value else "EAGLE-3 (normed lm_head input, pre-norm state " \
            "fed back)"
        yield Hit(f"norm_output = {str(value).lower()} in a SpecForge export: SpecForge before PR #879 trained "
                  f"{before}; SGLang and vLLM serve {after}; which SpecForge trained it is not recorded",
                  key=where, fix=_FIX_TRUE if value else _FIX_FALSE)


RULES = (norm_before_residual, norm_before_fc, fc_norm, norm_output)
