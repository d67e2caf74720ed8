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
