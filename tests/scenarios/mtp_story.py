"""The MTP story of docs/tutorial-low-acceptance.md: write its two dumps on a tiny target.

``python -m tests.scenarios.mtp_story speculators train.safetensors serve.safetensors``
    a Qwen3-family target with an MTP head fine-tuned by speculators (step 0 fed the vLLM
    layer-N capture: stream N *pre*-norm) and served by vLLM (``fnorm(s=N)``).
``python -m tests.scenarios.mtp_story vllm-0.23 train.safetensors serve.safetensors``
    a DeepSeek-V3 target with an MTP head trained as Megatron-LM does (``fnorm(s=N)``, recycle
    ``d_norm``, position 0 kept), served by vLLM before #45895 (steps >= 1 recycle ``d_raw``;
    vLLM zeroes the position-0 embedding).
``speculators-fixed`` / ``vllm-0.24``: the same after the fix (training on ``fnorm(s=N)``;
vLLM with #45895). A side given as ``-`` is not written (an existing file is never replaced).

On a real deployment the training side comes from the trainer's data step and the serving
side from the runtime's capture patch; here both are our own draft (tests/scenarios/mtp_build.py)
written with the project's dump writer, the serving side in bf16.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

from tests.scenarios import containers as C
from tests.scenarios.mtp_build import SideSpec, run_cached, target, target_tensors

_ALL = SideSpec(aux_rows="step")  # aux.0 as consistency.record.draft writes it: step 0's T-1 rows
_SPEC_TRAIN = ("speculators", replace(_ALL, step0="none"))  # verifier_last_hidden_states: the layer-N capture
_MEGATRON = ("megatron", _ALL)  # fnorm(s=N), recycle d_norm, position 0 kept
STORIES = {
    # story -> (family, (training runtime, spec), (serving runtime, version, spec))
    "speculators": ("qwen3", _SPEC_TRAIN, ("vllm", "0.24.0", _ALL)),
    "speculators-fixed": ("qwen3", ("speculators", _ALL), ("vllm", "0.24.0", _ALL)),
    "vllm-0.23": ("deepseek_v3", _MEGATRON, ("vllm", "0.23.1", replace(_ALL, recycle="d_raw", pos0="zeroed"))),
    "vllm-0.24": ("deepseek_v3", _MEGATRON, ("vllm", "0.24.0", replace(_ALL, pos0="zeroed"))),
}
STEPS, TOKENS = 3, 48


def write(story: str, train: Path, serve: Path) -> None:
    from consistency.contract.models import DumpMetadata, ModelInfo, RuntimeInfo
    from consistency.dump.writer import write_dump

    family, (t_rt, t_spec), (s_rt, s_ver, s_spec) = STORIES[story]
    t = target(family)
    model = ModelInfo(architecture=f"{family} (tiny)", num_layers=t.n, hidden_size=t.hidden_size)
    ref = {k: v.numpy() for k, v in target_tensors(t, TOKENS).items()} | dict(run_cached(family, "mtp", t_spec, STEPS,
                                                                                          TOKENS))
    cand = dict(run_cached(family, "mtp", s_spec, STEPS, TOKENS)) | {"input_ids": t.ids[:TOKENS].numpy()}
    said = []
    if str(train) != "-":
        write_dump(train, {k: np.array(v) for k, v in ref.items()},
                   DumpMetadata(side="training", runtime=RuntimeInfo(name=t_rt), model=model))
        said.append(f"{train} ({t_rt}: {len(ref)} tensors)")
    if str(serve) != "-":
        write_dump(serve, {k: (v if v.dtype.kind in "iub" else C._storage(np.array(v), "bfloat16"))
                           for k, v in cand.items()},
                   DumpMetadata(side="serving", runtime=RuntimeInfo(name=s_rt, version=s_ver), model=model))
        said.append(f"{serve} ({s_rt} {s_ver}, bfloat16: {len(cand)} tensors)")
    print("wrote " + " and ".join(said))


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] not in STORIES:
        sys.exit(f"usage: python -m tests.scenarios.mtp_story {{{','.join(STORIES)}}} TRAIN SERVE")
    write(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]))
