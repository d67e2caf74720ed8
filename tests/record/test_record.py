"""Recorders: HF hooks give pre-norm streams; the fused-residual loop gives the same streams."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from consistency.dump import names
from consistency.dump.writer import write_dump
from consistency.dump.reader import open_dump
from consistency.record import Recorder, capture
from consistency.record.api import record_reference, record_serving
from consistency.record.fused import FusedDecoder
from consistency.record.hf import capture_streams
from tests.conftest import prompt_ids, tiny

ARCHS = ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral", "tiny-deepseek-v3", "tiny-qwen3-moe"]


@pytest.mark.parametrize("arch", ARCHS + ["tiny-gpt2"])
def test_hooks_match_output_hidden_states_and_stream_n_is_pre_norm(arch):
    m = tiny(arch)
    ids = torch.as_tensor(prompt_ids(m, 20))[None]
    streams, notes = capture_streams(m, ids)
    with torch.no_grad():
        hs = m(input_ids=ids, output_hidden_states=True).hidden_states
    n = len(hs) - 1
    for s in range(n):
        assert torch.equal(streams[names.hidden(s)], hs[s]), f"stream {s}"
    # HF's last element is post-norm: it is final_norm, and stream N differs from it
    assert torch.allclose(streams[names.FINAL_NORM], hs[n], atol=1e-6)
    assert not torch.allclose(streams[names.hidden(n)], hs[n], atol=1e-3)
    if arch != "tiny-gpt2":
        assert not notes
        for k in range(n):
            s = streams[names.hidden(k)] + streams[names.attn_out(k)] + streams[names.mlp_out(k)]
            assert torch.allclose(s, streams[names.hidden(k + 1)], atol=1e-5), k


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_residual_loop_gives_the_same_streams_as_hf(arch):
    m = tiny(arch)
    ids = torch.as_tensor(prompt_ids(m, 16))[None]
    streams, _ = capture_streams(m, ids)
    n = m.config.num_hidden_layers
    _final, aux = FusedDecoder(m, list(range(n + 1)))(ids)
    for s in range(n + 1):
        assert torch.allclose(aux[s], streams[names.hidden(s)], atol=1e-6), s


def test_clone_capture_is_the_mlp_delta_except_at_the_embedding():
    m = tiny("tiny-llama")
    ids = torch.as_tensor(prompt_ids(m, 16))[None]
    streams, _ = capture_streams(m, ids)
    _final, aux = FusedDecoder(m, [0, 3, 7], capture_mode="clone")(ids)
    assert torch.equal(aux[0], streams["hidden.0"])  # clone == add at the embedding
    assert torch.allclose(aux[1], streams["mlp_out.2"], atol=1e-6)
    assert torch.allclose(aux[2], streams["mlp_out.6"], atol=1e-6)


def test_add_only_capture_fails_at_stream_0_like_old_sglang():
    m = tiny("tiny-llama")
    ids = torch.as_tensor(prompt_ids(m, 8))[None]
    with pytest.raises(TypeError):
        FusedDecoder(m, [0, 3], capture_mode="add")(ids)


def test_training_dump_holds_streams_components_and_aux(tmp_path):
    m = tiny("tiny-qwen3")
    ids = prompt_ids(m, 24)
    p = record_reference(m, ids, tmp_path / "t.safetensors", [0, 2, 6])
    with open_dump(p) as d:
        n = m.config.num_hidden_layers
        assert {names.hidden(s) for s in range(n + 1)} <= set(d.tensors)
        assert {names.mlp_out(k) for k in range(n)} <= set(d.tensors)
        assert d.metadata.aux.stream_ids == [0, 2, 6]
        assert d.metadata.model.num_layers == n and d.metadata.model.hidden_size == 64
        assert np.array_equal(d["aux.2"].read_all(), d["hidden.6"].read_all())
        assert np.array_equal(d["input_ids"].read_all(), ids)


def test_serving_dump_is_bf16_with_claims(tmp_path):
    m = tiny("tiny-llama")
    p = record_serving(m, prompt_ids(m, 24), tmp_path / "s.npz", [7, 3, 10], native_ids=[2, 6, 9],
                       convention="sglang@0.5.5", dtype="bfloat16")
    with open_dump(p) as d:
        assert d.metadata.aux.stream_ids == [3, 7, 10]  # capture order is the layer loop's
        assert d["aux.0"].dtype == "bfloat16"
        assert d.metadata.tensors["aux.0"].producer == "guarded"


def test_capture_is_inert_without_a_recorder_or_env(tmp_path, monkeypatch):
    monkeypatch.delenv("CONSISTENCY_RECORD", raising=False)
    capture("aux.0", torch.ones(3))  # nothing active: no error, no file
    assert not list(tmp_path.iterdir())
    with Recorder(tmp_path / "r.safetensors") as rec:
        capture("aux.0", torch.ones(2, 3).bfloat16())
        capture("aux.0", torch.zeros(2, 3))
    assert set(rec.tensors) == {"aux.0", "aux.0#2"}
    with open_dump(tmp_path / "r.safetensors") as d:
        assert d["aux.0"].dtype == "bfloat16"


def test_env_activated_capture_writes_at_exit(tmp_path):
    out = tmp_path / "env.safetensors"
    code = ("import torch; from consistency.record import capture;"
            "capture('aux.0', torch.arange(6.).reshape(2, 3))")
    env = dict(os.environ, CONSISTENCY_RECORD=str(out))
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
    with open_dump(out) as d:
        assert d["aux.0"].read_all().tolist() == [[0, 1, 2], [3, 4, 5]]
    env.pop("CONSISTENCY_RECORD")
    out.unlink()
    # without the variable nothing is written (torch tensors or not: capture is inert before
    # it looks at the tensor, test_capture_is_inert_without_a_recorder_or_env)
    inert = ("import numpy as np; from consistency.record import capture;"
             "capture('aux.0', np.arange(6.0).reshape(2, 3))")
    subprocess.run([sys.executable, "-c", inert], check=True, env=env)
    assert not out.exists()


def _rank_worker(rank: int, world: int, path: str, port: int) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        with Recorder(path) as rec:
            capture("aux.0", torch.full((2, 4), float(rank)))
        assert rec.written is not None
    finally:
        dist.destroy_process_group()


def _rank0_worker(rank: int, world: int, path: str, port: int) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        with Recorder(path, rank0_only=True):
            capture("aux.0", torch.full((2, 4), 7.0))  # replicated across the TP group: rank 0 holds it all
    finally:
        dist.destroy_process_group()


def test_a_rank0_only_recording_is_one_complete_file(tmp_path):
    """rank0_only under torch.distributed: one file named as the whole recording (never
    rank0-of2, which compare would read as a set missing rank 1), saying it was rank 0's."""
    import torch.multiprocessing as mp

    from consistency.pipeline.compare import compare as run

    path = tmp_path / "serve.safetensors"
    mp.spawn(_rank0_worker, args=(2, str(path), _free_port()), nprocs=2, join=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["serve.safetensors"]
    with open_dump(path) as d:
        assert d.metadata.extra.get("rank0_only") is True and (d.metadata.rank, d.metadata.world_size) == (0, 2)
    ref = write_dump(tmp_path / "train.safetensors", {"aux.0": np.full((2, 4), 7.0, np.float32)})
    assert run(str(ref), str(path)).verdict == "pass"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_rank_aware_file_names_under_torch_distributed(tmp_path):
    import torch.multiprocessing as mp

    path = str(tmp_path / "serve.safetensors")
    mp.spawn(_rank_worker, args=(2, path, _free_port()), nprocs=2, join=True)
    for r in range(2):
        with open_dump(tmp_path / f"serve.rank{r}-of2.safetensors") as d:
            assert d.metadata.rank == r and d.metadata.world_size == 2
            assert float(d["aux.0"].read_all()[0, 0]) == r


# --- the environment recorder never loses a recording (issue 15) ---

# numpy tensors: these children test the recorder's files, not torch, and a child that never
# imports torch starts in ~0.5 CPU-s instead of 3-6 (torch tensors at exit:
# test_env_activated_capture_writes_at_exit; under torch.distributed: the rank test).
ENV_CODE = ("import numpy as np; from consistency.record import capture;"
            "capture('aux.0', np.full((2, 3), {v}, np.float32)); print('captured', flush=True)")


def _env_run(out, v: float, **extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "CONSISTENCY_FORCE"}
    env.update(CONSISTENCY_RECORD=str(out), **extra)
    return subprocess.run([sys.executable, "-c", ENV_CODE.format(v=v)], env=env, capture_output=True, text=True,
                          timeout=300)


def _value(path) -> float:
    with open_dump(path) as d:
        return float(d["aux.0"].read_all()[0, 0])


def test_env_recorder_rerun_keeps_the_old_file_and_writes_a_sibling_said_at_first_capture(tmp_path):
    out = tmp_path / "env.safetensors"
    assert _env_run(out, 1).returncode == 0 and _value(out) == 1.0
    r = _env_run(out, 2)
    assert r.returncode == 0 and "Traceback" not in r.stderr
    assert _value(out) == 1.0  # the first run's recording is kept
    siblings = sorted(p for p in tmp_path.iterdir() if p != out)
    assert len(siblings) == 1 and siblings[0].name.startswith("env.") and siblings[0].suffix == ".safetensors"
    assert _value(siblings[0]) == 2.0  # and the second run's is not lost
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and str(siblings[0]) in lines[0] and "CONSISTENCY_FORCE=1" in lines[0]
    # said at the first capture, before the process went on with its work
    assert r.stdout == "captured\n"
    r = _env_run(out, 3, CONSISTENCY_FORCE="1")
    assert r.returncode == 0 and r.stderr == "" and _value(out) == 3.0


def test_env_recorders_of_two_processes_at_once_both_survive(tmp_path):
    out = tmp_path / "two.safetensors"
    env = dict(os.environ, CONSISTENCY_RECORD=str(out))
    env.pop("CONSISTENCY_FORCE", None)
    procs = [subprocess.Popen([sys.executable, "-c", ENV_CODE.format(v=v)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for v in (5, 6)]
    for p in procs:
        _out, err = p.communicate(timeout=300)
        assert p.returncode == 0 and "Traceback" not in err
    assert sorted(_value(p) for p in tmp_path.iterdir()) == [5.0, 6.0]


def test_env_recorder_creates_a_missing_directory_and_says_so_early(tmp_path):
    out = tmp_path / "not" / "yet" / "r.safetensors"
    r = _env_run(out, 4)
    assert r.returncode == 0 and _value(out) == 4.0
    assert "does not exist" in r.stderr and len(r.stderr.splitlines()) == 1


def test_env_recorder_under_an_unusable_directory_falls_back_to_the_temp_dir(tmp_path):
    (tmp_path / "afile").write_text("x")
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    r = _env_run(tmp_path / "afile" / "r.safetensors", 7, TMPDIR=str(tmpdir))
    assert r.returncode == 0 and "Traceback" not in r.stderr
    written = list(tmpdir.iterdir())
    assert len(written) == 1 and _value(written[0]) == 7.0 and str(written[0]) in r.stderr


def test_env_recorder_past_a_file_size_limit_says_what_was_lost_in_one_line(tmp_path):
    import resource

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))  # Python ignores SIGXFSZ: writes get EFBIG

    code = ("import numpy as np; from consistency.record import capture;"
            "capture('aux.0', np.ones((64, 1024), np.float32))")
    env = dict(os.environ, CONSISTENCY_RECORD=str(tmp_path / "big.safetensors"), TMPDIR=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, preexec_fn=limit,
                       timeout=300)
    assert "Traceback" not in r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and "could not write the recording (1 tensors, 0.3 MB)" in lines[0]
    assert "no space left" in lines[0]
    assert list(tmp_path.iterdir()) == []  # no truncated file under any name, temporary ones removed


def test_env_recorder_of_numpy_tensors_never_imports_torch(tmp_path):
    """A numpy-only process pays no torch import for the recorder (rank detection included)."""
    out = tmp_path / "np.safetensors"
    # registered before the first capture, so it runs after the recorder's flush at exit (LIFO)
    code = "import atexit, sys; atexit.register(lambda: print('torch' in sys.modules)); " + ENV_CODE.format(v=9)
    env = {k: v for k, v in os.environ.items() if k != "CONSISTENCY_FORCE"}
    env.update(CONSISTENCY_RECORD=str(out))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert r.stdout == "captured\nFalse\n" and _value(out) == 9.0
