"""The AsyncRecorder's own host time a capture, on any CPU: the device branch runs with
``is_cuda`` forced on host tensors and the staging on the host (the D2H send is dropped), so
only the recorder's Python and one host copy are timed. A relative figure for before/after
on one machine; bench/capture_cost.py measures the real thing on a GPU.

    python bench/capture_host.py [TREE]      # TREE: a checkout to import consistency from (default .)
"""
import sys, time, tempfile, statistics
import torch
sys.path.insert(0, sys.argv[1] if len(sys.argv) > 1 else ".")
from consistency.record.async_capture import AsyncRecorder
from consistency.record.staging import StepStaging
from consistency.record import recorder as R

class FakeCuda(torch.Tensor):
    __torch_function__ = torch._C._disabled_torch_function_impl
    @property
    def is_cuda(self): return True

def make():
    d = tempfile.mkdtemp()
    rec = AsyncRecorder(f"{d}/x.safetensors")
    rec._staging = StepStaging(rec.staging_bytes, "cpu", rec.flush_bytes)
    rec._ring = object()
    def flush():
        if rec._staging.items:
            rec._staging.take(); rec._staging.cur ^= 1
    rec._flush = flush
    rec.enabled = True
    return rec

def main(prof=False):
    names = [f"hidden.{i}" for i in range(33)]
    xs = [torch.randn(1, 4096).to(torch.bfloat16).as_subclass(FakeCuda) for _ in names]
    buf = torch.empty(1, 4096, dtype=torch.bfloat16)
    rec = make()
    R._active = rec
    runs = [("bare copy_", lambda n, x: buf.copy_(x)), ("rec.capture", lambda n, x: rec.capture(n, x)),
            ("api capture", lambda n, x: R.capture(n, x))]
    for label, fn in runs:
        res = []
        for rep in range(7):
            t = time.perf_counter()
            for step in range(40):
                for n, x in zip(names, xs):
                    fn(n, x)
            res.append((time.perf_counter() - t) / (40 * 33) * 1e6)
            rec.tensors.clear(); rec._layouts.clear(); rec.counts.clear(); rec.host_bytes = 0
        print(f"{label:12s} {statistics.median(res):6.2f} us/capture", rec.refused if rec.refused else "")
    if prof:
        import cProfile, pstats
        def go():
            for s in range(100):
                for n, x in zip(names, xs): rec.capture(n, x)
        cProfile.runctx('go()', globals(), locals(), '/tmp/cb/p.out')
        pstats.Stats('/tmp/cb/p.out').sort_stats('tottime').print_stats(14)
    R._active = None
main(prof="--prof" in sys.argv)
