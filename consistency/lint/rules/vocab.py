"""VOC: the draft-to-target vocabulary map (``d2t`` offsets, ``t2d`` mask)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from consistency.lint.context import Context, NotEvaluated
from consistency.lint.draft import Checkpoint, DraftInfo
from consistency.lint.rules.base import EAGLE3, E, W, Hit, rule

_OFFSETS = "target id = i + d2t[i] (sglang llama_eagle3.py hot_token_id; vllm llama_eagle3.py compute_logits)"


def _sizes(ctx: Context) -> tuple[DraftInfo, Checkpoint, int, int]:
    d, ck = ctx.need_draft(), ctx.need_checkpoint()
    vt = ctx.target_vocab or d.vocab_size
    t2d = ck.find("t2d")
    vt = vt or (t2d.shape[0] if t2d is not None and len(t2d.shape) == 1 else None)
    lm, d2t = ck.find("lm_head.weight"), ck.find("d2t")
    vd = d.draft_vocab_size or (lm.shape[0] if lm is not None and len(lm.shape) == 2 else None) or (
        d2t.shape[0] if d2t is not None and len(d2t.shape) == 1 else None)
    if not vt or not vd:
        raise NotEvaluated("target or draft vocabulary size unknown (--target, draft_vocab_size or lm_head.weight)")
    return d, ck, vt, vd


def _d2t(ck: Checkpoint) -> np.ndarray | None:
    t = ck.find("d2t")
    if t is None:
        return None
    v = ck.read_small("d2t")
    if v is None:
        raise NotEvaluated(f"d2t has {t.shape} elements, more than this linter reads")
    return v.reshape(-1)


@rule("VOC001", "d2t-missing", E, "the draft vocabulary is smaller than the target's but there is no d2t",
      "sglang eagle_worker_v2.py (no d2t: hot_token_id None, draft ids used as target ids); vllm llama_eagle3.py "
      "(zero-initialised offsets); NeMo Automodel PR #2447",
      "save the d2t offsets the draft was trained with (SpecForge vocab_mapping.pt, speculators d2t buffer)",
      applies_to=EAGLE3)
def d2t_missing(ctx: Context) -> Iterator[Hit]:
    _d, ck, vt, vd = _sizes(ctx)
    if vd < vt and ck.find("d2t") is None:
        yield Hit(f"draft vocabulary {vd} < target vocabulary {vt} and the checkpoint has no d2t: the server maps "
                  f"draft id i to target id i, so almost every drafted token is wrong", key="draft_vocab_size")


@rule("VOC002", "d2t-identity", E, "d2t is all zeros (the identity) while the draft vocabulary is smaller",
      "SpecForge/speculators initialise d2t to zeros before the vocab mapping is loaded; NeMo Automodel PR #2447",
      "write the trained offsets (d2t[i] = target_id(i) - i) into the checkpoint", applies_to=EAGLE3)
def d2t_identity(ctx: Context) -> Iterator[Hit]:
    _d, ck, vt, vd = _sizes(ctx)
    v = _d2t(ck)
    if v is None:
        raise NotEvaluated("no d2t in the checkpoint (see VOC001)")
    if vd < vt and v.size and not np.any(v):
        yield Hit(f"d2t has {v.size} zeros: draft id i becomes target id i, i.e. only the first {vd} target "
                  f"tokens of {vt} can ever be drafted", file=ck.find("d2t").file)


@rule("VOC003", "d2t-absolute", E,
      "i + d2t[i] leaves the target vocabulary or repeats: d2t holds absolute ids or is corrupt",
      _OFFSETS + "; verl-SpeCo PR #67 (arange-based d2t double-counted)",
      "store offsets, d2t[i] = target_id(i) - i, with distinct target ids", applies_to=EAGLE3)
def d2t_absolute(ctx: Context) -> Iterator[Hit]:
    _d, ck, vt, _vd = _sizes(ctx)
    v = _d2t(ck)
    if v is None:
        raise NotEvaluated("no d2t in the checkpoint (see VOC001)")
    f = ck.find("d2t").file
    if v.dtype.kind not in "iu":
        yield Hit(f"d2t is {v.dtype}, not an integer tensor", file=f)
        return
    tgt = np.arange(v.size, dtype=np.int64) + v.astype(np.int64)
    out = np.flatnonzero((tgt < 0) | (tgt >= vt))
    if out.size:
        looks_abs = bool(np.all(v >= 0) and np.all(v < vt) and np.all(np.diff(v) > 0))
        i = int(out[0])
        yield Hit(f"{out.size} of {v.size} entries map outside 0..{vt - 1} (first: i={i}, d2t[i]={int(v[i])}, "
                  f"i + d2t[i] = {int(tgt[i])})" + ("; d2t looks like absolute target ids, not offsets"
                                                     if looks_abs else ""), file=f)
    elif np.unique(tgt).size != tgt.size:
        yield Hit(f"{tgt.size - np.unique(tgt).size} draft ids map to a target id another draft id already has",
                  file=f)


@rule("VOC004", "t2d-count", E, "t2d does not mark exactly draft-vocab many of the target's tokens",
      "speculators model.py load_vocab_mappings (t2d.sum() == draft_vocab_size, len == target vocab); SpecForge "
      "initialises t2d to all True",
      "save the trained t2d mask: a boolean over the target vocabulary with draft_vocab_size True entries",
      applies_to=EAGLE3)
def t2d_count(ctx: Context) -> Iterator[Hit]:
    _d, ck, vt, vd = _sizes(ctx)
    t = ck.find("t2d")
    if t is None:
        raise NotEvaluated("no t2d in the checkpoint (SGLang and vLLM skip it; ModelOpt does not export it)")
    v = ck.read_small("t2d")
    if v is None:
        raise NotEvaluated("t2d is larger than this linter reads")
    v = v.reshape(-1)
    if v.size != vt:
        yield Hit(f"t2d has {v.size} entries, the target vocabulary {vt}", file=t.file)
    count = int(np.count_nonzero(v))
    if count != vd:
        yield Hit(f"t2d marks {count} target tokens but the draft vocabulary has {vd}"
                  + (" (all True: the untrained default)" if count == v.size else ""), file=t.file)


@rule("VOC005", "d2t-t2d-disagree", W, "d2t and t2d describe different draft vocabularies",
      "SpecForge data/preprocessing.py (d2t = used_tokens[i] - i, t2d = i in used_tokens)",
      "regenerate both from the same token list (the server uses d2t; training used t2d to slice lm_head)",
      applies_to=EAGLE3)
def d2t_t2d(ctx: Context) -> Iterator[Hit]:
    _d, ck, vt, _vd = _sizes(ctx)
    v, t = _d2t(ck), ck.read_small("t2d") if ck.find("t2d") is not None else None
    if v is None or t is None:
        raise NotEvaluated("needs both d2t and t2d in the checkpoint")
    t = t.reshape(-1).astype(bool)
    if v.dtype.kind not in "iu":
        return
    tgt = np.arange(v.size, dtype=np.int64) + v.astype(np.int64)
    ok = (tgt >= 0) & (tgt < t.size)
    marked = set(np.flatnonzero(t).tolist())
    mapped = set(tgt[ok].tolist())
    if mapped != marked:
        yield Hit(f"{len(mapped - marked)} target ids reached through d2t are not marked in t2d and "
                  f"{len(marked - mapped)} marked ones are unreachable", file=ck.find("d2t").file)


RULES = (d2t_missing, d2t_identity, d2t_absolute, t2d_count, d2t_t2d)
