"""Replay an MTP or EAGLE-1/2 draft: step 0 on each dump's ``aux.0``, steps >= 1 on what
each side recycles, scored exactly as EAGLE-3 replay scores (consistency/replay/engine.py).

What a side feeds the draft at step k >= 1 is what its dump recorded (``recycle.k``, the
serving capture's own record of the recycled state) or, when it recorded none, what the
draft's contract recycles (MTP: ``d_norm``; EAGLE-1/2: ``d_raw``). Step 0's tokens are the
dump's ``draft_ids.0`` when recorded (a capture that paired the wrong tokens replays as
such), else ``input_ids`` shifted by one. So a serving capture that recycled the pre-norm
state (vllm #45895's bug) replays with it, and the acceptance it loses at steps >= 1 is the
cost of that bug on this draft and this text; step 0 of both sides reads the same thing
when ``aux.0`` agrees, and its numbers agree exactly.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from consistency.contract.models import Recycle
from consistency.dump import names
from consistency.dump.sets import open_side
from consistency.dump.stitch import stitch
from consistency.errors import InputError, UsageError
from consistency.replay.checks import check_sides, common_tokens
from consistency.replay.report import DraftSummary, ReplayReport
from consistency.replay.sides import Side, _rows, read_side, truncate
from consistency.replay.steps import StepsOutput, run_steps

METHODS = ("auto", "eagle3", "mtp", "eagle1")
# the compare code for a side recycling this instead of the draft's contract (contract/findings.py)
COMPARE_CODE = {"d_raw": "RECYCLE_NORM_MISSING (vllm #45895)", "d_norm": "RECYCLE_NORM_APPLIED",
                "target": "RECYCLE_TARGET (sglang #18564)"}
DEFAULT_STEPS = 3
MAX_ATTN_BYTES = 16 << 30  # the chain's mask (rows x K*rows) and one block of scores: refuse past this
SAME = 1e-3  # relative L2 under which a recorded recycle.k "is" a candidate state (fp32 replay; bf16 is ~4e-3)


def detect_method(draft: str | Path) -> str:
    """``mtp`` for a config declaring MTP layers (``num_nextn_predict_layers``, speculators
    ``mtp``), ``eagle1`` for a draft whose ``fc`` takes 2H and whose first layer reads H,
    else ``eagle3``. Only the config and safetensors headers are read."""
    p = Path(draft)
    d = p if p.is_dir() else p.parent
    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        return "eagle3"  # the EAGLE-3 loader says what is missing
    from consistency.replay.config import read_json

    cfg = read_json(cfg_path)
    archs = cfg.get("architectures") if isinstance(cfg.get("architectures"), list) else []
    if cfg.get("speculators_model_type") == "eagle3" or any("eagle3" in str(a).lower() for a in archs):
        return "eagle3"  # an EAGLE-3 draft config copied from a DeepSeek target may keep num_nextn_predict_layers
    if cfg.get("speculators_model_type") == "mtp" or "num_nextn_predict_layers" in cfg:
        return "mtp"
    if cfg.get("speculators_model_type") in ("eagle", "eagle1", "hass"):
        return "eagle1"
    files = [p] if p.is_file() else sorted(d.glob("*.safetensors"))
    shapes: dict[str, tuple[int, ...]] = {}
    for f in files[:8]:
        shapes.update(_header_shapes(f))
    from consistency.replay.eagle1 import is_eagle1

    return "eagle1" if is_eagle1(shapes) else "eagle3"


def _header_shapes(f: Path) -> dict[str, tuple[int, ...]]:
    """Tensor shapes from a safetensors header (no tensor data); {} when unreadable (the
    loader reports the file properly)."""
    try:
        with f.open("rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            if not 0 < n <= 100 * 1024 * 1024:
                return {}
            head = json.loads(fh.read(n))
    except (OSError, ValueError):
        return {}
    return {k: tuple(v.get("shape", ())) for k, v in head.items() if isinstance(v, dict) and k != "__metadata__"}


def load_multistep(method: str, draft: str | Path, target: Any) -> Any:
    if method == "mtp":
        from consistency.replay.mtp import load_mtp

        return load_mtp(draft, target)
    from consistency.replay.eagle1 import load_eagle1

    return load_eagle1(draft, target)


def read_recorded(path: Path, steps: int, start: int, length: int, width: int,
                  layer_ids: Sequence[int] | None,
                  convention: str | None) -> tuple[dict[int, torch.Tensor], torch.Tensor | None]:
    """{k: recycle.k rows} and draft_ids.0 a dump recorded, cut to the tokens replayed."""
    rec: dict[int, torch.Tensor] = {}
    ids0 = None
    with open_side(path, layer_ids, convention) as raw:
        d, _layout = stitch(raw)
        total = None
        if names.INPUT_IDS in d:
            total = int(d[names.INPUT_IDS].numel)
        for k in range(1, steps):
            name = names.recycle(k)
            if name not in d:
                continue
            v = d[name]
            if v.cols != width:
                raise InputError(path, f"{name!r} is {v.cols} wide; the draft's hidden size is {width}")
            if total is not None and v.rows not in (total - 1 - k, total - 1, total):
                raise InputError(path, f"{name!r} has {v.rows} rows; step {k} of {total} tokens has {total - 1 - k} "
                                       "draft positions (row r pairs the hidden row r with token r+1+k)")
            t = _rows(v)[start:start + length - 1]
            if not torch.isfinite(t).all():
                raise InputError(path, f"{name!r} holds NaN or Inf values")
            rec[k] = t
        name0 = names.draft(names.DRAFT_IDS, 0)
        if name0 in d and not d[name0].is_float:
            ids0 = torch.from_numpy(d[name0].read_all().reshape(-1).astype("int64"))[start:start + length - 1]
            if len(ids0) != length - 1:
                raise InputError(path, f"{name0!r} has {len(ids0)} rows where {length - 1} draft positions "
                                       "are replayed")
    return rec, ids0


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    n = min(len(a), len(b))
    return float((a[:n] - b[:n]).norm() / b[:n].norm().clamp_min(1e-12))


def describe_recycle(out: StepsOutput, rec: dict[int, torch.Tensor], default: Recycle, hidden: torch.Tensor) -> str:
    """What a side's steps >= 1 were fed, in words; a recorded state is named after the
    candidate it equals (the draft's own pre- or post-norm output of the step before)."""
    if not rec:
        return f"{default.value} (contract; no recycle.k recorded)"
    k = min(rec)
    prev_out = out.tensors.get(names.draft(names.DRAFT_OUT, k - 1))
    prev_norm = out.tensors.get(names.draft(names.DRAFT_NORM, k - 1))
    cands = {"d_norm": prev_norm, "d_raw": prev_out, "target": hidden[k:]}
    hits = [n for n, c in cands.items() if c is not None and _rel(rec[k], c) <= SAME]
    what = hits[0] if hits else "unlike d_norm, d_raw and the target's state"
    steps = ",".join(str(i) for i in sorted(rec))
    return f"recorded: {what} (recycle.{steps})"


def replay_multistep(method: str, draft: str | Path, target: str | Any | None, reference: str | Path,
                     candidate: str | Path, steps: int | None, max_drop_points: float, feed: str, labels: str,
                     min_acceptance: float | None, layer_ids: Sequence[int] | None,
                     convention: str | None) -> ReplayReport:
    """The MTP / EAGLE-1 counterpart of :func:`consistency.replay.engine.run_replay`."""
    from consistency.replay.scoring import build_report, choose_feed, drafted_positions, load_target, score

    t0 = time.perf_counter()
    if target is None and method == "mtp" and (Path(draft) / "config.json").is_file():
        from consistency.replay.mtp import check_files

        check_files(Path(draft))
        target = str(draft)  # DeepSeek-V3 layout: the MTP layer ships inside the target's checkpoint
    if target is None:
        raise UsageError(f"replaying an {method} draft needs --target: its embedding, lm_head and (MTP) decoder "
                         "layer family come from the target")
    if isinstance(target, (str, Path)):
        tmodel, tname = _quiet_load(load_target, str(target)), str(target)
    else:
        tmodel, tname = target, getattr(target.config, "_name_or_path", None) or type(target).__name__
    loaded = load_multistep(method, draft, tmodel)
    m = loaded.model
    k = steps if steps is not None else DEFAULT_STEPS
    if k < 1 or k > 64:
        raise UsageError(f"--steps must be between 1 and 64, got {k}")
    h = m.hidden_size
    cache: dict[bytes, torch.Tensor] = {}
    ids = list(layer_ids) if layer_ids is not None else None
    reading = "mtp" if method == "mtp" else None  # a speculators file: its MTP trainer's reading (the last slot)
    ref = read_side(reference, 1, h, tmodel, labels, cache, ids, convention, tname, reading)
    cand = read_side(candidate, 1, h, tmodel, labels, cache, ids, convention, tname, reading)
    check_sides(reference, ref.meta, candidate, cand.meta)
    r0, c0, shared = common_tokens(ref.ids, cand.ids, reference, candidate, ref.segments, cand.segments)
    notes = [f"{s.path.name} holds {len(s.ids)} tokens: replayed on the {shared} both dumps share"
             for s in (ref, cand) if len(s.ids) > shared]
    ref, cand = truncate(ref, shared, r0), truncate(cand, shared, c0)
    if r0 != c0 and cand.label_source != "logits":
        cand = replace(cand, labels=ref.labels, label_source=ref.label_source)
    feed, why = choose_feed(feed, (ref, cand))
    mask, scored_on, where = drafted_positions(ref, cand)
    if where:
        notes.insert(0, where)
    if why:
        notes.insert(0, why)
    _check_memory(m, len(ref.ids) - 1, k)
    fed: list[str] = []
    scored = []
    for side, start in ((ref, r0), (cand, c0)):
        rec, ids0 = read_recorded(side.path, k, start, shared, h, ids, convention)
        _check_vocab(side, m.vocab_size)
        out = run_steps(m, side.aux, side.ids, k, loaded.spec.recycle, attention="chain", feed=feed, recorded=rec,
                        step0_ids=ids0)
        assert out.proposals is not None
        scored.append(score(out.proposals, side.labels, mask, side.segments))
        fed.append(describe_recycle(out, rec, loaded.spec.recycle, side.aux))
    summary = DraftSummary(path=str(loaded.path), layout=loaded.layout, hidden_size=h, target_hidden_size=h, num_aux=1,
                           num_layers=len(getattr(m, "layers", [])) or 1, draft_vocab_size=m.vocab_size,
                           target_vocab_size=m.vocab_size, norm_before_residual=False, norm_before_fc=False,
                           fc_norm=False, norm_output=loaded.spec.recycle == Recycle.d_norm, sources=loaded.sources,
                           method=method, consumer=loaded.spec.model_copy(update={"steps": k}))
    rep = build_report(loaded, tname, ref, cand, scored[0], scored[1], k, feed, max_drop_points,
                       time.perf_counter() - t0, min_acceptance, draft_summary=summary, scored_on=scored_on)
    rep.reference.recycle_fed, rep.candidate.recycle_fed = fed
    want = loaded.spec.recycle.value
    if k > 1 and not fed[1].startswith("recorded"):
        notes.append(f"{cand.path.name} records no recycle.k: steps 2..{k} replay the draft's contract ({want}) on "
                     "both sides, not what the server fed; only step 1 compares the serving side (record the draft's steps "
                     "to evaluate the rest)")
    for side, words in zip((ref, cand), fed):
        got = words.split(" ")[1] if words.startswith("recorded: ") else want
        if got in COMPARE_CODE and got != want:
            notes.append(f"{side.path.name} recycles {got} at steps >= 2 where this {method} draft recycles {want}; "
                         f"`consistency compare` reports it as {COMPARE_CODE[got]}")
    rep.notes[:0] = notes
    return rep


def _quiet_load(load: Any, spec: str) -> Any:
    """transformers lists the MTP layer's tensors as UNEXPECTED when it loads a DeepSeek-V3
    checkpoint (it has no MTP module); that table is noise here: this module reads them."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        return load(spec)
    finally:
        hf_logging.set_verbosity(level)


def _check_memory(m: Any, rows: int, steps: int) -> None:
    """The chain's additive mask is rows x (steps x rows) floats, a block of scores heads x
    QUERY_BLOCK x (steps x rows). Refuse (one line) before allocating too much."""
    from consistency.replay.steps import QUERY_BLOCK

    heads = int(getattr(m.config, "num_attention_heads", 1) or 1)
    need = 4 * rows * steps * rows + 4 * heads * min(rows, QUERY_BLOCK) * steps * rows
    if need > MAX_ATTN_BYTES:
        raise UsageError(f"replaying {rows + 1} tokens x {steps} steps needs ~{need / 2**30:.0f} GiB of attention "
                         f"scores ({heads} heads); replay a shorter dump or fewer --steps")


def _check_vocab(side: Side, vocab: int) -> None:
    if int(side.ids.max()) >= vocab or int(side.ids.min()) < 0:
        raise InputError(side.path, f"token ids outside the draft's vocabulary 0..{vocab - 1}")
