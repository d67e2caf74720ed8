"""The built wheel carries what the package needs at run time, and works outside the repo.

``pip wheel .`` builds it (no license warnings: the SPDX string), it is installed with
``--no-deps`` into a fresh venv whose dependencies come from the test venv's site-packages
through a ``.pth`` line (no download of torch), and the commands run from a directory with
no checkout in sight: the demo (embedded tiny model + committed draft), schema export
(generated from the models), and the torch-free import.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow


def _run(*cmd: str | Path, cwd: Path, env: dict[str, str] | None = None,
         timeout: int = 600) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("CONSISTENCY_", "PYTHON", "VIRTUAL_ENV"))}
    e.update(env or {})
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, cwd=cwd, env=e, timeout=timeout)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    tmp = tmp_path_factory.mktemp("wheel")
    # build isolation, as a user's `pip wheel .`: the pinned build backend, not whatever the venv holds.
    # setuptools builds in the checkout's build/: two xdist workers that each run this fixture
    # (worksteal splits a module) take turns, or one deletes the other's files mid-build
    with open(Path(tempfile.gettempdir()) / f"consistency-wheel-{os.getuid()}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        # setuptools never cleans build/lib: a module deleted from the source would still ship
        shutil.rmtree(ROOT / "build", ignore_errors=True)
        build = _run(sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "-w", tmp / "dist", cwd=tmp)
    assert build.returncode == 0, build.stderr[-3000:]
    whl = next((tmp / "dist").glob("specdec_consistency-*.whl"))  # the distribution name (pyproject)
    venv = tmp / "venv"
    made = _run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=tmp)
    assert made.returncode == 0, made.stderr
    py = venv / "bin" / "python"
    inst = _run(sys.executable, "-m", "pip", "--python", py, "install", "-q", "--no-deps", whl, cwd=tmp)
    assert inst.returncode == 0, inst.stderr[-3000:]
    site = Path(_run(py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=tmp).stdout.strip())
    # dependencies (numpy, pydantic, torch, ...) from the test venv; its editable finder is not
    # activated, since .pth files are only processed in site directories, not in .pth-added paths
    (site / "zz_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return whl, venv, build.stdout + build.stderr


def test_build_prints_no_license_warning(installed: tuple[Path, Path, str]) -> None:
    _whl, _venv, log = installed
    assert "license" not in log.lower(), log[-2000:]


def test_wheel_carries_runtime_data(installed: tuple[Path, Path, str]) -> None:
    whl, _venv, _log = installed
    names = set(zipfile.ZipFile(whl).namelist())
    src = {str(p.relative_to(ROOT)) for p in (ROOT / "consistency").rglob("*")
           if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"}
    assert src <= names, sorted(src - names)  # every module, config, asset and py.typed
    shipped = {n for n in names if n.startswith("consistency/")}
    assert shipped <= src, sorted(shipped - src)  # nothing the source no longer has (a stale build/)
    assert "consistency/replay/assets/tiny-llama-eagle3/model.safetensors" in names
    assert any(n.endswith("dist-info/licenses/LICENSE") for n in names)
    assert not any(n.startswith(("tests/", "fixtures/", "bench/")) for n in names)


def test_installed_wheel_runs_outside_the_checkout(installed: tuple[Path, Path, str], tmp_path: Path) -> None:
    _whl, venv, _log = installed
    py, exe = venv / "bin" / "python", venv / "bin" / "consistency"
    where = _run(py, "-c", "import consistency, sys; assert 'torch' not in sys.modules; print(consistency.__file__)",
                 cwd=tmp_path)
    assert where.returncode == 0, where.stderr
    assert str(venv) in where.stdout and str(ROOT) not in where.stdout  # the wheel, not the checkout
    assert _run(exe, "--version", cwd=tmp_path).stdout.strip().endswith("0.1.0")
    demo = _run(exe, "demo", "--out", tmp_path / "demo", cwd=tmp_path)
    assert demo.returncode == 0, demo.stdout[-2000:] + demo.stderr[-2000:]
    assert "LAYER_SHIFT" in demo.stdout or "shift" in demo.stdout.lower(), demo.stdout[-2000:]
    assert (tmp_path / "demo" / "train.safetensors").is_file()
    page = _run(exe, "lint", "--explain", "SRV007", cwd=tmp_path)  # the page ships with the package (issue 38)
    assert page.returncode == 0 and page.stdout.strip() == (ROOT / "docs/rules/SRV007.md").read_text().strip()
    schemas = _run(exe, "schema", "--out", tmp_path / "schemas", cwd=tmp_path)  # generated from the models
    assert schemas.returncode == 0, schemas.stderr
    written = {p.name for p in (tmp_path / "schemas").glob("*.json")}
    assert written == {p.name for p in (ROOT / "schemas").glob("*.json")}
    assert all(json.loads(p.read_text())["title"] for p in (tmp_path / "schemas").glob("*.json"))
