"""The identification stage: which reference tensor each candidate really holds.

Slots are ranked against every reference tensor of their shape (a handful of slots, the
question the tool exists to answer). A by-name pair is ranked only when it does not already
agree with its own name, and then against a bounded pool: its neighbours in the
reference's name order, the streams around its index, the final norm and the reference's
slots, except for the first ``FULL_RANKS`` differing tensors in forward order (where a root
cause sits), which get the whole pool. So identification stays linear in the number of
tensors when thousands of them differ (docs/performance.md, "Many differing tensors").
"""

from __future__ import annotations

import math
from dataclasses import replace

from consistency.compare import identify
from consistency.compare.context import Context, key
from consistency.compare.refslots import same_floor
from consistency.compare.types import Rows
from consistency.dump import names

FULL_RANKS = 64  # differing by-name tensors ranked against every same-shape reference
NEIGHBOURS = 6  # by-name tensors: this many reference names on either side in name order
STREAM_REACH = 3  # ... and the streams within this many layers of its index


def identify_all(ctx: Context, rows: dict[str, Rows]) -> dict[str, identify.Identification]:
    out: dict[str, identify.Identification] = {}
    entries = [e for e in ctx.plan.entries if rows[e.name].cand.is_float and rows[e.name].cand.cols > 1
               and key(rows[e.name].cand) in ctx.ref_fp]
    slots = [e for e in entries if e.slot is not None or e.concat_of is not None]
    identify.prefetch(ctx.cand_fp, ctx.ref_fp, [(rows[e.name].cand, rows[e.name].ref) for e in slots])
    same = same_floor(ctx.tol)
    full_left = FULL_RANKS
    ordered = sorted(entries, key=lambda e: (e.slot is None and e.concat_of is None, names.sort_key(e.name)))
    pools: dict[key, _Pools] = {}
    for e in ordered:
        rw = rows[e.name]
        cv, rv = rw.cand, rw.ref
        rfp, cfp = ctx.ref_fp[key(cv)], ctx.cand_fp[key(cv)]
        expected_in = rv is not None and rv.name in rfp
        is_slot = e.slot is not None or e.concat_of is not None
        pool = None
        if not is_slot:
            if expected_in:
                d = cfp.distance(cv.name, rv.name, rfp)
                if d <= ctx.noise_floor(e.name, rv, cv, user=False)[0]:
                    continue  # same-name pair that already agrees: no identification needed
            if full_left > 0:
                full_left -= 1
            else:
                if key(cv) not in pools:  # built once per shape: a sorted name list of every reference
                    pools[key(cv)] = _Pools(rfp)
                pool = pools[key(cv)].near(rv.name if rv is not None else e.name)
        ident = identify.rank(cv.name, cfp, rfp, pool, same)
        if expected_in:
            assert rv is not None
            gap_pool = rfp.of_kind(names.HIDDEN) if pool is None else [n for n in pool if names.stream_of(n) is not None]
            ident = replace(ident, expected=rv.name, expected_distance=cfp.distance(cv.name, rv.name, rfp),
                            gap=identify.neighbour_gap(rv.name, rfp, gap_pool, same))
        out[e.name] = ident
    return _assign_slots(ctx, rows, out)


class _Pools:
    """Bounded ranking pools of one fingerprint group, by the name a tensor should equal."""

    def __init__(self, rfp: identify.Fingerprints) -> None:
        self.order = sorted(rfp.names, key=names.sort_key)
        self.at = {n: i for i, n in enumerate(self.order)}
        have = set(rfp.names)
        self.always = [n for n in rfp.names if n == names.FINAL_NORM or names.parse(n).kind == names.AUX][:64]
        self.have = have

    def near(self, name: str) -> list[str]:
        i = self.at.get(name)
        out = list(self.always)
        if i is not None:
            out += self.order[max(0, i - NEIGHBOURS):i + NEIGHBOURS + 1]
        k = names.parse(name)
        if k.index is not None:
            s = k.index + (1 if k.kind in (names.MLP_OUT, names.ATTN_OUT) else 0)
            out += [names.hidden(j) for j in range(max(0, s - STREAM_REACH), s + STREAM_REACH + 1)
                    if names.hidden(j) in self.have]
        return list(dict.fromkeys(out))


def _assign_slots(ctx: Context, rows: dict[str, Rows],
                  idents: dict[str, identify.Identification]) -> dict[str, identify.Identification]:
    """Joint assignment over slots; when the expected reference is as good as the best
    (within noise), it wins the tie, so equal layers never cause a false alarm."""
    slots = [e for e in ctx.plan.slots if e.name in idents]
    options = []
    for e in slots:
        ident = idents[e.name]
        best = ident.best.distance if ident.best else math.inf
        floor = ctx.tol.dtype_floor(ctx.dtype("cand", rows[e.name].cand), "float32")
        if best > 3 * floor:  # nothing matches: no tie to break, keep the plain ranking
            options.append([(x.name, x.distance) for x in ident.ranking[:1]])
            continue
        limit = max(floor, 2 * best)
        opts = [(x.name, x.distance) for x in ident.ranking if x.distance <= limit]
        exp, exp_d = ident.expected, ident.expected_distance
        if exp and exp_d is not None and exp_d <= limit:
            grp = next((g for g in ident.groups if exp in g), (exp,))
            opts = [(exp, exp_d * 0.5)] + [o for o in opts if o[0] not in grp]
        options.append(opts)
    out = dict(idents)
    for e, name in zip(slots, identify.assign(options), strict=True):
        ident = idents[e.name]
        if name is not None and name not in ident.group:
            out[e.name] = ident.promoted(name, ident.expected_distance if name == ident.expected else None)
    return out
