"""Training files built by the upstream data pipelines themselves (test-time references).

* speculators 0.9.0 ``build_speculator_training_dataset`` (installed): rows per assistant turn
  with render-boundary loss masks. Its tokenizer is vLLM's ``/render`` endpoint, which cannot
  run here: the stand-in applies the same chat template with the HF tokenizer and truncates
  as the endpoint does (``truncation_side="right"``). The hidden states are what vLLM's
  connector writes (``hs_{i}.safetensors``: ``hidden_states`` [T, n, H], ``token_ids``), from
  a real target's forward, beside the dataset ``save_to_disk`` wrote (its loss mask).
* SpecForge 0.2.0 ``build_eagle3_dataset`` (the pinned wheel's ``specforge/data``, unpacked by
  scripts/upstream_sources.py; skipped when absent): input ids and the assistant-span loss
  mask from its chat-template registry, saved as ``prepare_hidden_states.py`` saves a
  sample (``data_{i}.ckpt``: aux_hidden_state, hidden_state, input_ids, loss_mask).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

CHATML = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
          "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")
SPECIAL = ["<|im_start|>", "<|im_end|>", "user", "assistant", "system"]


def word_tokenizer(vocab: int) -> Any:
    """A word-level tokenizer whose ids are a tiny target's whole vocabulary (word ``w{i}`` is
    id i; the chat template's tokens are ids 0..4), with a ChatML-style chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {w: i for i, w in enumerate(SPECIAL)} | {f"w{i}": i for i in range(len(SPECIAL), vocab)}
    tk = Tokenizer(models.WordLevel(words, unk_token="w5"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="w5", pad_token="w6")
    tok.chat_template = CHATML
    return tok


def text(ids: np.ndarray) -> str:
    return " ".join(SPECIAL[i] if i < len(SPECIAL) else f"w{i}" for i in ids.tolist())


def render_stand_in(tok: Any):  # noqa: ANN201
    """vLLM's /render (speculators data_generation/render_client.py): the chat template applied
    and tokenized, right-truncated to ``truncate_prompt_tokens``."""
    def render(endpoint: str, messages: list, *, add_generation_prompt: bool, tools: Any = None,
               truncate_prompt_tokens: int | None = None, truncation_side: str = "right") -> list[int]:
        out = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
        ids = list(out["input_ids"] if hasattr(out, "keys") else out)
        return ids[:truncate_prompt_tokens] if truncate_prompt_tokens else ids
    return render


def speculators_rows(conversations: list[list[dict]], tok: Any, max_length: int = 512) -> Any:
    """speculators' own preprocessing on these conversations (one row per assistant turn)."""
    import datasets
    from speculators.data_generation import preprocessing as P

    saved = P.render_conversation
    P.render_conversation = render_stand_in(tok)
    try:
        ds = datasets.Dataset.from_dict({"conversations": conversations})
        return P.build_speculator_training_dataset(ds, tok, max_length=max_length, num_proc=1,
                                                   render_endpoint="http://render.stand-in")
    finally:
        P.render_conversation = saved


@torch.no_grad()
def streams(model: Any, ids: np.ndarray) -> dict[int | str, np.ndarray]:
    """Residual stream s (pre-norm, s = N included: vLLM's layer-N capture) and ``final_norm``."""
    from consistency.record.hf import capture_streams

    got, _ = capture_streams(model, torch.as_tensor(ids)[None], components=False)
    out: dict[int | str, np.ndarray] = {int(k.split(".")[1]): v[0].float().numpy() for k, v in got.items()
                                        if k.startswith("hidden.")}
    out["final_norm"] = got["final_norm"][0].float().numpy()
    return out


def speculators_files(root: Path, rows: Any, model: Any, layers: list[int]) -> list[Path]:
    """The dataset at ``root`` and ``root/hidden_states/hs_{i}.safetensors`` as vLLM's
    connector writes them (``hidden_states`` = stack of the captured layers, ``token_ids``)."""
    from safetensors.numpy import save_file

    rows.save_to_disk(str(root))
    (root / "hidden_states").mkdir(parents=True, exist_ok=True)
    out = []
    for i in range(len(rows)):
        ids = np.asarray(rows[i]["input_ids"], np.int64)
        hs = streams(model, ids)
        stack = np.ascontiguousarray(np.stack([hs[s] for s in layers], 1), np.float32)
        p = root / "hidden_states" / f"hs_{i}.safetensors"
        save_file({"hidden_states": stack, "token_ids": ids}, str(p))
        out.append(p)
    return out


def specforge_tree() -> Path | None:
    import os

    base = Path(os.environ.get("CONSISTENCY_UPSTREAM") or Path.home() / ".cache" / "consistency-upstream")
    tree = base / "specforge-0.2.0"
    return tree if (tree / "specforge" / "data" / "preprocessing.py").is_file() else None


def specforge_rows(conversations: list[list[dict]], tok: Any, template: str, max_length: int = 512) -> Any:
    import datasets

    tree = specforge_tree()
    assert tree is not None
    if str(tree) not in sys.path:
        sys.path.insert(0, str(tree))
    from specforge.data.preprocessing import build_eagle3_dataset

    ds = datasets.Dataset.from_dict({"id": [str(i) for i in range(len(conversations))], "conversations": conversations})
    return build_eagle3_dataset(ds, tok, chat_template=template, max_length=max_length, num_proc=1, shuffle_seed=0)


def specforge_file(path: Path, ids: np.ndarray, mask: np.ndarray, model: Any, aux: list[int]) -> Path:
    """One sample as SpecForge's prepare_hidden_states.py saves it (torch.save of a dict)."""
    hs = streams(model, ids)
    torch.save({"input_ids": torch.as_tensor(ids), "loss_mask": torch.as_tensor(mask),
                "hidden_state": torch.as_tensor(hs["final_norm"])[None],
                "aux_hidden_state": torch.as_tensor(np.concatenate([hs[s] for s in aux], -1))[None]}, path)
    return path
