"""Where an eager decode step's recorder cost goes: host time inside ``capture`` and the
CUDA runtime calls the recorder makes (synchronisations, copies), per decode step.

    python bench/record_probe.py --out probe.json           # on a CUDA machine
    python bench/record_probe.py --small                    # a smaller model

Per mode (off; noop3: hooks that do nothing; copy3/copy_all: one bare device copy per
capture, the floor of any snapshot; aux3/all: the recorder; *_waited: the prefill's
captures on the host before the decode is timed), the median decode step (whole-run
medians: noisy, see bench/decode_blocks.py), the host microseconds inside the hook per
call, and a
``torch.profiler`` count of the CUDA runtime calls in four decode steps, so a cost that
is not the recorder's Python (a synchronisation, a pinned allocation) shows by name.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import emit  # noqa: E402

from bench.bench_record_gpu import Hooks, build, timed  # noqa: E402
from consistency.record.async_capture import AsyncRecorder  # noqa: E402


class TimedHooks(Hooks):
    """``how``: "capture" (the recorder), "noop" (the hook's own cost), "copy" (one device copy
    into a buffer of the hook's own: the floor of any snapshot)."""

    def __init__(self, *a, how: str = "capture", **kw) -> None:  # noqa: ANN002, ANN003
        super().__init__(*a, **kw)
        self.spent: list[float] = []
        self.how = how
        self.bufs: dict[str, torch.Tensor] = {}

    def _take(self, name: str, t: torch.Tensor, naive: bool) -> None:
        t0 = time.perf_counter()
        if self.how == "capture":
            super()._take(name, t, naive)
        elif self.how == "copy":
            b = self.bufs.get(name)
            if b is None or b.shape != t.shape:
                b = self.bufs[name] = torch.empty_like(t)
            b.copy_(t)
        self.spent.append(time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    model = build(args.small)
    n = model.config.num_hidden_layers
    aux = [2, n // 2, n - 3]
    # mode -> (streams, how, wait for the prefill's captures before the decode is timed)
    spec = {"off": None, "noop3": (aux, "noop", False), "copy3": (aux, "copy", False), "aux3": (aux, "capture", False),
            "aux3_waited": (aux, "capture", True), "all": (list(range(n + 1)), "capture", False),
            "all_waited": (list(range(n + 1)), "capture", True), "copy_all": (list(range(n + 1)), "copy", False)}
    ids = torch.randint(0, model.config.vocab_size, (1, args.tokens), device="cuda")
    res: dict = {"code": str(ROOT), "modes": {}}

    def once(mode: str, profile: bool = False) -> tuple[float, list[float], dict]:
        sp = spec[mode]
        hooks = TimedHooks(model, sp[0], False, how=sp[1]) if sp else None
        rec = AsyncRecorder("/tmp/probe.safetensors", force=True, max_host_bytes=64 << 30,
                            ring_bytes=2 << 30).prepare() if sp and sp[1] == "capture" else None
        if rec is not None:
            rec.__enter__()
        calls: dict = {}
        try:
            with torch.no_grad():
                out = model(input_ids=ids, use_cache=True)
                pkv, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
                torch.cuda.synchronize()
                if rec is not None and sp[2]:
                    rec.wait()
                if hooks:
                    hooks.spent.clear()

                def decode() -> None:
                    nonlocal pkv, nxt
                    for _ in range(args.steps):
                        o = model(input_ids=nxt, past_key_values=pkv, use_cache=True)
                        pkv, nxt = o.past_key_values, o.logits[:, -1:].argmax(-1)

                ms = timed(decode) / args.steps
                if profile:
                    from torch.profiler import ProfilerActivity, profile as prof

                    with prof(activities=[ProfilerActivity.CPU]) as p:
                        for _ in range(4):
                            o = model(input_ids=nxt, past_key_values=pkv, use_cache=True)
                            pkv, nxt = o.past_key_values, o.logits[:, -1:].argmax(-1)
                        torch.cuda.synchronize()
                    for e in p.key_averages():
                        if e.key.startswith("cuda") or "ynchron" in e.key or "Memcpy" in e.key or "HostAlloc" in e.key:
                            calls[e.key] = {"count": e.count, "cpu_us": round(e.cpu_time_total, 1)}
        finally:
            if rec is not None:
                rec.wait()
                rec.discard()
            if hooks is not None:
                hooks.remove()
        return ms, list(hooks.spent) if hooks else [], calls

    for m in spec:
        once(m)
    times: dict = {m: [] for m in spec}
    spent: dict = {m: [] for m in spec}
    for _ in range(args.repeat):
        for m in spec:
            ms, sp, _ = once(m)
            times[m].append(ms)
            spent[m] += sp
    for m in spec:
        _, _, calls = once(m, profile=True)
        med = statistics.median(times[m])
        res["modes"][m] = {"decode_ms": round(med, 3), "ratio": round(med / statistics.median(times["off"]), 4),
                           "capture_us_median": round(statistics.median(spent[m]) * 1e6, 1) if spent[m] else None,
                           "capture_us_mean": round(statistics.mean(spent[m]) * 1e6, 1) if spent[m] else None,
                           "capture_us_max": round(max(spent[m]) * 1e6, 1) if spent[m] else None,
                           "cuda_calls_4_steps": calls}
    emit(res, args.out)


if __name__ == "__main__":
    main()
