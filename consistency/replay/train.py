"""Train a small EAGLE-3 draft on CPU, the way speculators trains one (TTT), for fixtures.

Replay is only as convincing as its draft: a random draft is equally bad on every stream.
This trains a real one for a tiny seeded target on the training-side contract (HF hooks,
fp32, the aux streams the user names) in a minute or two, so that a correct stream list
gives a high acceptance and a shifted one visibly does not.

Training follows speculators' ``Eagle3DraftModel.forward`` with the loss of its TTT loop
(steps after the first are teacher-forced, their hidden state is the draft's own), with one
simplification: the loss is cross-entropy on the target's argmax instead of the KL to its
distribution. A random-init target's logits are nearly flat (std ~0.16 for tiny-llama), so
its softmax carries little signal; the argmax is the token greedy verification accepts, and
hard labels are the KL to the target sharpened without limit ("scaling its lm_head").
The draft vocabulary is the most frequent target labels (as SpecForge/speculators build it
from token frequencies), which exercises ``d2t``'s offset rule.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from consistency.replay.chain import run_chain
from consistency.replay.config import DraftConfig
from consistency.replay.draft import Eagle3Draft


@dataclass
class Batch:
    aux: torch.Tensor  # [b, t, n*H] fp32, training-side streams
    ids: torch.Tensor  # [b, t]
    labels: torch.Tensor  # [b, t] target argmax (its next token after ids[:, :p+1])

    def to(self, device: str) -> Batch:
        return Batch(self.aux.to(device), self.ids.to(device), self.labels.to(device))


def sequences(vocab: int, n: int, length: int, seed: int) -> torch.Tensor:
    """Diverse token sequences: uniform over the vocabulary, over small random alphabets
    (repetitive, text-like) and over the printable-byte range (what built-in models see
    when a prompt is tokenized as bytes)."""
    g = torch.Generator().manual_seed(seed)
    out = torch.empty(n, length, dtype=torch.long)
    for i in range(n):
        kind = i % 3
        if kind == 0:
            out[i] = torch.randint(0, vocab, (length,), generator=g)
        elif kind == 1:
            alphabet = torch.randperm(vocab, generator=g)[: int(torch.randint(8, 64, (1,), generator=g))]
            out[i] = alphabet[torch.randint(0, len(alphabet), (length,), generator=g)]
        else:
            lo, hi = min(32, vocab - 1), min(127, vocab)
            out[i] = torch.randint(lo, hi, (length,), generator=g) % vocab
    return out


@torch.no_grad()
def make_batch(target: Any, ids: torch.Tensor, streams: Sequence[int], chunk: int = 128) -> Batch:
    """Aux slots as the training side records them (HF hooks, pre-norm, fp32) and labels."""
    from consistency.record.hf import capture_streams

    aux, labels = [], []
    for s in range(0, ids.shape[0], chunk):
        part = ids[s:s + chunk]
        got, _ = capture_streams(target, part, components=False, logits=True)
        aux.append(torch.cat([got[f"hidden.{j}"].float() for j in streams], dim=-1))
        labels.append(got["logits"].argmax(-1))
    return Batch(torch.cat(aux), ids, torch.cat(labels))


def draft_vocab(labels: torch.Tensor, target_vocab: int, size: int) -> torch.Tensor:
    """The ``size`` most frequent label ids, sorted (speculators/SpecForge token-frequency map)."""
    counts = torch.bincount(labels.flatten().cpu(), minlength=target_vocab).double()
    counts += torch.linspace(1e-6, 0, target_vocab, dtype=torch.float64)  # deterministic tie-break
    return counts.topk(size).indices.sort().values


def new_config(target: Any, draft_vocab_size: int, intermediate: int = 256, **flags: bool) -> DraftConfig:
    tc = target.config
    h, heads = tc.hidden_size, tc.num_attention_heads
    kv = getattr(tc, "num_key_value_heads", heads) or heads
    layer = {"model_type": "llama", "hidden_size": h, "intermediate_size": intermediate, "num_hidden_layers": 1,
             "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": h // heads,
             "rms_norm_eps": 1e-6, "vocab_size": tc.vocab_size, "hidden_act": "silu",
             "max_position_embeddings": getattr(tc, "max_position_embeddings", 2048),
             "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "tie_word_embeddings": False}
    return DraftConfig("speculators", h, heads, kv, h // heads, intermediate, 1e-6, layer, tc.vocab_size,
                       draft_vocab_size, h, **flags)


def ttt_loss(draft: Eagle3Draft, b: Batch, t2d_index: torch.Tensor, steps: int) -> tuple[torch.Tensor, list[float]]:
    """Speculators' TTT: anchor i = (x[i+1], g[i]); step k predicts y[i+k+1]; tokens teacher-forced."""
    aux, nxt = b.aux[:, :-1], b.ids[:, 1:]
    t = nxt.shape[1]
    teacher = torch.stack([torch.cat([b.ids[:, 2 + k:], b.ids.new_zeros(b.ids.shape[0], 1 + k)], 1)[:, :t]
                           for k in range(steps)], dim=-1)
    out = run_chain(draft, aux, nxt, steps, feed="teacher", teacher=teacher, keep_logits=True)
    loss = torch.zeros(())
    accs = []
    for k, logits in enumerate(out.logits):
        y = b.labels[:, 1 + k:]  # y[i+k+1] for anchors i = 0..t-1-k
        lg = logits[:, : y.shape[1]]
        tgt = t2d_index[y]
        ok = tgt >= 0
        ce = torch.nn.functional.cross_entropy(lg[ok], tgt[ok]) if ok.any() else torch.zeros(())
        loss = loss + ce * (0.8 ** k)
        accs.append(float((draft.to_target(lg.argmax(-1)) == y).float().mean()))
    return loss, accs


def train(target: Any, streams: Sequence[int], *, seqs: int = 768, length: int = 96, vocab_size: int = 256,
          epochs: int = 6, batch: int = 24, ttt_steps: int = 3, lr: float = 3e-3, seed: int = 0, intermediate: int = 256, head_scale: float = 1.0,
          log: Any = None, device: str = "cpu", **flags: bool) -> tuple[Eagle3Draft, dict[str, Any]]:
    """Train a one-layer draft for ``target`` on aux ``streams``; deterministic for a seed."""
    torch.manual_seed(seed)
    vt = target.config.vocab_size
    data = make_batch(target, sequences(vt, seqs, length, seed).to(device), streams).to(device)
    held = make_batch(target, sequences(vt, 48, length, seed + 1000).to(device), streams).to(device)
    keep = draft_vocab(data.labels, vt, min(vocab_size, vt))
    cfg = new_config(target, len(keep), intermediate, **flags)
    draft = Eagle3Draft(cfg, len(streams), target.config.hidden_size, 1, vt, len(keep)).to(device)
    keep = keep.to(device)
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(target.get_input_embeddings().weight.float())
        draft.d2t.copy_(keep - torch.arange(len(keep), device=device))
        draft.lm_head.weight.copy_(target.get_output_embeddings().weight.float()[keep] * head_scale)  # speculators' init
    t2d_index = torch.full((vt,), -1, dtype=torch.long, device=device)
    t2d_index[keep] = torch.arange(len(keep), device=device)
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    total = epochs * (seqs // batch)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=total, pct_start=0.1)
    g = torch.Generator().manual_seed(seed)
    step = 0
    draft.train()
    for ep in range(epochs):
        order = torch.randperm(seqs, generator=g)
        for s in range(0, seqs - batch + 1, batch):
            idx = order[s:s + batch].to(device)
            loss, accs = ttt_loss(draft, Batch(data.aux[idx], data.ids[idx], data.labels[idx]), t2d_index, ttt_steps)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            step += 1
        if log is not None:
            log(f"epoch {ep + 1}/{epochs}: loss {float(loss.detach()):.3f}, step accuracies {[round(a, 3) for a in accs]}")
    draft.eval()
    with torch.no_grad():
        _, held_accs = ttt_loss(draft, held, t2d_index, ttt_steps)
    return draft, {"held_out_step_accuracy": held_accs, "draft_vocab_size": len(keep), "steps": step}


def fingerprint(model: Any) -> str:
    """A short hash of a target's weights: a committed draft is only valid for the same target."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(np.ascontiguousarray(t.detach().float().cpu().numpy()).tobytes())
    return h.hexdigest()[:16]


def save_speculators(draft: Eagle3Draft, out_dir: Path, aux_ids: Sequence[int], verifier: str,
                     extra: dict[str, Any] | None = None, speculative_tokens: int = 3) -> Path:
    """Write ``config.json`` (Eagle3SpeculatorConfig fields) and ``model.safetensors`` with
    speculators' tensor names; ``t2d`` is derived from ``d2t`` as speculators stores it."""
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = draft.cfg
    state = {k: v.detach().contiguous().clone() for k, v in draft.export_state().items()}
    t2d = torch.zeros(draft.target_vocab, dtype=torch.bool)
    t2d[torch.arange(draft.draft_vocab) + state["d2t"]] = True
    state["t2d"] = t2d
    doc = {
        "architectures": ["Eagle3DraftModel"], "speculators_model_type": "eagle3", "speculators_version": "0.9.0",
        "draft_vocab_size": draft.draft_vocab, "eagle_aux_hidden_state_layer_ids": list(aux_ids),
        "norm_before_residual": cfg.norm_before_residual, "norm_before_fc": cfg.norm_before_fc,
        "fc_norm": cfg.fc_norm, "norm_output": cfg.norm_output, "embed_requires_grad": False,
        "target_hidden_size": None, "tie_word_embeddings": False,
        "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                               "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                                                     "accept_tolerance": 0.0, "verifier_accept_k": 1}],
                               "verifier": {"name_or_path": verifier, "architectures": ["LlamaForCausalLM"]}},
        "transformer_layer_config": cfg.layer_config,
    }
    return _write_checkpoint(out_dir, state, doc, extra)


def save_sglang(draft: Eagle3Draft, out_dir: Path, layer_output_ids: Sequence[int],
                extra: dict[str, Any] | None = None) -> Path:
    """Write the SGLang/SpecForge export: ``LlamaForCausalLMEagle3`` config (aux ids nested under
    ``eagle_config``, meaning layer outputs), ``midlayer.*`` names, no ``embed_tokens``
    (SpecForge ``export/to_sglang.py`` drops it; the runtime borrows the target's)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = draft.cfg
    state = {k.replace("layers.0.", "midlayer.", 1) if k.startswith("layers.0.") else k: v.detach().contiguous().clone()
             for k, v in draft.export_state().items() if k != "embed_tokens.weight"}
    t2d = torch.zeros(draft.target_vocab, dtype=torch.bool)
    t2d[torch.arange(draft.draft_vocab) + state["d2t"]] = True
    state["t2d"] = t2d
    lc = cfg.layer_config
    doc = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": cfg.hidden_size,
           "intermediate_size": cfg.intermediate_size, "num_attention_heads": cfg.num_attention_heads,
           "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim, "num_hidden_layers": 1,
           "rms_norm_eps": cfg.rms_norm_eps, "hidden_act": cfg.hidden_act, "vocab_size": draft.target_vocab,
           "draft_vocab_size": draft.draft_vocab, "max_position_embeddings": lc.get("max_position_embeddings", 2048),
           "rope_theta": (lc.get("rope_parameters") or {}).get("rope_theta", 10000.0), "tie_word_embeddings": False,
           "torch_dtype": "float32", "norm_output": cfg.norm_output,
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(layer_output_ids), "use_aux_hidden_state": True}}
    return _write_checkpoint(out_dir, state, doc, extra)


def _write_checkpoint(out_dir: Path, state: dict[str, torch.Tensor], doc: dict[str, Any],
                      extra: dict[str, Any] | None) -> Path:
    """Weights then config, each atomically (a reader never sees half a checkpoint)."""
    from safetensors.torch import save

    from consistency.dump.atomic import write_bytes_atomic

    if extra:
        doc["consistency_fixture"] = extra
    write_bytes_atomic(out_dir / "model.safetensors", save(state, metadata={"format": "pt"}), force=True)
    write_bytes_atomic(out_dir / "config.json", (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode(), force=True)
    return out_dir
