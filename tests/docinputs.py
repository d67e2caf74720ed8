"""Inputs a docs page's commands assume the reader has, built for the docs sweep.

A page names a set in a setup line, ``<!-- docs-test setup: python ROOT/tests/docinputs.py
SET -->`` (run in the page's working directory, before its commands): the files are built
from the repository's fixtures and the built-in tiny models, never downloaded, so the
page's shown output is held to what these inputs really give.

Sets:
- ``configs``: the fixture targets under the names the pages use (``kimi-k2.5.json``,
  ``deepseek-v3.json``, and ``kimi-k2.json``: DeepSeek-V3's config without its MTP layer) and the seed's SGLang draft config as the
  directories ``kimi-eagle3/``, ``kimi-draft/`` and ``draft/``, plus ``train.safetensors``
  recording training streams [0, 3, 31] (the seed story's);
- ``dumps``: ``train.safetensors`` and ``serve.safetensors`` of the tutorial (the built-in
  tiny Llama, training streams [0, 3, 7], SGLang 0.5.5 serving ids [2, 6, 9] in bf16), and
  ``ref.safetensors`` (a copy of the training dump); ``serve.npz``, the fixed serving side
  (streams [0, 3, 7], bf16), and ``contract.yaml`` naming those streams;
- ``gate``: ``consistency.toml`` with two lints of the seed's draft, fixed (passes) and as
  served (fails);
- ``hostile-ckpt``: ``data_0.ckpt``, a SpecForge record whose pickle would run a command, and
  the ``dumps`` set (its ``serve.safetensors``).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = ("Speculative decoding drafts several tokens with a small model and verifies them with the target in one "
          "pass; the draft must see exactly the hidden states it was trained on.")


def configs(here: Path) -> None:
    import numpy as np

    from consistency.contract.models import AuxInfo, DumpMetadata
    from consistency.dump.writer import write_dump

    targets = ROOT / "fixtures" / "configs" / "targets"
    for name in ("kimi-k2.5.json", "deepseek-v3.json"):
        shutil.copyfile(targets / name, here / name)
    # Kimi-K2: DeepSeek-V3's architecture and size, without its MTP layer
    text = (targets / "deepseek-v3.json").read_text()
    assert '"num_nextn_predict_layers": 1,' in text
    (here / "kimi-k2.json").write_text(text.replace('"num_nextn_predict_layers": 1,', '"num_nextn_predict_layers": 0,'))
    seed = ROOT / "fixtures" / "configs" / "drafts" / "sglang" / "kimi-k2.5-eagle3-seed.json"
    for d in ("kimi-eagle3", "kimi-draft", "draft"):
        (here / d).mkdir(exist_ok=True)
        shutil.copyfile(seed, here / d / "config.json")
    rng = np.random.default_rng(0)
    aux = {f"aux.{i}": rng.standard_normal((4, 8)).astype(np.float32) for i in range(3)}
    write_dump(here / "train.safetensors", aux, DumpMetadata(side="training", aux=AuxInfo(stream_ids=[0, 3, 31])),
               force=True)


def dumps(here: Path) -> None:
    from consistency.record.api import record_reference, record_serving, resolve_streams
    from consistency.record.models import load_model, tokenize

    model = load_model("tiny-llama")
    ids = tokenize(model, "tiny-llama", PROMPT)
    train = [0, 3, 7]
    record_reference(model, ids, here / "train.safetensors", train, native_ids=train, convention="stream", force=True)
    served = load_model("tiny-llama", dtype="bfloat16")
    streams, _ = resolve_streams(served, [2, 6, 9], "sglang@0.5.5")
    record_serving(served, ids, here / "serve.safetensors", streams, native_ids=[2, 6, 9], convention="sglang@0.5.5",
                   runtime="sglang@0.5.5", force=True)
    shutil.copyfile(here / "train.safetensors", here / "ref.safetensors")
    # the fixed serving side, as npz, and a contract of the streams training used
    fixed = load_model("tiny-llama", dtype="bfloat16")
    record_serving(fixed, ids, here / "serve.npz", train, native_ids=train, convention="stream", force=True)
    (here / "contract.yaml").write_text("target: {num_layers: 12, hidden_size: 64}\nslots:\n  - {stream: 0}\n"
                                        "  - {stream: 3}\n  - {stream: 7}\n")


def hostile_ckpt(here: Path) -> None:
    """``data_0.ckpt``: a SpecForge-shaped torch.save whose pickle would run ``os.system``."""
    import os

    import torch

    class Payload:
        def __reduce__(self):  # noqa: ANN204
            return (os.system, ("touch pwned",))

    torch.save({"aux_hidden_state": torch.zeros(1, 4, 24), "evil": Payload()}, here / "data_0.ckpt")


def gate(here: Path) -> None:
    """``consistency.toml`` of two lints of the seed's Kimi-K2.5 draft: as served (fails) and fixed (passes)."""
    fx = ROOT / "fixtures" / "configs"
    target = fx / "targets" / "kimi-k2.5.json"
    checks = [("kimi-fixed", "kimi-k2.5-eagle3-fixed.json", "sglang@0.5.23"),
              ("kimi-seed", "kimi-k2.5-eagle3-seed.json", "sglang@0.5.12")]
    (here / "consistency.toml").write_text("".join(
        f'[[lint]]\nname = "{name}"\ndraft = "{fx / "drafts" / "sglang" / draft}"\ntarget = "{target}"\n'
        f'runtime = "{runtime}"\ntrained_with = "stream:0,3,31"\n\n' for name, draft, runtime in checks))


SETS = {"configs": configs, "dumps": dumps, "hostile-ckpt": hostile_ckpt, "gate": gate}


def build(name: str, here: Path, cache: Path | None) -> None:
    """The set in ``here``; built once per ``cache`` (``dumps`` records two models: seconds) and
    copied from there for every later page."""
    if cache is None:
        SETS[name](here)
        return
    done = cache / name
    if not (done / ".complete").is_file():
        tmp = cache / f".{name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        SETS[name](tmp)
        (tmp / ".complete").write_text("")
        shutil.rmtree(done, ignore_errors=True)
        tmp.rename(done)
    for src in done.iterdir():
        if src.name == ".complete":
            continue
        dst = here / src.name
        if src.is_dir():
            shutil.copytree(src, dst, dirs_exist_ok=True)
        else:
            shutil.copyfile(src, dst)


if __name__ == "__main__":
    # the pages run from out/docs/<page>/: out/docs/.inputs keeps each set for the next page
    root = next((p for p in [Path.cwd(), *Path.cwd().parents] if p.name == "out"), None)
    for name in sys.argv[1:]:
        build(name, Path.cwd(), root / "docs" / ".inputs" if root is not None else None)
