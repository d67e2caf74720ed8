"""Shared test helpers: real tiny transformers models (seeded, built in memory) and the CLI."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import warnings
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@lru_cache(maxsize=None)
def _model(name: str, seed: int = 0):  # noqa: ANN202
    from consistency.record.models import build_builtin

    return build_builtin(name, seed)


def tiny(name: str = "tiny-llama", seed: int = 0):  # noqa: ANN201
    """A fresh copy of a built-in tiny model (cached build, so tests stay fast)."""
    return copy.deepcopy(_model(name, seed))


@lru_cache(maxsize=None)
def _record_source_digest() -> str:
    """What a recording depends on besides its arguments: the recorder's and writer's source,
    and the torch/transformers that run the model."""
    import hashlib

    import torch
    import transformers

    h = hashlib.sha256(f"{torch.__version__} {transformers.__version__}".encode())
    pkg = ROOT / "consistency"
    for f in sorted([*(pkg / "record").rglob("*.py"), *(pkg / "dump").rglob("*.py"), *(pkg / "contract").rglob("*.py")]):
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def recorded(kind: str, arch: str, ids, path: "str | Path", *args, seed: int = 0, **kw) -> Path:  # noqa: ANN001
    """``record_reference``/``record_serving`` (``kind``) of the built-in ``arch`` on ``ids``
    into ``path``, through an on-disk cache keyed by the content of every input (arguments,
    ids, the recorder's source, torch and transformers versions): the tests that compare the
    same recordings (test_compare.py's pairs) run the model once per machine, not once per test.
    Tests of the recorder itself call it directly."""
    import hashlib
    import shutil
    import tempfile

    import numpy as np

    from consistency.record import api

    path = Path(path)
    key = hashlib.sha256(repr((kind, arch, seed, args, sorted(kw.items()), path.suffix, _record_source_digest()))
                         .encode() + np.asarray(ids).astype(np.int64).tobytes()).hexdigest()[:24]
    cache = Path(tempfile.gettempdir()) / f"consistency-test-dumps-{os.getuid()}"
    hit = cache / f"{key}{path.suffix}"
    if not hit.is_file():
        cache.mkdir(exist_ok=True)
        fn = {"training": api.record_reference, "serving": api.record_serving}[kind]
        tmp = Path(tempfile.mkdtemp(dir=cache)) / f"dump{path.suffix}"
        fn(tiny(arch, seed), ids, tmp, *args, **kw)
        os.replace(tmp, hit)  # atomic: another worker may be writing the same key
        shutil.rmtree(tmp.parent, ignore_errors=True)
    shutil.copyfile(hit, path)
    return path


def prompt_ids(model, n: int = 48, seed: int = 1):  # noqa: ANN001, ANN201
    import numpy as np

    rng = np.random.default_rng(seed)
    return rng.integers(0, model.config.vocab_size, size=n).astype("int64")


def cli(*args: str, env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run the real console entry point in a subprocess: exit codes and output as a user sees them."""
    e = dict(os.environ)
    e.pop("CONSISTENCY_RECORD", None)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "consistency", *args], capture_output=True, text=True,
                          env=e, cwd=cwd or ROOT, timeout=600)


# Interpreter start-up filters: what a fresh ``python -m consistency`` shows on stderr (pytest
# records warnings itself, so without these an in-process run would hide one from the test).
_FRESH_FILTERS = (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning)


def _show_on_stderr(message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ANN001
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


def run_cli(*args: str, env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """The console script's own function (``consistency.cli.run``) in this process.

    Same exit code, stdout and stderr as :func:`cli` for everything that does not depend on
    a fresh interpreter, without paying 1-8 s of imports (torch, transformers) per call.
    Exit codes come from ``SystemExit`` as the interpreter maps them; stdout and stderr are
    click's test streams (not a terminal, like a pipe: rich and click strip nothing more or
    less than in CI); Python warnings are shown on that stderr with a fresh interpreter's
    filters, and logging handlers writing to stderr (transformers') are pointed at it, so a
    stray warning still breaks a "one line on stderr" assertion. Use :func:`cli` where the
    process is the point: the console-script path, import-time behaviour, hostile pickles,
    signals; each command keeps at least one such test.
    """
    import logging

    from click.testing import CliRunner

    from consistency.cli import run

    e: dict[str, str | None] = {"CONSISTENCY_RECORD": None, "CONSISTENCY_DEBUG": None}
    e.update(env or {})
    here = os.getcwd()
    code: int = 0
    handlers = [h for lg in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
                if isinstance(lg, logging.Logger) for h in lg.handlers
                if type(h) is logging.StreamHandler and h.stream in (sys.stderr, sys.__stderr__)]
    old_streams = [h.stream for h in handlers]
    with CliRunner().isolation(env=e) as (out, err, _mixed), warnings.catch_warnings():
        warnings.resetwarnings()
        for cat in _FRESH_FILTERS:
            warnings.simplefilter("ignore", cat)
        warnings.showwarning = _show_on_stderr  # pytest records warnings; an interpreter prints them
        for h in handlers:
            h.setStream(sys.stderr)
        try:
            os.chdir(cwd or ROOT)
            run([str(a) for a in args])
        except SystemExit as x:
            if x.code is None or isinstance(x.code, int):
                code = x.code or 0
            else:  # sys.exit("message"): the interpreter prints it and exits 1
                print(x.code, file=sys.stderr)
                code = 1
        finally:
            os.chdir(here)
            for h, s in zip(handlers, old_streams):
                h.setStream(s)
            sys.stdout.flush()
            sys.stderr.flush()
        stdout, stderr = out.getvalue().decode(), err.getvalue().decode()
    return subprocess.CompletedProcess(["consistency", *args], code, stdout, stderr)


_BATCH = r"""
import json, os, sys, tempfile
from consistency.cli import run
results = []
for argv in json.loads(sys.argv[2]):
    sys.stdout.flush(); sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        os.dup2(out.fileno(), 1); os.dup2(err.fileno(), 2)
        try:
            run(argv)
            code = 0
        except SystemExit as e:
            code = e.code if e.code is None or isinstance(e.code, int) else 1
            if code == 1 and not isinstance(e.code, int):  # sys.exit("message"), as the interpreter does
                print(e.code, file=sys.stderr)
        finally:
            sys.stdout.flush(); sys.stderr.flush()
            os.dup2(saved[0], 1); os.dup2(saved[1], 2)
            os.close(saved[0]); os.close(saved[1])
        out.seek(0); err.seek(0)
        results.append([code or 0, out.read().decode(), err.read().decode("utf-8", "backslashreplace")])
with open(sys.argv[1], "w") as fh:
    json.dump(results, fh)
"""


def cli_batch(*argvs: list[str], env: dict | None = None, cwd: Path | None = None) -> list[subprocess.CompletedProcess]:
    """Several CLI runs in ONE fresh interpreter (not this one): one import of torch and
    transformers instead of one per run. Each run goes through ``consistency.cli.run`` with
    file descriptors 1 and 2 pointed at its own files, so everything it writes (Python,
    logging, warnings, C) is its stdout/stderr. For tests whose inputs must not be opened in
    the test process (pickles), and that still want one process for many runs."""
    import json
    import tempfile

    e = dict(os.environ)
    e.pop("CONSISTENCY_RECORD", None)
    e.update(env or {})
    with tempfile.TemporaryDirectory() as d:
        res = Path(d) / "results.json"
        r = subprocess.run([sys.executable, "-c", _BATCH, str(res), json.dumps([[str(a) for a in v] for v in argvs])],
                           capture_output=True, text=True, env=e, cwd=cwd or ROOT, timeout=600)
        assert r.returncode == 0 and res.is_file(), r.stderr[-3000:]
        return [subprocess.CompletedProcess(["consistency", *v], c, o, x)
                for v, (c, o, x) in zip(argvs, json.loads(res.read_text()), strict=True)]


@pytest.fixture
def tmp(tmp_path: Path) -> Path:
    return tmp_path



# -- running in parallel (scripts/test runs pytest-xdist, ``--dist worksteal``) -----------------
# Each worker gets an equal share of the cores for torch/BLAS threads, so two workers on two
# cores do not fight over four threads. worksteal hands each worker a contiguous half of the
# collection (a module's cached models and module fixtures are then mostly built once) and
# rebalances at the end; new test files need nothing to take part.

def _worker_threads() -> int | None:
    n = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    if n <= 1:
        return None
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        cores = os.cpu_count() or 1
    return max(1, cores // n)


_THREADS = _worker_threads()
if _THREADS is not None:
    for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(_var, str(_THREADS))
    if "torch" in sys.modules:  # pragma: no cover - a plugin imported it first
        sys.modules["torch"].set_num_threads(_THREADS)


def _self_contained_slow(item: pytest.Item) -> bool:
    """Marked slow and holding no module/class/package fixture: it can run anywhere."""
    if item.get_closest_marker("slow") is None:
        return False
    defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", None)
    if defs is None:
        return False
    return all(d[-1].scope in ("function", "session") for d in defs.values() if d)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under xdist, self-contained slow tests (a training run, gloo process groups, CLI
    processes) go to the front of the collection. worksteal can rebalance only between tests,
    so a 40 s test that starts last leaves the other core idle for its length; started first,
    the short tests fill in around it. Every worker computes the same order (xdist requires
    it); tests that share a module fixture keep their place, so it is still built once."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    first = [i for i in items if _self_contained_slow(i)]
    if first:
        rest = [i for i in items if not _self_contained_slow(i)]
        items[:] = first + rest


def twin(path: "str | Path") -> Path:
    """A byte-identical copy of a file beside it: the same values under another path (a
    file compared with itself is SAME_INPUT, never a pass; a copy is a real comparison)."""
    import shutil

    src = Path(path)
    dst = src.with_name(f"{src.stem}.twin{src.suffix}")
    if not dst.exists():
        shutil.copyfile(src, dst)
    return dst
