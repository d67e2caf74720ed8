"""SHP: tensor shapes of the draft against the target and the server's slot count."""

from __future__ import annotations

from collections.abc import Iterator

from consistency.contract import conventions as cv
from consistency.contract.models import Consumer
from consistency.lint.context import Context, NotEvaluated
from consistency.lint.rules.base import EAGLE3, E, Hit, rule


def _target_hidden(ctx: Context) -> tuple[int, str]:
    if ctx.target_hidden:
        return ctx.target_hidden, "the target's hidden size"
    d = ctx.draft
    if d is not None and d.target_hidden_size:
        return d.target_hidden_size, "the draft's target_hidden_size"
    raise NotEvaluated("the target's hidden size is unknown (--target CONFIG)")


def _fc(ctx: Context) -> tuple[int, int]:
    ck = ctx.need_checkpoint()
    fc = ck.find("fc.weight")
    if fc is None or len(fc.shape) != 2:
        raise NotEvaluated("the checkpoint has no 2-D fc.weight (see SHP002 for the layout)")
    return fc.shape[0], fc.shape[1]


@rule("SHP001", "fc-width", E, "fc input width is not (slots fed) x (target hidden size)",
      "EAGLE-3 fc: Linear(n * H_target, H_draft) in sglang llama_eagle3.py, vllm llama_eagle3.py, speculators core.py",
      "feed as many aux states as the fc was trained on (the id count), or retrain the fc for the new count",
      applies_to=EAGLE3)
def fc_width(ctx: Context) -> Iterator[Hit]:
    _out, width = _fc(ctx)
    h, what = _target_hidden(ctx)
    if ctx.plan is not None and ctx.plan.streams is not None:
        slots, who = len(ctx.plan.streams), f"{ctx.plan.label} feeds"
    elif ctx.training is not None and ctx.training.streams is not None:
        slots, who = len(ctx.training.streams), "training used"
    else:
        raise NotEvaluated("neither the serving nor the training slot count is known")
    if width != slots * h:
        k = f"{width / h:g}"
        yield Hit(f"fc.weight takes {width} = {k} x {h} inputs ({what}), but {who} {slots} slot(s) = {slots * h}",
                  key=cv.NESTED_IDS if ctx.plan and ctx.plan.key == cv.NESTED_IDS else None,
                  evidence={"fc_in": width, "slots": slots, "hidden": h})


@rule("SHP002", "hidden-size", E, "draft hidden sizes disagree with the target or with each other",
      "sglang llama_eagle3.py (target_hidden_size, 2H-wide q/k/v); speculators load_verifier_weights "
      "('Verifier hidden size ... does not match draft hidden size')",
      "set target_hidden_size to the target's hidden size; keep fc out, q_proj in / 2 and the embedding width "
      "equal to the draft's hidden size")
def hidden_size(ctx: Context) -> Iterator[Hit]:
    d = ctx.need_draft()
    ht = ctx.target_hidden
    checked = False
    hd = d.hidden_size
    if d.config and ht:
        checked = True
        if d.target_hidden_size and d.target_hidden_size != ht:
            yield Hit(f"target_hidden_size is {d.target_hidden_size} but the target's hidden size is {ht}",
                      key="target_hidden_size")
        elif hd and hd != ht and not d.target_hidden_size:
            extra = (" (speculators requires the draft's hidden size to equal the verifier's)"
                     if d.format == "speculators" else "; set target_hidden_size")
            yield Hit(f"the draft's hidden size is {hd}, the target's {ht}, and no target_hidden_size says so{extra}",
                      key="hidden_size")
    ck = d.checkpoint
    eagle3 = ctx.kind in (Consumer.eagle3_aux, Consumer.p_eagle, None)  # MTP/EAGLE-1/Medusa have no EAGLE-3 fc
    if ck is not None:
        fc = ck.find("fc.weight")
        if fc is None and eagle3:
            checked = True
            yield Hit("the checkpoint has no fc.weight: no EAGLE-3 server can load it")
        hd = hd or (fc.shape[0] if fc is not None and len(fc.shape) == 2 and eagle3 else None)
        if hd:
            checked = True
            eagle3_dims = (("fc.weight", 0, hd), ("layers.0.self_attn.q_proj.weight", 1, 2 * hd)) if eagle3 else ()
            for name, dim, want in (*eagle3_dims, ("embed_tokens.weight", 1, hd), ("lm_head.weight", 1, hd)):
                t = ck.find(name)
                if t is not None and len(t.shape) == 2 and t.shape[dim] != want:
                    yield Hit(f"{t.name} is {list(t.shape)}: dim {dim} should be {want} for a draft of hidden size "
                              f"{hd}{' (embeddings and fc output concatenated)' if want == 2 * hd else ''}",
                              file=t.file)
    if not checked:
        raise NotEvaluated("needs the draft config with --target, or the draft checkpoint")


@rule("SHP003", "vocab-size", E, "draft vocabularies disagree with the target's or with each other",
      "sglang llama_eagle3.py (draft_vocab_size, lm_head); speculators DraftVocabMixin (t2d over the target vocab)",
      "build the draft for the target's tokenizer; draft_vocab_size = lm_head rows <= target vocab")
def vocab_size(ctx: Context) -> Iterator[Hit]:
    d = ctx.need_draft()
    vt, vd = ctx.target_vocab, d.draft_vocab_size
    checked = False
    if vt and d.vocab_size and d.vocab_size != vt:
        checked = True
        yield Hit(f"the draft was built for a vocabulary of {d.vocab_size}, the target has {vt}",
                  key="transformer_layer_config.vocab_size" if d.format == "speculators" else "vocab_size")
    if vt and vd:
        checked = True
        if vd > vt:
            yield Hit(f"draft_vocab_size {vd} exceeds the target's vocabulary {vt}", key="draft_vocab_size")
    ck = d.checkpoint
    if ck is not None:
        lm = ck.find("lm_head.weight")
        if lm is not None and vd and len(lm.shape) == 2:
            checked = True
            if lm.shape[0] != vd:
                yield Hit(f"lm_head.weight has {lm.shape[0]} rows but draft_vocab_size is {vd}", file=lm.file,
                          key="draft_vocab_size")
        emb = ck.find("embed_tokens.weight")
        if emb is not None and vt and len(emb.shape) == 2:
            checked = True
            if emb.shape[0] != vt:
                yield Hit(f"embed_tokens.weight has {emb.shape[0]} rows but the target vocabulary is {vt}",
                          file=emb.file)
    if not checked:
        raise NotEvaluated("needs vocabulary sizes from --target and the draft config or checkpoint")


@rule("SHP004", "aux-count", E, "the server sizes the fc for another number of aux states than the checkpoint has",
      "sglang llama_eagle3.py / vllm llama_eagle3.py: num_aux = num_aux_hidden_states > len(eagle_config ids) > 3 "
      "(top-level ids ignored; vLLM PR #54598, open)",
      "set num_aux_hidden_states (or eagle_config ids of that length) to the fc's slot count", applies_to=EAGLE3)
def aux_count(ctx: Context) -> Iterator[Hit]:
    plan = ctx.need_plan()
    d = ctx.need_config()
    _out, width = _fc(ctx)
    h, _what = _target_hidden(ctx)
    if d.num_aux_hidden_states is not None:
        num, why = d.num_aux_hidden_states, "num_aux_hidden_states"
    elif d.ids_nested:
        num, why = len(d.ids_nested), "len(eagle_config.eagle_aux_hidden_state_layer_ids)"
    else:
        num, why = 3, "the built-in 3 (no num_aux_hidden_states, no eagle_config ids)"
    if width % h == 0 and width // h != num:
        yield Hit(f"{plan.runtime} builds the fc for {num} aux states ({why}) but fc.weight takes {width // h} x {h}: "
                  "loading the weights fails", key="num_aux_hidden_states")


RULES = (fc_width, hidden_size, vocab_size, aux_count)
