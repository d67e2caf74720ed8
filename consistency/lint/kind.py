"""Which kind of draft a lint run is about: EAGLE-3, MTP, EAGLE-1/2, Medusa, DFlash.

Two independent readings, because the bugs live where they disagree:

- what the **serving flags** ask for (SGLang ``--speculative-algorithm NEXTN/EAGLE/EAGLE3``,
  vLLM ``--speculative-config {"method": ...}``), and
- what the **draft files** are (a speculators ``speculators_model_type``, an EAGLE-1
  ``LlamaForCausalLMEagle`` config or SafeAILab checkpoint, ``medusa_num_heads``), plus how
  many MTP layers the model the MTP head comes from declares (``num_nextn_predict_layers``
  for DeepSeek/GLM/MiMo/Kimi, ``mtp_num_hidden_layers`` for Qwen3-Next/3.5).

The rows of :mod:`consistency.contract.consumers` are keyed by the target's model family;
:func:`family` picks the first of the target's architecture / model-type names a row knows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from consistency.contract import consumers as C
from consistency.contract import sglang_drafts as SD
from consistency.contract.runtime_model import sglang_draft_class
from consistency.contract.sglang_drafts import MTP_ALGORITHMS
from consistency.contract.models import Consumer
from consistency.lint.configs import TargetInfo, dig, int_at
from consistency.lint.draft import DraftInfo
from consistency.lint.serve import ServeInfo

# vLLM speculative methods that run a target's own MTP layers (vllm config/speculative.py
# MTPModelTypes and the "mtp" alias); "mtp" is resolved per target model_type by vLLM.
VLLM_MTP_METHODS = frozenset({"mtp", "deepseek_mtp", "qwen3_next_mtp", "qwen3_5_mtp", "mimo_mtp", "glm4_moe_mtp",
                              "glm4_moe_lite_mtp", "ernie_mtp", "longcat_flash_mtp", "pangu_ultra_moe_mtp",
                              "bailing_moe_v3_mtp", "nemotron_h_mtp", "kimi_k3_mtp", "step3p5_mtp"})
_VLLM = {"eagle": Consumer.eagle1, "eagle3": Consumer.eagle3_aux, "medusa": Consumer.medusa,
         "dflash": Consumer.dflash, "dspark": Consumer.dflash}
# SGLang: NEXTN is rewritten to EAGLE (server_args.py: "NEXTN shares the same implementation of EAGLE").
_SGLANG = {"NEXTN": Consumer.mtp, "EAGLE": Consumer.eagle1, "EAGLE3": Consumer.eagle3_aux, "MEDUSA": Consumer.medusa,
           "DFLASH": Consumer.dflash}
EAGLE1_ARCHS = ("LlamaForCausalLMEagle", "EagleLlamaForCausalLM", "EagleQwen2ForCausalLM", "Qwen2ForCausalLMEagle",
                "EagleMiniCPMForCausalLM")
MTP_LAYER_KEYS = ("num_nextn_predict_layers", "mtp_num_hidden_layers")
FAMILIES = (C.DEEPSEEK_MTP, C.QWEN3_NEXT_MTP, C.MIMO_MTP)


LABEL = {Consumer.mtp: "MTP", Consumer.eagle1: "EAGLE-1/2", Consumer.medusa: "Medusa", Consumer.dflash: "DFlash",
         Consumer.eagle3_aux: "EAGLE-3", Consumer.p_eagle: "P-EAGLE"}


@dataclass
class Kind:
    """The kind of one side, and the sentence that says how it was known."""

    kind: Consumer | None
    how: str
    undecided: bool = False  # True: the inputs cannot tell which kind runs (not "none runs")
    broken: bool = False  # True: the flags select a method the server cannot run on these files as any draft


def requested(serve: ServeInfo | None, target: TargetInfo | None = None, version: tuple[int, ...] | None = None,
              draft: DraftInfo | None = None) -> Kind:
    """What the command line runs (None: no command line, or speculative decoding off).

    SGLang's ``EAGLE`` and ``NEXTN`` are one algorithm; the draft it loads is the draft path,
    or the target's own checkpoint when none is given, with its architecture rewritten to an
    MTP class where the release's table says so (contract/sglang_drafts.py): GLM-4.6 becomes
    Glm4MoeForCausalLMNextN, MiMo MiMoMTP, whichever of the two flags was typed."""
    if serve is None:
        return Kind(None, "no serving command line")
    algo = serve.algorithm
    if algo is None:
        return Kind(None, "the command line selects no speculative method")
    if serve.runtime == "sglang":
        k = _SGLANG.get(algo.upper())
        if algo.upper() in MTP_ALGORITHMS:
            return _sglang_eagle(serve, target, version, draft)
        return Kind(k, f"--speculative-algorithm {algo}")
    m = algo.lower()
    k = Consumer.mtp if m in VLLM_MTP_METHODS else _VLLM.get(m)
    return Kind(k, f"vLLM method {m!r}")


def _sglang_eagle(serve: ServeInfo, target: TargetInfo | None, version: tuple[int, ...] | None,
                  draft: DraftInfo | None) -> Kind:
    """``--speculative-algorithm EAGLE``/``NEXTN``: the class SGLang loads decides the kind."""
    flag = f"--speculative-algorithm {serve.algorithm}"
    own = not serve.draft_model or serve.draft_model == serve.target_model
    if own:
        arch, whose = (target.architecture if target else None), "the target's own checkpoint"
    elif draft is not None and draft.architectures:
        arch, whose = draft.architectures[0], f"the draft {serve.draft_model}"
    else:
        return Kind(None, f"{flag} with the draft {serve.draft_model}, whose architecture is unknown (lint its "
                          "directory with --draft): an MTP head or an EAGLE-1/2 draft cannot be told apart", True)
    if arch is None:
        return Kind(None, f"{flag} with {whose}, whose architecture is unknown (--target): MTP or EAGLE-1 cannot be "
                          "told apart", True)
    dc = sglang_draft_class(arch, version)
    at = f"sglang {'.'.join(map(str, version))}" if version else "the newest sglang (version not pinned)"
    if any(r.served == arch for r in SD.REWRITES):  # already an MTP class (an exported NextN head): loaded as it is
        return Kind(Consumer.mtp, f"{flag} with {whose}: {arch} is an MTP class SGLang loads as it is ({SD.SOURCE})")
    if not dc.known:
        return Kind(None, f"{flag} with {whose} ({arch}): {dc.source}", True)
    if dc.served is not None:
        return Kind(Consumer.mtp, f"{flag} with {whose}: {at} loads {arch} as {dc.served} ({SD.SOURCE})")
    if own:
        return Kind(None, f"{flag} without a draft path: {at} would load the target checkpoint ({arch}) itself as "
                          f"the draft, and has no MTP class for it ({SD.SOURCE})", broken=True)
    if arch in EAGLE1_ARCHS or "eagle" in arch.lower():
        return Kind(Consumer.eagle1, f"{flag} with the EAGLE draft {serve.draft_model} ({arch})")
    return Kind(None, f"{flag} with the draft {serve.draft_model} ({arch}): {at} has no MTP class for it and it is "
                      "not an EAGLE draft", broken=True)


def draft_kind(d: DraftInfo | None) -> Kind:
    """What the draft files are; None when they do not say (a bare checkpoint, an odd config)."""
    if d is None:
        return Kind(None, "no draft given")
    cfg = d.config
    mt = cfg.get("speculators_model_type") if isinstance(cfg.get("speculators_model_type"), str) else None
    if mt:
        k = {"mtp": Consumer.mtp, "eagle3": Consumer.eagle3_aux, "peagle": Consumer.p_eagle,
             "dflash": Consumer.dflash, "dspark": Consumer.dflash, "eagle": Consumer.eagle1}.get(mt)
        return Kind(k, f"speculators_model_type {mt!r}")
    if "medusa_num_heads" in cfg or any("medusa" in a.lower() for a in d.architectures):
        return Kind(Consumer.medusa, "medusa_num_heads in the draft config")
    arch = next((a for a in d.architectures if a in EAGLE1_ARCHS), None)
    if arch:
        return Kind(Consumer.eagle1, f"architecture {arch}")
    if any(k in cfg for k in MTP_LAYER_KEYS) and any("mtp" in a.lower() or "nextn" in a.lower()
                                                     for a in d.architectures):
        return Kind(Consumer.mtp, f"architecture {d.architectures[0]} with MTP layers")
    if _safeailab_eagle1(d):
        return Kind(Consumer.eagle1, "checkpoint: fc [h, 2h] and layer 0 attention reads h (SafeAILab EAGLE-1 layout)")
    e3 = d.is_eagle3
    if e3:
        return Kind(Consumer.eagle3_aux, "EAGLE-3 draft (architecture, aux ids or fc width)")
    return Kind(None, "the draft config and checkpoint name no method")


def _safeailab_eagle1(d: DraftInfo) -> bool:
    """SafeAILab EAGLE-1/2 (``ea_config``) and HASS checkpoints: ``fc`` maps cat(embed, hidden)
    [h, 2h] and the decoder layer's attention reads h; an EAGLE-3 midlayer's q_proj reads 2h."""
    ck, h = d.checkpoint, d.hidden_size
    if ck is None or not h or d.ids_top is not None or d.ids_nested is not None:
        return False
    fc, q = ck.find("fc.weight"), ck.find("layers.0.self_attn.q_proj.weight")
    return (fc is not None and q is not None and fc.shape == (h, 2 * h) and len(q.shape) == 2 and q.shape[1] == h
            and ck.find("d2t") is None and ck.find("midlayer.self_attn.q_proj.weight") is None)


def family(target: TargetInfo | None) -> str | None:
    """The target's name a consumer row is keyed by (model_type or architecture), or its first name."""
    if target is None:
        return None
    for key in target.keys:
        if any(key in fam for fam in FAMILIES):
            return key
    return target.keys[0] if target.keys else None


def in_family(name: str | None, fam: frozenset[str]) -> bool:
    return name is not None and name in fam


def mtp_layers(cfg: dict[str, Any] | None, where: Any = None) -> tuple[int | None, str | None]:
    """(count, key) of the MTP layers a config declares, top level or in ``text_config``."""
    for prefix in ("", "text_config."):
        for key in MTP_LAYER_KEYS:
            if dig(cfg, prefix + key) is not None:
                return int_at(cfg, prefix + key, where), prefix + key
    return None, None


def steps(serve: ServeInfo | None) -> int | None:
    """Draft steps per round: SGLang --speculative-num-steps, vLLM num_speculative_tokens."""
    if serve is None:
        return None
    return serve.num_steps if serve.runtime == "sglang" else serve.num_speculative_tokens
