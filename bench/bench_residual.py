"""RESIDUAL_MISSING's cost against the number of reference tensors (issue 24).

    python bench/bench_residual.py                 # L = 250, 1000, 2000 layers
    python bench/bench_residual.py --layers 500

A reference of L layers records ``hidden.0..L`` and each layer's ``attn_out.k`` and
``mlp_out.k`` ([256, 64] float32, 3L + 1 tensors of one shape, in memory); the candidate
holds every stream as the previous layer's MLP delta plus noise, so every one of its L
tensors is a RESIDUAL_MISSING case. Both ways of finding the delta run on the same
:class:`Evidence`, timed over every candidate tensor:

* ``scan`` (the baseline, what diagnose/hypotheses.py did before issue 24): one batched
  distance row from the candidate to every reference tensor, then the nearest delta: O(n)
  arithmetic per tensor, O(n^2) for n differing tensors;
* ``near`` (now): the attention and MLP outputs of layers s-1 and s, pair by pair (and their
  sum for parallel blocks): O(1) per tensor.

Both must find the same delta; the ratio is the point. docs/performance.md holds the figures.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import report  # noqa: E402

from consistency.compare.engine import compare  # noqa: E402
from consistency.diagnose import hypotheses  # noqa: E402
from consistency.diagnose.evidence import Evidence  # noqa: E402
from consistency.dump import names  # noqa: E402
from consistency.dump.memory import MemoryDump  # noqa: E402

T, H = 256, 64


def dumps(layers: int) -> tuple[MemoryDump, MemoryDump]:
    rng = np.random.default_rng(0)
    h = [rng.standard_normal((T, H)).astype(np.float32)]
    ref: dict[str, np.ndarray] = {}
    for k in range(layers):
        a = (0.3 * rng.standard_normal((T, H))).astype(np.float32)
        m = (0.3 * rng.standard_normal((T, H))).astype(np.float32)
        ref[names.attn_out(k)], ref[names.mlp_out(k)] = a, m
        h.append(h[-1] + a + m)
    ref |= {names.hidden(s): x for s, x in enumerate(h)}
    cand = {names.hidden(s): (ref[names.mlp_out(s - 1)] * (1 + 1e-3 * rng.standard_normal((T, H)))).astype(np.float32)
            for s in range(1, layers + 1)}
    return MemoryDump(ref, name="reference"), MemoryDump(cand, name="candidate")


def scan(ev: Evidence, r) -> tuple[float, str] | None:  # noqa: ANN001
    """The baseline: a distance row over every reference tensor, then the nearest delta."""
    fp, cfp = ev.cmp.ref_fp.get(ev.key(r)), ev.cmp.cand_fp.get(ev.key(r))
    at = fp.of_kind(names.MLP_OUT, names.ATTN_OUT)
    dist = cfp.distances(r.cand.name, fp)[at]
    i = int(np.argmin(dist))
    return float(dist[i]), fp.names[int(at[i])]


def one(layers: int) -> dict:
    ref, cand = dumps(layers)
    cmp = compare(ref, cand)
    ev = Evidence(cmp)
    results = [r for r in cmp.results if r.ref is not None]
    times = {}
    found = {}
    for how in ("near", "scan"):
        for fp in list(cmp.cand_fp.values()) + list(cmp.ref_fp.values()):
            fp._memo.clear()
        t = time.perf_counter()
        if how == "near":
            found[how] = [x.identified_as if (x := hypotheses.residual_missing(ev, r)) else None for r in results]
        else:
            found[how] = [scan(ev, r)[1] for r in results]
        times[how] = time.perf_counter() - t
    assert found["near"] == found["scan"], "the two ways disagree"
    n = len(ref.tensors)
    return {"layers": layers, "reference tensors": n, "differing tensors": len(results),
            "scan (baseline)": f"{times['scan']:.2f} s", "near (now)": f"{times['near']:.2f} s",
            "per tensor, scan": f"{1e3 * times['scan'] / len(results):.2f} ms",
            "per tensor, near": f"{1e3 * times['near'] / len(results):.2f} ms",
            "ratio": f"{times['scan'] / max(times['near'], 1e-9):.1f}x"}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, nargs="+", default=[250, 1000, 2000])
    a = ap.parse_args(argv)
    report([one(n) for n in a.layers], ROOT / "bench" / "results" / "residual.json")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
