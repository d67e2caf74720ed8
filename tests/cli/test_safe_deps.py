"""A missing optional dependency is one line with the install command, never a bare
ModuleNotFoundError (issue 15). The dependencies are really absent: a finder installed
before anything is imported makes ``import torch`` (etc.) fail in the subprocess, as on
an install without the extra."""

from __future__ import annotations

import gzip
import io
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from consistency.dump.writer import write_dump

BLOCK = """
import sys
BLOCKED = set(sys.argv[1].split(","))
class _Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, _Blocker())
from consistency.cli import run
run(sys.argv[2:])
"""
HF = "torch,transformers,accelerate"


def _run(blocked: str, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "CONSISTENCY_RECORD"}
    return subprocess.run([sys.executable, "-c", BLOCK, blocked, *args], capture_output=True, text=True, timeout=300,
                          env=env, cwd=cwd)


@pytest.fixture(scope="module")
def dumps(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("deps")
    rng = np.random.default_rng(0)
    h = {f"hidden.{i}": rng.standard_normal((8, 16)).astype(np.float32) for i in range(3)}
    return (write_dump(d / "a.safetensors", h), write_dump(d / "b.safetensors", h))


def _one_line(r: subprocess.CompletedProcess, install: str) -> None:
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr and "ModuleNotFoundError" not in r.stderr, r.stderr
    assert r.stderr.startswith("consistency: error: ") and f"install it with: pip install '{install}'" in r.stderr
    torch_extra = install.endswith(("[hf]", "[torch]"))  # an extra that pulls torch says how to get the CPU wheel
    assert ("pip install torch --index-url https://download.pytorch.org/whl/cpu" in r.stderr) == torch_extra, r.stderr


@pytest.mark.parametrize("args", [
    ["demo"],
    ["record", "--model", "tiny-llama", "--prompt", "hi", "-o", "{tmp}/r.safetensors"],
    ["replay", "--draft", "tiny-llama-eagle3", "--target", "tiny-llama", "{a}", "{b}"],
])
def test_commands_that_run_a_model_name_the_hf_extra(tmp_path: Path, dumps: tuple[Path, Path], args: list[str]) -> None:
    a, b = dumps
    r = _run(HF, *[x.format(tmp=tmp_path, a=a, b=b) for x in args], cwd=tmp_path)
    _one_line(r, "specdec-consistency[hf]")
    assert not list(tmp_path.iterdir())  # nothing written


def test_compare_png_without_matplotlib_names_the_report_extra(tmp_path: Path, dumps: tuple[Path, Path]) -> None:
    a, b = dumps
    r = _run("matplotlib", "compare", str(a), str(b), "-q", "--png", str(tmp_path / "png"))
    _one_line(r, "specdec-consistency[report]")
    assert not (tmp_path / "png").exists()


def test_a_specforge_file_reads_without_torch(tmp_path: Path, dumps: tuple[Path, Path]) -> None:
    """A .ckpt is a torch.save archive: the restricted reader reads it with torch absent (issue 39),
    gzipped or not, and its values are the ones saved."""
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(0)
    rec = {"input_ids": torch.arange(8), "loss_mask": torch.ones(8), "hidden_state": torch.randn(1, 8, 16, generator=g),
           "aux_hidden_state": torch.randn(1, 8, 48, generator=g).bfloat16()}
    buf = io.BytesIO()
    torch.save(rec, buf)
    gz, plain = tmp_path / "data_0.ckpt.gz", tmp_path / "data_1.ckpt"
    gz.write_bytes(gzip.compress(buf.getvalue()))
    plain.write_bytes(buf.getvalue())
    r = _run(HF, "compare", str(gz), str(plain), "-q", "--layer-ids", "1,2,3")
    assert r.returncode == 0 and r.stdout.startswith("PASS"), r.stdout + r.stderr
    r = _run(HF, "inspect", str(gz), "--json")
    assert r.returncode == 0, r.stderr
    import json

    shapes = {t["name"]: (t["dtype"], t["shape"]) for t in json.loads(r.stdout)["tensors"]}
    assert shapes["aux.2"] == ("bfloat16", [8, 16]) and shapes["input_ids"] == ("int64", [8]), shapes
    from consistency.dump.sets import open_side

    with open_side(gz, [1, 2, 3]) as d:  # the values, not only the shapes
        want = rec["aux_hidden_state"][0, :, 32:].float().numpy()
        assert np.array_equal(d["aux.2"].rows_float(0, 8), want)


def test_commands_without_optional_dependencies_still_work(dumps: tuple[Path, Path]) -> None:
    a, b = dumps
    assert _run(HF + ",matplotlib", "compare", str(a), str(b), "-q").returncode == 0
    assert _run(HF + ",matplotlib", "inspect", str(a)).returncode == 0
