"""Megatron-LM ``--save-activations-interval K``: ``activations/iter_{7d}/mp_rank_{tp:02d}[_{pp:03d}][_{ep:03d}].pth``.

Written by ``megatron/training/activation_logging.py`` (megatron-core 0.18.0 wheel): forward
hooks on every Linear / Column- / RowParallelLinear / Router / TE linear and norm module
store ``{"model_chunk0": {"<module>/input{i}" | "/output{i}" | "/<kwarg>": value}}`` and
``save_grads`` writes one file per (tp, pp, ep) rank (expert-DP rank 0 only). Entries are
overwritten per microbatch: the file holds the last microbatch of the iteration.

Streams (TE spec, where ``linear_qkv`` is a LayerNorm+Linear taking the raw stream):
``hidden.l`` = ``decoder.layers.l.self_attention.linear_qkv/input0`` (layout ``[s, b, h]``);
``decoder.final_layernorm`` is not hooked (``TENorm.__new__`` returns a TE ``RMSNorm``, which
the isinstance check misses), so ``hidden.N`` is the last layer's input plus its attention
and MLP outputs (``linear_proj/output0 + linear_fc2/output0``, plus their returned biases),
and ``final_norm`` is ``output_layer/input0``. Under sequence parallelism each TP rank holds
``s / tp`` rows of the stream: ranks whose copies differ are concatenated along ``s``.
Pipeline stages and virtual chunks name their layers from 0 (one ``ModuleList`` each): the
global layer is the chunk's offset, counted from the files in Megatron's order (virtual
stage ``c * pp + p``), plus the local index.
The file holds no token ids.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from consistency.contract.models import DumpMetadata, ModelInfo, NormState, RuntimeInfo
from consistency.dump import names, ptzip
from consistency.dump.formats import stock
from consistency.dump.formats.base import ForeignDump, aux_info, memory_view, resolve_claims
from consistency.dump.reader import TensorView
from consistency.errors import InputError

NAME = "megatron-activations"
RANK_FILE = re.compile(r"^mp_rank_(\d{2,4})(?:_(\d{3,4}))?(?:_(\d{3,4}))?\.pth$")
ITER_DIR = re.compile(r"^iter_(\d{7,9})$")
QKV = re.compile(r"^decoder\.layers\.(\d{1,6})\.self_attention\.linear_qkv/input0$")
CHUNK = re.compile(r"^model_chunk(\d{1,4})$")


def _iter_dir(path: Path) -> Path | None:
    if ITER_DIR.match(path.name) and _rank_files(path):
        return path
    base = path / "activations" if (path / "activations").is_dir() else path
    try:
        iters = sorted((int(m.group(1)), p) for p in base.iterdir() if (m := ITER_DIR.match(p.name)) and p.is_dir())
    except OSError:
        return None
    iters = [(i, p) for i, p in iters if _rank_files(p)]
    return iters[-1][1] if iters else None


def _rank_files(d: Path) -> list[Path]:
    try:
        return sorted(p for p in d.iterdir() if RANK_FILE.match(p.name) and p.is_file())
    except OSError:
        return []


def sniff_dir(path: Path) -> bool:
    return _iter_dir(path) is not None


def sniff(path: Path, head: bytes) -> bool:
    return RANK_FILE.match(path.name) is not None and ITER_DIR.match(path.parent.name) is not None


def open_file(path: Path, layer_ids: Sequence[int] | None = None, convention: str | None = None) -> ForeignDump:
    return _open(path, [path], path.parent, layer_ids, convention)


def open_dir(path: Path, layer_ids: Sequence[int] | None = None, convention: str | None = None) -> ForeignDump:
    d = _iter_dir(path)
    if d is None:
        raise InputError(path, "not a Megatron activation log (no activations/iter_*/mp_rank_*.pth)")
    return _open(path, _rank_files(d), d, layer_ids, convention)


def _open(path: Path, files: list[Path], d: Path, layer_ids: Sequence[int] | None,
          convention: str | None) -> ForeignDump:
    archives: list[ptzip.Archive] = []
    try:
        return _build(path, files, d, archives, layer_ids, convention)
    except BaseException:
        for a in archives:
            a.close()
        raise


def _chunks(p: Path, a: ptzip.Archive) -> list[tuple[int, dict[str, Any]]]:
    """(chunk index, entries) per virtual-pipeline chunk; each chunk names its layers from 0."""
    obj = a.obj
    if not isinstance(obj, dict) or not obj:
        raise InputError(p, f"holds a {type(obj).__name__}; a Megatron activation file is {{model_chunkN: {{...}}}}")
    chunks = sorted((int(m.group(1)), k) for k in obj if isinstance(k, str) and (m := CHUNK.match(k)))
    if not chunks:
        raise InputError(p, f"no model_chunk entries (keys: {', '.join(map(str, list(obj)[:4]))})")
    out: list[tuple[int, dict[str, Any]]] = []
    for c, key in chunks:
        if not isinstance(obj[key], dict):
            raise InputError(p, f"{key} holds a {type(obj[key]).__name__}, not a dict")
        e: dict[str, Any] = {}
        names.refuse_twins(p, obj[key])  # decoder.layers.3 beside decoder.layers.03: either could be layer 3
        for k, v in obj[key].items():
            if isinstance(k, str):
                e.setdefault(re.sub(r"^(module\.)+", "", k), v)
        out.append((c, e))
    return out


def _local_layers(e: dict[str, Any]) -> list[int]:
    return sorted(int(m.group(1)) for k in e if (m := QKV.match(k)))


def _sbh(p: Path, key: str, t: Any, fd: int, name: str) -> TensorView:
    """``[s, b, h]`` -> ``[b*s, h]`` rows, sequence-major per sample (one sample: ``[s, h]``)."""
    if not isinstance(t, ptzip.PtTensor) or len(t.shape) != 3:
        raise InputError(p, f"{key} is {getattr(t, 'shape', type(t).__name__)}; expected an [s, b, h] tensor")
    if t.shape[1] == 1:
        v = t.view(name, fd)
        out = memory_view(name, v.read_all().reshape(t.shape[0], t.shape[2]), t.dtype, p) if v._array is not None \
            else TensorView(name, t.dtype, (t.shape[0], t.shape[2]), v._storage, fd, v._offset, p)
        return out
    t.charge(2 * t.numel * t.itemsize, f"{key} (reordered [s, b, h] -> [b*s, h] in memory)")
    arr = t.view(name, fd).read_all().transpose(1, 0, 2).reshape(-1, t.shape[2])
    return memory_view(name, np.ascontiguousarray(arr), t.dtype, p)


def _rank_pass(p: Path, a: ptzip.Archive, chunks: list[tuple[int, dict[str, Any]]], offsets: dict[int, int],
               n_layers: int | None) -> stock.Pass:
    """One rank's streams in global layer numbers: chunk c's local layer k is ``offsets[c] + k``."""
    pas = stock.Pass()
    for c, e in chunks:
        layers = _local_layers(e)
        for k in layers:
            key = f"decoder.layers.{k}.self_attention.linear_qkv/input0"
            s = offsets[c] + k
            pas.put(names.hidden(s), _sbh(p, key, e[key], a.fd, names.hidden(s)), f"megatron {key}"
                    + (f" (layer {s}: model_chunk{c}, from layer {offsets[c]})" if offsets[c] else ""))
        if "output_layer/input0" not in e:
            continue
        pas.put(names.FINAL_NORM, _sbh(p, "output_layer/input0", e["output_layer/input0"], a.fd, names.FINAL_NORM),
                "megatron output_layer/input0", NormState.final_norm)
        if not layers or n_layers is None:
            continue
        last = f"decoder.layers.{layers[-1]}"
        keys = [f"{last}.self_attention.linear_qkv/input0", f"{last}.self_attention.linear_proj/output0",
                f"{last}.self_attention.linear_proj/output1", f"{last}.mlp.linear_fc2/output0",
                f"{last}.mlp.linear_fc2/output1"]
        have = [k for k in keys if isinstance(e.get(k), ptzip.PtTensor) and len(e[k].shape) == 3]
        if all(keys[i] in have for i in (0, 1, 3)):  # the input, attention's and the MLP's outputs (an MoE has none)
            parts = [_sbh(p, k, e[k], a.fd, k) for k in have]
            for k in (keys[2], keys[4]):  # a returned bias [h] (add_bias_linear): added to every row
                b = e.get(k)
                if isinstance(b, ptzip.PtTensor) and b.shape == (parts[0].cols,):
                    rows = np.broadcast_to(b.read(a.fd).reshape(1, -1), parts[0].shape)
                    parts.append(memory_view(k, rows, b.dtype, p))
            pas.put(names.hidden(n_layers), stock.SumView.of(names.hidden(n_layers), parts),
                    f"megatron {last}: linear_qkv/input0 + linear_proj/output + linear_fc2/output (final_layernorm "
                    "is not hooked)")
    return pas


def _offsets(d: Path, counts: dict[tuple[int, int], int], pps: list[int]) -> dict[tuple[int, int], int]:
    """Global first layer of each (pipeline stage, chunk): Megatron names a stage's (and a
    virtual chunk's) layers from 0 and assigns layers chunk by chunk, stage by stage
    (virtual stage c * pp_size + p, get_transformer_layer_offset)."""
    vps = sorted({c for _p, c in counts})
    missing = [(p, c) for c in vps for p in pps if (p, c) not in counts]
    if missing:
        raise InputError(d, f"pipeline stage {missing[0][0]} holds no model_chunk{missing[0][1]} while other stages do: "
                         "virtual pipeline chunks must appear on every stage")
    out, at = {}, 0
    for c in vps:
        for p in pps:
            out[(p, c)] = at
            at += counts[(p, c)]
    return out


def _by_rank(d: Path, fields: dict[Path, tuple[int, ...]], files: list[tuple[Path, ptzip.Archive, list]],
             notes: list[str]) -> dict[tuple[int, int, int], tuple[Path, ptzip.Archive, list]]:
    """(pp, ep, tp) of each file, read as upstream names them: ``mp_rank_{tp:02d}``, then
    ``_{pp:03d}`` only when pipeline-parallel and ``_{ep:03d}`` only when expert-parallel
    (NVIDIA/Megatron-LM megatron/training/checkpointing.py, megatron-core 0.18.0: ``save_grads``
    lines 461-489, ``get_checkpoint_name`` lines 197-236). Two
    fields are TP+PP or TP+EP: pipeline stages hold different layers and only the last holds
    ``output_layer``; expert ranks (PP 1) each run the whole model, so every one holds it."""
    counts = {len(f) for f in fields.values()}
    if len(counts) != 1:
        raise InputError(d, "rank files mix mp_rank_TT, mp_rank_TT_PPP and mp_rank_TT_PPP_EEE names: two runs' files "
                         "in one iteration directory")
    n = counts.pop()
    second_is_ep = False
    if n == 2:
        has_out: dict[int, bool] = {}
        for p, _a, chs in files:
            x = fields[p][1]
            has_out[x] = has_out.get(x, False) or any("output_layer/input0" in e for _c, e in chs)
        last = max(has_out)
        if all(has_out.values()) and len(has_out) > 1:
            second_is_ep = True
            notes.append("mp_rank_TT_EEE names with every file holding output_layer: expert-parallel ranks "
                         "(pipeline size 1), as Megatron's save_grads names them")
        elif any(v for x, v in has_out.items() if x != last):  # none holding it: stages without the last one
            raise InputError(d, "mp_rank_TT_NNN names whose output_layer files fit neither pipeline stages (only the "
                             "last stage holds it) nor expert ranks (every rank holds it)")
    out: dict[tuple[int, int, int], tuple[Path, ptzip.Archive, list]] = {}
    for p, a, chs in files:
        f = fields[p]
        tp, pp, ep = f[0], (f[1] if n >= 2 and not second_is_ep else 0), (f[1] if second_is_ep else f[2] if n == 3
                                                                          else 0)
        if (pp, ep, tp) in out:
            raise InputError(p, f"names the same (tp, pp, ep) rank as {out[(pp, ep, tp)][0].name}")
        out[(pp, ep, tp)] = (p, a, chs)
    return out


def _build(path: Path, files: list[Path], d: Path, archives: list[ptzip.Archive], layer_ids: Sequence[int] | None,
           convention: str | None) -> ForeignDump:
    notes: list[str] = []
    by_rank: dict[tuple[int, int, int], stock.Pass] = {}
    opened: dict[tuple[int, int, int], tuple[Path, ptzip.Archive, list[tuple[int, dict[str, Any]]]]] = {}
    fields: dict[Path, tuple[int, ...]] = {}
    for p in files:
        m = RANK_FILE.match(p.name)
        assert m is not None
        a = ptzip.open_archive(p)
        archives.append(a)
        fields[p] = tuple(int(g) for g in m.groups() if g is not None)
        opened[(0, 0, len(opened))] = (p, a, _chunks(p, a))  # keyed by rank below, once the naming is known
    opened = _by_rank(d, fields, list(opened.values()), notes)
    tps = sorted({tp for _pp, _ep, tp in opened})
    pps = sorted({pp for pp, _ep, _tp in opened})
    eps = sorted({ep for _pp, ep, _tp in opened})
    if tps != list(range(len(tps))) or pps != list(range(len(pps))):
        raise InputError(d, f"rank files for tp {tps}, pp {pps}: some ranks are missing")
    for pp in pps:
        if len([tp for tp in tps if (pp, eps[0], tp) in opened]) != len(tps):
            raise InputError(d, f"pipeline stage {pp} lacks tensor-parallel rank files")
    counts = {(pp, c): len(_local_layers(e)) for (pp, ep, tp), (_p, _a, chs) in opened.items()
              if ep == eps[0] and tp == 0 for c, e in chs}
    offsets = _offsets(d, counts, pps)
    last_stage = any("output_layer/input0" in e for (_pp, _ep, _tp), (_p, _a, chs) in opened.items() for _c, e in chs)
    n_layers = sum(counts.values()) if last_stage else None
    if not last_stage:
        notes.append("no file holds output_layer (the last pipeline stage): the number of layers, stream N and "
                     "final_norm are unknown")
    for (pp, ep, tp), (p, a, chs) in opened.items():
        by_rank[(pp, ep, tp)] = _rank_pass(p, a, chs, {c: offsets[(pp, c)] for c, _e in chs}, n_layers)
    stages, replicas = [], {}
    for pp in pps:
        group = [by_rank[(pp, eps[0], tp)] for tp in tps]
        combined, rep, _n = stock.combine_ranks(d, group, tps, split_rows=True)
        replicas.update(rep)
        stages.append(combined)
    if len(eps) > 1:
        notes.append(f"expert-parallel ranks {eps}: the streams of ep rank {eps[0]} are read (each EP rank's "
                     "activations come from its own data-parallel micro-batch)")
    merged = stock.merge_stages(d, stages)
    tensors, metas = stock.steps(d, [merged], notes)
    claims = resolve_claims(d, layer_ids, convention, "stream", sorted_slots=True, num_layers=n_layers)
    notes += claims.notes
    stock.derive_aux(d, tensors, metas, claims, "Megatron", 1, notes)
    notes.append("the activation log holds no token ids and only the iteration's last micro-batch; rows are "
                 "compared in order")
    streams = stock.stream_ids(tensors)
    hidden = next((v.cols for k, v in tensors.items() if names.stream_of(k) is not None), None)
    summary = (f"Megatron activation log, {d.name}, TP {len(tps)}" + (f", PP {len(pps)}" if len(pps) > 1 else "")
               + (f", EP {len(eps)}" if len(eps) > 1 else "") + f", streams {stock.spans(streams) or 'none'}")
    meta = DumpMetadata(runtime=RuntimeInfo(name="megatron"),  # a trainer: reference or candidate, as placed
                        model=ModelInfo(num_layers=n_layers, hidden_size=hidden),
                        aux=aux_info(claims, len(claims.streams or [])), tensors=metas,
                        extra={"notes": notes, "source_format": {"tool": NAME, "summary": summary, "tp": len(tps),
                                                                 "pp": len(pps), "ep": len(eps), "streams": streams}})
    dump = ForeignDump(d, NAME, tensors, meta, fds=[a.fd for a in archives])
    dump.replica_checks = replicas
    return dump
