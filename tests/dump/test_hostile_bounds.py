"""Someone else's file costs what it weighs (issue 37): a hostile corpus per reader, each case
run in a fresh process under an address-space limit (``prlimit --as``) and a time limit.

Each case is built here from a construction whose unbounded cost is known (K latin1 copies
of an S-byte string: K x S bytes; V stride-0 views of B bytes: V x B; a rank table of
TP x PP entries), so the limit it runs under is one the unfixed reader cannot meet, and the
assertion is the one-line refusal naming the file (exit 2) within the limit. Loops over
members and rank names are checked for linear growth (N and 8N). A symlinked secret never
reaches an output, and a FIFO never blocks a reader.
"""

from __future__ import annotations

import io
import os
import shutil
import struct
import subprocess
import sys
import threading
import time
import zipfile
import zlib
from pathlib import Path

import pytest

from consistency.dump import ptzip
from consistency.errors import InputError
from tests.conftest import ROOT

AS_LIMIT = 1400 << 20  # the interpreter with numpy and the CLI needs ~0.6 GiB of address space
TIME_LIMIT = 60  # seconds: every case below is refused in well under one on an idle machine
PRLIMIT = shutil.which("prlimit")


def _bounded(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``consistency ARGS`` in a fresh interpreter under AS_LIMIT bytes of address space."""
    e = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    e.pop("CONSISTENCY_RECORD", None)
    e.update(env or {})
    cmd = [sys.executable, "-m", "consistency", *args]
    if PRLIMIT:
        cmd = [PRLIMIT, f"--as={AS_LIMIT}", "--", *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, env=e, cwd=ROOT, timeout=TIME_LIMIT)


def _one_line(r: subprocess.CompletedProcess, path: Path, words: str) -> str:
    err = r.stderr.strip()
    assert r.returncode == 2, (r.returncode, err[-600:])
    assert len(err.splitlines()) == 1 and str(path) in err and words in err, err[-600:]
    assert "Traceback" not in err and "MemoryError" not in err and "RecursionError" not in err
    return err


# -- building archives by hand: a torch.save zip is a root directory of plain members ----------

def _zip(path: Path, members: list[tuple[str, bytes, int]]) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        for name, data, comp in members:
            z.writestr(zipfile.ZipInfo(name), data, compress_type=comp)
    return path


def _archive(path: Path, pkl: bytes, storages: dict[str, bytes] | None = None,
             comp: int = zipfile.ZIP_DEFLATED) -> Path:
    root = path.stem
    return _zip(path, [(f"{root}/data.pkl", pkl, comp), (f"{root}/byteorder", b"little", zipfile.ZIP_STORED)]
                + [(f"{root}/data/{k}", v, zipfile.ZIP_STORED) for k, v in (storages or {}).items()])


def _u(s: str) -> bytes:  # BINUNICODE
    b = s.encode()
    return b"X" + struct.pack("<I", len(b)) + b


def _tensor_op(key: str, numel_storage: int, size: tuple[int, ...], stride: tuple[int, ...]) -> bytes:
    """Opcodes of ``torch._utils._rebuild_tensor_v2(<FloatStorage key>, 0, size, stride, False, OrderedDict())``."""
    tup = {1: b"\x85", 2: b"\x86", 3: b"\x87"}
    ints = lambda xs: b"".join(b"J" + struct.pack("<i", x) for x in xs) + tup[len(xs)]  # noqa: E731
    pid = (b"(" + _u("storage") + b"ctorch\nFloatStorage\n" + _u(key) + _u("cpu") + b"J"
           + struct.pack("<i", numel_storage) + b"tQ")
    return (b"ctorch._utils\n_rebuild_tensor_v2\n(" + pid + b"K\x00" + ints(size) + ints(stride) + b"\x89"
            + b"ccollections\nOrderedDict\n)R" + b"tR")


def string_bomb(path: Path, s_bytes: int, k: int) -> Path:
    """One S-byte string, then K ``_codecs.encode(memo[0], 'latin1')`` copies: K x S bytes from
    a file of S / 1000 (the string deflates), every copy under every per-value bound."""
    body = (b"\x80\x02" + b"X" + struct.pack("<I", s_bytes) + b"a" * s_bytes + b"q\x00" + b"](" +
            (b"c_codecs\nencode\nh\x00" + _u("latin1") + b"\x86R") * k + b"e.")
    return _archive(path, body)


def stride0_views(path: Path, n_views: int, elems: int) -> Path:
    """V tensors of ``elems`` float32 each, every one a stride-0 view of one 4-byte storage."""
    body = b"\x80\x02}(" + b"".join(_u(f"v{i}") + _tensor_op("0", 1, (elems,), (0,)) for i in range(n_views)) + b"u."
    return _archive(path, body, {"0": struct.pack("<f", 1.0)}, comp=zipfile.ZIP_STORED)


def deep_tuple(path: Path, depth: int) -> Path:
    return _archive(path, b"\x80\x02" + b"(" * depth + b")" + b"t" * depth + b".")


def shared_lists(path: Path, levels: int) -> Path:
    """Level i is a list holding level i-1 twice (two memo gets): 2^levels paths from 3 x levels opcodes."""
    body = b"\x80\x02]q\x00" + b"".join(b"(h" + bytes([i - 1]) + b"h" + bytes([i - 1]) + b"lq" + bytes([i])
                                         for i in range(1, levels + 1)) + b"."
    return _archive(path, body)


def self_list(path: Path) -> Path:
    return _archive(path, b"\x80\x02]q\x00h\x00a.")  # a list that contains itself


def _patch_central(path: Path, member: str, field_at: int, fmt: str, value: int) -> Path:
    """Set a field of ``member``'s central-directory record (flags at 8, method at 10, CRC at 16)."""
    data = bytearray(path.read_bytes())
    name = member.encode()
    at = 0
    while True:
        at = data.index(b"PK\x01\x02", at)
        n = struct.unpack("<H", data[at + 28:at + 30])[0]
        if bytes(data[at + 46:at + 46 + n]) == name:
            break
        at += 4
    struct.pack_into(fmt, data, at + field_at, value)
    path.write_bytes(bytes(data))
    return path


def _good_pkl() -> bytes:
    return b"\x80\x02}(" + _u("x") + _tensor_op("0", 4, (2, 2), (2, 1)) + b"u."


@pytest.mark.skipif(PRLIMIT is None, reason="prlimit (util-linux) is not installed")
def test_pt_allocations_are_charged_to_one_budget_per_file(tmp_path):
    """K latin1 copies of a 32 MiB string (2 GiB unbounded) and 16 stride-0 views of 128 MiB
    (2 GiB, each under the 1 GiB per-view bound) are refused in one line inside 1.4 GiB of
    address space; a 100,000-deep tuple (and a 999-deep one, which the unpickler builds but a
    later recursive walk does not survive) is one line, not a RecursionError; a list holding the
    level below twice, 60 levels (2^60 paths), and a list that contains itself are one line,
    never an endless walk."""
    cases = {
        "strings": (string_bomb(tmp_path / "strings.pt", 32 << 20, 64), "a bytes value of data.pkl"),
        "views": (stride0_views(tmp_path / "views.pt", 16, 32 << 20), "a strided view copied into memory"),
        "deep": (deep_tuple(tmp_path / "deep.pt", 100_000), "nests containers more than 100 deep"),
        "deep999": (deep_tuple(tmp_path / "deep999.pt", 999), "nests containers more than 100 deep"),
        "shared": (shared_lists(tmp_path / "shared.pt", 60), "share or contain themselves"),
        "cycle": (self_list(tmp_path / "cycle.pt"), "share or contain themselves"),
    }
    assert cases["strings"][0].stat().st_size < 200_000 and cases["views"][0].stat().st_size < 4000
    for what, (p, words) in cases.items():
        err = _one_line(_bounded("inspect", str(p)), p, words)
        if what in ("strings", "views"):
            assert "budget" in err and "CONSISTENCY_MAX_FILE_MEMORY" in err, err


def test_budget_is_sized_from_the_file_and_the_cap(tmp_path, monkeypatch):
    """The budget is min(16 GiB, 256 MiB + 4 x size); CONSISTENCY_MAX_FILE_MEMORY, when set, is
    every file's budget: 1 MiB refuses even a small view, 64 GiB reads what the default refuses."""
    from consistency.dump.budget import FACTOR, FLOOR, MAX_FILE_MEMORY, limit_for

    assert limit_for(1000) == FLOOR + FACTOR * 1000 and limit_for(10 ** 10) == MAX_FILE_MEMORY
    monkeypatch.setenv("CONSISTENCY_MAX_FILE_MEMORY", str(1 << 20))
    assert limit_for(10 ** 9) == 1 << 20
    p = stride0_views(tmp_path / "small.pt", 1, 1 << 19)  # 2 MiB: within the floor, over a 1 MiB cap
    a = ptzip.open_archive(p)
    with pytest.raises(InputError, match="budget of 1048576 bytes"):
        a.obj["v0"].view("v0", a.fd)
    a.close()
    monkeypatch.delenv("CONSISTENCY_MAX_FILE_MEMORY")
    a = ptzip.open_archive(p)  # the default budget reads it, views and all
    assert a.obj["v0"].view("v0", a.fd).read_all().sum() == 1 << 19
    a.close()
    big = stride0_views(tmp_path / "big.pt", 3, 1 << 25)  # three 128 MiB views: past the default budget
    a = ptzip.open_archive(big)
    with pytest.raises(InputError, match="budget"):
        [a.obj[f"v{i}"].view(f"v{i}", a.fd) for i in range(3)]
    a.close()
    monkeypatch.setenv("CONSISTENCY_MAX_FILE_MEMORY", str(1 << 36))  # the user's word for a genuine file
    a = ptzip.open_archive(big)
    assert [a.obj[f"v{i}"].view(f"v{i}", a.fd).shape for i in range(3)] == [(1 << 25,)] * 3
    a.close()


def test_zip_features_we_do_not_read_are_one_line(tmp_path):
    """Encrypted, unknown-method and bad-CRC members are refused naming the member and the
    problem (they reached the crash handler as RuntimeError / NotImplementedError / BadZipFile)."""
    def good(name: str) -> Path:
        return _archive(tmp_path / f"{name}.pt", _good_pkl(), {"0": b"\x00" * 16}, comp=zipfile.ZIP_STORED)

    cases = {
        "encrypted": (_patch_central(good("enc"), "enc/data.pkl", 8, "<H", 1), "is encrypted"),
        "method 99": (_patch_central(good("meth"), "meth/data.pkl", 10, "<H", 99), "compression method 99"),
        "bzip2": (_patch_central(good("bz"), "bz/data.pkl", 10, "<H", 12), "compression method 12"),
        "bad CRC": (_patch_central(good("crc"), "crc/data.pkl", 16, "<I",
                                   zlib.crc32(_good_pkl()) ^ 1), "fails its CRC check"),
        "bad CRC byteorder": (_patch_central(good("bo"), "bo/byteorder", 16, "<I", 7), "fails its CRC check"),
    }
    ok = ptzip.open_archive(good("ok"))
    ok.close()
    for what, (p, words) in cases.items():
        with pytest.raises(InputError) as e:
            ptzip.open_archive(p).close()
        line = str(e.value)
        assert "\n" not in line and str(p) in line and words in line, (what, line)
    r = _bounded("inspect", str(cases["encrypted"][0]))
    _one_line(r, cases["encrypted"][0], "is encrypted")


def _min_time(fn, reps: int = 3) -> float:  # noqa: ANN001
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _dup_zip(path: Path, n: int) -> Path:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for i in range(n):
            z.writestr(zipfile.ZipInfo(f"d/data/{i}"), b"")
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            z.writestr(zipfile.ZipInfo(f"d/data/{n - 1}"), b"")  # the last name again: found after N others
    path.write_bytes(buf.getvalue())
    return path


def test_duplicate_member_check_grows_linearly(tmp_path):
    """One member name repeated after N others: refusing it takes time linear in N (the
    check counted each name in the whole list: 80k members took 129 s)."""
    small, big = _dup_zip(tmp_path / "s.pt", 3000), _dup_zip(tmp_path / "b.pt", 24000)

    def refuse(p: Path) -> None:
        with pytest.raises(InputError, match="appears twice"):
            ptzip.open_archive(p)

    ts, tb = _min_time(lambda: refuse(small)), _min_time(lambda: refuse(big))
    assert tb < 24 * ts + 0.05, (ts, tb)  # linear: ~8x; the quadratic check was ~64x


def _rank_dirs(root: Path, far: int) -> Path:
    (root / "TP0_PP0_Rank0_pid1").mkdir(parents=True)
    (root / f"TP{far}_PP{far}_Rank{far}_pid2").mkdir()
    return root


@pytest.mark.skipif(PRLIMIT is None, reason="prlimit (util-linux) is not installed")
def test_rank_tables_come_from_the_directories_present(tmp_path):
    """``TP0_PP0_*`` beside ``TP9999_PP9999_*`` (two empty directories): the names claim 10^8
    ranks; the table is built from the two present (7.1 GB and 33 s before), refused in one
    line; and the time does not grow with the claimed numbers."""
    root = _rank_dirs(tmp_path / "td", 9999)
    _one_line(_bounded("inspect", str(root)), root, "2 are present")
    from consistency.dump.formats import sglang_tensor_dump as td

    small, big = _rank_dirs(tmp_path / "s", 300), _rank_dirs(tmp_path / "b", 2400)

    def refuse(p: Path) -> None:
        with pytest.raises(InputError, match="2 are present"):
            td._parse_ranks(p, td._rank_dirs(p))

    ts, tb = _min_time(lambda: refuse(small)), _min_time(lambda: refuse(big))
    assert tb < 24 * ts + 0.05, (ts, tb)  # claims 8x larger per axis: 64x the table when built from names


@pytest.mark.skipif(PRLIMIT is None, reason="prlimit (util-linux) is not installed")
def test_dumper_declared_sizes_are_claims_not_allocations(tmp_path):
    """A 2 KB dumper file declaring tp_size = pp_size = 10^6 (a 10^12-entry table; MemoryError
    at 7.5 GB before) is refused in one line: the files present are one rank."""
    import torch

    d = tmp_path / "dumper"
    d.mkdir()
    info = {"tp_rank": 0, "tp_size": 10 ** 6, "pp_rank": 0, "pp_size": 10 ** 6}
    p = d / "step=0___rank=0___dump_index=0___name=input_ids.pt"
    torch.save({"value": torch.arange(4), "meta": {"sglang_parallel_info": info}}, p)
    assert p.stat().st_size < 4000
    _one_line(_bounded("inspect", str(d)), d, "declare pp 1000000 x tp 1000000 ranks")


def test_megatron_expert_ranks_are_not_pipeline_stages(tmp_path):
    """``mp_rank_00_000``/``mp_rank_00_001`` with PP 1, EP 2 (megatron/training/checkpointing.py
    save_grads: ``_{pp:03d}`` only when PP > 1, ``_{ep:03d}`` only when EP > 1): every file holds
    output_layer, so they are expert ranks of one stage: streams 0..N, not two stages' 0..2N."""
    from consistency.dump.sets import open_side
    from tests.dump.test_stock_dumps import N, megatron_log

    megatron_log(tmp_path / "ep1")
    src = next((tmp_path / "ep1").glob("activations/iter_*/mp_rank_00.pth"))
    d = tmp_path / "ep2" / "activations" / src.parent.name
    d.mkdir(parents=True)
    for e in range(2):
        shutil.copy(src, d / f"mp_rank_00_{e:03d}.pth")
    with open_side(tmp_path / "ep2") as dump:
        summary = dump.metadata.extra["source_format"]["summary"]
        assert f"EP 2, streams 0..{N}" in summary and "PP" not in summary, summary
        assert dump.metadata.model.num_layers == N
    # the first of two files holding output_layer and the second not: neither stages nor expert ranks
    import torch

    obj = torch.load(src, weights_only=True)
    obj = {c: {k: v for k, v in e.items() if not k.startswith("output_layer")} for c, e in obj.items()}
    torch.save(obj, d / "mp_rank_00_001.pth")
    with pytest.raises(InputError, match="fit neither pipeline stages"):
        open_side(tmp_path / "ep2")


SECRET = b"sk-live-7Q2XSECRETTOKEN\x13\x37\xbe\xef-tail"


def _secret_layouts(tmp: Path, secret: Path) -> list[Path]:
    """Committed symlinks to a secret under each reader's file names."""
    out = []
    for rel in ("td/TP0_PP0_Rank0_pid1/Pass00000.pt", "meg/activations/iter_0000001/mp_rank_00.pth",
                "dumper/step=0___rank=0___dump_index=0___name=input_ids.pt", "x.pt", "x.pth", "x.safetensors",
                "x.npz", "x.ckpt"):
        p = tmp / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.symlink_to(secret)
        out.append(tmp / rel.split("/")[0])
    return out


def test_a_symlinked_secret_never_reaches_an_output(tmp_path):
    """No byte of a secret a committed symlink points at (text or binary, as hex) appears in
    stdout or stderr, whichever reader refuses it (ptzip's magic, each stock format)."""
    from tests.conftest import cli_batch

    secret = tmp_path / "secret" / "key"
    secret.parent.mkdir()
    for content in (SECRET, b"\x13\x37\xbe\xef" + SECRET):
        secret.write_bytes(content)
        work = tmp_path / f"w{len(content)}"
        work.mkdir()
        targets = _secret_layouts(work, secret)
        runs = cli_batch(*[["inspect", str(t)] for t in targets],
                         *[["compare", str(t), str(t)] for t in targets[:3]])
        for t, r in zip(targets + targets[:3], runs):
            out = r.stdout + r.stderr
            assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, (t, r.stderr)
            for needle in ("sk-l", "SECRET", "13 37", "1337", "\\x13", "be ef", "beef", "7Q2X"):
                assert needle not in out, (t, needle, out)


def test_a_fifo_never_blocks_a_reader(tmp_path):
    """A FIFO where a pass file, a rank file or a dump is expected is refused in one line at
    once; and a path swapped for a FIFO between the check and the open (os.stat says a regular
    file) is caught on the descriptor opened non-blocking, never a hang."""
    from consistency.dump.safetensors_io import open_regular

    fifos = []
    for rel in ("td/TP0_PP0_Rank0_pid1/Pass00000.pt", "meg/activations/iter_0000001/mp_rank_00.pth", "x.pt",
                "x.safetensors"):
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        os.mkfifo(p)
        fifos.append(p)
    for p in fifos:
        target = p if p.parent == tmp_path else tmp_path / p.relative_to(tmp_path).parts[0]
        r = _bounded("inspect", str(target))
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, (p, r.stderr)
    real_stat, regular = os.stat, os.stat(__file__)
    done: list[object] = []

    def swapped() -> None:
        os.stat = lambda path, *a, **k: regular if str(path) == str(fifos[2]) else real_stat(path, *a, **k)
        try:
            open_regular(fifos[2])
        except InputError as exc:
            done.append(exc)
        finally:
            os.stat = real_stat

    t = threading.Thread(target=swapped, daemon=True)
    t.start()
    t.join(20)
    assert not t.is_alive(), "open_regular blocked on a FIFO"
    assert done and "not a regular file" in str(done[0])
    # the sniffing opens (first bytes, is it a torch zip) meet the swapped path too: never a hang
    from consistency.dump.formats import checked_head

    for name, call in (("checked_head", lambda: done.append(checked_head(fifos[2]))),
                       ("is_torch_zip", lambda: done.append(ptzip.is_torch_zip(fifos[2], b"PK\x03\x04")))):
        t = threading.Thread(target=call, daemon=True)
        t.start()
        t.join(20)
        assert not t.is_alive(), f"{name} blocked on a FIFO"
    assert done[1:] == [None, False]


@pytest.mark.parametrize("value", ["abc", "0", "-5"])
@pytest.mark.parametrize("knob", ["CONSISTENCY_CHUNK_MB", "CONSISTENCY_SAMPLE_MB", "CONSISTENCY_MAX_FILE_MEMORY"])
def test_performance_knobs_are_validated_at_start_up(knob, value):
    from tests.conftest import run_cli

    r = run_cli("inspect", "/nonexistent.safetensors", env={knob: value})
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [r.stderr.strip()] and knob in r.stderr, r.stderr
    assert "no such file" not in r.stderr  # refused before any work


@pytest.mark.skipif(PRLIMIT is None, reason="prlimit (util-linux) is not installed")
def test_rank_set_world_size_is_a_claim_checked_against_the_files(tmp_path):
    """``x.rank{r}-of{w}`` names claim a world: ``-of999999999`` over two files listed every
    missing rank (a 10^9-entry list); now one line under the memory limit, and the time to
    refuse a missing rank does not grow with the claimed world (64x claimed, within 8x)."""
    import numpy as np

    from consistency.dump.ranks import check_set
    from consistency.dump.writer import write_dump

    d = tmp_path / "set"
    d.mkdir()
    for r in range(2):
        write_dump(d / f"x.rank{r}-of999999999.safetensors", {"hidden.1": np.ones((2, 4), np.float32)})
    r = _bounded("inspect", str(d / "x.rank*-of999999999.safetensors"))
    _one_line(r, d / "x.rank0-of999999999.safetensors", "claims a world of 999999999 ranks")
    with pytest.raises(InputError, match="no such rank"):
        check_set([Path("x.rank0-of4.safetensors"), Path("x.rank7-of4.safetensors")], allow_missing=True)
    paths = [Path(f"x.rank{r}-of{{w}}.safetensors") for r in range(2)]

    def refuse(w: int) -> None:
        with pytest.raises(InputError, match="are missing"):
            check_set([Path(str(p).format(w=w)) for p in paths])

    ts, tb = _min_time(lambda: refuse(15_000)), _min_time(lambda: refuse(960_000))
    assert tb < 8 * ts + 0.02, (ts, tb)


def test_the_speculators_dataset_beside_a_file_never_blocks(tmp_path):
    """The loss mask speculators keeps beside ``hs_{i}.safetensors`` is read from the dataset's
    state.json and Arrow files: one swapped for a FIFO is a note, never a hang (pyarrow opened
    the path itself, blocking)."""
    pytest.importorskip("pyarrow")
    import json

    import numpy as np

    from consistency.dump.formats.speculators import loss_mask_beside

    root = tmp_path / "data"
    (root / "hidden_states").mkdir(parents=True)
    (root / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000.arrow"}]}))
    os.mkfifo(root / "data-00000.arrow")
    got: list[object] = []
    t = threading.Thread(target=lambda: got.append(loss_mask_beside(root / "hidden_states" / "hs_0.safetensors",
                                                                     np.arange(4))), daemon=True)
    t.start()
    t.join(20)
    assert not t.is_alive(), "loss_mask_beside blocked on a FIFO"
    mask, note = got[0]  # type: ignore[misc]
    assert mask is None and "could not be read" in note


@pytest.mark.skipif(PRLIMIT is None, reason="prlimit (util-linux) is not installed")
def test_npz_fortran_members_share_the_files_budget(tmp_path):
    """Fortran-ordered members are reordered in memory, each under the 1 GiB per-member bound:
    twelve deflated 128 MiB members (a 2 MB npz) took 1.5 GiB together; the file's budget refuses
    them in one line under the memory limit, and one such member still reads."""
    import numpy as np

    zeros = np.zeros((8192, 4096), np.float32, order="F")  # 128 MiB, never touched: calloc'd pages
    p = tmp_path / "fortran.npz"
    np.savez_compressed(p, **{f"hidden.{i}": zeros for i in range(12)})
    assert p.stat().st_size < 3_000_000
    _one_line(_bounded("inspect", str(p)), p, "Fortran-ordered, reordered in memory")
    one = tmp_path / "one.npz"
    np.savez_compressed(one, **{"hidden.1": zeros})
    r = _bounded("inspect", str(one))
    assert r.returncode == 0 and "hidden.1" in r.stdout, r.stderr


def _many_tensors(path: Path, n: int) -> Path:
    body = b"\x80\x02}(" + b"".join(_u(f"t{i}") + _tensor_op(str(i), 4, (2, 2), (2, 1)) for i in range(n)) + b"u."
    return _archive(path, body, {str(i): b"\x00" * 16 for i in range(n)}, comp=zipfile.ZIP_STORED)


def test_opening_an_archive_grows_linearly_in_its_tensors(tmp_path):
    """Members, storages, persistent ids, the opcode scan and the tree walk of an archive of N
    and 8N tensors (each its own storage member): within a linear factor (min of 3 timings)."""
    small, big = _many_tensors(tmp_path / "s.pt", 500), _many_tensors(tmp_path / "b.pt", 4000)

    def read(p: Path, n: int) -> None:
        a = ptzip.open_archive(p)
        assert a.tensors == n
        a.close()

    ts, tb = _min_time(lambda: read(small, 500)), _min_time(lambda: read(big, 4000))
    assert tb < 24 * ts + 0.05, (ts, tb)


def test_a_refused_capture_gives_back_its_reservation_and_compare_never_passes_over_it(tmp_path):
    """A capture the recorder refuses (a complex tensor no dump can hold) must not keep the
    host bytes it reserved: the later good capture, which fits the bound only once those are
    given back, is recorded and the file written. Compare reads extra.refused_captures as it
    reads dropped_captures: CAPTURES_DROPPED names the refused capture, never a PASS."""
    import torch

    from consistency.api import compare
    from consistency.dump.reader import open_dump
    from consistency.dump.writer import write_dump
    from consistency.record import capture
    from consistency.record.async_capture import AsyncRecorder

    size = 256 * 1024  # elements: 1 MiB as float32, 2 MiB as complex64
    good = torch.arange(size, dtype=torch.float32).reshape(256, 1024) / size
    with AsyncRecorder(tmp_path / "cand.safetensors", max_host_bytes=(2 << 20) + (1 << 20)) as rec:
        capture("hidden.5", torch.zeros(256, 1024, dtype=torch.complex64))  # refused: 2 MiB reserved, then given back
        capture("hidden.3", good)
        capture("hidden.4", good + 1)  # fits only if hidden.5's 2 MiB went back
    assert rec.written is not None and rec.host_bytes == 2 << 20
    with open_dump(rec.written) as d:
        assert sorted(d.tensors) == ["hidden.3", "hidden.4"]
        assert "dropped_captures" not in d.metadata.extra
        assert list(d.metadata.extra["refused_captures"]) == ["hidden.5"]
    write_dump(tmp_path / "ref.safetensors", {"hidden.3": good.numpy(), "hidden.4": (good + 1).numpy()})
    rep = compare(str(tmp_path / "ref.safetensors"), str(rec.written))
    drop = [f for f in rep.findings if f.code == "CAPTURES_DROPPED"]
    assert rep.verdict != "pass" and len(drop) == 1, (rep.verdict, [f.code for f in rep.findings])
    assert drop[0].metrics["dropped"] == {"hidden.5": 1} and "hidden.5 refused" in drop[0].message


def test_a_ckpt_gz_swapped_for_a_fifo_after_its_check_is_read_from_the_checked_descriptor(tmp_path, monkeypatch):
    """The SpecForge reader checks the path (open_regular: non-blocking, a regular file) and then
    gunzips it: from that descriptor, never by reopening the name, which a FIFO may have
    replaced in between (a reopen by name blocked forever)."""
    import gzip

    from consistency.dump.formats import specforge

    p = tmp_path / "data_0.ckpt.gz"
    p.write_bytes(gzip.compress(b"not a torch zip at all" * 10))
    real = specforge.open_regular

    def open_then_swap(path):
        fd = real(path)
        os.unlink(path)
        os.mkfifo(path)  # the name now blocks any reader that opens it again
        return fd

    monkeypatch.setattr(specforge, "open_regular", open_then_swap)
    done: list[object] = []

    def load() -> None:
        try:
            specforge.load_record(p)
        except InputError as exc:
            done.append(exc)

    t = threading.Thread(target=load, daemon=True)
    t.start()
    t.join(20)
    assert not t.is_alive(), "the .ckpt.gz reader reopened a path swapped for a FIFO"
    assert done and "data_0.ckpt.gz" in str(done[0]) and "torch.save zip" in str(done[0]), done
