"""Compare at real sizes: Kimi-shaped dumps, three ways, in one run.

    python bench/bench_compare.py                      # 61 layers, hidden 7168, 2048 tokens, bf16 (~1.9 GB)
    python bench/bench_compare.py --tokens 512 --layers 16 --hidden 2048   # quicker
    python bench/bench_compare.py --scaling            # how cost grows with tokens and layers
    python bench/bench_compare.py --no-naive --before /tmp/head   # + hot compare of another source tree

(a) a plain sequential read of both files (the floor), (b) a naive compare that loads
everything with torch and computes every slot-by-stream metric, (c) ``consistency compare``
with identification, as a subprocess (its peak RSS is measured with getrusage), and (d) the
same ``compare()`` in-process split into phases (fingerprints, ranking, gaps, full metrics;
``inproc_*_s``), which says where the time above the read floor goes. Figures go
to stdout as a Markdown table and, with --json, to a file; docs/performance.md holds them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import report  # noqa: E402

from consistency.contract.models import AuxInfo, DumpMetadata, ModelInfo  # noqa: E402
from consistency.dump.dtypes import float32_to_bf16_bits  # noqa: E402
from consistency.dump.reader import META_KEY  # noqa: E402
from consistency.dump.safetensors_io import serialize_header, write_raw  # noqa: E402


def make_streams(layers: int, tokens: int, hidden: int, seed: int = 0):  # noqa: ANN201
    """Yield (s, bf16 bits of stream s): a random walk, so adjacent layers are close (as in real models)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tokens, hidden), dtype=np.float32)
    x[0] *= 50.0  # an attention-sink row with a massive norm, as in real models
    for s in range(layers + 1):
        yield s, float32_to_bf16_bits(x)
        x += rng.standard_normal((tokens, hidden), dtype=np.float32) * 0.35


def write_streaming(path: Path, specs: list[tuple[str, tuple[int, ...]]], chunks, meta: DumpMetadata) -> None:  # noqa: ANN001
    """safetensors written tensor by tensor: the header first (sizes are known), then data."""
    header = serialize_header({n: ("bfloat16", shp, int(np.prod(shp)) * 2) for n, shp in specs},
                              {META_KEY: meta.model_dump_json(exclude_none=True)})
    with open(path, "wb") as fh:
        fh.write(header)
        for arr in chunks:
            write_raw(fh, arr)


def build(out: Path, layers: int, tokens: int, hidden: int, slots: list[int]) -> tuple[Path, Path]:
    ref, cand = out / f"ref-{layers}x{hidden}x{tokens}.safetensors", out / f"cand-{layers}x{hidden}x{tokens}.safetensors"
    if ref.exists() and cand.exists():
        return ref, cand
    model = ModelInfo(num_layers=layers, hidden_size=hidden)
    keep: dict[int, np.ndarray] = {}

    def ref_chunks():  # noqa: ANN202
        for s, bits in make_streams(layers, tokens, hidden):
            if s in slots:
                keep[s] = bits
            yield bits

    specs = [(f"hidden.{s}", (tokens, hidden)) for s in range(layers + 1)]
    write_streaming(ref, specs, ref_chunks(), DumpMetadata(side="training", model=model,
                                                           aux=AuxInfo(stream_ids=[0, *slots[:-1]])))
    served = [keep[s] for s in slots]
    write_streaming(cand, [(f"aux.{i}", (tokens, hidden)) for i in range(len(slots))], iter(served),
                    DumpMetadata(side="serving", model=model, aux=AuxInfo(stream_ids=slots)))
    return ref, cand


def evict(paths: list[Path]) -> None:
    """Drop the files from the page cache (clean pages; no privileges needed)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def plain_read(paths: list[Path]) -> float:
    buf = bytearray(16 << 20)
    t = time.perf_counter()
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
    return time.perf_counter() - t


# the CLI, then its own peak RSS (VmHWM) on stderr: ru_maxrss would include this parent's size
HWM_WRAPPER = ("import sys\nfrom consistency.cli import run\ntry:\n    run(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
               "print('VmHWM', next(int(x.split()[1]) for x in open('/proc/self/status') if x.startswith('VmHWM:')),"
               " file=sys.stderr)")

NAIVE = r"""
import sys, time, torch
from safetensors.torch import load_file
t = time.perf_counter()
ref = load_file(sys.argv[1]); cand = load_file(sys.argv[2])
refs = {k: v.double() for k, v in ref.items()}
for cn, c in cand.items():
    c = c.double()
    for rn, r in refs.items():
        rel = ((c - r) ** 2).sum() / ((c * c).sum() + (r * r).sum())
        cos = (c * r).sum() / (c.norm() * r.norm())
print(time.perf_counter() - t)
print("VmHWM", next(int(x.split()[1]) for x in open("/proc/self/status") if x.startswith("VmHWM:")), file=sys.stderr)
"""


def _cold(fn, files: list[Path]) -> float:  # noqa: ANN001
    evict(files)
    return fn(files)


def child_env() -> dict[str, str]:
    """The children keep compiled bytecode, as an installed package does: this machine's
    sessions set PYTHONDONTWRITEBYTECODE=1, which would recompile every module of ours on
    every run (~0.5 G instructions, a third of a small compare's start-up)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env.setdefault("PYTHONPYCACHEPREFIX", str(ROOT / "bench" / "out" / "pycache"))
    return env


def run_child(args: list[str], cwd: Path | None = None) -> tuple[float, float, str]:
    """Wall seconds, this child's own peak RSS (MB, from wait4), and its stdout; ``cwd``
    another source tree to run (``python -c`` imports ``consistency`` from there)."""
    t = time.perf_counter()
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(), cwd=cwd)
    out = proc.stdout.read() if proc.stdout else ""
    err = proc.stderr.read() if proc.stderr else ""
    _pid, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t
    code = os.waitstatus_to_exitcode(status)
    proc.returncode = code
    if code not in (0, 1):
        raise SystemExit(f"{args[:3]} failed: {err[-2000:]}")
    hwm = [int(x.split()[1]) for x in err.splitlines() if x.startswith("VmHWM ")]
    return wall, (hwm[-1] if hwm else usage.ru_maxrss) / 1024, out


def phases(ref: Path, cand: Path, repeat: int) -> dict:
    """In-process ``compare()`` split into its phases (best of ``repeat``, hot cache): building
    the fingerprints, the slots' distances (prefetch), ranking (identification), neighbour gaps
    and the full metrics."""
    from consistency.compare import engine, identify, stream
    from consistency.dump.reader import open_dump

    spent: dict[str, float] = {}

    def timed(owner: object, name: str, label: str) -> None:
        fn = getattr(owner, name)

        def wrapper(*a, **k):  # noqa: ANN002, ANN003, ANN202
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[label] = spent.get(label, 0.0) + time.perf_counter() - t
        setattr(owner, name, wrapper)

    timed(identify.Fingerprints, "__init__", "fingerprints")
    timed(identify, "prefetch", "prefetch")  # the slots' distances, batched (rank/gap then hit the memo)
    timed(identify, "rank", "rank")
    timed(identify, "neighbour_gap", "gap")
    timed(stream, "measure", "metrics")
    best: dict[str, float] | None = None
    with open_dump(ref) as r, open_dump(cand) as c:
        for _ in range(repeat):
            spent.clear()
            t = time.perf_counter()
            engine.compare(r, c)
            spent["compare"] = time.perf_counter() - t
            if best is None or spent["compare"] < best["compare"]:
                best = dict(spent)
    return {f"inproc_{k}_s": round(v, 3) for k, v in (best or {}).items()}


def measure(out: Path, layers: int, tokens: int, hidden: int, naive: bool, repeat: int,
            before: Path | None = None) -> dict:
    slots = [3, 31, 59] if layers >= 60 else [min(3, layers), layers // 2, layers - 2]
    ref, cand = build(out, layers, tokens, hidden, slots)
    size = ref.stat().st_size + cand.stat().st_size
    files = [ref, cand]
    cmd = [sys.executable, "-c", HWM_WRAPPER, "compare", str(ref), str(cand), "--json", str(out / "report.json"),
           "--force", "-q"]
    row = {"layers": layers, "tokens": tokens, "hidden": hidden, "bytes": size}
    run_child(cmd)  # compiles the bytecode once (not timed)
    for cache in ("cold", "hot"):
        a_runs, c_runs = [], []
        for _ in range(repeat):
            if cache == "cold":
                evict(files)
            else:
                plain_read(files)
            a_runs.append(plain_read(files) if cache == "hot" else _cold(plain_read, files))
            if cache == "cold":
                evict(files)
            c_runs.append(run_child(cmd))
        a, c, rss = min(a_runs), min(r[0] for r in c_runs), max(r[1] for r in c_runs)
        row.update({f"{cache}_a_read_s": round(a, 3), f"{cache}_c_compare_s": round(c, 3),
                    f"{cache}_c_over_a": round(c / a, 2)})
    row["c_peak_rss_mb"] = round(rss, 1)
    if before is not None:  # the same compare from another source tree, hot, alternating with this one
        run_child(cmd, before)
        a_runs, b_runs, c_runs = [], [], []
        for _ in range(repeat):
            plain_read(files)
            a_runs.append(plain_read(files))
            b_runs.append(run_child(cmd, before))
            c_runs.append(run_child(cmd))
        a = min(a_runs)
        row.update(before_hot_a_read_s=round(a, 3), before_hot_c_compare_s=round(min(r[0] for r in b_runs), 3),
                   before_hot_c_over_a=round(min(r[0] for r in b_runs) / a, 2),
                   before_c_peak_rss_mb=round(max(r[1] for r in b_runs), 1),
                   after_hot_c_compare_s=round(min(r[0] for r in c_runs), 3),
                   after_hot_c_over_a=round(min(r[0] for r in c_runs) / a, 2))
    rep = json.loads((out / "report.json").read_text())
    row.update(identified=[s["identified_stream"] for s in rep["slots"]], expected_slots=slots)
    help_t = min(run_child([sys.executable, "-m", "consistency", "--help"])[0] for _ in range(3))
    chelp_t = min(run_child([sys.executable, "-m", "consistency", "compare", "--help"])[0] for _ in range(3))
    row.update(compare_help_s=round(chelp_t, 3))
    torch_t = min(run_child([sys.executable, "-c", "import torch"])[0] for _ in range(3))
    row.update(help_s=round(help_t, 3), import_torch_s=round(torch_t, 3))
    row.update(phases(ref, cand, repeat))
    if naive:
        evict(files)
        b, b_rss, _ = run_child([sys.executable, "-c", NAIVE, str(ref), str(cand)])
        row.update(cold_b_naive_s=round(b, 3), cold_b_over_a=round(b / row["cold_a_read_s"], 2),
                   b_peak_rss_mb=round(b_rss, 1))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out")
    ap.add_argument("--no-naive", action="store_true", help="skip (b), which needs ~6x the dump size in RAM")
    ap.add_argument("--scaling", action="store_true", help="vary tokens and layers at hidden 2048")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--before", type=Path, help="another source tree (holding consistency/): its hot compare too")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    if args.scaling:
        for layers, tokens in ((16, 512), (16, 2048), (16, 8192), (32, 2048), (61, 2048)):
            rows.append(measure(args.out, layers, tokens, 2048, False, args.repeat))
    else:
        rows.append(measure(args.out, args.layers, args.tokens, args.hidden, not args.no_naive, args.repeat,
                            args.before))
    report(rows, args.json)


if __name__ == "__main__":
    main()
