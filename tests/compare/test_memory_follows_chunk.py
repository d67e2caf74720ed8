"""Memory follows the chunk, not the dump: peak RSS barely moves when the dump grows 12x."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from consistency.contract.models import AuxInfo, DumpMetadata, ModelInfo
from consistency.dump.reader import META_KEY
from consistency.dump.safetensors_io import serialize_header, write_raw

H = 2048


def _write(path: Path, names: list[str], tokens: int, blocks: dict[str, np.ndarray], meta: DumpMetadata) -> None:
    """Stream a bf16 dump tensor by tensor, so the test itself stays small in memory."""
    specs = {n: ("bfloat16", (tokens, H), tokens * H * 2) for n in names}
    with open(path, "wb") as fh:
        fh.write(serialize_header(specs, {META_KEY: meta.model_dump_json(exclude_none=True)}))
        for n in names:
            write_raw(fh, np.tile(blocks[n], (tokens // blocks[n].shape[0], 1)))


def _pair(tmp: Path, tokens: int, layers: int = 8) -> tuple[Path, Path]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, H), dtype=np.float32)
    blocks = {}
    for s in range(layers + 1):
        blocks[f"hidden.{s}"] = (x.view(np.uint32) >> 16).astype(np.uint16)
        x = x + rng.standard_normal((256, H), dtype=np.float32) * 0.3
    ref, cand = tmp / f"ref{tokens}.safetensors", tmp / f"cand{tokens}.safetensors"
    model = ModelInfo(num_layers=layers, hidden_size=H)
    _write(ref, list(blocks), tokens, blocks, DumpMetadata(model=model, aux=AuxInfo(stream_ids=[0, 3, 5])))
    cb = {"aux.0": blocks["hidden.3"], "aux.1": blocks["hidden.5"], "aux.2": blocks["hidden.7"]}
    _write(cand, list(cb), tokens, cb, DumpMetadata(model=model, aux=AuxInfo(stream_ids=[3, 5, 7])))
    return ref, cand


def _peak_rss_mb(ref: Path, cand: Path, env: dict[str, str]) -> float:
    # VmHWM, not ru_maxrss: ru_maxrss keeps the high-water mark of the forking parent across
    # exec, so a child of a large pytest process would report the parent's size.
    code = ("import sys\nfrom consistency.cli import run\n"
            "try:\n    run(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            "print(next(int(x.split()[1]) for x in open('/proc/self/status') if x.startswith('VmHWM:')))")
    r = subprocess.run([sys.executable, "-c", code, "compare", str(ref), str(cand), "-q"], capture_output=True,
                       text=True, env={**os.environ, **env}, check=True)
    assert "shifted by 1 slot" in r.stdout
    return int(r.stdout.strip().splitlines()[-1]) / 1024


@pytest.mark.slow
def test_peak_memory_is_bounded_by_the_chunk_not_the_dump(tmp_path):
    env = {"CONSISTENCY_CHUNK_MB": "8", "CONSISTENCY_SAMPLE_MB": "16"}
    small = _peak_rss_mb(*_pair(tmp_path, 1024), env)  # 9 x 4 MB reference
    big = _peak_rss_mb(*_pair(tmp_path, 12288), env)  # 9 x 48 MB = 432 MB reference, 12x larger
    assert (tmp_path / "ref12288.safetensors").stat().st_size > 400e6
    assert big - small < 48, (small, big)  # the dump grew by ~400 MB; memory by less than the chunk budget
