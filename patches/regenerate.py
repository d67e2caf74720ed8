"""Regenerate the unified diffs in this folder from unpacked SGLang/vLLM wheels.

Usage::

    pip download sglang==0.5.21 --no-deps -d /tmp/w && unzip -q /tmp/w/sglang-0.5.21-*.whl -d /tmp/sgl0521
    python patches/regenerate.py --sglang-classic /tmp/sgl0521 --sglang-deepseek-classic /tmp/sgl05121 \\
        --sglang-boundary /tmp/sgl0523 --vllm /tmp/vllm0330

Each edit is data: an anchor line that must occur exactly once (verbatim upstream text)
and the line(s) added after it. Every patch adds one import and one call per captured
point, nothing else; the calls are inert unless CONSISTENCY_RECORD is set. Not imported
by the package; kept so the patches can be re-made for the next release.
"""

from __future__ import annotations

import argparse
import difflib
from pathlib import Path

IMPORT = "from consistency.record.patch import {names}  # consistency: inert unless CONSISTENCY_RECORD is set\n"
SIG_SGL_LLAMA = "    ) -> Union[torch.Tensor, Tuple[torch.Tensor, List[torch.Tensor]], PPProxyTensors]:\n"
SIG_VLLM_LLAMA = "    ) -> torch.Tensor | IntermediateTensors | tuple[torch.Tensor, list[torch.Tensor]]:\n"
SGL_DS_TOP = "        total_num_layers = self.end_layer - self.start_layer\n"
CLASSIC = "capture_aux(len(aux_hidden_states) - 1, aux_hidden_states[-1], hidden_states, residual)\n"
# MTP drafts (consistency/record/mtp_patch.py): what the draft is fed at step 0 and recycles after
IMPORT_MTP = "from consistency.record.mtp_patch import {names}  # consistency: inert unless CONSISTENCY_RECORD is set\n"


def _at(indent: int, text: str) -> str:
    return " " * indent + text


def after(anchor: str, added: str) -> tuple[str, str]:
    """(anchor, replacement): the added lines go right after the anchor."""
    return anchor, anchor + added


def before(anchor: str, added: str) -> tuple[str, str]:
    """(anchor, replacement): the added lines go right before the anchor."""
    return anchor, added + anchor


def inside(head: str, tail: str, added: str) -> tuple[str, str]:
    """The added lines go between two consecutive lines (when neither alone is unique)."""
    return head + tail, head + added + tail


# The import is local to the patched function (first statement), so a patch has one hunk
# per function and no hunk in the import block, whose neighbours change every release.
# patch file -> {path inside site-packages: [(anchor, its replacement)]}
SPECS: dict[str, dict[str, list[tuple[str, str]]]] = {
    "sglang-classic-llama.patch": {
        "sglang/srt/models/llama.py": [
            after(SIG_SGL_LLAMA, _at(8, IMPORT.format(names="capture_aux, capture_input_ids"))
             + _at(8, "capture_input_ids(input_ids, positions, forward_batch)\n")),
            after(_at(16, "aux_hidden_states.append(hidden_states + residual)\n"), _at(16, CLASSIC)),
        ],
    },
    "sglang-classic-deepseek_v2.patch": {
        "sglang/srt/models/deepseek_v2.py": [
            after(SGL_DS_TOP, _at(8, IMPORT.format(names="capture_aux, capture_input_ids"))
             + _at(8, "capture_input_ids(input_ids, positions, forward_batch)\n")),
            after(_at(24, "aux_hidden_states.append(hidden_states + residual)\n"), _at(20, CLASSIC)),
        ],
    },
    "sglang-boundary-llama.patch": {
        "sglang/srt/models/llama.py": [
            after(SIG_SGL_LLAMA, _at(8, IMPORT.format(names="capture_aux_states, capture_input_ids"))
             + _at(8, "capture_input_ids(input_ids, positions, forward_batch)\n")),
            after("        if len(aux_hidden_states) == 0:\n            return hidden_states\n\n",
                  _at(8, "capture_aux_states(aux_hidden_states)\n")),
        ],
    },
    "sglang-boundary-deepseek_v2.patch": {
        "sglang/srt/models/deepseek_v2.py": [
            after(SGL_DS_TOP, _at(8, IMPORT.format(names="capture_aux_states, capture_input_ids"))
             + _at(8, "capture_input_ids(input_ids, positions, forward_batch)\n")),
            after("        if len(aux_hidden_states) == 0:\n            return hidden_states\n",
                  _at(8, "capture_aux_states(aux_hidden_states)\n")),
        ],
    },
    "vllm-llama.patch": {
        "vllm/model_executor/models/interfaces.py": [
            after(_at(12, "aux_hidden_states.append(value)\n"),
                  _at(12, IMPORT.format(names="capture_aux"))
             + _at(12, "capture_aux(len(aux_hidden_states) - 1, value, hidden_states, residual)\n")),
        ],
        "vllm/model_executor/models/llama.py": [
            after(SIG_VLLM_LLAMA, _at(8, IMPORT.format(names="capture_input_ids")) + _at(8, "capture_input_ids(input_ids, positions)\n")),
        ],
    },
    "vllm-deepseek_v2.patch": {
        "vllm/model_executor/models/deepseek_v2.py": [
            inside("    ) -> torch.Tensor | IntermediateTensors:\n", "        if get_pp_group().is_first_rank:\n",
                   _at(8, IMPORT.format(names="capture_aux, capture_input_ids"))
                   + _at(8, "capture_input_ids(input_ids, positions)\n")),
            after(_at(16, "aux_hidden_states.append(aux_hidden_state)\n"), _at(16, CLASSIC)),
            after("        if self.end_layer in self.aux_hidden_state_layers:\n"
                  "            aux_hidden_states.append(hidden_states + residual)\n", _at(12, CLASSIC)),
        ],
    },
    "sglang-deepseek_nextn.patch": {
        "sglang/srt/models/deepseek_nextn.py": [  # DeepseekModelNextN.forward
            inside("            hidden_states = input_embeds\n\n", "            if hidden_states.shape[0] > 0:\n",
                   _at(12, IMPORT_MTP.format(names="capture_mtp_cat, capture_nextn_input, capture_nextn_output"))
                   + _at(12, "capture_nextn_input(input_ids, positions, forward_batch, hidden_states)\n")),
            after(_at(20, "hidden_states = self.eh_proj(eh_input)\n"), _at(16, "capture_mtp_cat(eh_input)\n")),
            after(_at(12, "exit_stack.close()\n"), _at(8, "capture_nextn_output(hidden_states, forward_batch)\n")),
        ],
    },
    "sglang-classic-deepseek_nextn.patch": {
        "sglang/srt/models/deepseek_nextn.py": [  # 0.5.12.post1: no try/finally, one indent less
            inside("            hidden_states = input_embeds\n\n", "        if hidden_states.shape[0] > 0:\n",
                   _at(8, IMPORT_MTP.format(names="capture_mtp_cat, capture_nextn_input, capture_nextn_output"))
                   + _at(8, "capture_nextn_input(input_ids, positions, forward_batch, hidden_states)\n")),
            after(_at(16, "hidden_states = self.eh_proj(eh_input)\n"), _at(12, "capture_mtp_cat(eh_input)\n")),
            before("        if _is_npu and self.quant_config is None:\n"
                   "            os.environ[\"SGLANG_DEEPEP_BF16_DISPATCH\"] = \"0\"\n",
                   _at(8, "capture_nextn_output(hidden_states, forward_batch)\n")),
        ],
    },
    "vllm-deepseek_mtp.patch": {
        "vllm/model_executor/models/deepseek_mtp.py": [
            # DeepSeekMultiTokenPredictorLayer.forward: masked embedding, concat parts, (d_raw, d_norm)
            after("        inputs_embeds = torch.where(positions.unsqueeze(-1) == 0, 0, inputs_embeds)\n",
                  _at(8, IMPORT_MTP.format(names="capture_mtp_cat, capture_mtp_embed, capture_mtp_output"))
                  + _at(8, "capture_mtp_embed(inputs_embeds)\n")),
            after("        previous_hidden_states = self.hnorm(previous_hidden_states)\n",
                  _at(8, "capture_mtp_cat(inputs_embeds, previous_hidden_states)\n")),
            inside("        # Matches SGLang's deepseek_nextn.\n", "        return hidden_states, self.shared_head(hidden_states)\n",
                   _at(8, "capture_mtp_output(hidden_states, norm=self.shared_head)\n")),
            # DeepSeekMultiTokenPredictor.forward: the raw spec_step_idx (the layer sees it modulo the layer count)
            inside("            inputs_embeds = self.embed_tokens(input_ids)\n",
                   "        current_step_idx = spec_step_idx % self.num_mtp_layers\n",
                   _at(8, IMPORT_MTP.format(names="capture_mtp_input"))
                   + _at(8, 'capture_mtp_input(input_ids, positions, previous_hidden_states, step=spec_step_idx, '
                            'row="vllm-deepseek-mtp")\n')),
        ],
    },
    "vllm-qwen3_next_mtp.patch": {
        "vllm/model_executor/models/qwen3_next_mtp.py": [
            # Qwen3NextMultiTokenPredictor.forward (no position-0 masking: the embedding is read as is)
            after("            assert hidden_states.shape[-1] == inputs_embeds.shape[-1]\n",
                  _at(12, IMPORT_MTP.format(names="capture_mtp_cat, capture_mtp_input"))
                  + _at(12, "capture_mtp_input(input_ids, positions, hidden_states, inputs_embeds, step=spec_step_idx, "
                            'row="vllm-qwen3-next-mtp")\n')),
            after("            hidden_states = self.pre_fc_norm_hidden(hidden_states)\n",
                  _at(12, "capture_mtp_cat(inputs_embeds, hidden_states)\n")),
            # Qwen3NextMTP.forward: what the predictor returns is self.norm(h, residual), d_norm
            after("            input_ids, positions, hidden_states, intermediate_tensors, inputs_embeds\n        )\n",
                  _at(8, IMPORT_MTP.format(names="capture_mtp_output")) + _at(8, "capture_mtp_output(d_norm=hidden_states)\n")),
        ],
    },
}
# Context lines per patch (3 unless said): 2 lets the post-loop hunk also match sglang 0.5.17-0.5.19
# (a `)` line before the final return instead of a blank one) and the mixin hunk vllm 0.25-0.26.
# sglang-deepseek_nextn.patch: 1, so one patch covers 0.5.13-0.5.23 (the lines around each capture moved).
CONTEXT = {"sglang-boundary-deepseek_v2.patch": 2, "vllm-llama.patch": 2, "sglang-deepseek_nextn.patch": 1}
# Roots: which unpacked wheel each patch is written against.
ROOTS = {"sglang-classic-llama.patch": "sglang_classic", "sglang-classic-deepseek_v2.patch": "sglang_deepseek_classic",
         "sglang-boundary-llama.patch": "sglang_boundary", "sglang-boundary-deepseek_v2.patch": "sglang_boundary",
         "vllm-llama.patch": "vllm", "vllm-deepseek_v2.patch": "vllm", "sglang-deepseek_nextn.patch": "sglang_boundary",
         "vllm-deepseek_mtp.patch": "vllm", "sglang-classic-deepseek_nextn.patch": "sglang_deepseek_classic", "vllm-qwen3_next_mtp.patch": "vllm"}


def edit(patch: str, text: str, edits: list[tuple[str, str]], where: str) -> str:
    """Replace each anchor (which must occur exactly once) by its replacement."""
    for anchor, added in edits:
        count = text.count(anchor)
        if count != 1:
            raise SystemExit(f"{patch}: {where}: anchor found {count} times, expected once: {anchor!r}")
        text = text.replace(anchor, added)
    return text


def make(patch: str, roots: dict[str, Path]) -> str:
    root = roots[ROOTS[patch]]
    out: list[str] = []
    for rel, edits in SPECS[patch].items():
        old = (root / rel).read_text()
        new = edit(patch, old, edits, rel)
        out += difflib.unified_diff(old.splitlines(True), new.splitlines(True), f"a/{rel}", f"b/{rel}",
                                  n=CONTEXT.get(patch, 3))
    return "".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sglang-classic", type=Path, required=True, help="unpacked sglang 0.5.21 (llama.py classic)")
    ap.add_argument("--sglang-deepseek-classic", type=Path, required=True, help="unpacked sglang 0.5.12.post1")
    ap.add_argument("--sglang-boundary", type=Path, required=True, help="unpacked sglang 0.5.23")
    ap.add_argument("--vllm", type=Path, required=True, help="unpacked vllm 0.33.0")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent)
    a = ap.parse_args()
    roots = {"sglang_classic": a.sglang_classic, "sglang_deepseek_classic": a.sglang_deepseek_classic,
             "sglang_boundary": a.sglang_boundary, "vllm": a.vllm}
    for patch in SPECS:
        (a.out / patch).write_text(make(patch, roots))
        print(f"wrote {a.out / patch}")


if __name__ == "__main__":
    main()
