"""The restricted .pt/.pth reader against a corpus written by torch.save, and hostile archives.

Readable: every dtype we store, views with offsets and strides into a shared storage, nested
containers (dicts, lists, tuples, OrderedDict, plain metadata), as torch.load reads them.
Hostile: a __reduce__ payload, a TorchScript archive, out-of-bounds strides, a storage whose
size lies, a zip bomb, a deflated storage, an unknown global, a BUILD on a tensor, a raw
legacy pickle: each refused with one line, exit 2, and no payload ever runs (a marker file the
payload would create stays absent). The reader works with torch made unimportable.
"""

from __future__ import annotations

import pickle
import subprocess
import sys
import zipfile
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch

from consistency.dump import ptzip
from consistency.errors import InputError
from tests.conftest import cli, run_cli

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
          torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.uint16, torch.uint32, torch.uint64,
          torch.bool]


def _as_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return t.view(torch.uint8).numpy()
    if t.dtype in (torch.uint16, torch.uint32, torch.uint64):
        return t.to(torch.int64).numpy().astype({torch.uint16: np.uint16, torch.uint32: np.uint32,
                                                  torch.uint64: np.uint64}[t.dtype])
    return t.numpy()


def _corpus() -> dict:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 8, generator=g)
    out: dict = {}
    for dt in DTYPES:
        x = (torch.randn(3, 5, generator=g) * 4)
        out[str(dt).removeprefix("torch.")] = x.to(dt) if dt != torch.bool else x > 0
    out["views"] = {"row_offset": base[2:5], "column_slice": base[:, 3:6], "transposed": base.t(),
                    "strided": base[::2, 1::3], "scalar": base[1, 2], "empty": base[:0]}
    out["nested"] = OrderedDict(a=[torch.arange(4), (torch.ones(2, 2), None)], meta={"dims": "t h # tp:replicated",
                                                                                    "ids": [1, 2], "x": 1.5,
                                                                                    "raw": b"\x00\xffbytes"})
    return out


def _walk(a, b, path=""):  # noqa: ANN001, ANN202 - our tree against torch.load's
    if isinstance(b, torch.Tensor):
        assert isinstance(a, ptzip.PtTensor), path
        assert a.shape == tuple(b.shape) and a.dtype == str(b.dtype).removeprefix("torch."), path
        return
    if isinstance(b, dict):
        assert isinstance(a, dict) and list(a) == list(b), path
        for k in b:
            _walk(a[k], b[k], f"{path}.{k}")
    elif isinstance(b, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _walk(x, y, f"{path}.{i}")
    else:
        assert a == b, path


def test_corpus_reads_as_torch_load_does(tmp_path):
    obj = _corpus()
    p = tmp_path / "corpus.pt"
    torch.save(obj, p)
    back = torch.load(p, weights_only=True)
    a = ptzip.open_archive(p)
    try:
        _walk(a.obj, back)
        for name in [str(dt).removeprefix("torch.") for dt in DTYPES]:
            assert np.array_equal(a.obj[name].read(a.fd), _as_numpy(back[name])), name
        for name, t in back["views"].items():
            assert np.array_equal(a.obj["views"][name].read(a.fd), _as_numpy(t)), name
        assert a.obj["views"]["row_offset"].offset == 16  # a view stores the whole storage plus an offset
        assert a.obj["views"]["row_offset"].storage is a.obj["views"]["transposed"].storage
    finally:
        a.close()


def test_plain_torch_save_compares_and_converts_without_torch_semantics(tmp_path):
    p = tmp_path / "mine.pt"
    x = torch.randn(10, 16)
    torch.save({"hidden": [x, x * 2], "input_ids": torch.arange(10)}, p)
    r = run_cli("inspect", str(p))
    assert r.returncode == 0 and "torch.save archive, 3 tensors" in r.stdout and "hidden.1" in r.stdout
    r = run_cli("convert", str(p), "-o", str(tmp_path / "mine.safetensors"))
    assert r.returncode == 0, r.stderr
    r = run_cli("compare", str(tmp_path / "mine.safetensors"), str(p))
    assert r.returncode == 0, r.stdout + r.stderr


# -- hostile archives -------------------------------------------------------------------------------

class _Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: ANN204
        return (open, (self.marker, "w"))


def _rezip(src: Path, dst: Path, edit) -> Path:  # noqa: ANN001
    """Rewrite an archive member by member, ``edit(name, data) -> (name, data, compress) | None``."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for info in zin.infolist():
            got = edit(info.filename, zin.read(info))
            if got is None:
                continue
            name, data, comp = got
            zout.writestr(zipfile.ZipInfo(name), data, compress_type=comp)
    return dst


def _patch_pickle(src: Path, dst: Path, fn) -> Path:  # noqa: ANN001
    return _rezip(src, dst, lambda n, d: (n, fn(d) if n.endswith("/data.pkl") else d, zipfile.ZIP_STORED))


def _hostile(tmp: Path, marker: Path) -> dict[str, tuple[Path, str]]:
    ok = tmp / "ok.pt"
    torch.save({"x": torch.arange(12, dtype=torch.float32).view(3, 4)}, ok)
    cases: dict[str, tuple[Path, str]] = {}
    p = tmp / "reduce.pt"
    torch.save({"x": torch.ones(2), "boom": _Payload(str(marker))}, p)
    cases["__reduce__ payload"] = (p, "names global io.open")
    script = tmp / "script.pt"
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), script)
    cases["TorchScript"] = (script, "a TorchScript archive")
    cases["out-of-bounds stride"] = (_patch_pickle(ok, tmp / "oob.pt", lambda d: d.replace(
        b"K\x04K\x01\x86", b"K\x09K\x01\x86")), "out of bounds")
    cases["lying size"] = (_patch_pickle(ok, tmp / "lie.pt", lambda d: d.replace(b"K\x0ct", b"K\x30t")), "a lying size")
    bomb = tmp / "bomb.pt"  # 64 MiB of zeros in 64 KiB, checked against a 4 MB bound (BOMB_ENV)
    with zipfile.ZipFile(bomb, "w") as z:
        z.writestr("bomb/data.pkl", pickle.dumps({"x": 1}) + b"\x00" * (64 << 20), compress_type=zipfile.ZIP_DEFLATED)
    cases["zip bomb"] = (bomb, "over the")
    cases["deflated storage"] = (_rezip(ok, tmp / "defl.pt", lambda n, d: (
        n, d, zipfile.ZIP_DEFLATED if "/data/" in n else zipfile.ZIP_STORED)), "is compressed")
    gl = tmp / "global.pt"
    torch.save({"x": torch.nn.Parameter(torch.ones(2))}, gl)
    cases["Parameter (unlisted global)"] = (gl, "_rebuild_parameter")
    legacy = tmp / "legacy.pt"
    torch.save({"x": torch.ones(2)}, legacy, _use_new_zipfile_serialization=False)
    cases["legacy raw pickle"] = (legacy, "a raw pickle stream")
    build = tmp / "build.pt"  # BUILD (object state) applied to a dict: {}.__setstate__({"a": 1})
    _patch_pickle(ok, build, lambda d: b"\x80\x02}}X\x01\x00\x00\x00aK\x01sb.")
    cases["BUILD on a container"] = (build, "refused")
    cases["truncated"] = (_truncate(ok, tmp / "trunc.pt"), "")
    # a second copy of a storage member: torch.load reads the first, a last-wins reader the other
    dup = tmp / "dup.pt"
    with zipfile.ZipFile(ok) as zin, zipfile.ZipFile(dup, "w") as zout:
        for info in zin.infolist():
            zout.writestr(zipfile.ZipInfo(info.filename), zin.read(info))
        key = next(n for n in zin.namelist() if "/data/" in n)
        zout.writestr(zipfile.ZipInfo(key), np.full(12, 99, np.float32).tobytes())
    cases["duplicate member"] = (dup, "appears twice")
    enc = tmp / "encode.pt"  # _codecs.encode beyond a latin1 bytes value
    _patch_pickle(ok, enc, lambda d: b"\x80\x02c_codecs\nencode\nX\x01\x00\x00\x00aX\x05\x00\x00\x00rot13\x86R.")
    cases["_codecs.encode other than latin1"] = (enc, "latin1")
    lists = tmp / "lists.pt"  # 2M one-byte opcodes, each an empty list: ~160 MB built from a 2 KB file
    with zipfile.ZipFile(lists, "w") as z:
        z.writestr("lists/data.pkl", b"\x80\x02" + b"]" * (2 << 20) + b".", compress_type=zipfile.ZIP_DEFLATED)
    cases["opcode bomb"] = (lists, "pickle opcodes")
    memo = tmp / "memo.pt"  # LONG_BINPUT 2**31 - 1: a 16 GiB memo array
    with zipfile.ZipFile(memo, "w") as z:
        z.writestr("memo/data.pkl", b"\x80\x02]r\xff\xff\xff\x7f.")
    cases["memo index bomb"] = (memo, "memo entry 2147483647")
    for tag, mark in (("big", b"big"), ("padded", b"big" + b" " * 30)):  # torch.load refuses all but little/big
        cases[f"byteorder {tag}"] = (_rezip(ok, tmp / f"order_{tag}.pt", lambda n, d, m=mark: (
            n, m if n.endswith("/byteorder") else d, zipfile.ZIP_STORED)), "byteorder b'big")
    return cases


def test_two_tensors_flattening_to_one_name_are_refused(tmp_path):
    p = tmp_path / "clash.pt"
    torch.save({"hidden.3": torch.zeros(2, 4), "hidden": {"3": torch.ones(2, 4)}}, p)
    r = run_cli("inspect", str(p))
    assert r.returncode == 2 and "flatten to the name 'hidden.3'" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def _truncate(src: Path, dst: Path) -> Path:
    data = src.read_bytes()
    dst.write_bytes(data[: len(data) // 2])
    return dst


BOMB_ENV = {"CONSISTENCY_MAX_PICKLE_BYTES": "4000000", "CONSISTENCY_MAX_PICKLE_OPS": "1000000"}


def test_hostile_archives_are_refused_with_one_line_and_nothing_runs(tmp_path, monkeypatch):
    for k, v in BOMB_ENV.items():
        monkeypatch.setenv(k, v)
    marker = tmp_path / "PWNED"
    cases = _hostile(tmp_path, marker)
    for what, (p, words) in cases.items():
        with pytest.raises(InputError) as e:
            a = ptzip.open_archive(p)
            a.close()
            raise AssertionError(f"{what}: read")
        line = str(e.value)
        assert "\n" not in line and str(p) in line and words in line, (what, line)
    assert not marker.exists()
    # the same through the CLI, in a fresh interpreter: exit 2, one line on stderr, nothing written
    for what in ("__reduce__ payload", "TorchScript", "out-of-bounds stride", "zip bomb", "memo index bomb"):
        p = cases[what][0]
        r = cli("inspect", str(p), env=BOMB_ENV)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, (what, r.stderr)
    assert not marker.exists()


def test_reader_needs_no_torch(tmp_path):
    """With torch made unimportable, the archive and an SGLang-style pass dict still read."""
    p = tmp_path / "Pass00000.pt"
    torch.save({"model.embed_tokens": torch.randn(4, 8), "model.norm": [torch.randn(4, 8), torch.randn(4, 8)]}, p)
    want = torch.load(p, weights_only=True)["model.norm"][1].numpy()
    np.save(tmp_path / "want.npy", want)
    code = f"""
import sys, numpy as np
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked")
sys.meta_path.insert(0, Block())
from consistency.dump import ptzip
a = ptzip.open_archive({str(p)!r})
got = a.obj["model.norm"][1].read(a.fd)
assert np.array_equal(got, np.load({str(tmp_path / 'want.npy')!r}))
assert "torch" not in sys.modules
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_unknown_content_names_what_it_looks_like(tmp_path):
    cases = {"a.npy": (lambda p: np.save(p, np.zeros(3)), "a single numpy .npy array"),
             "notes.txt": (lambda p: p.write_text("hello, these are notes\n"), "is text"),
             "noise.dat": (lambda p: p.write_bytes(bytes(range(7, 200))), "unrecognised bytes"),
             "w.bin": (lambda p: p.write_bytes(pickle.dumps({"a": 1})), "a raw pickle stream")}
    for name, (make, words) in cases.items():
        p = tmp_path / name
        make(p)
        for cmd in (["inspect", str(p)], ["convert", str(p), "-o", str(tmp_path / "o.safetensors")]):
            r = run_cli(*cmd)
            assert r.returncode == 2, (name, cmd, r.stdout)
            err = r.stderr.strip()
            assert len(err.splitlines()) == 1 and words in err and "consistency reads" in err, (name, err)
            assert "safetensors header" not in err
    assert not (tmp_path / "o.safetensors").exists()
