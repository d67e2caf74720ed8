"""Bad input ends in exit code 2 with one line naming the file; nothing is unpickled."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

from consistency.dump.writer import write_dump
from tests.conftest import twin, cli, run_cli


class _Payload:
    """Unpickling this creates a marker file: proof that pickle ran."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: ANN204
        return (Path.touch, (Path(self.marker),))


def _good(tmp_path: Path) -> Path:
    return write_dump(tmp_path / "good.safetensors", {"aux.0": np.ones((4, 8), np.float32)})


def _one_line_exit_2(r: subprocess.CompletedProcess, name: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1, r.stderr
    assert name in lines[0] and "Traceback" not in r.stderr


def test_object_array_npz_is_refused_and_never_unpickled(tmp_path):
    marker = tmp_path / "pwned"
    bad = tmp_path / "evil.npz"
    arr = np.empty(1, dtype=object)
    arr[0] = _Payload(str(marker))
    np.savez(bad, aux=arr)  # numpy pickles object arrays
    r = cli("compare", str(_good(tmp_path)), str(bad))  # a real process: the pickle must never run in any
    _one_line_exit_2(r, "evil.npz")
    assert "pickle" in r.stderr
    assert not marker.exists()


def test_truncated_safetensors(tmp_path):
    good = _good(tmp_path)
    data = good.read_bytes()
    bad = tmp_path / "trunc.safetensors"
    bad.write_bytes(data[: len(data) - 10])
    _one_line_exit_2(run_cli("compare", str(good), str(bad)), "trunc.safetensors")


def test_header_shape_disagrees_with_data(tmp_path):
    good = _good(tmp_path)
    data = good.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    hdr = json.loads(data[8:8 + n])
    hdr["aux.0"]["shape"] = [4, 9]
    body = json.dumps(hdr).encode()
    bad = tmp_path / "shape.safetensors"
    bad.write_bytes(struct.pack("<Q", len(body)) + body + data[8 + n:])
    r = run_cli("compare", str(good), str(bad))
    _one_line_exit_2(r, "shape.safetensors")


def test_metadata_shape_disagrees_with_npz_member(tmp_path):
    p = write_dump(tmp_path / "m.npz", {"aux.0": np.ones((4, 8), np.float32)})
    with zipfile.ZipFile(p) as z:
        members = {i.filename: z.read(i) for i in z.infolist()}
    meta = json.loads(np.load(p)["__consistency__"].item())
    meta["tensors"]["aux.0"]["shape"] = [8, 4]
    bad = tmp_path / "meta.npz"
    with zipfile.ZipFile(bad, "w") as z:
        z.writestr("aux.0.npy", members["aux.0.npy"])
        import io

        buf = io.BytesIO()
        np.lib.format.write_array(buf, np.array(json.dumps(meta)), allow_pickle=False)
        z.writestr("__consistency__.npy", buf.getvalue())
    _one_line_exit_2(run_cli("compare", str(_good(tmp_path)), str(bad)), "meta.npz")


@pytest.mark.parametrize("content", [b"", b"\x00" * 3, b"not a dump at all, just text"])
def test_garbage_files(tmp_path, content):
    bad = tmp_path / "garbage.safetensors"
    bad.write_bytes(content)
    _one_line_exit_2(run_cli("compare", str(_good(tmp_path)), str(bad)), "garbage.safetensors")


def test_directory_and_missing_paths(tmp_path):
    good = str(_good(tmp_path))
    _one_line_exit_2(run_cli("compare", good, str(tmp_path)), str(tmp_path))
    _one_line_exit_2(run_cli("compare", good, str(tmp_path / "nope.npz")), "nope.npz")


NO_TORCH = "import sys; sys.modules['torch'] = None; from consistency.cli import run; run(sys.argv[1:])"


def test_help_and_compare_run_without_torch(tmp_path):
    good = _good(tmp_path)
    for args in (["--help"], ["compare", "--help"], ["compare", str(good), str(twin(good)), "-q"], ["inspect", str(good)]):
        r = subprocess.run([sys.executable, "-c", NO_TORCH, *args], capture_output=True, text=True)
        assert r.returncode == 0, (args, r.stderr)
    check = ("import sys; from consistency.cli import run\n"
             "try:\n    run(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
             "assert 'torch' not in sys.modules, 'torch was imported'\n")
    r = subprocess.run([sys.executable, "-c", check, "compare", str(good), str(twin(good)), "-q"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


# A missing input is refused before the heavy imports: the process never loads torch or
# transformers (6-9 CPU-s), and the answer is still the one-line exit 2 naming the file.
NO_HEAVY = ("import sys; from consistency.cli import run\n"
            "try:\n    run(sys.argv[1:])\nexcept SystemExit as e:\n    code = e.code\n"
            "heavy = sorted(m for m in ('torch', 'transformers') if m in sys.modules)\n"
            "print(code, heavy, file=sys.stderr)\n")


@pytest.mark.parametrize("which", ["reference", "candidate"])
def test_replay_with_a_missing_input_exits_2_without_importing_torch(tmp_path, which):
    good = str(_good(tmp_path))
    missing = str(tmp_path / "missing.safetensors")
    pair = [missing, good] if which == "reference" else [good, missing]
    r = subprocess.run([sys.executable, "-c", NO_HEAVY, "replay", "--draft", "tiny-llama-eagle3", *pair],
                       capture_output=True, text=True, timeout=300)
    lines = r.stderr.splitlines()
    assert r.returncode == 0 and len(lines) == 2, r.stderr
    assert lines[0] == f"consistency: error: {missing}: no such file", r.stderr
    assert lines[1] == "2 []", r.stderr  # exit 2, neither torch nor transformers imported


def test_replay_api_with_a_missing_input_raises_without_importing_torch(tmp_path):
    code = ("import sys; from consistency.errors import InputError; from consistency.replay.api import replay_check\n"
            "try:\n    replay_check('tiny-llama-eagle3', sys.argv[1], sys.argv[2])\n"
            "except InputError as e:\n    print(e)\n"
            "print('torch' in sys.modules, 'transformers' in sys.modules)\n")
    missing = tmp_path / "nope.npz"
    r = subprocess.run([sys.executable, "-c", code, str(_good(tmp_path)), str(missing)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and r.stdout.splitlines() == [f"{missing}: no such file", "False False"], r.stderr


def test_record_with_missing_input_ids_exits_2_without_importing_torch(tmp_path):
    missing = str(tmp_path / "ids.npy")
    r = subprocess.run([sys.executable, "-c", NO_HEAVY, "record", "--model", "tiny-llama", "--input-ids", missing,
                        "-o", str(tmp_path / "out.safetensors")], capture_output=True, text=True, timeout=300)
    lines = r.stderr.splitlines()
    assert r.returncode == 0 and len(lines) == 2, r.stderr
    assert lines[0] == f"consistency: error: {missing}: no such file" and lines[1] == "2 []", r.stderr
    assert not (tmp_path / "out.safetensors").exists()
