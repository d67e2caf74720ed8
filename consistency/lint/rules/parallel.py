"""SRV007/SRV008: what pipeline and data parallelism do to the aux capture.

Both are facts of the server, not of the draft: under pipeline parallelism only the last
stage captures aux states, so slots whose layers live on earlier stages never reach the
draft; under DP attention each rank captures only its own requests' tokens.
"""

from __future__ import annotations

from collections.abc import Iterator

from consistency.lint.context import Context, NotEvaluated
from consistency.lint.rules.base import EAGLE3, E, I, W, Hit, rule

_PP_SRC = ("sglang python/sglang/srt/models/llama.py, qwen3_moe.py, deepseek_v2.py, glm4_moe_lite.py "
           "set_eagle3_layers_to_capture (`if not self.pp_group.is_last_rank: return`, 0.5.23); layer split "
           "get_pp_indices (sglang/srt/distributed/utils.py, vllm/distributed/utils.py; *_PP_LAYER_PARTITION); "
           "vllm PR #36731 (issue #36151: local indices on later stages), PR #45985 (aux states of non-last stages "
           "dropped)")


def pp_partition(num_layers: int, pp: int) -> list[int]:
    """Layers per stage as get_pp_indices splits them: N // pp each, the remainder added to
    the stages before the last, from the second-to-last backwards (the last holds the head)."""
    parts = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        parts[-i] += 1
    return parts


@rule("SRV007", "pipeline-aux-missing", E, "pipeline parallelism: aux layers held by stages before the last are "
      "never captured", _PP_SRC,
      "serve the target without pipeline parallelism (tensor parallelism instead), or move every aux layer onto "
      "the last stage with SGLANG_PP_LAYER_PARTITION / VLLM_PP_LAYER_PARTITION", applies_to=EAGLE3)
def pipeline(ctx: Context) -> Iterator[Hit]:
    s = ctx.need_serve()
    pp = s.pp or 1
    if pp <= 1:
        return
    plan, n = ctx.need_plan(), ctx.need_n()
    if plan.streams is None:
        raise NotEvaluated("serving streams unknown")
    env = "SGLANG_PP_LAYER_PARTITION" if s.runtime == "sglang" else "VLLM_PP_LAYER_PARTITION"
    parts = s.pp_partition
    if parts is not None and (len(parts) != pp or sum(parts) != n):
        yield Hit(f"{env}={','.join(map(str, parts))} has {len(parts)} stages summing to {sum(parts)} layers, but "
                  f"the command runs {pp} stages of a {n}-layer target: the server refuses to start")
        return
    how = f"{env}" if parts is not None else "split evenly (get_pp_indices)"
    parts = parts or pp_partition(n, pp)
    start = sum(parts[:-1])  # the last stage runs layers start..N-1 and captures streams start..N
    gone = [(i, st) for i, st in enumerate(plan.streams) if st < start]
    if not gone:
        return
    slots = ", ".join(f"slot {i} (stream {st})" for i, st in gone)
    yield Hit(f"pipeline parallel size {pp}: the {n} layers are {how} as {parts}, and only the last stage (layers "
              f"{start}..{n - 1}) captures aux states, so {slots} {'is' if len(gone) == 1 else 'are'} never filled: "
              f"the draft gets {len(plan.streams) - len(gone)} of {len(plan.streams)} slots",
              evidence={"partition": parts, "last_stage_first_layer": start, "missing_slots": [i for i, _ in gone]})


@rule("SRV008", "dp-capture-subset", I, "data-parallel attention: a capture on one rank holds only that rank's "
      "requests", "sglang --enable-dp-attention (each DP rank runs attention, and the model's capture, for its own "
      "requests; python/sglang/srt/layers/dp_attention.py); vllm --data-parallel-size (one engine per rank)",
      "record on every DP rank (or serve with one DP rank while recording) before comparing whole prompts")
def dp_attention(ctx: Context) -> Iterator[Hit]:
    s = ctx.need_serve()
    dp = s.dp or 1
    on = (s.runtime == "sglang" and s.dp_attention) or (s.runtime == "vllm" and dp > 1)
    if not on:
        return
    what = "--enable-dp-attention" + (f" with {dp} DP ranks" if dp > 1 else "") if s.runtime == "sglang" \
        else f"--data-parallel-size {dp}"
    recording = "CONSISTENCY_RECORD" in s.env
    yield Hit(f"{what}: each rank captures aux states only for the requests it serves, so a dump from one rank "
              "holds a subset of the tokens (other prompts, or none of yours)"
              + ("; CONSISTENCY_RECORD is set: record every rank, or serve with one DP rank while recording"
                 if recording else ""), W if recording else I)


RULES = (pipeline, dp_attention)
