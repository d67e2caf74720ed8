"""SGLang's ``dumper`` (``sglang/srt/debug_utils/dumper.py``): one ``.pt`` per dumped value.

Two eras, read as released in the wheels:

* up to 0.5.8: ``sglang_dump_{time}/forward_pass_id=F___rank=R___name=N___dump_index=I[___k=v].pt``,
  the raw ``torch.save(value)``; 0.5.9 keeps the names and saves ``{"value", "meta"}``;
* 0.5.10 and later (``DUMPER_ENABLE=1 DUMPER_NON_INTRUSIVE_MODE=all``):
  ``{exp}/step=S___rank=R___dump_index=I___name=N___recompute_status=...[___layer_id=L].pt``
  with ``{"value", "meta"}``; ``meta`` carries ``sglang_parallel_info`` (or Megatron's) and,
  for manual dumps, ``dims``.

Names: the ``core`` fields (``input_ids``, ``positions``, ``seq_lens``, ``rids``) and the
non-intrusive module names (``non_intrusive__model.layers.1.input_layernorm.output.1``) are
mapped as for the tensor dump (:func:`stock.sglang_name`); the EAGLE-3 aux states the logits
processor receives (``non_intrusive__logits_processor.inputs.4.{i}``) are ``aux.{i}`` --
values the server really fed, not a rule. A decoder layer's own ``output.0``/``output.1``
(which a ``layer_id`` filter keeps) give stream k+1 as their sum where the fused norm's
residual was filtered out. Each step is a capture (``#k``); ``rids`` with ``seq_lens`` give
each token its request. Manual ``dumper.dump(name, value)`` calls (the only kind before
0.5.10) are kept when ``name`` is one of our names (``hidden.3``, ``aux.0``, ``input_ids``);
other module inputs and outputs are not streams and are left out.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from consistency.contract.models import DumpMetadata, ModelInfo, RuntimeInfo
from consistency.dump import names, ptzip
from consistency.dump.formats import stock
from consistency.dump.formats.base import ForeignDump, aux_info, memory_view, resolve_claims
from consistency.errors import InputError

NAME = "sglang-dumper"
PREFIX = "non_intrusive__"
FIELD = re.compile(r"^([a-z_]{1,40})=(.*)$")
OUT = re.compile(r"^(?P<mod>.+)\.output(?:\.(?P<item>\d{1,3}))?$")
AUX = re.compile(r"^logits_processor\.inputs\.(?:4|aux_hidden_states)(?:\.(?P<i>\d{1,3}))?$")
LAYER_OUT = re.compile(r"^model\.layers\.(\d{1,6})\.output\.([01])$")
MAX_FILES = 2_000_000
KNOWN = frozenset({names.HIDDEN, names.AUX, names.FINAL_NORM, names.ATTN_OUT, names.MLP_OUT, names.RESID_MID,
                   names.LOGITS})


def notes_seen(notes: list[str], word: str) -> bool:
    return any(n.startswith(word) for n in notes)


def parse_name(fname: str) -> dict[str, str] | None:
    """``step=1___rank=0___...___name=x.pt`` -> fields, or None."""
    if not fname.endswith(".pt"):
        return None
    out: dict[str, str] = {}
    for part in fname[:-3].split("___"):
        m = FIELD.match(part)
        if m is None:
            return None
        out[m.group(1)] = m.group(2)
    if "name" not in out or "rank" not in out or not ("step" in out or "forward_pass_id" in out):
        return None
    if not all(out.get(k, "0").isdigit() for k in ("step", "forward_pass_id", "rank", "dump_index")):
        return None
    return out


def _files(path: Path) -> list[tuple[dict[str, str], Path]]:
    try:
        entries = list(path.iterdir())
    except OSError:
        return []
    if len(entries) > MAX_FILES:
        raise InputError(path, f"holds {len(entries)} entries, over the {MAX_FILES} bound")
    return [(f, p) for p in entries if (f := parse_name(p.name)) is not None and p.is_file()]


def exp_dir(path: Path) -> Path | None:
    """The directory holding the dump files: ``path`` itself, or its one experiment directory."""
    if _files(path):
        return path
    try:
        subs = [s for s in path.iterdir() if s.is_dir() and _files(s)]
    except OSError:
        return None
    if len(subs) > 1:
        raise InputError(path, f"holds {len(subs)} dumper runs ({', '.join(sorted(s.name for s in subs)[:4])}): "
                         "name one")
    return subs[0] if subs else None


def sniff_dir(path: Path) -> bool:
    try:
        return exp_dir(path) is not None
    except (OSError, InputError):
        return True  # open_dir says what is wrong


def open_dir(path: Path, layer_ids: Sequence[int] | None = None, convention: str | None = None) -> ForeignDump:
    d = exp_dir(path)
    if d is None:
        raise InputError(path, "not an SGLang dumper directory (no step=...___rank=...___name=....pt files)")
    archives: list[ptzip.Archive] = []
    try:
        return _build(path, d, archives, layer_ids, convention)
    except BaseException:
        for a in archives:
            a.close()
        raise


def _payload(p: Path, archives: list[ptzip.Archive]) -> tuple[Any, dict[str, Any], int, bool]:
    """(value, meta, fd, new_era): 0.5.9+ saves {"value", "meta"}, older versions the value itself."""
    a = ptzip.open_archive(p)
    archives.append(a)
    obj = a.obj
    if isinstance(obj, dict) and set(obj) == {"value", "meta"} and isinstance(obj["meta"], dict):
        return obj["value"], obj["meta"], a.fd, True
    return obj, {}, a.fd, False


def _rank_of(meta: dict[str, Any], fields: dict[str, str]) -> tuple[int, int, int, int, int]:
    """(pp, tp, pp_size, tp_size, dp_size) from the parallel info in meta, else world rank as TP."""
    info = meta.get("sglang_parallel_info") or meta.get("megatron_parallel_info") or {}
    if isinstance(info, dict) and isinstance(info.get("tp_rank"), int):
        dp = info.get("attn_dp_size") if info.get("attn_dp_enabled") else 1
        return (_int(info.get("pp_rank", 0)), _int(info["tp_rank"]), _int(info.get("pp_size", 1)),
                _int(info.get("tp_size", 1)), _int(dp) if isinstance(dp, int) else 1)
    ws = meta.get("world_size")
    return 0, int(fields["rank"]), 1, int(ws) if isinstance(ws, int) else 0, 1  # 0: from the ranks seen


def _int(v: Any) -> int:
    """A rank or size from the file's metadata: an int or -1 (refused by the layout check)."""
    return v if isinstance(v, int) and not isinstance(v, bool) else -1


def _build(path: Path, d: Path, archives: list[ptzip.Archive], layer_ids: Sequence[int] | None,
           convention: str | None) -> ForeignDump:
    notes: list[str] = []
    files = _files(d)
    eras = {("step" in f): p for f, p in files}
    if len(eras) > 1:
        raise InputError(d, f"holds files of both dumper eras ({eras[True].name} from 0.5.10 on, {eras[False].name} up "
                         "to 0.5.9): two runs in one directory; keep one run's files")
    step_key = "step" if True in eras else "forward_pass_id"
    era = "0.5.10+ (step=, value+meta)" if step_key == "step" else "up to 0.5.9 (forward_pass_id=)"
    records: dict[tuple[int, int], dict[int, list[tuple[int, dict, Any, dict, int]]]] = {}
    sizes: set[tuple[int, int, int]] = set()
    kinds: dict[bool, Path] = {}
    for f, p in sorted(files, key=lambda x: (int(x[0]["rank"]), int(x[0].get("dump_index", 0)))):
        value, meta, fd, new = _payload(p, archives)
        kinds.setdefault(new, p)
        if len(kinds) > 1:
            raise InputError(d, f"{kinds[False].name} holds a bare value but {kinds[True].name} holds "
                             "{value, meta}: files of two dumper versions (or a file not written by the dumper) in "
                             "one run")
        pp, tp, pps, tps, dp = _rank_of(meta, f)
        sizes.add((pps, tps, dp))
        step = int(f[step_key])
        records.setdefault((pp, tp), {}).setdefault(step, []).append((int(f.get("dump_index", 0)), f, value, meta, fd))
    if len(sizes) != 1:
        raise InputError(d, f"files disagree on the parallel layout (pp, tp, attn_dp sizes): {sorted(sizes)}")
    pp_size, tp_size, dp_size = sizes.pop()
    tp_size = tp_size or len(records)
    if pp_size < 1 or tp_size < 1 or pp_size * tp_size > len(records) or \
            any(not (0 <= pp < pp_size and 0 <= tp < tp_size) for pp, tp in records):
        # a size is a claim: the files present decide the layout, and a table is never built to a claim's size
        raise InputError(d, f"the files declare pp {pp_size} x tp {tp_size} ranks but hold (pp, tp) ranks "
                         f"{sorted(records)[:6]}{' ...' if len(records) > 6 else ''} ({len(records)} present)")
    if dp_size > 1:
        raise InputError(d, f"attention data parallel (attn_dp_size {dp_size}): each DP rank holds other requests' "
                         "tokens and merging them is not supported; dump with --dp-size 1 or compare one DP rank")
    missing = [(pp, tp) for pp in range(pp_size) for tp in range(tp_size) if (pp, tp) not in records]
    if missing:
        raise InputError(d, f"no files from (pp, tp) ranks {missing[:6]} of pp {pp_size} x tp {tp_size}")
    step_sets = {tuple(sorted(v)) for v in records.values()}
    if len(step_sets) != 1:
        raise InputError(d, "ranks dumped different steps")
    steps = list(step_sets.pop())
    all_mods = [f["name"].removeprefix(PREFIX) for f, _p in files]
    n_layers, _seen = stock.layer_count([m.split(".output")[0] + "." for m in all_mods if m.startswith("model.layers.")])
    requests: dict[str, int] = {}
    per_rank = {r: [_step(d, steps_of[s], n_layers, tp_size == 1, requests, notes) for s in steps]
                for r, steps_of in records.items()}
    passes, replicas = [], {}
    partial = frozenset(n for n in per_rank[(0, 0)][0].tensors if names.parse(n).kind in (names.ATTN_OUT, names.MLP_OUT))
    for k in range(len(steps)):
        stages = []
        for pp in range(pp_size):
            group = [per_rank[(pp, tp)][k] for tp in range(tp_size)]
            combined, rep, _n = stock.combine_ranks(d, group, list(range(tp_size)), partial=partial)
            replicas.update({(n if k == 0 else f"{n}#{k + 1}"): v for n, v in rep.items()})
            stages.append(combined)
        passes.append(stock.merge_stages(d, stages))
    tensors, metas = stock.steps(d, passes, notes)
    has_aux = names.aux(0) in tensors
    claims = resolve_claims(d, layer_ids, convention, "sglang", sorted_slots=True, num_layers=n_layers)
    notes += claims.notes
    if not has_aux:
        stock.derive_aux(d, tensors, metas, claims, "SGLang", len(passes), notes)
    elif claims.streams is not None and len(claims.streams) != len([n for n in tensors if names.parse(n).kind == "aux"
                                                                   and "#" not in n]):
        raise InputError(d, f"--layer-ids gives {len(claims.streams)} ids but the logits processor received a different "
                         "number of aux states")
    streams = stock.stream_ids(tensors)
    hidden = next((v.cols for k, v in tensors.items() if names.stream_of(k) is not None), None)
    summary = (f"SGLang dumper, {era}, TP {tp_size}" + (f", PP {pp_size}" if pp_size > 1 else "")
               + f", {len(steps)} steps, streams {stock.spans(streams) or 'none'}"
               + (", aux states as fed to the draft" if has_aux else ""))
    extra: dict[str, Any] = {"notes": notes, "source_format": {"tool": NAME, "summary": summary, "era": era,
                                                               "tp": tp_size, "pp": pp_size, "steps": len(steps),
                                                               "streams": streams}}
    if requests:
        extra["requests"] = {str(v): k for k, v in requests.items()}
    meta = DumpMetadata(side="serving", runtime=RuntimeInfo(name="sglang"),
                        model=ModelInfo(num_layers=n_layers, hidden_size=hidden),
                        aux=aux_info(claims, len(claims.streams or [])), tensors=metas, extra=extra)
    dump = ForeignDump(d, NAME, tensors, meta, fds=[a.fd for a in archives])
    dump.replica_checks = replicas
    return dump


def _step(d: Path, recs: list[tuple[int, dict, Any, dict, int]], n_layers: int | None, components: bool,
          requests: dict[str, int], notes: list[str]) -> stock.Pass:
    pas = stock.Pass()
    layer_out: dict[int, dict[int, Any]] = {}
    rids: list[str] | None = None
    seq_lens = None
    core: list[tuple[bool, str, ptzip.PtTensor, int]] = []
    unknown: set[str] = set()
    names.refuse_twins(d, (f["name"] for _i, f, *_rest in recs), "holds files named")  # one step of one rank
    for _i, f, value, _meta, fd in sorted(recs, key=lambda r: r[0]):
        name = f["name"]
        if name in ("input_ids", "positions") and isinstance(value, ptzip.PtTensor):
            core.append(("layer_id" in f, name, value, fd))  # the root's copy (no layer_id) first
            continue
        if name == "rids" and isinstance(value, list) and all(isinstance(x, str) for x in value):
            rids = value
            continue
        if name == "seq_lens" and isinstance(value, ptzip.PtTensor):
            seq_lens = value.read(fd).reshape(-1).astype(np.int64)
            continue
        if not isinstance(value, ptzip.PtTensor):
            continue
        if not name.startswith(PREFIX):  # a manual dumper.dump(name, ...): kept when it is one of our names
            kind = names.parse(name).kind
            if kind in KNOWN or "." in name and names.parse(name).index is not None and kind in names.DRAFT_KINDS:
                pas.put(name, value.view(name, fd), f"sglang dumper {name}")
            else:
                unknown.add(name)
            continue
        mod = name.removeprefix(PREFIX)
        if (m := AUX.match(mod)) is not None:
            i = int(m.group("i") or 0)
            pas.put(names.aux(i), value.view(names.aux(i), fd), f"sglang dumper {name} (what the draft was fed)")
            continue
        if (m := LAYER_OUT.match(mod)) is not None:
            layer_out.setdefault(int(m.group(1)), {})[int(m.group(2))] = value.view(mod, fd)
            continue
        if (m := OUT.match(mod)) is not None:
            item = m.group("item")
            got = stock.sglang_name(m.group("mod"), int(item) if item is not None else None, 1 if item is None else 2,
                                    n_layers, components)
            if got is not None:
                pas.put(got[0], value.view(got[0], fd), f"sglang dumper {name}", got[1])
    for _tagged, name, value, fd in sorted(core, key=lambda c: c[0]):
        pas.put(name, value.view(name, fd), f"sglang dumper core {name}")
    for k, parts in sorted(layer_out.items()):
        s = names.hidden(k + 1)
        if s not in pas.tensors and len(parts) == 2:
            pas.put(s, stock.SumView.of(s, [parts[0], parts[1]]), f"sum of model.layers.{k}.output.0 and .1")
    if unknown and not notes_seen(notes, "manual"):
        notes.append(f"manual dumps under names that are not dump names left out: {', '.join(sorted(unknown)[:5])}"
                     f"{', ...' if len(unknown) > 5 else ''} (name them hidden.s, aux.i, final_norm to compare them)")
    if rids is not None and seq_lens is not None and "positions" in pas.tensors:
        ids = _request_rows(pas.tensors["positions"].read_all().reshape(-1).astype(np.int64), seq_lens, rids,
                            requests)
        if ids is not None:
            pas.put("request_ids", memory_view("request_ids", ids, "int64", d), "sglang dumper rids + seq_lens")
    return pas


def _request_rows(positions: np.ndarray, seq_lens: np.ndarray, rids: list[str],
                  requests: dict[str, int]) -> np.ndarray | None:
    """Each token's request: the batch lays requests out in order, request r's tokens
    ending at position seq_lens[r] - 1."""
    if len(rids) != len(seq_lens):
        return None
    out = np.empty(len(positions), dtype=np.int64)
    r = 0
    for i, p in enumerate(positions):
        if r >= len(rids):
            return None
        out[i] = requests.setdefault(rids[r], len(requests))
        if p == seq_lens[r] - 1:
            r += 1
    return out if r == len(rids) else None
