"""Token alignment cost: 32k-token id sequences in the layouts a server produces.

    python bench/bench_tokens.py                 # 32768 tokens, 5 repeats
    python bench/bench_tokens.py --tokens 131072 --json bench/results/cpu-tokens.json

Each case builds the candidate from the reference at known places (a template in front, a
prefix-cache suffix, edits in the middle, a different prompt) and times
:func:`consistency.compare.tokens.match`, the whole per-request alignment. Two id
distributions: uniform over a 50k vocabulary, and Zipf over 2k ids (natural text repeats
a few ids very often, which is what makes naive diffs quadratic). The figure that matters
is the ratio to a plain ``np.array_equal`` of the same ids (the floor of any aligner) and
the absolute time against the one-second target; docs/performance.md holds the numbers.
Reference point: :class:`difflib.SequenceMatcher` (autojunk off) on the edited case.
"""

from __future__ import annotations

import argparse
import difflib
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from consistency.compare.tokens import match  # noqa: E402


def cases(n: int, rng: np.random.Generator) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    out = {}
    for dist in ("uniform", "zipf"):
        a = rng.integers(0, 50_000, n) if dist == "uniform" else (rng.zipf(1.3, n) % 2_000)
        b = a.tolist()
        for k in range(30):  # 30 edits: deletions, insertions, replacements
            i = int(rng.integers(0, len(b)))
            if k % 3 == 0:
                del b[i:i + 5]
            elif k % 3 == 1:
                b[i:i] = rng.integers(0, 50_000, 7).tolist()
            else:
                b[i] = 7
        other = rng.integers(0, 50_000, n) if dist == "uniform" else (rng.zipf(1.3, n) % 2_000)
        out[f"{dist}: identical"] = (a, a.copy())
        out[f"{dist}: template (+40 in front)"] = (a, np.concatenate([rng.integers(0, 50_000, 40), a]))
        out[f"{dist}: prefix-cache suffix"] = (a, a[n // 7:])
        out[f"{dist}: 30 edits in the middle"] = (a, np.asarray(b))
        out[f"{dist}: different prompt"] = (a, other)
    return out


def best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=32_768)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--difflib", action="store_true", help="also time difflib on the edited cases (slow)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    rows = []
    print(f"| case ({args.tokens} tokens) | method | aligned | ms | x array_equal |")
    print("|---|---|---|---|---|")
    for name, (a, b) in cases(args.tokens, rng).items():
        floor = best_of(lambda a=a: np.array_equal(a, a.copy()), args.repeats)
        t = best_of(lambda a=a, b=b: match(a, b), args.repeats)
        method, blocks = match(a, b)
        aligned = sum(n for _i, _j, n in blocks)
        rows.append({"case": name, "method": method, "aligned": aligned, "seconds": t, "ratio": t / floor})
        print(f"| {name} | {method} | {aligned} | {t * 1e3:.1f} | {t / floor:.0f} |")
        if args.difflib and "edits" in name:
            t0 = time.perf_counter()
            difflib.SequenceMatcher(None, a.tolist(), b.tolist(), autojunk=False).get_matching_blocks()
            print(f"| {name}, difflib | - | - | {(time.perf_counter() - t0) * 1e3:.0f} | - |")
    if args.json:
        args.json.write_text(json.dumps({"tokens": args.tokens, "machine": platform.processor() or platform.machine(),
                                         "python": platform.python_version(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
