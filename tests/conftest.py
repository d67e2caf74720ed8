"""Shared test helpers: real tiny transformers models (seeded, built in memory) and the CLI."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
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
