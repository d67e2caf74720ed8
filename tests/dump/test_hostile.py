"""Hostile and broken inputs: each ends in exit code 2 and one line naming the file; nothing unpickles.

The corpus (fixtures/hostile/make_corpus.py, committed under fixtures/hostile/corpus/) is
run through the real CLI entry point, many files per interpreter (fixtures/hostile/drive.py),
plus a few true ``python -m consistency`` subprocesses. Pickle payloads and bombs are built
here, at test time; the payloads aim at a marker file, and a positive control shows each
payload does run when something *does* unpickle it.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import pickle
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import numpy as np
import pytest

from consistency.dump.writer import write_dump
from fixtures.hostile import make_corpus as mc
from tests.conftest import twin, ROOT, cli

CORPUS = ROOT / "fixtures" / "hostile" / "corpus"
MAX_RSS_MB = 1024  # the whole run, torch included; a loader that trusted a bomb would blow far past it


def _one_line(stderr: str) -> list[str]:
    return [x for x in stderr.splitlines() if x.strip()]


def _drive(good: Path, files: list[str], env: dict | None = None, timeout: int = 240) -> tuple[list[dict], int]:
    e = dict(os.environ)
    e.update(env or {})
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-m", "fixtures.hostile.drive", "--timeout", "30", str(good), *files],
                       capture_output=True, text=True, cwd=ROOT, env=e, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    return [x for x in lines if "argv" in x], lines[-1]["maxrss_kb"] // 1024


def _specials(d: Path) -> dict[str, str]:
    """Paths that are not regular files, each with the problem it must be refused for."""
    fifo = d / "fifo.safetensors"
    os.mkfifo(fifo)
    (d / "zero_link.npz").symlink_to("/dev/zero")
    (d / "dangling.safetensors").symlink_to(d / "nowhere")
    (d / "a_dir.safetensors").mkdir()
    return {str(d / "a_dir.safetensors"): "directory", "/dev/zero": "not a regular file",
            "/dev/null": "not a regular file", str(fifo): "not a regular file",
            str(d / "zero_link.npz"): "not a regular file", str(d / "missing.npz"): "no such file",
            str(d / "dangling.safetensors"): "no such file"}


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> dict:
    d = tmp_path_factory.mktemp("hostile")
    marker = d / "PWNED"
    good = write_dump(d / "good.safetensors", {"aux.0": mc.GOOD})
    expect = {str(CORPUS / c.name): c.expect for c in mc.cases()}
    built = mc.payload_cases(marker) + mc.torch_payload_cases(marker)
    mc.write(d, built)
    expect.update({str(d / c.name): c.expect for c in built})
    bomb = mc.deflate_bomb(d / "bomb_lies_256MiB.npz", 256 << 20, declared=4096)
    expect[str(bomb)] = "inflates to more than"
    expect.update(_specials(d))
    runs, rss = _drive(good, list(expect))
    return {"runs": runs, "rss_mb": rss, "expect": expect, "marker": marker, "dir": d, "good": good}


def test_committed_corpus_is_what_the_generator_writes():
    cases = mc.cases()
    assert len(cases) >= 30 and len({c.name for c in cases}) == len(cases)
    manifest = json.loads((CORPUS / "MANIFEST.json").read_text())
    assert manifest == mc.manifest(cases), "corpus drifted: run `python -m fixtures.hostile.make_corpus`"
    for c in cases:
        assert hashlib.sha256((CORPUS / c.name).read_bytes()).hexdigest() == manifest[c.name]["sha256"], c.name
    assert sum(len(c.data) for c in cases) < 300_000


def test_every_hostile_input_ends_in_exit_2_and_one_line_naming_it(hostile):
    assert len(hostile["expect"]) >= 30
    bad = []
    seen = set()
    for r in hostile["runs"]:
        f = r["file"]
        seen.add(f)
        lines = _one_line(r["stderr"])
        ok = (r["code"] == 2 and len(lines) == 1 and lines[0].startswith(f"consistency: error: {f}: ")
              and re.search(hostile["expect"][f], lines[0], re.I) and "Traceback" not in r["stderr"])
        if not ok:
            bad.append(f"{' '.join(r['argv'][:1])} {Path(f).name}: code={r['code']} stderr={r['stderr'][-300:]!r}")
    assert seen == set(hostile["expect"])
    assert not bad, "\n".join(bad)


def test_no_pickle_payload_ever_ran(hostile):
    assert not hostile["marker"].exists()
    assert not list(hostile["dir"].glob("PWNED*"))


def test_the_payloads_are_live_when_something_does_unpickle_them(tmp_path):
    """Positive control: the marker proof means something only if the payloads work."""
    import torch

    marker = tmp_path / "control"
    for c in mc.payload_cases(marker) + mc.torch_payload_cases(marker):
        if c.name == "evil_object_array.npz":
            (tmp_path / c.name).write_bytes(c.data)
            np.load(tmp_path / c.name, allow_pickle=True)["aux.0"]
            assert marker.exists(), c.name
            marker.unlink()
        if c.name == "evil_raw_pickle.bin":
            pickle.loads(c.data)  # noqa: S301 - the positive control, on our own payload
            assert marker.exists(), c.name
            marker.unlink()
        if c.name == "evil_torch.pt":
            (tmp_path / c.name).write_bytes(c.data)
            torch.load(tmp_path / c.name, weights_only=False)  # what a trusting loader would do
            assert marker.exists(), c.name
            marker.unlink()


def test_loading_stays_within_bounded_memory(hostile):
    """Memory is the bound a test can hold (peak RSS of the whole run, torch included).

    Wall time is not: under two workers on a loaded machine an honest load of
    ``evil_torch.pt`` took 10.09 s. Speed belongs in bench/; a hang is still caught, by
    the driver's per-run alarm (``--timeout 30``), which records ``code == "hang"``.
    """
    assert hostile["rss_mb"] < MAX_RSS_MB, hostile["rss_mb"]
    assert len(hostile["runs"]) == 2 * len(hostile["expect"])  # every file ran, compare and inspect
    hung = [r["file"] for r in hostile["runs"] if r["code"] == "hang"]
    assert not hung, hung


@pytest.mark.parametrize("case", ["evil_object_array.npz", "st_deep_nesting.safetensors", "npz_bomb_claim.npz",
                                  "fifo", "/dev/zero", "evil_torch.ckpt"])
def test_true_cli_subprocess(hostile, case):
    d = hostile["dir"]
    target = {"fifo": str(d / "fifo.safetensors")}.get(case, case)
    if not target.startswith("/"):
        target = str(CORPUS / case) if (CORPUS / case).exists() else str(d / case)
    r = cli("compare", str(hostile["good"]), target)
    lines = _one_line(r.stderr)
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith(f"consistency: error: {target}: ")
    assert re.search(hostile["expect"][target], lines[0], re.I)
    assert not hostile["marker"].exists()


def test_bounds_are_enforced_on_real_bombs_and_overridable(tmp_path):
    """An honest 256 MiB bomb opens (spilled to disk, not memory); under a lower bound it is refused."""
    bomb = mc.deflate_bomb(tmp_path / "bomb.npz", 256 << 20)
    good = write_dump(tmp_path / "g.safetensors", {"aux.0": mc.GOOD})
    for env, want in (({"CONSISTENCY_MAX_INFLATE_BYTES": str(64 << 20)}, "inflate to more than"),
                      ({"CONSISTENCY_MAX_MEMBER_BYTES": str(64 << 20)}, "over the .*-byte bound")):
        r = cli("inspect", str(bomb), env=env)
        assert r.returncode == 2 and re.search(want, r.stderr), r.stderr
        assert len(_one_line(r.stderr)) == 1
    r = cli("inspect", str(bomb), env={"CONSISTENCY_MAX_INFLATE_BYTES": "lots"})
    assert r.returncode == 2 and "CONSISTENCY_MAX_INFLATE_BYTES" in r.stderr
    runs, rss = _drive(good, [str(bomb)])
    assert [r["code"] for r in runs] == [2, 0]  # compare: 64M rows refused at open (CONSISTENCY_MAX_ROWS); inspect: fine
    assert rss < 400, rss
    runs, rss = _drive(good, [str(bomb)], env={"CONSISTENCY_MAX_ROWS": str(1 << 27)})
    assert [r["code"] for r in runs] == [1, 0]  # under a raised row bound, a real finding (shape)
    assert rss < 400, rss  # 256 MiB inflated, never resident


def test_gzip_bomb_in_a_specforge_ckpt_is_refused(tmp_path):
    p = tmp_path / "data_0.ckpt.gz"
    with gzip.open(p, "wb", compresslevel=1) as g:
        block = bytes(1 << 20)
        for _ in range(64):
            g.write(block)
    good = write_dump(tmp_path / "g.safetensors", {"aux.0": mc.GOOD})
    r = cli("compare", str(good), str(p), env={"CONSISTENCY_MAX_GUNZIP_BYTES": str(16 << 20)})
    lines = _one_line(r.stderr)
    assert r.returncode == 2 and len(lines) == 1 and str(p) in lines[0] and "decompresses to more" in lines[0], r.stderr


def _as_nobody(warm: Callable[[], object], fn: Callable[[], object]) -> object:
    """``fn()`` in a forked child that dropped root for uid/gid 65534; its JSON-able result.

    Tests run as root, and root ignores file modes; an unprivileged process is the honest
    check. The interpreter lives under /root, unreadable to that user, so the child first
    runs ``warm()`` as root (importing every module ``fn`` needs), then drops privileges.
    """
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        try:
            os.close(rfd)
            warm()
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            os.write(wfd, json.dumps(fn()).encode())
        except BaseException:  # noqa: BLE001 - report it to the parent, which fails the test with it
            import traceback

            os.write(wfd, json.dumps({"child_error": traceback.format_exc()}).encode())
        finally:
            os._exit(0)
    os.close(wfd)
    data = b""
    while b := os.read(rfd, 65536):
        data += b
    os.close(rfd)
    os.waitpid(pid, 0)
    out = json.loads(data or b"null")
    assert not (isinstance(out, dict) and "child_error" in out), out["child_error"]
    return out


def _cli_in_process(argv: list[str]) -> tuple[int, str]:
    """The console script's function, in this process: exit code and stderr."""
    from consistency.cli import run

    err = io.StringIO()
    code = 0
    with redirect_stderr(err), redirect_stdout(io.StringIO()):
        try:
            run(argv)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
    return code, err.getvalue()


@pytest.fixture
def locked() -> Iterator[dict]:
    """A readable dump, an unreadable one (mode 000), one in an untraversable dir, an unreadable contract."""
    base = Path(tempfile.mkdtemp(prefix="consistency-perm-"))
    try:
        os.chmod(base, 0o755)
        f = {"base": base}
        f["good"] = write_dump(base / "good.safetensors", {"aux.0": mc.GOOD})
        f["locked"] = write_dump(base / "locked.safetensors", {"aux.0": mc.GOOD})
        (base / "private").mkdir(mode=0o700)
        f["hidden"] = write_dump(base / "private" / "hidden.npz", {"aux.0": mc.GOOD})
        text = '{"target": {"num_layers": 4}, "slots": [{"stream": 0}]}'
        (base / "readable.json").write_text(text)
        f["contract"] = base / "contract.json"
        f["contract"].write_text(text)
        os.chmod(f["good"], 0o644)
        os.chmod(f["locked"], 0o000)
        os.chmod(f["contract"], 0o000)
        yield {k: str(v) for k, v in f.items()}
    finally:
        subprocess.run(["chmod", "-R", "u+rwx", str(base)], check=False)
        subprocess.run(["rm", "-rf", str(base)], check=False)


def _runs_unprivileged(f: dict, runs: list[list[str]]) -> list[tuple[int, str]]:
    if os.geteuid() != 0:  # file modes already bind this process
        return [(r.returncode, r.stderr) for r in (cli(*argv) for argv in runs)]

    def warm() -> None:
        _cli_in_process(["compare", f["good"], f["good"], "--contract", f["base"] + "/readable.json"])
        _cli_in_process(["inspect", f["good"]])

    return [tuple(x) for x in _as_nobody(warm, lambda: [_cli_in_process(a) for a in runs])]


def _attempt(calls: list[tuple[Callable, str]]) -> list[str]:
    from consistency.errors import InputError

    out = []
    for fn, p in calls:
        try:
            x = fn(p)
            getattr(x, "close", lambda: None)()
            out.append(f"opened {p}")
        except InputError as e:
            out.append(str(e))
    return out


def test_unreadable_files_are_refused_for_an_unprivileged_user(locked):
    """The loaders (open_dump, read_contract) and the CLI, as uid 65534; root would read anything."""
    from consistency.contract.io import read_contract
    from consistency.dump.reader import open_dump

    calls = [(open_dump, locked["locked"]), (open_dump, locked["hidden"]), (read_contract, locked["contract"]),
             (open_dump, locked["good"])]
    if os.geteuid() == 0:
        got = _as_nobody(lambda: open_dump(locked["good"]).close(), lambda: _attempt(calls))
    else:
        got = _attempt(calls)
    assert got == [f"{locked['locked']}: permission denied", f"{locked['hidden']}: permission denied",
                   f"{locked['contract']}: permission denied", f"opened {locked['good']}"], got
    res = _runs_unprivileged(locked, [["compare", locked["good"], str(twin(locked["good"])), "-q"]])
    assert res[0][0] == 0, res[0]  # the CLI runs as that user, and reads what it may


def test_unreadable_dump_through_the_cli_is_one_line(locked):
    from consistency.dump.sets import open_side

    if os.geteuid() == 0:
        got = _as_nobody(lambda: open_side(locked["good"]).close(), lambda: _attempt([(open_side, locked["hidden"])]))
    else:
        got = _attempt([(open_side, locked["hidden"])])
    assert got == [f"{locked['hidden']}: permission denied"]
    runs = [["inspect", locked["locked"]], ["compare", locked["good"], locked["hidden"]],
            ["compare", locked["good"], locked["good"], "--contract", locked["contract"]]]
    for (code, err), argv in zip(_runs_unprivileged(locked, runs), runs, strict=True):
        assert code == 2 and _one_line(err) == [f"consistency: error: {argv[-1]}: permission denied"], (argv, err)
