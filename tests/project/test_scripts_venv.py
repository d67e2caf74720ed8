"""scripts/demo and scripts/test share one venv and its stamps (issue 39: the demo's venv had no
stamp, so `scripts/demo` then `scripts/test` rebuilt .venv from scratch, and every demo run
re-installed the project and printed setuptools' editable-install banner).

The real scripts/venv.sh runs against a venv whose ``python`` is a shim: it logs every
``-m pip`` and ``upstream_sources.py`` call (and does not run them: nothing is downloaded),
and runs anything else with this interpreter, so the project check sees this checkout."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT

SHIM = """#!/usr/bin/env bash
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then echo "pip $*" >> "{log}"; exit 0; fi
case "$*" in *upstream_sources.py*) echo "upstream $*" >> "{log}"; exit 0;; esac
exec "{real}" "$@"
"""


def _venv(tmp: Path) -> tuple[Path, Path]:
    venv, log = tmp / "venv", tmp / "calls.log"
    (venv / "bin").mkdir(parents=True)
    shim = venv / "bin" / "python"
    shim.write_text(SHIM.format(log=log, real=sys.executable))
    shim.chmod(0o755)
    (venv / "bin" / "activate").write_text(f'export PATH="{venv / "bin"}:$PATH"\n')
    (venv / "marker").write_text("a venv --clear would remove this")
    return venv, log


def _ensure(venv: Path, layer: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHON"))}
    env["VENV"] = str(venv)
    return subprocess.run(["bash", "-c", f". scripts/venv.sh && ensure_venv {layer}"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def _key(layer: str) -> str:
    r = subprocess.run(["bash", "-c", f". scripts/venv.sh && _venv_key {layer}"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_the_demos_venv_gets_the_test_layer_added_not_rebuilt(tmp_path: Path) -> None:
    venv, log = _venv(tmp_path)
    (venv / ".consistency-base").write_text(_key("base") + "\n")  # what scripts/demo leaves
    r = _ensure(venv, "test")
    assert r.returncode == 0, r.stderr
    assert (venv / "marker").exists()  # not rebuilt from scratch
    calls = log.read_text()
    assert "[test,report]" in calls and "torch==" not in calls and "'.[hf]'" not in calls, calls
    assert "upstream" in calls  # install-test-references ran (the wheels themselves are cached outside)
    assert (venv / ".consistency-installed").read_text().strip() == _key("test")
    log.unlink()
    for layer in ("test", "base"):  # warm: scripts/test and scripts/demo install nothing, print nothing
        r = _ensure(venv, layer)
        assert r.returncode == 0 and not log.exists() and r.stdout == "" and r.stderr == "", (layer, r.stderr)


def test_the_base_key_does_not_change_with_the_test_layers_inputs(tmp_path: Path) -> None:
    """Editing the test references re-runs only the test layer; the demo's base stays."""
    work = tmp_path / "co"
    (work / "scripts").mkdir(parents=True)
    for f in ("pyproject.toml", "scripts/constraints.txt", "scripts/venv.sh", "scripts/install-test-references"):
        shutil.copyfile(ROOT / f, work / f)

    def key(layer: str) -> str:
        r = subprocess.run(["bash", "-c", f". scripts/venv.sh && _venv_key {layer}"], cwd=work, capture_output=True,
                           text=True, timeout=60)
        return r.stdout.strip()

    base, test = key("base"), key("test")
    assert base == _key("base") and test == _key("test") and base != test
    with open(work / "scripts" / "install-test-references", "a") as f:
        f.write("\n# changed\n")
    assert key("base") == base and key("test") != test
    with open(work / "scripts" / "constraints.txt", "a") as f:
        f.write("\n# changed\n")
    assert key("base") != base


def test_upstream_wheels_are_fetched_once_into_a_cache_outside_the_venv(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """A rebuilt venv reuses the unpacked trees: the cache is not in the venv, and a marked tree
    is never downloaded again (pip is not called)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import upstream_sources as us
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    monkeypatch.delenv("CONSISTENCY_UPSTREAM", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    cache = us.default_cache()
    assert cache == tmp_path / "xdg" / "consistency-upstream" and ".venv" not in cache.parts
    (pkg, version), (_name, digest, _tags) = next(iter(us.PINS.items()))
    tree = cache / f"{pkg}-{version}"
    tree.mkdir(parents=True)
    (tree / us.MARK).write_text(f"{digest}\n{us.MEMBERS}\n")
    monkeypatch.setattr(us.subprocess, "run", lambda *a, **k: (_ for _ in ()).throw(AssertionError("downloaded")))
    assert us.fetch(pkg, version, cache).endswith(f"cached in {tree}")
    (tree / us.MARK).write_text(f"{digest}\nother-members\n")  # a tree unpacked with other members is redone
    try:
        us.fetch(pkg, version, cache)
    except AssertionError as exc:
        assert "downloaded" in str(exc)
    else:
        raise AssertionError("a stale tree was kept")
