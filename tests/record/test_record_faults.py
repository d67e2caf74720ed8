"""The recorder under fault: it never raises into the host and never loses a good capture.

Every dtype numpy and torch have, names a reader would refuse, metadata that cannot be
written, captures and flushes interleaved (threads and calls), processes recording to one
path at once, a file-size limit (``RLIMIT_FSIZE``), SIGKILL in the middle of a flush, and a
read-only directory (as uid 65534: root ignores modes). After each, every good capture is
read back and compared by ``compare`` against a dump written directly from the same arrays,
and every bad one was refused with one stderr line and counted in the dump's metadata.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from consistency.dump.reader import open_dump
from consistency.dump.writer import write_dump
from consistency.record import Recorder
from tests.conftest import ROOT


def _values(path: Path) -> dict[str, tuple[np.ndarray, str]]:
    with open_dump(path) as d:
        return {n: (d[n].read_all(), d[n].dtype) for n in d.names}


def assert_readable_by_compare(path: Path, expected: dict[str, np.ndarray | tuple[np.ndarray, str]],
                               tmp: Path) -> None:
    """Every expected capture is in ``path`` bit for bit, and ``compare`` of a dump written
    directly from the same arrays against it passes."""
    from consistency.pipeline.compare import compare as run

    got = _values(path)
    for name, want in expected.items():
        arr, dt = want if isinstance(want, tuple) else (want, None)
        assert name in got, (name, sorted(got))
        assert got[name][0].shape == arr.shape and got[name][0].tobytes() == np.ascontiguousarray(
            arr.astype(arr.dtype.newbyteorder("<")) if arr.dtype.byteorder == ">" else arr).tobytes(), name
        if dt:
            assert got[name][1] == dt, (name, got[name][1], dt)
    ref = tmp / f"ref-{path.stem[:80]}.safetensors"
    write_dump(ref, expected, force=True)  # type: ignore[arg-type]
    rep = run(str(ref), str(path))
    refused = _refused(path)
    if not refused:
        assert rep.verdict == "pass", rep.summary
        return
    # a capture the recorder refused is never passed over (issue 37): CAPTURES_DROPPED names
    # every refused capture, and it is the only failure (the kept ones compare equal)
    from consistency.contract.findings import Severity

    drop = [f for f in rep.findings if f.code == "CAPTURES_DROPPED"]
    assert rep.verdict == "fail" and len(drop) == 1, rep.summary
    assert sorted(drop[0].metrics["dropped"]) == sorted({k[:80] for k in refused})[:64], drop[0].metrics
    assert not [f.code for f in rep.findings if f.severity == Severity.error and f.code != "CAPTURES_DROPPED"]


def _refused(path: Path) -> dict:
    with open_dump(path) as d:
        return (d.metadata.extra if d.metadata else {}).get("refused_captures", {})


# -- every dtype ---------------------------------------------------------------------------
def _numpy_dtypes() -> list[np.dtype]:
    seen: dict[str, np.dtype] = {}
    for t in set(np.sctypeDict.values()):
        try:
            dt = np.dtype(t)
        except TypeError:
            continue
        seen.setdefault(dt.str + dt.kind, dt)
    for extra in (">f4", ">i8", ">u2", "<U4", "S3", "V8", "M8[s]", "m8[ms]", "O", [("a", "<f4"), ("b", "<i2")]):
        dt = np.dtype(extra)
        seen.setdefault(dt.str + dt.kind + str(dt.descr), dt)
    return list(seen.values())


def _storable_numpy(dt: np.dtype) -> bool:
    return dt.kind == "b" or (dt.kind in "iu" and dt.itemsize in (1, 2, 4, 8)) or (
        dt.kind == "f" and dt.itemsize in (2, 4, 8))


def test_every_numpy_dtype_is_kept_or_refused_alone(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    rng = np.random.default_rng(0)
    out = tmp_path / "np.safetensors"
    expected: dict[str, np.ndarray] = {}
    refused: list[str] = []
    with Recorder(out) as rec:
        for k, dt in enumerate(_numpy_dtypes()):
            name = f"t{k}"
            if dt.kind in "fiu" and dt.fields is None:
                arr = (rng.standard_normal((3, 4)) * 50).astype(dt)
            else:
                arr = np.zeros((3, 4), dtype=dt)
            rec.capture(name, arr)  # never raises, whatever the dtype
            (expected.__setitem__(name, arr.copy()) if _storable_numpy(dt) else refused.append(name))
        layout = rng.standard_normal((6, 8)).astype(np.float32)
        rec.capture("strided", layout[:, ::2])
        rec.capture("fortran", np.asfortranarray(layout))
        expected |= {"strided": np.ascontiguousarray(layout[:, ::2]), "fortran": layout.copy()}
    err = capsys.readouterr().err.splitlines()
    assert len(err) == len(refused) and all("refused" in line for line in err), err
    assert sorted(_refused(out)) == sorted(refused)
    assert refused and len(expected) >= 12  # both kinds really happened
    assert_readable_by_compare(out, expected, tmp_path)


def _torch_tensor(torch, dt):  # noqa: ANN001, ANN202 - a (3, 4) tensor of dt, or None when torch cannot make one
    import warnings

    g = torch.Generator().manual_seed(0)
    warnings.filterwarnings("ignore", message=".*(ComplexHalf|quantize).*")  # torch's own notes on exotic dtypes
    for make in (lambda: (torch.randn(3, 4, generator=g) * 8).to(dt),
                 lambda: torch.randint(0, 100, (3, 4), generator=g).to(dt),
                 lambda: torch.zeros(3, 4, dtype=dt),
                 lambda: torch.quantize_per_tensor(torch.randn(3, 4, generator=g), 0.1, 0, dt)):
        try:
            return make()
        except Exception:  # noqa: BLE001, S112 - the next way to build one
            continue
    return None


def test_every_torch_dtype_is_kept_or_refused_alone(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    torch = pytest.importorskip("torch")
    from consistency.dump import dtypes

    all_dtypes = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)
    out = tmp_path / "torch.safetensors"
    expected: dict[str, tuple[np.ndarray, str]] = {}
    refused, unmakeable = [], []
    with Recorder(out) as rec:
        for dt in all_dtypes:
            t = _torch_tensor(torch, dt)
            name = str(dt).removeprefix("torch.")
            if t is None:
                unmakeable.append(name)
                continue
            rec.capture(name, t)
            if name in dtypes.BY_NAME:
                expected[name] = dtypes.torch_storage(t)
                if name not in ("bool",) and name in dtypes.UNIT_ROUNDOFF:  # the bits decode to torch's own values
                    wide = dtypes.to_float(expected[name][0], name, np.float64)
                    want = t.double().numpy()
                    assert np.array_equal(np.isnan(wide), np.isnan(want))
                    assert np.array_equal(wide[~np.isnan(wide)], want[~np.isnan(want)]), name
            else:
                refused.append(name)
    err = capsys.readouterr().err.splitlines()
    from consistency.record.guard import MAX_SAID

    # one line per refusal, up to MAX_SAID, then one line saying the rest are only counted
    assert len(err) == min(len(refused), MAX_SAID) + (len(refused) > MAX_SAID), err
    assert sorted(_refused(out)) == sorted(refused)
    assert {"complex64", "float8_e8m0fnu"} <= set(refused) | set(unmakeable), (refused, unmakeable)
    assert set(expected) == set(dtypes.BY_NAME)  # every dtype a dump can hold was captured
    assert_readable_by_compare(out, expected, tmp_path)


# -- names and metadata ----------------------------------------------------------------------
BAD_NAMES = ["line\nbreak", "x" * 1025, "__metadata__", "__consistency__", "", "aux.0#2", "tab\there", "\x1b[31m",
             "\ud800", 7, None, b"bytes"]


def test_bad_names_and_bad_metadata_are_refused_alone(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "names.safetensors"
    good = {"aux.0": np.ones((2, 3), np.float32), "x" * 1024: np.full((2,), 2.0, np.float32),
            "héllo·名": np.arange(4, dtype=np.int64)}
    with Recorder(out) as rec:
        for name, arr in good.items():
            rec.capture(name, arr)
        for name in BAD_NAMES:
            rec.capture(name, np.zeros(2, np.float32))  # type: ignore[arg-type]
        rec.capture("bad-meta", np.zeros(2, np.float32), token_index=["a"])
        rec.capture("bad-shard", np.zeros(2, np.float32), shard="nonsense")
        rec.capture("bad-field", np.zeros(2, np.float32), no_such_field=1)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == len(BAD_NAMES) + 3, err
    assert_readable_by_compare(out, good, tmp_path)
    assert sum(v["count"] for v in _refused(out).values()) == len(BAD_NAMES) + 3


def test_an_explicit_repeat_suffix_never_overwrites_an_automatic_one(tmp_path: Path) -> None:
    out = tmp_path / "rep.safetensors"
    with Recorder(out) as rec:
        rec.capture("aux.0", np.zeros(2, np.float32))
        rec.capture("aux.0#2", np.full(2, 9.0, np.float32))  # refused: the recorder's own suffix
        rec.capture("aux.0", np.ones(2, np.float32))
    assert_readable_by_compare(out, {"aux.0": np.zeros(2, np.float32), "aux.0#2": np.ones(2, np.float32)}, tmp_path)


def test_a_host_buffer_reused_after_the_capture_does_not_change_it(tmp_path: Path) -> None:
    out = tmp_path / "buf.safetensors"
    buf = np.zeros((2, 3), np.float32)
    with Recorder(out) as rec:
        for k in range(3):
            buf[:] = k
            rec.capture("h", buf)
    assert_readable_by_compare(out, {"h": np.zeros((2, 3), np.float32), "h#2": np.ones((2, 3), np.float32),
                                     "h#3": np.full((2, 3), 2.0, np.float32)}, tmp_path)


def test_metadata_the_caller_set_badly_drops_that_metadata_not_the_tensors(tmp_path: Path) -> None:
    out = tmp_path / "meta.safetensors"
    with Recorder(out) as rec:
        rec.capture("aux.0", np.ones(2, np.float32))
        rec.metadata.extra["huge"] = "x" * (17 << 20)  # past the readers' metadata bound
    assert_readable_by_compare(out, {"aux.0": np.ones(2, np.float32)}, tmp_path)
    with open_dump(out) as d:
        assert "metadata_dropped" in d.metadata.extra


# -- flush and capture interleaved ----------------------------------------------------------
INTERLEAVE = """
import os, sys, numpy as np
from consistency.record import recorder
out = sys.argv[1]
recorder.capture("a", np.full(3, 1.0, np.float32))
p1 = recorder.flush()
recorder.capture("b", np.full(3, 2.0, np.float32))
p2 = recorder.flush()
m = os.stat(p2).st_mtime_ns
assert recorder.flush() == p2 and os.stat(p2).st_mtime_ns == m  # nothing new: not rewritten
recorder.capture("c", np.full(3, 3.0, np.float32))  # after the last flush: written at exit
print(p1, p2)
"""


def _env(out: Path, **extra: str) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("CONSISTENCY_")}
    return {**e, "CONSISTENCY_RECORD": str(out), **extra}


def test_captures_after_a_flush_are_written_by_the_next_flush_or_at_exit(tmp_path: Path) -> None:
    out = tmp_path / "i.safetensors"
    r = subprocess.run([sys.executable, "-c", INTERLEAVE, str(out)], capture_output=True, text=True,
                       env=_env(out), cwd=ROOT, timeout=300)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    p1, p2 = r.stdout.split()
    assert p1 == p2 == str(out)  # one file, rewritten with the whole recording; no sibling
    assert sorted(p.name for p in tmp_path.iterdir()) == ["i.safetensors"]
    assert_readable_by_compare(out, {n: np.full(3, v, np.float32) for n, v in (("a", 1.0), ("b", 2.0), ("c", 3.0))},
                               tmp_path)


REPLACED = """
import sys, numpy as np
from consistency.record import recorder
from consistency.dump.writer import write_dump
recorder.capture("a", np.ones(3, np.float32))
p = recorder.flush()
write_dump(p, {"theirs": np.zeros(2, np.float32)}, force=True)  # someone else's file now
recorder.capture("b", np.ones(3, np.float32))
print(recorder.flush())
"""


def test_a_flushed_file_replaced_by_someone_else_is_kept_and_the_next_flush_goes_beside_it(tmp_path: Path) -> None:
    out = tmp_path / "r.safetensors"
    r = subprocess.run([sys.executable, "-c", REPLACED, str(out)], capture_output=True, text=True, env=_env(out),
                       cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr
    second = Path(r.stdout.strip())
    assert second != out and "not" in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr
    assert set(_values(out)) == {"theirs"}  # theirs, untouched
    assert_readable_by_compare(second, {"a": np.ones(3, np.float32), "b": np.ones(3, np.float32)}, tmp_path)


def test_threads_capturing_while_another_flushes(tmp_path: Path) -> None:
    out = tmp_path / "t.safetensors"
    rec = Recorder(out)
    stop = threading.Event()
    errors: list[BaseException] = []

    def worker(w: int) -> None:
        try:
            for k in range(200):
                rec.capture(f"w{w}", np.full(4, w * 1000 + k, np.float32))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    def flusher() -> None:
        try:
            while not stop.is_set():
                if rec.tensors:
                    rec.save()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    with rec:
        f = threading.Thread(target=flusher)
        f.start()
        ws = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
        for t in ws:
            t.start()
        for t in ws:
            t.join()
        stop.set()
        f.join()
    assert not errors, errors
    got = _values(out)
    assert len(got) == 800
    for w in range(4):  # each thread's captures in its order, none lost, none overwritten
        vals = [got[f"w{w}" if k == 0 else f"w{w}#{k + 1}"][0][0] for k in range(200)]
        assert vals == [w * 1000 + k for k in range(200)]


# -- processes, limits, signals, permissions -------------------------------------------------
PROC = """
import os, sys, numpy as np
from consistency.record import recorder
w = int(sys.argv[1])
for k in range(50):
    recorder.capture(f"h.{k}", np.full((8, 16), w * 100 + k, np.float32))
"""


def test_processes_recording_to_one_path_at_once_each_keep_everything(tmp_path: Path) -> None:
    out = tmp_path / "shared.safetensors"
    procs = [subprocess.Popen([sys.executable, "-c", PROC, str(w)], env=_env(out), cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for w in range(4)]
    for p in procs:
        p.wait(timeout=300)
        p.stderr.close()
        assert p.returncode == 0
    files = sorted(tmp_path.glob("shared*.safetensors"))
    assert len(files) == 4, files  # one at the path, the others beside it: nobody clobbered
    seen = set()
    for f in files:
        got = _values(f)
        w = int(got["h.0"][0][0, 0]) // 100
        seen.add(w)
        assert_readable_by_compare(f, {f"h.{k}": np.full((8, 16), w * 100 + k, np.float32) for k in range(50)},
                                   tmp_path)
    assert seen == {0, 1, 2, 3}


FSIZE = """
import resource, sys, numpy as np
from consistency.record import recorder
recorder.capture("small", np.ones((4, 4), np.float32))
first = recorder.flush()
resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))
recorder.capture("big", np.ones((1024, 1024), np.float32))  # 4 MiB: past the limit
recorder.flush()
print("alive", first)
"""


def test_a_file_size_limit_keeps_the_earlier_flush_and_the_host_runs_on(tmp_path: Path) -> None:
    out = tmp_path / "f.safetensors"
    r = subprocess.run([sys.executable, "-c", FSIZE], capture_output=True, text=True, env=_env(out), cwd=ROOT,
                       timeout=300)
    assert r.returncode == 0 and r.stdout.startswith("alive"), r.stderr
    assert "Traceback" not in r.stderr and "could not write the recording" in r.stderr
    assert_readable_by_compare(out, {"small": np.ones((4, 4), np.float32)}, tmp_path)
    assert not list(tmp_path.glob(".f.safetensors.tmp-*"))  # no temp file left by the failed writes


KILLED = """
import sys, time, numpy as np
from consistency.record import recorder
recorder.capture("first", np.full((4, 4), 5.0, np.float32))
recorder.flush()
x = np.full((1024, 1024), 7.0, np.float32)
for i in range(96):
    recorder.capture(f"h.{i}", x)
recorder.flush()  # 384 MiB: killed in the middle of this
time.sleep(60)
"""


def test_sigkill_in_the_middle_of_a_flush_leaves_the_earlier_flush_readable(tmp_path: Path) -> None:
    out = tmp_path / "k.safetensors"
    proc = subprocess.Popen([sys.executable, "-c", KILLED], env=_env(out), cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    try:
        while time.monotonic() < deadline and not out.exists():
            time.sleep(0.01)
        first = out.read_bytes()
        while time.monotonic() < deadline:
            tmps = [p for p in tmp_path.glob(".k.safetensors.tmp-*") if p.stat().st_size > 0]
            if tmps:
                proc.send_signal(signal.SIGSTOP)
                assert out.read_bytes() == first  # frozen mid-flush: the final name holds the earlier flush
                break
            time.sleep(0.001)
        else:
            raise AssertionError("the second flush never started")
    finally:
        proc.kill()
        proc.wait()
    assert_readable_by_compare(out, {"first": np.full((4, 4), 5.0, np.float32)}, tmp_path)
    # the next recording to that name sweeps the dead writer's temporary file
    write_dump(out, {"next": np.ones(2, np.float32)}, force=True)
    assert not list(tmp_path.glob(".k.safetensors.tmp-*"))


def test_a_read_only_directory_falls_back_to_the_temp_dir_for_an_unprivileged_host() -> None:
    from tests.dump.test_hostile import _as_nobody

    ro = Path(tempfile.mkdtemp(prefix="consistency-ro-"))
    os.chmod(ro, 0o555)  # readable, not writable, by uid 65534
    out = ro / "rec.safetensors"

    def warm() -> None:
        import consistency.dump.atomic  # noqa: F401 - everything the child needs, imported as root
        import consistency.record.fallback  # noqa: F401
        from consistency.record import recorder  # noqa: F401
        os.environ["CONSISTENCY_RECORD"] = str(out)

    def record() -> dict:
        import io
        from contextlib import redirect_stderr

        from consistency.record import recorder

        err = io.StringIO()
        with redirect_stderr(err):
            recorder.capture("aux.0", np.full((2, 3), 4.0, np.float32))
            written = recorder.flush()
        return {"written": str(written), "err": err.getvalue()}

    try:
        res = _as_nobody(warm, record)
        written = Path(res["written"])
        assert written.parent == Path(tempfile.gettempdir()) and written.is_file(), res
        assert "not a writable directory" in res["err"] and len(res["err"].splitlines()) == 1, res
        assert not out.exists()
        with tempfile.TemporaryDirectory() as t:
            assert_readable_by_compare(written, {"aux.0": np.full((2, 3), 4.0, np.float32)}, Path(t))
        written.unlink()
    finally:
        os.chmod(ro, 0o755)
        for p in ro.iterdir():
            p.unlink()
        ro.rmdir()


@pytest.mark.skipif("not __import__('torch').cuda.is_available()", reason="the AsyncRecorder's device path needs CUDA")
def test_the_async_recorders_device_path_refuses_alone_and_keeps_the_rest(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture) -> None:
    """The same rules on the GPU path (staging buffers, the pinned ring): bad captures refused
    alone, every good one bit for bit, a shard annotation resolved as on the host path."""
    import torch

    from consistency.record import capture
    from consistency.record.async_capture import AsyncRecorder

    dev = "cuda"
    torch.manual_seed(0)
    x = torch.randn(4, 16, 64, device=dev, dtype=torch.bfloat16)
    y = torch.randn(1, 8, 32, device=dev)
    f8 = torch.randn(2, 8, 4, device=dev).to(torch.float8_e4m3fn)
    big = torch.randn(2, 1024, 1024, device=dev)  # 8 MiB: past the staging size, through the ring
    p1, p2 = tmp_path / "tokens.safetensors", tmp_path / "ring.safetensors"
    with AsyncRecorder(p1, tokens=[0, 3]):
        for k in range(3):
            capture("aux.0", x + k)
        for name, t, kw in (("bad\nname", y, {}), ("c", torch.randn(2, 8, 4, device=dev, dtype=torch.complex64), {}),
                            ("r17", torch.zeros([1] * 15 + [8, 4], device=dev), {}), ("aux.0#2", y, {}),
                            ("m", y, {"token_index": ["a"]}), ("m2", y, {"shard": "nonsense"})):
            capture(name, t, **kw)
        capture("sh", y, shard="h[tp]")
        capture("f8", f8)
    with AsyncRecorder(p2):
        capture("big", big)
        capture("big", big * 2)
    assert len(capsys.readouterr().err.splitlines()) == 6
    assert sorted(_refused(p1)) == sorted(["bad\nname", "c", "r17", "aux.0#2", "m", "m2"])
    sel = x[:, [0, 3]]
    expected = {n: ((sel + k).view(torch.int16).cpu().numpy().view(np.uint16), "bfloat16")
                for k, n in enumerate(["aux.0", "aux.0#2", "aux.0#3"])}
    expected["f8"] = (f8[:, [0, 3]].view(torch.uint8).cpu().numpy(), "float8_e4m3fn")
    got = _values(p1)
    for n, (bits, dt) in expected.items():
        assert np.array_equal(got[n][0], bits) and got[n][1] == dt, n
    with open_dump(p1) as d:
        assert d.metadata.tensors["sh"].shard is not None
    assert_readable_by_compare(p2, {"big": big.cpu().numpy(), "big#2": (big * 2).cpu().numpy()}, tmp_path)


# -- hostile knob values ----------------------------------------------------------------------
KNOBS = """
import numpy as np
from consistency.record import graphs, patch
for _ in range(2):  # two forwards of 3 tokens, as a patched model file calls them
    patch.capture_input_ids(np.arange(3))
    patch.capture_aux(0, np.full((3, 4), 1.5, np.float32))
    patch.capture_aux(1, np.full((3, 4), 2.5, np.float32))
print(graphs.budget().limit)
"""


@pytest.mark.parametrize("knobs", [
    {"CONSISTENCY_RECORD_TOKENS": "abc"}, {"CONSISTENCY_RECORD_TOKENS": "3.0"}, {"CONSISTENCY_RECORD_TOKENS": "-3"},
    {"CONSISTENCY_RECORD_GRAPH_BYTES": "lots"}, {"CONSISTENCY_DRAFT_STEPS": "x\n::error::y"},
], ids=lambda k: "-".join(f"{n.removeprefix('CONSISTENCY_')}={v!r}" for n, v in k.items()))
def test_a_knob_set_to_nonsense_never_raises_into_the_forward_and_loses_nothing(knobs: dict[str, str],
                                                                               tmp_path: Path) -> None:
    """A value that is not a count (the host's environment, a typo) is ignored, said once on
    stderr (escaped), and the recording is whole: the forward pass never sees an exception."""
    from consistency.record.graph_plan import DEFAULT_BYTES

    out = tmp_path / "k.safetensors"
    r = subprocess.run([sys.executable, "-c", KNOBS], capture_output=True, text=True, env=_env(out, **knobs),
                       cwd=ROOT, timeout=300)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert int(r.stdout.split()[-1]) == DEFAULT_BYTES
    name = next(iter(knobs))
    lines = r.stderr.splitlines()
    if name != "CONSISTENCY_DRAFT_STEPS":  # read only by MTP draft passes, which this host has none of
        assert len(lines) == 1 and name in lines[0] and ("ignored" in lines[0] or "default" in lines[0]), r.stderr
    assert not any(line.lstrip().startswith("::") for line in lines), r.stderr
    assert_readable_by_compare(out, {"input_ids": np.arange(3), "aux.0": np.full((3, 4), 1.5, np.float32),
                                     "aux.1": np.full((3, 4), 2.5, np.float32)}, tmp_path)


def test_a_token_count_knob_that_is_a_count_still_filters(tmp_path: Path) -> None:
    """Positive control: 3 records the 3-token forward (once), 4 records nothing."""
    for want, recorded in (("3", True), ("4", False)):
        out = tmp_path / f"t{want}.safetensors"
        r = subprocess.run([sys.executable, "-c", KNOBS], capture_output=True, text=True,
                           env=_env(out, CONSISTENCY_RECORD_TOKENS=want), cwd=ROOT, timeout=300)
        assert r.returncode == 0 and r.stderr == "", r.stderr
        assert out.exists() == recorded


@pytest.mark.parametrize("name", ["a" * 300 + ".safetensors", "é" * 200 + ".npz", "b" * 254])
def test_a_recording_path_whose_name_is_too_long_for_the_filesystem_is_written_under_a_shorter_one(
        name: str, tmp_path: Path) -> None:
    """``CONSISTENCY_RECORD`` naming a file over 255 bytes raised OSError (ENAMETOOLONG) into
    the host at the first capture, and at exit every fallback name was too long as well:
    the recording was lost. Now: one line names the shorter file it goes to, and it is whole."""
    out = tmp_path / "rec" / name
    (tmp_path / "rec").mkdir()
    script = "import numpy as np\nfrom consistency.record import capture\ncapture('aux.0', np.full((2, 3), 4.0, np.float32))\n"
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=_env(out), cwd=ROOT,
                       timeout=300)
    assert r.returncode == 0 and "Traceback" not in r.stderr and "could not write" not in r.stderr, r.stderr
    written = list((tmp_path / "rec").iterdir())
    assert len(written) == 1 and len(os.fsencode(written[0].name)) <= 255, written
    assert written[0].name in r.stderr or str(written[0]) in r.stderr
    assert_readable_by_compare(written[0], {"aux.0": np.full((2, 3), 4.0, np.float32)}, tmp_path)


# -- the host's stderr ----------------------------------------------------------------------
NO_STDERR = """
import sys, numpy as np
class Raising:
    def write(self, s): raise RuntimeError("the host's log sink is down")
    def flush(self): raise RuntimeError("the host's log sink is down")
sys.stderr = None if sys.argv[1] == "none" else Raising()
from consistency.record import capture
capture("aux.0", np.full((2, 3), 1.0, np.float32))
capture("bad", np.ones(3, np.complex64))  # refused: a warning line
capture("bad\\nname", np.ones(3, np.float32))  # refused: a warning line
capture("aux.1", np.full((2, 3), 2.0, np.float32))
if sys.argv[1] == "raises":
    sys.stderr = sys.__stderr__  # else the interpreter's own flush at exit fails (exit 120), not ours
print("host ran on")
"""


@pytest.mark.parametrize("sink", ["none", "raises"])
def test_a_host_without_a_working_stderr_gets_no_exception_and_keeps_the_recording(sink: str,
                                                                                   tmp_path: Path) -> None:
    """A daemon started with fd 2 closed has ``sys.stderr = None`` (and a host may install a
    log sink that raises): the recorder's first warning raised AttributeError into the host
    and the recording was lost. Its warnings go nowhere then; the host runs on, the
    recording is written beside the existing file it must not overwrite."""
    out = tmp_path / "r.safetensors"
    out.write_bytes(b"someone else's file")
    r = subprocess.run([sys.executable, "-c", NO_STDERR, sink], capture_output=True, text=True, env=_env(out),
                       cwd=ROOT, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "host ran on", r.stdout + r.stderr
    assert out.read_bytes() == b"someone else's file"
    written = [p for p in tmp_path.iterdir() if p != out]
    assert len(written) == 1, written
    assert_readable_by_compare(written[0], {"aux.0": np.full((2, 3), 1.0, np.float32),
                                            "aux.1": np.full((2, 3), 2.0, np.float32)}, tmp_path)


@pytest.mark.skipif("not __import__('torch').cuda.is_available()", reason="the AsyncRecorder's device path needs CUDA")
def test_the_device_paths_reused_layout_follows_every_change_of_a_point(tmp_path: Path) -> None:
    """The hot path reuses what it checked for a point's last layout (a decode step's points
    keep theirs step after step): a capture of the same name with another dtype, shape,
    stride, producer or keywords is checked and described afresh, and every value and layout
    in the dump is the capture's own (issue 36: the every-stream cost at batch 1)."""
    import torch

    from consistency.dump.dtypes import torch_storage
    from consistency.record import capture
    from consistency.record.async_capture import AsyncRecorder

    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    base = torch.randn(2, 64, device=dev, generator=g)
    seq = [("bf16", base.bfloat16(), None, {}), ("bf16 again", (base * 2).bfloat16(), None, {}),
           ("fp32", base * 3, None, {}), ("wider", torch.randn(3, 64, device=dev, generator=g), None, {}),
           ("transposed", torch.randn(64, 2, device=dev, generator=g).t(), None, {}),
           ("producer", base * 4, "model.layers.1", {}), ("keywords", base * 5, None, {"token_index": [4, 9]}),
           ("plain again", base * 6, None, {})]
    path = tmp_path / "layouts.safetensors"
    with AsyncRecorder(path):
        for _why, t, producer, kw in seq:
            capture("hidden.1", t, producer, **kw)
    with open_dump(path) as d:
        keys = ["hidden.1"] + [f"hidden.1#{k}" for k in range(2, len(seq) + 1)]
        assert sorted(d.metadata.tensors) == sorted(keys)
        for key, (why, t, producer, kw) in zip(keys, seq):
            tm = d.metadata.tensors[key]
            assert tm.dtype == str(t.dtype).removeprefix("torch."), why
            assert list(tm.shape) == list(t.shape) and list(tm.stride) == list(t.stride()), why
            assert tm.contiguous == t.is_contiguous() and tm.producer == producer, why
            assert (tm.token_index == kw.get("token_index")), why
            want, _dt = torch_storage(t.cpu())
            assert np.array_equal(d[key].read_all(), want), why
