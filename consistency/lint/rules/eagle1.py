"""EAGLE-1/2 (and HASS) and Medusa drafts against the serving method.

An EAGLE-1 draft reads one hidden state, ``fc(cat(embed, fnorm(s=N)))`` [h, 2h]; an EAGLE-3
draft reads a concatenation of aux streams. Served under the other method, the runtime
builds the wrong model class: SGLang captures aux states only for EAGLE3 and loads
``LlamaForCausalLMEagle`` only for EAGLE; vLLM picks ``EagleLlamaForCausalLM`` for
``eagle`` and ``Eagle3LlamaForCausalLM`` for ``eagle3``. Rule SRV003 covers an EAGLE-3 draft
served as EAGLE; EG1001 covers the other direction. Medusa has no SGLang path at all.
"""

from __future__ import annotations

from collections.abc import Iterator

from consistency.contract.models import Consumer
from consistency.lint.context import Context, NotEvaluated
from consistency.lint.kind import LABEL
from consistency.lint.rules.base import E, Hit, rule

_RIGHT = {"sglang": "--speculative-algorithm EAGLE", "vllm": "\"method\": \"eagle\""}


@rule("EG1001", "eagle1-method-mismatch", E, "an EAGLE-1/2 draft is served as EAGLE-3, MTP or another method",
      "sglang python/sglang/srt/models/llama_eagle.py (EAGLE: fc(cat(embed, hidden)), layer-0 input_layernorm "
      "skipped) vs llama_eagle3.py; sglang model_runner.py (aux capture only for EAGLE3); vllm "
      "model_executor/models/llama_eagle.py (method eagle) vs llama_eagle3.py (eagle3)",
      "SGLang: --speculative-algorithm EAGLE; vLLM: \"method\": \"eagle\" in --speculative-config")
def eagle1_method(ctx: Context) -> Iterator[Hit]:
    s = ctx.need_serve()
    d = ctx.need_draft()
    if ctx.draft_kind.kind is None:
        raise NotEvaluated("cannot tell whether the draft is EAGLE-1/2 or EAGLE-3 (no architecture, ids or checkpoint)")
    if ctx.draft_kind.kind is not Consumer.eagle1:
        return
    req = ctx.requested
    if req.kind is None and s.algorithm is None:
        yield Hit("the command line selects no speculative method: the EAGLE-1 draft is not used")
    elif req.kind is not None and req.kind is not Consumer.eagle1:  # EAGLE-3, MTP, DFlash, Medusa, P-EAGLE
        yield Hit(f"the draft {d.path} is an EAGLE-1/2 draft ({ctx.draft_kind.how}) but {req.how} runs "
                  f"{req.kind.value}: the server builds another model class around its weights "
                  f"(use {_RIGHT.get(s.runtime, 'EAGLE')})", key="architectures" if d.architectures else None)


@rule("MDS001", "medusa-unsupported", E, "a Medusa draft or method on a runtime without Medusa (SGLang), or a "
      "Medusa draft served by another method",
      "sglang python/sglang/srt/speculative/spec_info.py (009db01: SpeculativeAlgorithm NONE, EAGLE, EAGLE3; "
      "from_string raises for any other name; 2026 copies add DFLASH, FROZEN_KV_MTP, STANDALONE, NGRAM, no MEDUSA); "
      "vllm v1/spec_decode/medusa.py (method medusa; eagle/eagle3/mtp build other model classes)",
      "serve Medusa heads on vLLM (\"method\": \"medusa\"), or train an EAGLE draft for SGLang")
def medusa(ctx: Context) -> Iterator[Hit]:
    s = ctx.need_serve()
    if s.runtime != "sglang":
        r = ctx.requested
        if ctx.draft_kind.kind is Consumer.medusa and r.kind is not Consumer.medusa and not r.undecided:
            runs = f"runs {LABEL.get(r.kind, r.kind.value)}" if r.kind is not None else "selects no Medusa method"
            yield Hit(f"the draft is a Medusa model ({ctx.draft_kind.how}) but {r.how} {runs}: vLLM builds another "
                      "model class around its heads (use \"method\": \"medusa\")", key="medusa_num_heads")
        return
    if ctx.requested.kind is Consumer.medusa:
        yield Hit(f"{ctx.requested.how}: SGLang has no Medusa algorithm and refuses the name at start-up")
    elif ctx.draft_kind.kind is Consumer.medusa:
        yield Hit(f"the draft is a Medusa model ({ctx.draft_kind.how}); SGLang cannot serve Medusa heads "
                  f"({ctx.requested.how} loads it as another method)", key="medusa_num_heads")


RULES = (eagle1_method, medusa)
