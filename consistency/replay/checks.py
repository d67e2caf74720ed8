"""Refuse a replay whose inputs do not belong together, before any number is reported.

A replay's verdict means "this candidate costs the draft so many points" only when both
dumps were recorded on the ``--target`` in use, the reference is the training side, and
both hold the same text. Each check here turns a mismatch into one line (exit 2) instead
of a verdict computed on the wrong model, the wrong way round, or different prompts.
"""

from __future__ import annotations

from typing import Any

import torch

from consistency.contract.models import DumpMetadata
from consistency.dump import names
from consistency.errors import UsageError

TRAINING_SIDES = ("training", "reference")
SERVING_SIDES = ("serving", "candidate")
MAX_STREAM_ERROR = 0.05  # relative L2 error of a recorded stream against the target's: bf16 noise is ~0.01


def check_sides(ref_path: Any, ref: DumpMetadata | None, cand_path: Any, cand: DumpMetadata | None) -> None:
    """REFERENCE recorded as the serving side and CANDIDATE as the training side: swapped."""
    rs, cs = (ref.side if ref else None), (cand.side if cand else None)
    if rs in SERVING_SIDES and cs in TRAINING_SIDES:
        raise UsageError(f"REFERENCE {ref_path} was recorded as the {rs} side and CANDIDATE {cand_path} as the {cs} "
                         "side: swapped? replay takes what the draft was trained on first")


def same_input(a: Any, b: Any) -> bool:
    """REFERENCE and CANDIDATE are one input: the same file or directory, or byte-identical
    copies of one file. The draft then scores the same on both, and that verifies nothing."""
    import filecmp
    import os

    try:
        if os.path.samefile(a, b):
            return True
        return os.path.isfile(a) and os.path.isfile(b) and filecmp.cmp(a, b, shallow=False)
    except OSError:
        return False


MAX_SEGMENTS = 64  # requests of each dump tried (64 x 64 pairs): a run past them is not looked for


def common_tokens(ref_ids: torch.Tensor, cand_ids: torch.Tensor, ref_path: Any, cand_path: Any,
                  ref_segments: list[tuple[int, int]] | None = None,
                  cand_segments: list[tuple[int, int]] | None = None) -> tuple[int, int, int]:
    """(reference start, candidate start, length) of the longest run of tokens both dumps
    hold, found by the token aligner compare uses (equal, a prefix-cache suffix, a template
    in front, edits). Replay needs one contiguous run: chained steps read consecutive
    positions, inside one request (``*_segments``: each request's [start, stop) on the
    stitched axis; a run never crosses a request boundary). Dumps of different text would
    score the draft on two unrelated tasks: refused."""
    from consistency.compare.tokens import match

    rseg = ref_segments or [(0, len(ref_ids))]
    cseg = cand_segments or [(0, len(cand_ids))]
    if len(rseg) > 1 or len(cseg) > 1:
        best: tuple[int, int, int] | None = None
        for r0, r1 in rseg[:MAX_SEGMENTS]:
            for c0, c1 in cseg[:MAX_SEGMENTS]:
                _m, blocks = match(ref_ids[r0:r1].numpy(), cand_ids[c0:c1].numpy())
                for i, j, n in blocks:
                    if best is None or n > best[2]:
                        best = (r0 + i, c0 + j, n)
        if best is not None and best[2] >= 2:
            return best
    method, blocks = match(ref_ids.numpy(), cand_ids.numpy())
    if not blocks or max(n for _i, _j, n in blocks) < 2:
        n = min(len(ref_ids), len(cand_ids))
        diff = (ref_ids[:n] != cand_ids[:n]).nonzero()
        first = int(diff[0]) if len(diff) else n
        raise UsageError(f"REFERENCE {ref_path} and CANDIDATE {cand_path} hold different tokens (first difference at "
                         f"position {first} of {n}; no common run found, {method}): replay compares the draft on the "
                         "same prompt; record both sides on the same input_ids")
    return max(blocks, key=lambda b: b[2])


def _target_info(target: Any) -> dict[str, Any]:
    cfg = target.config
    text = getattr(cfg, "text_config", None) or cfg
    archs = getattr(cfg, "architectures", None) or []
    return {"architecture": archs[0] if archs else None,
            "num_layers": getattr(text, "num_hidden_layers", None) or getattr(text, "n_layer", None),
            "hidden_size": getattr(text, "hidden_size", None) or getattr(text, "n_embd", None),
            "vocab_size": getattr(text, "vocab_size", None)}


def check_model(path: Any, meta: DumpMetadata | None, target: Any, target_name: str | None) -> None:
    """The dump's metadata names the model it was recorded on: the target must be that model."""
    m = meta.model if meta else None
    if m is None or target is None:
        return
    have = _target_info(target)
    bad = [f"{k} {getattr(m, k)!r} vs {have[k]!r}" for k in ("architecture", "num_layers", "hidden_size", "vocab_size")
           if getattr(m, k) is not None and have[k] is not None and getattr(m, k) != have[k]]
    from consistency.record.models import builtin_names

    builtin = set(builtin_names())
    if m.name in builtin and target_name in builtin and m.name != target_name:
        bad.insert(0, f"name {m.name!r} vs {target_name!r}")
    if bad:
        raise UsageError(f"--target {target_name or 'model'} is not the model {path} was recorded on "
                         f"({m.name or 'unnamed'}; dump vs target: {', '.join(bad)})")


@torch.no_grad()
def check_streams(path: Any, dump: Any, ids: torch.Tensor, target: Any, target_name: str | None) -> None:
    """A dump recording residual streams (``hidden.k``, training style) must match the target's
    own streams on its tokens; a target with other weights (another seed, another checkpoint)
    differs by O(1), numeric noise by ~1e-2."""
    if target is None:
        return
    n = _target_info(target)["num_layers"]
    ks = [k for k in range(1, n or 0) if names.hidden(k) in dump] if n else []
    if not ks:
        return
    k = ks[len(ks) // 2]
    rec = torch.from_numpy(dump[names.hidden(k)].rows_float(0, len(ids))).float()
    out = target(input_ids=ids[None], output_hidden_states=True)
    got = out.hidden_states[k][0].float()
    if rec.shape != got.shape:
        raise UsageError(f"--target {target_name or 'model'} is not the model {path} was recorded on (stream {k} is "
                         f"{list(rec.shape)} in the dump, {list(got.shape)} from the target)")
    err = float((rec - got).norm() / got.norm().clamp_min(1e-12))
    if not err <= MAX_STREAM_ERROR:
        raise UsageError(f"--target {target_name or 'model'} is not the model {path} was recorded on: its stream {k} "
                         f"differs from the recorded one by {100 * err:.0f}% (relative L2; recording noise is ~1%)")
