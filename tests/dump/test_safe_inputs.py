"""A file is read by what its name promises, checked against its first bytes, before any
loader that could decompress or unpickle it (issue 15: a gzip stream named
``.safetensors`` reached torch and inflated in memory)."""

from __future__ import annotations

import gzip
import io
import pickle
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

from consistency.dump.formats import check_content, content_kind, detect
from consistency.dump.writer import write_dump
from consistency.errors import InputError

# A finder that records any attempt to import torch (and refuses it), so a test can tell
# "refused before torch" from "torch refused it".
WATCH = """
import sys, os
class _Watch:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "torch":
            open(os.environ["TORCH_MARKER"], "a").write(name + "\\n")
            raise ModuleNotFoundError(name, name=name)
        return None
sys.meta_path.insert(0, _Watch())
from consistency.cli import run
try:
    run(sys.argv[1:])
finally:
    # VmHWM: this process image's peak (ru_maxrss would include the forking parent's pages)
    hwm = next(x for x in open("/proc/self/status") if x.startswith("VmHWM:")).split()[1]
    sys.stderr.write(f"maxrss_kb={hwm}\\n")
"""


def _gzip_bomb(path: Path, mib: int) -> None:
    """``mib`` MiB of zeros, gzip-compressed (about 1/1000 of that on disk)."""
    chunk = b"\0" * (1 << 20)
    with gzip.open(path, "wb", compresslevel=1) as g:
        for _ in range(mib):
            g.write(chunk)


def _run(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, str, int]:
    marker = tmp_path / "torch-imported"
    r = subprocess.run([sys.executable, "-c", WATCH, *args], capture_output=True, text=True, timeout=300,
                       env={**__import__("os").environ, "TORCH_MARKER": str(marker)})
    rss = int(r.stderr.rsplit("maxrss_kb=", 1)[1].split()[0])
    return r, (marker.read_text() if marker.exists() else ""), rss


@pytest.mark.parametrize("command", ["compare", "inspect"])
def test_a_gzip_bomb_named_safetensors_is_refused_by_content_before_torch(tmp_path: Path, command: str) -> None:
    bomb = tmp_path / "hs_0.safetensors"
    _gzip_bomb(bomb, 512)  # 512 MiB inflated, ~0.5 MB on disk
    assert bomb.stat().st_size < 4 << 20
    good = write_dump(tmp_path / "g.safetensors", {"hidden.0": np.ones((4, 8), np.float32)})
    args = [command, str(bomb)] if command == "inspect" else [command, str(good), str(bomb)]
    r, imported, rss_kb = _run(tmp_path, *args)
    assert r.returncode == 2
    lines = [x for x in r.stderr.splitlines() if not x.startswith("maxrss_kb=")]
    assert lines == [f"consistency: error: {bomb}: named .safetensors but its content is gzip data, not a safetensors "
                     "header; refused (files are read by what their name promises and never decompressed or unpickled "
                     "on a guess)"]
    assert imported == ""  # torch was never even imported
    assert rss_kb < 256 * 1024  # nothing was inflated (the bomb alone would be 512 MiB)


@pytest.mark.parametrize("make,kind", [
    (lambda p: p.write_bytes(gzip.compress(b"x" * 100)), "gzip"),
    (lambda p: p.write_bytes(pickle.dumps({"a": 1})), "pickle"),
    (lambda p: zipfile.ZipFile(p, "w").writestr("a", "b"), "zip"),
])
def test_any_foreign_content_named_safetensors_is_refused(tmp_path: Path, make, kind: str) -> None:  # noqa: ANN001
    p = tmp_path / "x.safetensors"
    make(p)
    with pytest.raises(InputError, match=f"content is {kind} data, not a safetensors header"):
        detect(p)


def test_an_npz_that_is_not_a_zip_is_refused(tmp_path: Path) -> None:
    p = tmp_path / "x.npz"
    p.write_bytes(gzip.compress(b"\0" * 1000))
    with pytest.raises(InputError, match="content is gzip data, not a zip header"):
        detect(p)


def test_real_files_still_open_by_content(tmp_path: Path) -> None:
    """The check does not refuse what it should read: our dumps (both formats) and a
    SpecForge ``.ckpt.gz`` (gzip under a name that promises gzip)."""
    st = write_dump(tmp_path / "a.safetensors", {"hidden.0": np.ones((2, 2), np.float32)})
    nz = write_dump(tmp_path / "a.npz", {"hidden.0": np.ones((2, 2), np.float32)})
    assert content_kind(st.read_bytes()[:16]) == "safetensors" and detect(st) is None
    assert content_kind(nz.read_bytes()[:16]) == "zip" and detect(nz) is None
    ck = tmp_path / "data_0.ckpt.gz"
    torch = pytest.importorskip("torch")
    buf = io.BytesIO()
    torch.save({"input_ids": torch.arange(4), "loss_mask": torch.ones(4), "hidden_state": torch.zeros(1, 4, 8),
                "aux_hidden_state": torch.zeros(1, 4, 24)}, buf)
    ck.write_bytes(gzip.compress(buf.getvalue()))
    fmt = detect(ck)
    assert fmt is not None and fmt.name == "specforge"
    check_content(tmp_path / "no-suffix", b"\x1f\x8b\x08\x00")  # no promise, no refusal
