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


def test_a_specforge_file_without_torch_names_the_torch_extra(tmp_path: Path, dumps: tuple[Path, Path]) -> None:
    torch = pytest.importorskip("torch")
    buf = io.BytesIO()
    torch.save({"input_ids": torch.arange(8), "loss_mask": torch.ones(8), "hidden_state": torch.zeros(1, 8, 16),
                "aux_hidden_state": torch.zeros(1, 8, 48)}, buf)
    ck = tmp_path / "data_0.ckpt.gz"
    ck.write_bytes(gzip.compress(buf.getvalue()))
    r = _run(HF, "compare", str(dumps[0]), str(ck), "-q")
    _one_line(r, "specdec-consistency[torch]")
    assert str(ck) in r.stderr


def test_commands_without_optional_dependencies_still_work(dumps: tuple[Path, Path]) -> None:
    a, b = dumps
    assert _run(HF + ",matplotlib", "compare", str(a), str(b), "-q").returncode == 0
    assert _run(HF + ",matplotlib", "inspect", str(a)).returncode == 0
