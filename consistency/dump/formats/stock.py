"""What the readers of stock debug dumps share (SGLang's tensor dump and dumper, Megatron's log).

Those tools write module outputs per forward pass and per rank, under the model's module
names. A reader turns one pass of one rank into our names (:func:`sglang_name` for SGLang's
module tree), and the helpers here do the rest the same way for every tool:

* ranks: a tensor-parallel group's copies of a replicated stream are checked against each
  other (a disagreement is ``REPLICA_MISMATCH``, as for our own rank sets) and rank 0's
  copy is kept; token-split tensors (Megatron sequence parallelism) are concatenated;
  pipeline stages contribute the names they hold;
* passes: pass k's captures become ``name#k+1`` (the first is plain ``name``), so the
  stitcher joins prefill chunks and decode steps exactly as for our own serving captures;
* aux slots: a stock dump records the target's streams, not what the server fed the draft.
  With the server's ``--layer-ids`` we *derive* ``aux.i`` as views of the streams the
  runtime's rule names (the values are the dump's own; which stream is the user's ids under
  the convention), so ``compare`` diagnoses a shifted or offset id list as on our dumps.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from consistency.contract.models import NormState, ShardSpec, TensorMeta
from consistency.dump import names
from consistency.dump.formats.base import Claims, rename
from consistency.dump.reader import TensorView
from consistency.errors import InputError

_SGL_LAYER = re.compile(r"^model\.layers\.(\d{1,6})\.(input_layernorm|post_attention_layernorm|self_attn\.o_proj|"
                        r"mlp\.down_proj)$")
REPLICA_FLOOR = 1e-10  # token rel_diff under which TP copies are one replicated value


@dataclass
class Pass:
    """One forward pass of one rank, in our names: views and where each came from."""

    tensors: dict[str, TensorView] = field(default_factory=dict)
    producers: dict[str, str] = field(default_factory=dict)
    norms: dict[str, NormState] = field(default_factory=dict)

    def put(self, name: str, view: TensorView, producer: str, norm: NormState | None = None) -> None:
        if name in self.tensors:
            return  # the first capture of a name in a pass wins (e.g. positions per decoder layer)
        self.tensors[name] = rename(view, name)
        self.producers[name] = producer
        if norm is not None:
            self.norms[name] = norm


def layer_count(module_names: Sequence[str]) -> tuple[int | None, list[int]]:
    """(N, layers seen): N is known when layers 0..max all appear (no --debug-tensor-dump-layers
    subset); with a subset the last layer's index says nothing about N."""
    seen = sorted({int(m.group(1)) for n in module_names if (m := re.match(r"^model\.layers\.(\d{1,6})\.", n))})
    if seen and seen == list(range(seen[-1] + 1)):
        return seen[-1] + 1, seen
    return None, seen


def sglang_name(module: str, item: int | None, n_items: int, num_layers: int | None,
                components: bool) -> tuple[str, NormState | None] | None:
    """Our name for output ``item`` (of ``n_items``) of an SGLang module, or None.

    Classic decoder layers (up to 0.5.22) run a fused add+RMSNorm that returns
    ``(normed, x + residual)``: the residual item of layer s's ``input_layernorm`` is stream
    s, of ``model.norm`` stream N (its normed item is ``final_norm``), of
    ``post_attention_layernorm`` the stream plus the attention output (``resid_mid``).
    Layer 0's input norm gets no residual and returns the normed embedding only.
    ``components``: ``o_proj``/``down_proj`` outputs are the block deltas (only where they
    are all-reduced: tensor parallel 1, or before 0.5.23's ``reduce_results=False``).
    """
    if module == "model.embed_tokens" and n_items == 1:
        return names.hidden(0), None
    if module == "model.norm" and n_items == 2:
        if item == 0:
            return names.FINAL_NORM, NormState.final_norm
        return (names.hidden(num_layers), None) if num_layers is not None else None
    m = _SGL_LAYER.match(module)
    if m is None:
        return None
    k, part = int(m.group(1)), m.group(2)
    if part == "input_layernorm" and n_items == 2 and item == 1 and k >= 1:
        return names.hidden(k), None
    if part == "post_attention_layernorm" and n_items == 2 and item == 1:
        return f"{names.RESID_MID}.{k}", None
    if components and n_items == 1 and part == "self_attn.o_proj":
        return names.attn_out(k), None
    if components and n_items == 1 and part == "mlp.down_proj":
        return names.mlp_out(k), None
    return None


def combine_ranks(path: Path, group: Sequence[Pass], ranks: Sequence[int], split_rows: bool = False,
                  partial: frozenset[str] = frozenset()) -> tuple[Pass, dict[str, tuple[float, int]], list[str]]:
    """One pass of a tensor-parallel group: replicated names from the first rank, checked
    against the others; ``split_rows``: names whose copies differ are token shards
    (sequence parallel), concatenated in rank order; names in ``partial`` whose copies
    differ are rank-local partial sums (a row-parallel output before its all-reduce), summed."""
    out = Pass()
    replicas: dict[str, tuple[float, int]] = {}
    notes: list[str] = []
    from consistency.dump.ranks import CombinedView, _replica_spread

    first = group[0]
    for name, view in first.tensors.items():
        views = [p.tensors.get(name) for p in group]
        if any(v is None for v in views):
            lacking = [ranks[i] for i, v in enumerate(views) if v is None]
            raise InputError(path, f"rank(s) {lacking} lack {name!r} that rank {ranks[0]} holds")
        out.put(name, view, first.producers[name], first.norms.get(name))
        if len(views) == 1 or not view.is_float:
            continue
        spread, at = _replica_spread(views)  # type: ignore[arg-type]
        if name in partial and spread > REPLICA_FLOOR:
            spec = ShardSpec(kind="partial", rank=0, world_size=len(views), group="tp")
            out.tensors[name] = CombinedView.of(name, views, spec)  # type: ignore[arg-type]
            out.producers[name] += f" (rank-local partial sums of {len(views)} ranks, added)"
            continue
        if split_rows and spread > REPLICA_FLOOR and all(v.cols == view.cols for v in views):  # type: ignore[union-attr]
            spec = ShardSpec(kind="split", dim=-2, rank=0, world_size=len(views), group="tp")
            out.tensors[name] = CombinedView.of(name, views, spec)  # type: ignore[arg-type]
            out.producers[name] += f" (sequence-parallel shards of {len(views)} ranks, concatenated)"
            continue
        replicas[name] = (spread, ranks[at])
    return out, replicas, notes


def merge_stages(path: Path, stages: Sequence[Pass]) -> Pass:
    """The union of pipeline stages' names (each stage holds its own layers)."""
    out = Pass()
    for st in stages:
        for name, view in st.tensors.items():
            out.put(name, view, st.producers[name], st.norms.get(name))
    return out


def steps(path: Path, passes: Sequence[Pass], notes: list[str]) -> tuple[dict[str, TensorView], dict[str, TensorMeta]]:
    """Pass k as capture ``#k+1`` of each name; a name missing from some pass is dropped
    (the stitcher needs every name in every pass), with a note naming it."""
    if not passes:
        raise InputError(path, "holds no forward pass")
    common = set(passes[0].tensors)
    for p in passes[1:]:
        common &= set(p.tensors)
    dropped = sorted(set().union(*(set(p.tensors) for p in passes)) - common, key=names.sort_key)
    if dropped:
        notes.append(f"{len(dropped)} name(s) not in every pass, left out: {', '.join(dropped[:6])}"
                     f"{', ...' if len(dropped) > 6 else ''}")
    tensors: dict[str, TensorView] = {}
    metas: dict[str, TensorMeta] = {}
    for k, p in enumerate(passes):
        for name in sorted(common, key=names.sort_key):
            key = name if k == 0 else f"{name}#{k + 1}"
            v = rename(p.tensors[name], key)
            tensors[key] = v
            extra = {"norm": p.norms[name]} if name in p.norms else {}
            metas[key] = TensorMeta(dtype=v.dtype, shape=list(v.shape), producer=p.producers[name], **extra)
    return tensors, metas


def derive_aux(path: Path, tensors: dict[str, TensorView], metas: dict[str, TensorMeta], claims: Claims,
               runtime: str, passes: int, notes: list[str]) -> None:
    """``aux.i`` (every pass) as the stream the runtime's rule names for the user's i-th id."""
    if claims.streams is None:
        notes.append(f"no --layer-ids: the dump holds the target's streams, not what {runtime} fed the draft; pass "
                     "the draft config's ids (eagle_aux_hidden_state_layer_ids) to check the aux slots")
        return
    for i, s in enumerate(claims.streams):
        src = names.hidden(s)
        if src not in tensors:
            raise InputError(path, f"--layer-ids {claims.native} under {claims.convention} name stream {s} for slot {i}, "
                             f"which the dump does not hold (it holds {_streams_text(tensors)})")
        for k in range(passes):
            key_src, key = (src, names.aux(i)) if k == 0 else (f"{src}#{k + 1}", f"{names.aux(i)}#{k + 1}")
            tensors[key] = rename(tensors[key_src], key)
            metas[key] = metas[key_src].model_copy(update={"producer": f"derived: {runtime}'s stream {s} for id "
                                                            f"{claims.native[i] if claims.native else s} "
                                                            f"({claims.convention})"})
    notes.append(f"aux slots derived from the dump's streams {claims.streams} for --layer-ids {claims.native} under "
                 f"{claims.convention}: their values are the server's, which streams they are is the rule's")


def stream_ids(tensors: Mapping[str, TensorView]) -> list[int]:
    return sorted({s for k in tensors if "#" not in k and (s := names.stream_of(k)) is not None})


def _streams_text(tensors: Mapping[str, TensorView]) -> str:
    return spans(stream_ids(tensors)) or "no streams"


def spans(xs: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> '0..2, 5'."""
    out, i = [], 0
    xs = sorted(xs)
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}..{xs[j]}")
        i = j + 1
    return ", ".join(out)


class SumView(TensorView):
    """The elementwise sum of views of one shape (a decoder layer's ``(hidden, residual)``
    outputs are stream k+1 once added, as the next fused norm adds them); formed in float64."""

    parts: list[TensorView]

    @classmethod
    def of(cls, name: str, parts: Sequence[TensorView]) -> SumView:
        base = parts[0]
        if any(p.shape != base.shape for p in parts):
            raise InputError(base.path, f"{name}: cannot add parts of shapes {[list(p.shape) for p in parts]}")
        out = cls.__new__(cls)
        out.__dict__.update(base.__dict__)
        out.name, out.parts = name, list(parts)
        out._cols = None
        return out

    def read_rows(self, start: int, stop: int):  # noqa: ANN201 - float sums, never raw codes
        return self.rows_float(start, stop)

    def rows_float(self, start: int, stop: int, out_dtype: type = np.float32):  # noqa: ANN201
        acc = None
        for p in self.parts:
            x = p.rows_float(start, stop, np.float64)
            acc = x if acc is None else acc + x
        return acc.astype(out_dtype, copy=False)  # type: ignore[union-attr]

    def column_view(self, c0: int, c1: int, name: str) -> TensorView:
        return SumView.of(name, [p.column_view(c0, c1, name) for p in self.parts])
