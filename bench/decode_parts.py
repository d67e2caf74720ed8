"""Where every-stream recording's eager decode cost goes, part by part, in one run.

    python bench/decode_parts.py --out parts.json            # on a CUDA machine
    python bench/decode_parts.py --small                     # a smaller model

bench/bench_record_gpu.py gives the recorder's whole cost; this splits it, with the same
interleaved blocks (bench/decode_blocks.py, ratios paired inside a block), into what any
capture of 33 points pays and what the recorder adds:
  off        no hooks
  noop_all   33 forward hooks that do nothing (the hook path itself)
  copy_all   33 hooks, each one bare device copy into a buffer of its own (cudaMemcpyAsync)
  kcopy_all  the same copy as an elementwise kernel (bit-exact: an int16 view or'ed with 0)
  all        the recorder, every stream
  all_f8     the recorder sending staged steps 8 MiB at a time (1 MiB by default)
  all_hold   the recorder with staging that leaves the device only when full (the writer
             thread idle in most blocks): what the writer thread costs the model's thread
  all_nosend the recorder whose staged batches never leave the device (no D2H, no event,
             no stream wait, no writer): what sending costs
  all_nocopy the recorder without the staging copy itself (every check and bookkeeping,
             no ``copy_``): what the recorder's Python costs on its own
Per mode also the host microseconds spent inside the hooks per step (what is not inside them
is the rest of the step slowing down), the model thread's and the whole process's CPU time
per step (``time.thread_time`` / ``process_time``: a step that is slower in wall time but not
in the model thread's CPU time waits, for the GPU or for the GIL), the writer thread's CPU
time per step (/proc), the garbage collector's passes and time, and, for off and all, a
torch.profiler table of the four steps' CPU ops.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_record_gpu import Hooks, build, timed  # noqa: E402
from bench.common import emit  # noqa: E402
from bench.decode_blocks import decode_blocks  # noqa: E402
from consistency.record.async_capture import AsyncRecorder  # noqa: E402


class PartHooks(Hooks):
    """Hooks whose body is ``how`` (capture / noop / copy / kcopy), timed into ``spent``."""

    def __init__(self, model, streams: list[int], how: str, spent: list[float]) -> None:  # noqa: ANN001
        super().__init__(model, streams, naive=False)
        self.how, self.spent = how, spent
        self.bufs: dict[str, torch.Tensor] = {}

    def _take(self, name: str, t: torch.Tensor, naive: bool) -> None:
        t0 = time.perf_counter()
        if self.how == "capture":
            super()._take(name, t, naive)
        elif self.how in ("copy", "kcopy"):
            b = self.bufs.get(name)
            if b is None or b.shape != t.shape:
                b = self.bufs[name] = torch.empty_like(t)
            if self.how == "copy":
                b.copy_(t)
            else:
                torch.bitwise_or(t.view(torch.int16), 0, out=b.view(torch.int16))
        self.spent.append(time.perf_counter() - t0)


class NoSend(AsyncRecorder):
    """Staged batches are dropped on the device: nothing is sent, no writer runs."""

    def _flush(self) -> None:
        if self._staging is not None and self._staging.items:
            self._staging.take()


class NoCopy(AsyncRecorder):
    """Every check and every bit of bookkeeping of a capture, without the staging copy."""

    def prepare(self, device="cuda"):  # noqa: ANN001, ANN201
        super().prepare(device)
        st = self._staging
        real = st.put

        def put(key, name, sel, nbytes, dtype=None, shape=None, dname=None, pad=None):  # noqa: ANN001, ANN202
            vk = (st.cur, st.at, dtype, shape)
            if vk not in st._views:
                return real(key, name, sel, nbytes, dtype, shape, dname, pad)  # builds the view once
            st.items.append((key, st.at, nbytes, dname, shape))
            st.names.add(name)
            st.at += pad

        st.put = put
        return self


def thread_cpu_s(tid: int) -> float:
    """A thread's user+system CPU seconds (/proc; clock ticks)."""
    import os

    try:
        f = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
    except OSError:
        return float("nan")


class GcClock:
    """Collections and seconds the collector spent, per mode (gc.callbacks)."""

    def __init__(self) -> None:
        self.mode = ""
        self.by: dict[str, list[float]] = {}
        self._t = 0.0
        gc.callbacks.append(self._cb)

    def _cb(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        else:
            self.by.setdefault(f"{self.mode}:gen{info['generation']}", []).append(time.perf_counter() - self._t)


def kernel_busy_ms(prof: object) -> float | None:
    """Milliseconds in which at least one CUDA kernel or copy ran (the union of their intervals)."""
    try:
        from torch.autograd import DeviceType

        spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()  # type: ignore[attr-defined]
                       if e.device_type == DeviceType.CUDA)
    except Exception:  # noqa: BLE001 - a profiler without this view: say so in the result, not a crash
        return None
    busy, reached = 0.0, float("-inf")
    for s, e in spans:  # sorted by start: only the part past what earlier spans reached is new
        busy += max(0.0, e - max(s, reached))
        reached = max(reached, e)
    return round(busy / 1e3, 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--blocks", type=int, default=40)
    ap.add_argument("--modes", default="off,noop_all,copy_all,kcopy_all,all,all_f8,all_hold")
    ap.add_argument("--tmp", type=Path, default=Path("/tmp"))
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    modes = args.modes.split(",")
    model = build(args.small)
    n = model.config.num_hidden_layers
    every = list(range(n + 1))
    how = {"noop_all": "noop", "copy_all": "copy", "kcopy_all": "kcopy", "all": "capture", "all_hold": "capture",
           "all_f8": "capture", "all_nosend": "capture", "all_nocopy": "capture"}
    ids = torch.randint(0, model.config.vocab_size, (1, args.tokens), device="cuda")
    spent: dict[str, list[float]] = {m: [] for m in modes}
    clock = GcClock()

    def hooks_for(m: str):  # noqa: ANN202
        clock.mode = m
        return PartHooks(model, every, how[m], spent[m]) if m in how else None

    def recorder_for(m: str):  # noqa: ANN202
        if m == "all":
            return AsyncRecorder(args.tmp / "all.safetensors", force=True, max_host_bytes=64 << 30,
                                 ring_bytes=512 << 20).prepare()
        if m == "all_hold":
            return AsyncRecorder(args.tmp / "hold.safetensors", force=True, max_host_bytes=64 << 30, ring_bytes=512 << 20,
                                 staging_bytes=96 << 20, flush_bytes=96 << 20).prepare()
        if m in ("all_nosend", "all_nocopy"):
            cls = NoSend if m == "all_nosend" else NoCopy
            return cls(args.tmp / f"{m}.safetensors", force=True, max_host_bytes=64 << 30, ring_bytes=512 << 20).prepare()
        if m == "all_f8":
            return AsyncRecorder(args.tmp / "f8.safetensors", force=True, max_host_bytes=64 << 30, ring_bytes=512 << 20,
                                 staging_bytes=32 << 20, flush_bytes=8 << 20).prepare()
        return None

    cpu: dict[str, list[tuple[float, float, float]]] = {m: [] for m in modes}  # (wall, thread, process) s a block
    writer_s: dict[str, float] = {}

    def timed_cpu(fn) -> float:  # noqa: ANN001
        torch.cuda.synchronize()
        w, t, p = time.perf_counter(), time.thread_time(), time.process_time()
        fn()
        torch.cuda.synchronize()
        cpu[clock.mode].append((time.perf_counter() - w, time.thread_time() - t, time.process_time() - p))
        return (time.perf_counter() - w) * 1000

    def recorder_kept(m: str):  # noqa: ANN202
        rec = recorder_for(m)
        if rec is not None:  # the writer's CPU time is read when the bench is done with it
            tid, discard = rec._thread.native_id, rec.discard

            def read_then_discard() -> None:
                writer_s[m] = thread_cpu_s(tid)
                discard()

            rec.discard = read_then_discard
        return rec

    res, dropped = decode_blocks(model, ids, modes, hooks_for, recorder_kept, args.steps, args.blocks, timed_cpu)
    for m in modes:
        rows = cpu[m][1:]  # block 0 warms up
        n = max(1, len(rows)) * args.steps
        res[m]["wall_ms_per_step"] = round(sum(r[0] for r in rows) / n * 1e3, 3)
        res[m]["model_thread_cpu_ms_per_step"] = round(sum(r[1] for r in rows) / n * 1e3, 3)
        res[m]["process_cpu_ms_per_step"] = round(sum(r[2] for r in rows) / n * 1e3, 3)
        if m in writer_s:
            res[m]["writer_cpu_ms_per_step"] = round(writer_s[m] / (len(cpu[m]) * args.steps) * 1e3, 3)
    per_step = {m: (sum(spent[m]) / max(1, len(spent[m])) * (len(every)) * 1e6 if spent[m] else 0.0) for m in modes}
    for m in modes:
        res[m]["in_hooks_us_per_step"] = round(per_step[m], 1)
        res[m]["in_hook_us_median"] = round(statistics.median(spent[m]) * 1e6, 2) if spent[m] else None
        gcs = {k.split(":")[1]: (len(v), round(sum(v) * 1e3, 2)) for k, v in clock.by.items() if k.startswith(m + ":")}
        res[m]["gc_passes_ms"] = gcs
    off_ms = res["off"]["decode_ms"]
    for m in modes:
        res[m]["outside_hooks_us_per_step"] = round((res[m]["decode_ms"] - off_ms) * 1e3 - per_step[m], 1)
    profiles = {}
    for m in ("off", "all"):
        if m not in modes:
            continue
        from torch.profiler import ProfilerActivity, profile

        h = hooks_for(m)
        rec = recorder_for(m)
        if rec is not None:
            rec.__enter__()
        with torch.no_grad():
            out = model(input_ids=ids[:, :256], use_cache=True)
            pkv, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
            for _ in range(4):
                o = model(input_ids=nxt, past_key_values=pkv, use_cache=True)
                pkv, nxt = o.past_key_values, o.logits[:, -1:].argmax(-1)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
                for _ in range(4):
                    o = model(input_ids=nxt, past_key_values=pkv, use_cache=True)
                    pkv, nxt = o.past_key_values, o.logits[:, -1:].argmax(-1)
                torch.cuda.synchronize()
        if rec is not None:
            rec._deactivate()
            rec.discard()
            rec.close()
        if h is not None:
            h.remove()
        avg = p.key_averages()
        rows = sorted(avg, key=lambda e: -e.self_cpu_time_total)[:18]
        profiles[m] = {e.key: {"count": e.count, "self_cpu_us": round(e.self_cpu_time_total, 1)} for e in rows}
        dev = [(e.key, e.count, getattr(e, "self_device_time_total", 0.0)) for e in avg]
        # an op's self device time also holds its kernels' time: summing every row counts a
        # kernel twice (the first run of this bench did). The union of the kernels' intervals
        # is what the GPU was busy with.
        busy = kernel_busy_ms(p)
        profiles[m]["kernel_busy_ms_per_step"] = None if busy is None else round(busy / 4, 3)  # type: ignore[assignment]
        profiles[m]["gpu_top"] = {k: {"count": c, "self_gpu_us": round(d, 1)}  # type: ignore[assignment]
                                  for k, c, d in sorted(dev, key=lambda x: -x[2])[:10]}
    emit({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "steps": args.steps,
          "blocks": args.blocks, "dropped": dropped, "switchinterval": sys.getswitchinterval(), "modes": res,
          "profile_4_steps": profiles}, args.out)


if __name__ == "__main__":
    main()
