"""Writes never leave a corrupt file: kill -9 mid-write, a full disk, a racing writer.

Each test uses the real thing: a child process killed with SIGKILL while its temp file is
being written, a tiny tmpfs that really runs out of space (when this process may mount),
and RLIMIT_FSIZE, under which the kernel answers writes past the limit with EFBIG.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from consistency.dump.atomic import atomic_write, check_writable, is_report, write_text_atomic
from consistency.dump.reader import open_dump
from consistency.dump.writer import write_dump
from consistency.errors import InputError, OutputExistsError
from tests.conftest import twin, ROOT, run_cli

# A writer that takes a while: 64 x 4 MiB tensors (256 MiB) through write_dump.
WRITER = """
import sys, numpy as np
from consistency.dump.writer import write_dump
x = np.full((1024, 1024), 7.0, np.float32)
write_dump(sys.argv[1], {f"hidden.{i}": x for i in range(64)}, force=sys.argv[2] == "1")
"""

# The recorder as a serving runtime uses it: CONSISTENCY_RECORD set, capture() calls, flush().
RECORDER = """
import torch
from consistency.record import recorder
x = torch.full((1024, 1024), 3.0, dtype=torch.bfloat16)
for i in range(128):
    recorder.capture(f"hidden.{i}", x)
recorder.flush()
"""


def _temps(p: Path) -> list[Path]:
    return sorted(p.parent.glob(f".{p.name}.tmp-*"))


def _kill_mid_write(code: str, out: Path, args: list[str], env: dict | None = None,
                    delay: float = 0.0) -> tuple[int, int]:
    """Start a writer, SIGSTOP it once its temp file holds data, look, then SIGKILL it.

    Returns (bytes in the temp file at the kill, the writer's exit signal). The final name
    is checked while the writer is frozen, so "it was not yet published" is observed, not
    assumed.
    """
    e = dict(os.environ)
    e.update(env or {})
    e.pop("CONSISTENCY_DEBUG", None)
    before = out.read_bytes() if out.exists() else None
    proc = subprocess.Popen([sys.executable, "-c", code, *args], cwd=ROOT, env=e,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    size = 0
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            tmps = _temps(out)
            if tmps:
                try:
                    size = tmps[0].stat().st_size
                except FileNotFoundError:
                    size = 0
                if size > 0:
                    if delay:
                        time.sleep(delay)
                    proc.send_signal(signal.SIGSTOP)
                    size = _temps(out)[0].stat().st_size
                    # frozen mid-write: the final name still holds the old bytes, or nothing
                    assert (out.read_bytes() if out.exists() else None) == before
                    break
            time.sleep(0.0005)
        else:
            raise AssertionError(f"writer finished or stalled before it could be killed: {proc.stderr.read()!r}")
    finally:
        proc.kill()  # SIGKILL, also to a stopped process
        proc.wait()
        proc.stderr.close()
    return size, -proc.returncode


@pytest.mark.parametrize("delay", [0.0, 0.02])
def test_kill_9_mid_write_leaves_no_file(tmp_path, delay):
    out = tmp_path / "d.safetensors"
    size, sig = _kill_mid_write(WRITER, out, [str(out), "0"], delay=delay)
    assert sig == signal.SIGKILL and 0 < size
    assert not out.exists()
    assert len(_temps(out)) == 1  # the evidence: killed while writing, under a hidden name


@pytest.mark.parametrize("suffix", [".safetensors", ".npz"])
def test_kill_9_mid_overwrite_keeps_the_old_file_and_the_next_write_cleans_up(tmp_path, suffix):
    out = tmp_path / f"d{suffix}"
    old = np.arange(12, dtype=np.float32).reshape(3, 4)
    write_dump(out, {"aux.0": old})
    before = out.read_bytes()
    size, sig = _kill_mid_write(WRITER, out, [str(out), "1"])
    assert sig == signal.SIGKILL and size > 0
    assert out.read_bytes() == before
    with open_dump(out) as d:
        assert np.array_equal(d["aux.0"].read_all(), old)
    assert _temps(out)
    write_dump(out, {"aux.0": old + 1}, force=True)  # the killed writer's leftover is swept
    assert not _temps(out)
    with open_dump(out) as d:
        assert np.array_equal(d["aux.0"].read_all(), old + 1)


def test_kill_9_during_a_recording_leaves_no_dump(tmp_path):
    """CONSISTENCY_RECORD + capture() + flush(), as a patched serving runtime records; killed mid-flush."""
    out = tmp_path / "serve.safetensors"
    size, sig = _kill_mid_write(RECORDER, out, [], env={"CONSISTENCY_RECORD": str(out)})
    assert sig == signal.SIGKILL and size > 0
    assert not out.exists()


def test_leftovers_of_live_writers_are_kept(tmp_path):
    out = tmp_path / "r.json"
    host = __import__("consistency.dump.atomic", fromlist=["_tag"])._tag().split("-")[0]
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live = tmp_path / f".r.json.tmp-{host}-{os.getppid()}-abc"
    gone = tmp_path / f".r.json.tmp-{host}-{dead.pid}-abc"
    other_host = tmp_path / f".r.json.tmp-elsewhere-{dead.pid}-abc"
    for p in (live, gone, other_host):
        p.write_bytes(b"partial")
    write_text_atomic(out, "{}")
    assert live.exists() and other_host.exists() and not gone.exists()
    assert out.read_text() == "{}"


def _fsize_limited(limit: int) -> callable:
    def pre() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))  # Python ignores SIGXFSZ: writes get EFBIG

    return pre


def test_full_disk_via_rlimit_fsize_leaves_old_file_or_none(tmp_path):
    out = tmp_path / "big.safetensors"
    code = ("import sys, numpy as np\nfrom consistency.dump.writer import write_dump\n"
            "write_dump(sys.argv[1], {'a': np.ones((1024, 1024), np.float32)}, force=True)\n")
    run = [sys.executable, "-c", code]
    r = subprocess.run(run + [str(out)], capture_output=True, text=True, cwd=ROOT, preexec_fn=_fsize_limited(1 << 20))
    assert r.returncode != 0 and "no space left" in r.stderr and "File too large" in r.stderr
    assert not out.exists() and not _temps(out)
    write_dump(out, {"a": np.zeros(4, np.float32)})
    before = out.read_bytes()
    r = subprocess.run(run + [str(out)], capture_output=True, text=True, cwd=ROOT, preexec_fn=_fsize_limited(1 << 20))
    assert r.returncode != 0 and "no space left" in r.stderr
    assert out.read_bytes() == before and not _temps(out)


def test_full_disk_through_the_cli_is_one_line_and_keeps_the_old_report(tmp_path):
    good = write_dump(tmp_path / "g.safetensors", {"hidden.1": np.ones((8, 16), np.float32)})
    report = tmp_path / "report.json"
    report.write_text("old report\n")
    r = subprocess.run([sys.executable, "-m", "consistency", "compare", str(good), str(twin(good)), "-q", "--json",
                        str(report), "--force"], capture_output=True, text=True, cwd=ROOT,
                       preexec_fn=_fsize_limited(64))
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith(f"consistency: error: {report}: no space left to write")
    assert report.read_text() == "old report\n" and not _temps(report)


@pytest.fixture
def tiny_tmpfs(tmp_path):  # noqa: ANN201
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()}); RLIMIT_FSIZE tests cover a full disk")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_full_tmpfs_leaves_old_file_or_none(tiny_tmpfs):
    out = tiny_tmpfs / "d.npz"
    with pytest.raises(InputError, match="no space left to write .*No space left on device"):
        write_dump(out, {"a": np.ones((256, 256), np.float32)})  # 256 KiB into 64 KiB
    assert not out.exists() and not _temps(out)
    small = np.arange(64, dtype=np.float32)
    write_dump(out, {"a": small})
    before = out.read_bytes()
    with pytest.raises(InputError, match="no space left"):
        write_dump(out, {"a": np.ones((256, 256), np.float32)}, force=True)
    assert out.read_bytes() == before and not _temps(out)
    with open_dump(out) as d:
        assert np.array_equal(d["a"].read_all(), small)


def test_full_tmpfs_through_the_cli(tiny_tmpfs, tmp_path):
    good = write_dump(tmp_path / "g.safetensors", {"hidden.1": np.ones((8, 16), np.float32)})
    filler = tiny_tmpfs / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:  # fill the filesystem to the last byte
        for n in (4096, 512, 64, 1):
            while True:
                try:
                    os.write(fd, b"\0" * n)
                except OSError:
                    break
    finally:
        os.close(fd)
    report = tiny_tmpfs / "report.json"
    r = run_cli("compare", str(good), str(twin(good)), "-q", "--json", str(report))
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 2 and lines == [f"consistency: error: {report}: no space left to write "
                                           "(No space left on device); nothing was written"], r.stderr
    assert not report.exists() and not _temps(report)


def test_existing_outputs_are_never_clobbered_without_force(tmp_path):
    good = write_dump(tmp_path / "g.safetensors", {"hidden.1": np.ones((8, 16), np.float32)})
    report = tmp_path / "r.json"
    report.write_text("mine\n")
    r = run_cli("compare", str(good), str(twin(good)), "-q", "--json", str(report))
    assert r.returncode == 2 and "output exists; pass --force" in r.stderr and report.read_text() == "mine\n"
    r = run_cli("compare", str(good), str(twin(good)), "-q", "--json", str(report), "--force")
    assert r.returncode == 0 and report.read_text().startswith("{")


def test_a_file_that_appears_mid_write_is_not_clobbered(tmp_path):
    out = tmp_path / "race.json"
    with pytest.raises(OutputExistsError), atomic_write(out) as fh:
        fh.write(b"ours")
        out.write_text("theirs")  # another writer got there first
    assert out.read_text() == "theirs" and not _temps(out)
    with atomic_write(out, force=True) as fh:
        fh.write(b"ours")
    assert out.read_text() == "ours"


def test_a_failed_write_leaves_nothing(tmp_path):
    out = tmp_path / "x.npz"
    with pytest.raises(ValueError), atomic_write(out) as fh:
        fh.write(b"half")
        raise ValueError("the writer broke")
    assert not out.exists() and not _temps(out)


def test_compare_json_reruns_in_a_loop_over_its_own_report(tmp_path):
    """The overwrite rule (docs/commands.md#outputs): a report of ours is an output, not data."""
    good = write_dump(tmp_path / "g.safetensors", {"hidden.1": np.ones((8, 16), np.float32)})
    report = tmp_path / "r.json"
    for _ in range(3):
        r = run_cli("compare", str(good), str(twin(good)), "-q", "--json", str(report))
        assert r.returncode == 0, r.stderr
        assert json.loads(report.read_text())["verdict"] == "pass"
    for fmt, name in (("json", "l.json"), ("sarif", "l.sarif")):
        for _ in range(2):
            r = run_cli("lint", "--runtime", "sglang@0.5.12", "--serve", "python -m sglang.launch_server", "--format", fmt,
                    "-o", str(tmp_path / name))
            assert r.returncode in (0, 1), r.stderr
    assert not _temps(report)


@pytest.mark.parametrize("content", [b"", b"{}", b'{"tool": "other"}', b"<?xml version='1.0'?><testsuites/>",
                                     b"not a report"])
def test_a_file_that_is_not_our_report_needs_force(tmp_path, content):
    p = tmp_path / "out.json"
    p.write_bytes(content)
    assert not is_report(p)
    with pytest.raises(OutputExistsError):
        check_writable(p, force=False)
    with pytest.raises(OutputExistsError), atomic_write(p) as fh:
        fh.write(b'{"tool": "consistency"}')
    assert p.read_bytes() == content


def test_a_dump_is_never_taken_for_a_report(tmp_path):
    d = write_dump(tmp_path / "d.safetensors", {"hidden.1": np.ones((2, 2), np.float32)})
    n = write_dump(tmp_path / "d.npz", {"hidden.1": np.ones((2, 2), np.float32)})
    assert not is_report(d) and not is_report(n)
    r = run_cli("compare", str(d), str(d), "-q", "--json", str(n))
    assert r.returncode == 2 and "output exists" in r.stderr


def test_a_fifo_or_device_is_refused_even_with_force(tmp_path):
    fifo = tmp_path / "f"
    os.mkfifo(fifo)
    for target in (fifo, Path("/dev/null")):
        for force in (False, True):
            with pytest.raises(InputError, match="not a regular file"):
                check_writable(target, force)


@pytest.mark.parametrize("stem", ["n" * 250, "é" * 124 + "x"], ids=["250-ascii", "249-bytes-utf8"])
def test_an_output_name_near_the_255_byte_limit_is_written(tmp_path: Path, stem: str) -> None:
    """The temporary file beside the output (``.<name>.tmp-<host>-<pid>-<random>``) used the
    whole name and failed with ENAMETOOLONG for a valid name over ~200 bytes: every
    command's output, and the recorder's fallback names."""
    for ext in (".json", ".safetensors"):
        out = tmp_path / (stem[: len(stem) - len(ext)] + ext)
        assert len(os.fsencode(out.name)) <= 255
        if ext == ".json":
            write_text_atomic(out, '{"tool": "consistency"}\n')
            assert json.loads(out.read_text()) == {"tool": "consistency"}
        else:
            write_dump(out, {"a": np.ones(3, np.float32)})
            with open_dump(out) as d:
                assert d.names == ["a"]
    assert sorted(p.name.startswith(".") for p in tmp_path.iterdir()) == [False, False]  # no temp file left


def _inputs(d: Path) -> dict[str, Path]:
    """A pair of dumps, a draft/target config pair and a gate config over them (all written here)."""
    rng = np.random.default_rng(3)
    a = rng.standard_normal((6, 8)).astype(np.float32)
    write_dump(d / "ref.safetensors", {"aux.0": a})
    write_dump(d / "cand.safetensors", {"aux.0": a + 1})
    fix = ROOT / "fixtures" / "configs"
    (d / "draft.json").write_text((fix / "drafts" / "sglang" / "kimi-k2.5-eagle3-fixed.json").read_text())
    (d / "target.json").write_text((fix / "targets" / "kimi-k2.5.json").read_text())
    (d / "c.toml").write_text('[[lint]]\nname = "x"\ndraft = "draft.json"\ntarget = "target.json"\n'
                              'runtime = "sglang@0.5.23"\n')
    return {p.name: p for p in d.iterdir()}


LINT = ["lint", "--draft", "draft.json", "--target", "target.json", "--runtime", "sglang@0.5.23", "--format", "json"]


@pytest.mark.parametrize("argv", [
    ["compare", "ref.safetensors", "cand.safetensors", "--json", "ref.safetensors", "--force"],
    ["compare", "ref.safetensors", "cand.safetensors", "--html", "cand.safetensors", "--force"],
    ["compare", "ref.safetensors", "cand.safetensors", "--json", "link.json", "--force"],  # a symlink to the reference
    ["compare", "ref.safetensors", "cand.safetensors", "--json", "hard.json", "--force"],  # a hard link to it
    [*LINT, "-o", "target.json", "--force"],
    ["gate", "--config", "c.toml", "--json", "c.toml", "--force"],
    ["gate", "--config", "c.toml", "--junit", "draft.json", "--force"],
], ids=["compare-json-over-reference", "compare-html-over-candidate", "via-symlink", "via-hard-link",
        "lint-over-target", "gate-over-its-config", "gate-over-a-checks-input"])
def test_an_output_never_replaces_an_input_even_with_force(argv: list[str], tmp_path: Path) -> None:
    files = _inputs(tmp_path)
    (tmp_path / "link.json").symlink_to("ref.safetensors")
    os.link(tmp_path / "ref.safetensors", tmp_path / "hard.json")
    before = {n: p.read_bytes() for n, p in files.items()}
    r = run_cli(*argv, cwd=tmp_path)
    assert r.returncode == 2 and "is the input" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert {n: p.read_bytes() for n, p in files.items()} == before


def test_two_outputs_naming_one_file_are_refused_before_any_work(tmp_path: Path) -> None:
    _inputs(tmp_path)
    for argv in (["compare", "ref.safetensors", "cand.safetensors", "--json", "r.out", "--html", "r.out"],
                 ["gate", "--config", "c.toml", "--json", "g.out", "--sarif", "./g.out"]):
        r = run_cli(*argv, cwd=tmp_path)
        assert r.returncode == 2 and "named twice as an output" in r.stderr, r.stderr
        assert not (tmp_path / argv[-1]).exists()
    ok = run_cli("compare", "ref.safetensors", "cand.safetensors", "--json", "r.json", "--html", "r.html",
                 cwd=tmp_path)  # control: two files, both written
    assert ok.returncode == 1 and json.loads((tmp_path / "r.json").read_text())["tool"] == "consistency"
    assert (tmp_path / "r.html").read_text().startswith("<!DOCTYPE html>")
