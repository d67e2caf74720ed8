"""SGLang ``--debug-tensor-dump-output-folder DIR``: one ``Pass{NNNNN}.pt`` per forward pass and rank.

Written by ``sglang/srt/debug_utils/tensor_dump_forward_hook.py`` (0.5.5 and later, read
here as released in the 0.5.5 and 0.5.23 wheels): forward hooks on every leaf module and on
the top-level ``model`` child save ``torch.save({module name: output})`` per pass into
``DIR/[target|draft/]TP{tp}_PP{pp}_Rank{tp_size*pp+tp}_pid{pid}/`` (``target/``/``draft/``
from 0.5.11). A tuple output drops its ``None`` items; one tensor is saved as a tensor,
several as a list. The top-level hook saves the pass file *first* and then records
``model``'s own output and the logits processor's, so those of pass k sit in ``Pass{k+1}``
and the last pass's are never written: we move them back (and check ``model``'s output of
pass k against ``model.norm``'s of pass k) and leave logits out (the last pass has none).
The files are read by the restricted archive reader (:mod:`consistency.dump.ptzip`).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from consistency.contract.models import DumpMetadata, ModelInfo, RuntimeInfo
from consistency.dump import names, ptzip
from consistency.dump.formats import stock
from consistency.dump.formats.base import ForeignDump, aux_info, resolve_claims
from consistency.errors import InputError

NAME = "sglang-tensor-dump"
RANK_DIR = re.compile(r"^TP(\d{1,4})_PP(\d{1,4})_Rank(\d{1,6})_pid(\d{1,10})$")
PASS_FILE = re.compile(r"^Pass(\d{5,9})\.pt$")
BATCH = "model.forward_batch_info."
TAIL = ("model", "logits_processor")  # recorded after the pass file was written: they belong to the pass before
MAX_PASSES = 100_000


def _rank_dirs(path: Path) -> list[Path]:
    try:
        return sorted(p for p in path.iterdir() if RANK_DIR.match(p.name) and p.is_dir())
    except OSError:
        return []


def root_of(path: Path) -> tuple[Path, str] | None:
    """(directory holding the rank directories, layout) or None."""
    if RANK_DIR.match(path.name) and any(PASS_FILE.match(x.name) for x in path.iterdir()):
        return path.parent, "one rank directory"
    if (path / "target").is_dir() and _rank_dirs(path / "target"):
        return path / "target", "0.5.11+ layout (target/ and draft/)"
    if path.name in ("target", "draft") and _rank_dirs(path):
        return path, "0.5.11+ layout (target/ and draft/)"
    if _rank_dirs(path):
        return path, "0.5.5-0.5.10 layout (one directory per rank)"
    return None


def sniff_dir(path: Path) -> bool:
    try:
        return root_of(path) is not None
    except OSError:
        return False


def open_dir(path: Path, layer_ids: Sequence[int] | None = None, convention: str | None = None) -> ForeignDump:
    found = root_of(path)
    if found is None:
        raise InputError(path, "not an SGLang tensor dump (no TP*_PP*_Rank*_pid* directories)")
    root, layout = found
    if root.name == "draft":
        raise InputError(path, "is the draft model's tensor dump: its modules (fc, midlayer) are not the target's "
                         "streams; compare the target/ directory")
    dirs = [path] if layout == "one rank directory" else _rank_dirs(root)
    ranks = _parse_ranks(path, dirs)
    archives: list[ptzip.Archive] = []
    try:
        return _build(path, root, layout, ranks, archives, layer_ids, convention)
    except BaseException:
        for a in archives:
            a.close()
        raise


def _parse_ranks(path: Path, dirs: Sequence[Path]) -> dict[tuple[int, int], Path]:
    out: dict[tuple[int, int], Path] = {}
    for d in dirs:
        m = RANK_DIR.match(d.name)
        assert m is not None
        tp, pp = int(m.group(1)), int(m.group(2))
        if (pp, tp) in out:
            raise InputError(d, f"two processes wrote TP{tp}_PP{pp} ({out[(pp, tp)].name} and {d.name}): a restarted "
                             "server dumps into the same folder; keep one run's directories")
        out[(pp, tp)] = d
    tp_size, pp_size = max(tp for _pp, tp in out) + 1, max(pp for pp, _tp in out) + 1
    if len(dirs) > 1 and tp_size * pp_size != len(out):
        # the names claim a layout; the directories present are the evidence (never a table of the claim's size)
        missing = list(itertools.islice(((pp, tp) for pp in range(pp_size) for tp in range(tp_size)
                                         if (pp, tp) not in out), 6))
        raise InputError(path, f"rank directories name TP up to {tp_size - 1} and PP up to {pp_size - 1} "
                         f"({tp_size * pp_size} ranks) but {len(out)} are present; missing "
                         f"{', '.join(f'TP{tp}_PP{pp}' for pp, tp in missing)}{', ...' if len(missing) == 6 else ''}")
    for (pp, tp), d in out.items():
        rank = int(RANK_DIR.match(d.name).group(3))  # type: ignore[union-attr]
        if len(dirs) > 1 and rank != tp_size * pp + tp:
            raise InputError(d, f"Rank{rank} is not tp_size * pp_rank + tp_rank = {tp_size * pp + tp}")
    return out


def _passes(d: Path) -> list[Path]:
    files = sorted((int(m.group(1)), x) for x in d.iterdir() if (m := PASS_FILE.match(x.name)))
    if len(files) > MAX_PASSES:
        raise InputError(d, f"holds {len(files)} pass files, over the {MAX_PASSES} bound")
    twin = next(((a.name, b.name) for (n, a), (m, b) in zip(files, files[1:]) if n == m), None)
    if twin is not None:  # Pass00001.pt and Pass000001.pt: one pass, two files; either could be meant
        raise InputError(d, f"holds {min(twin)!r} and {max(twin)!r}: two spellings of pass {int(twin[0][4:-3])}; "
                         "refused, since either could be meant")
    nums = [n for n, _x in files]
    if nums != list(range(len(nums))):
        gap = next(i for i, n in enumerate(nums) if n != i)
        raise InputError(d, f"pass files are not Pass00000..: Pass{gap:05d}.pt is missing")
    return [x for _n, x in files]


def _load(p: Path, archives: list[ptzip.Archive]) -> tuple[dict[str, Any], int]:
    a = ptzip.open_archive(p)
    archives.append(a)
    if not isinstance(a.obj, dict) or not all(isinstance(k, str) for k in a.obj):
        raise InputError(p, f"holds a {type(a.obj).__name__}; an SGLang pass file is a dict of module name -> output")
    names.refuse_twins(p, a.obj)  # model.layers.3 and model.layers.03 would both be stream 3: first one wins
    return a.obj, a.fd


def _items(p: Path, key: str, value: Any) -> list[ptzip.PtTensor]:
    vals = value if isinstance(value, list) else [value]
    if not all(isinstance(v, ptzip.PtTensor) for v in vals):
        raise InputError(p, f"{key!r} holds a {type(value).__name__}, not tensors")
    return vals


def _rank_passes(d: Path, archives: list[ptzip.Archive], components: bool, n_layers: int | None,
                 notes: list[str]) -> list[stock.Pass]:
    files = _passes(d)
    raw = [_load(p, archives) for p in files]
    out: list[stock.Pass] = []
    for k, (obj, fd) in enumerate(raw):
        pas = stock.Pass()
        for key, value in obj.items():
            if key in TAIL:
                continue
            if key.startswith(BATCH):
                field = key[len(BATCH):]
                t = _items(files[k], key, value)[0]
                if field in ("input_ids", "positions"):
                    pas.put(field, t.view(field, fd), f"sglang {key}")
                continue
            items = _items(files[k], key, value)
            for i, t in enumerate(items):
                got = stock.sglang_name(key, i if len(items) > 1 else None, len(items), n_layers, components)
                if got is not None:
                    pas.put(got[0], t.view(got[0], fd), f"sglang {key}" + (f"[{i}]" if len(items) > 1 else ""),
                            got[1])
        _next_stream(pas)
        out.append(pas)
    _check_shift(d, files, raw, out, notes)
    return out


def _next_stream(pas: stock.Pass) -> None:
    """Stream k+1 of the last layer k dumped, where no later norm gives it (a
    --debug-tensor-dump-layers subset): layer k's residual after attention plus its MLP
    output (named only where those are whole, not partial sums)."""
    mids = sorted(int(n.rsplit(".", 1)[1]) for n in pas.tensors if n.startswith(names.RESID_MID + "."))
    if not mids:
        return
    k = mids[-1]
    s, parts = names.hidden(k + 1), [pas.tensors.get(f"{names.RESID_MID}.{k}"), pas.tensors.get(names.mlp_out(k))]
    if s not in pas.tensors and all(v is not None for v in parts) and parts[0].shape == parts[1].shape:  # type: ignore[union-attr]
        pas.put(s, stock.SumView.of(s, parts), f"sum of model.layers.{k}.post_attention_layernorm[1] and "  # type: ignore[arg-type]
                f"model.layers.{k}.mlp.down_proj (layer {k}'s output)")


def _check_shift(d: Path, files: Sequence[Path], raw: Sequence[tuple[dict, int]], passes: Sequence[stock.Pass],
                 notes: list[str]) -> None:
    """``model``'s output in Pass{k+1} is pass k's final hidden state: it must equal pass k's ``model.norm[0]``."""
    checked = 0
    for k in range(len(raw) - 1):
        tail = raw[k + 1][0].get("model")
        mine = passes[k].tensors.get(names.FINAL_NORM)
        if not isinstance(tail, ptzip.PtTensor) or mine is None:
            continue
        tail.charge(16 * tail.numel, f"{files[k + 1].name}'s 'model' output and pass {k}'s model.norm, in float64")
        a = tail.view("model", raw[k + 1][1]).rows_float(0, 1 << 30, np.float64)
        b = mine.rows_float(0, 1 << 30, np.float64)
        if tail.budget is not None:
            tail.budget.release(16 * tail.numel)  # compared and dropped: one pass at a time
        if a.shape != b.shape or not np.array_equal(a, b):
            notes.append(f"{files[k + 1].name}: its 'model' output is not {files[k].name}'s model.norm output; the "
                         "pass-file shift could not be confirmed")
            return
        checked += 1
    if checked:
        notes.append(f"the hook saves 'model'/'logits_processor' of pass k in Pass{{k+1}}: moved back (checked on "
                     f"{checked} pass(es)); logits left out (the last pass's are never written)")


def _confirm_n(path: Path, ranks: dict[tuple[int, int], Path], archives: list[ptzip.Archive], n: int,
               notes: list[str]) -> int | None:
    """Layers 0..n-1 were dumped: N is n only if ``model.norm``'s residual is layer n-1's
    output (its ``post_attention_layernorm`` residual plus its ``down_proj`` output, summed
    over TP ranks where those are partial sums). ``--debug-tensor-dump-layers 0 1 2`` dumps
    a prefix of the layers and ``model.norm`` still: then N is unknown, never n."""
    stage = max(pp for pp, _tp in ranks)
    mid_key, mlp_key = f"model.layers.{n - 1}.post_attention_layernorm", f"model.layers.{n - 1}.mlp.down_proj"
    parts: list[tuple[dict[str, Any], int]] = []
    for (pp, _tp), d in sorted(ranks.items()):
        if pp == stage and (files := _passes(d)):
            a = ptzip.open_archive(files[0])
            archives.append(a)
            parts.append((a.obj if isinstance(a.obj, dict) else {}, a.fd))
    obj, fd = parts[0]
    norm, mid, mlp = obj.get("model.norm"), obj.get(mid_key), [o.get(mlp_key) for o, _fd in parts]
    if not (isinstance(norm, list) and len(norm) == 2 and isinstance(mid, list) and len(mid) == 2
            and all(isinstance(x, ptzip.PtTensor) for x in [*norm, *mid, *mlp])
            and len({x.shape for x in [norm[1], mid[1], *mlp]}) == 1):
        notes.append(f"N = {n} taken from the layers dumped (0..{n - 1}); not checked on values (no {mlp_key} output "
                     "beside model.norm's residual)")
        return n
    want = norm[1].read(fd).astype(np.float64)
    base = mid[1].read(fd).astype(np.float64)
    deltas = [m.read(f).astype(np.float64) for m, (_o, f) in zip(mlp, parts)]
    for got in (base + deltas[0], base + sum(deltas)):
        scale = np.linalg.norm(want, axis=-1) + 1e-30
        if float((np.linalg.norm(got - want, axis=-1) / scale).max(initial=0.0)) < N_CHECK:
            return n
    return None  # layers after n - 1 were not dumped: the note on N unknown follows


N_CHECK = 1e-2  # token rel_diff: a bf16 add rounds within 2^-8; another stream differs by far more


def _build(path: Path, root: Path, layout: str, ranks: dict[tuple[int, int], Path], archives: list[ptzip.Archive],
           layer_ids: Sequence[int] | None, convention: str | None) -> ForeignDump:
    notes: list[str] = []
    tps = sorted({tp for _pp, tp in ranks})  # the ranks present: one directory may be named TP9999_PP9999
    pps = sorted({pp for pp, _tp in ranks})
    tp_size, pp_size = len(tps), len(pps)
    first = ptzip.open_archive(_passes(ranks[min(ranks)])[0]) if _passes(ranks[min(ranks)]) else None
    if first is None:
        raise InputError(ranks[min(ranks)], "holds no Pass*.pt file")
    archives.append(first)
    all_names = set(first.obj) if isinstance(first.obj, dict) else set()
    for (pp, tp), d in ranks.items():
        if (pp, tp) != min(ranks) and tp == 0:
            ps = _passes(d)
            if ps:
                a = ptzip.open_archive(ps[0])
                archives.append(a)
                all_names |= set(a.obj) if isinstance(a.obj, dict) else set()
    n_layers, seen = stock.layer_count(sorted(all_names))
    if n_layers is not None:
        n_layers = _confirm_n(path, ranks, archives, n_layers, notes)
    if n_layers is None and seen:
        notes.append(f"layers {stock.spans(seen)} dumped (--debug-tensor-dump-layers): N is unknown, so model.norm's "
                     "residual (stream N) is not named")
    # one rank directory named TP1_*: the run had TP >= 2 (its o_proj/down_proj outputs are partial sums), whatever
    # number of directories is present; the claim decides only that, never a loop's or a table's size
    whole = max(tps) == 0
    per_rank = {r: _rank_passes(d, archives, whole, n_layers, notes) for r, d in sorted(ranks.items())}
    counts = {len(v) for v in per_rank.values()}
    if len(counts) != 1:
        raise InputError(path, f"ranks wrote different numbers of passes ({sorted(counts)})")
    passes, replicas = [], {}
    for k in range(counts.pop()):
        stages = []
        for pp in pps:
            group = [per_rank[(pp, tp)][k] for tp in tps if (pp, tp) in per_rank]
            combined, rep, _n = stock.combine_ranks(path, group, list(range(len(group))))
            replicas.update({(n if k == 0 else f"{n}#{k + 1}"): v for n, v in rep.items()})
            stages.append(combined)
        passes.append(stock.merge_stages(path, stages))
    tensors, metas = stock.steps(path, passes, notes)
    claims = resolve_claims(path, layer_ids, convention, "sglang", sorted_slots=True, num_layers=n_layers)
    notes += claims.notes
    stock.derive_aux(path, tensors, metas, claims, "SGLang", len(passes), notes)
    hidden = next((v.cols for k, v in tensors.items() if names.stream_of(k) is not None), None)
    streams = stock.stream_ids(tensors)
    tp_text = f"TP {tp_size}" if whole or tp_size == max(tps) + 1 else f"TP rank(s) {tps} of a TP >= {max(tps) + 1} run"
    summary = (f"SGLang tensor dump, {layout}, {tp_text}" + (f", PP {pp_size}" if pp_size > 1 else "")
               + f", {len(passes)} passes, streams {stock.spans(streams) or 'none'}")
    meta = DumpMetadata(side="serving", runtime=RuntimeInfo(name="sglang"),
                        model=ModelInfo(num_layers=n_layers, hidden_size=hidden),
                        aux=aux_info(claims, len(claims.streams or [])), tensors=metas,
                        extra={"notes": notes, "source_format": {"tool": NAME, "summary": summary, "layout": layout,
                                                                 "tp": tp_size, "pp": pp_size, "passes": len(passes),
                                                                 "streams": streams}})
    dump = ForeignDump(path, NAME, tensors, meta, fds=[a.fd for a in archives])
    dump.replica_checks = replicas
    return dump
