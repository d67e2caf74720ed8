"""The file patches and the monkey patch capture the same tensors, and nothing when off.

Both run on models with the upstream structure (tests/record/test_patch_models.py): the released
SGLang/vLLM forward methods, verbatim, with the patch from patches/ applied for (a) and the
unpatched method plus ``consistency.record.patch.install`` for (b).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from consistency.pipeline.compare import compare as run_compare
from consistency.dump.reader import open_dump
from consistency.record import Recorder, recorder
from consistency.record.api import record_reference
from consistency.record.hf import capture_streams
from consistency.record.patch import ENV_COMPONENTS, ENV_TOKENS, find_inner, install
from tests.conftest import prompt_ids, tiny
from tests.record.test_patch_models import CASES, InnerModel, run

N = 12
ENV = "CONSISTENCY_RECORD"
# streams each loop can capture: classic SGLang cannot take stream 0 (residual is None) nor N;
# boundary SGLang takes 0 but not N; vLLM's mixin takes 0..N; vLLM DeepSeek takes 1..N.
CAPTURE = {"sglang-classic-llama": [2, 6, 9], "sglang-classic-deepseek_v2": [2, 6, 9],
           "sglang-boundary-llama": [0, 6, 9], "sglang-boundary-deepseek_v2": [0, 6, 9],
           "vllm-llama": [0, 6, 9, N], "vllm-deepseek_v2": [2, 6, N]}
CLASSIC = [c for c in CASES if "boundary" not in c]


def _ids(t: int = 20) -> torch.Tensor:
    return torch.as_tensor(prompt_ids(tiny("tiny-llama"), t))


# _ids() for a child process, without importing this module (and the compare pipeline it
# imports: ~3 CPU-s of a child's ~8)
CHILD_IDS = ("from tests.conftest import prompt_ids, tiny;"
             "_ids = lambda t=20: torch.as_tensor(prompt_ids(tiny('tiny-llama'), t));")


def _record(model: InnerModel, path: Path, *inputs: torch.Tensor) -> dict[str, tuple[np.ndarray, str]]:
    with Recorder(path) as rec:
        for ids in inputs:
            run(model, ids)
    return dict(rec.tensors)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("components", [False, True])
def test_monkey_patch_captures_what_the_file_patch_captures(case, components, tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, str(tmp_path / "unused.safetensors"))
    monkeypatch.setenv(ENV_COMPONENTS, "1" if components else "0")
    caps, ids = CAPTURE[case], _ids()
    patched = InnerModel(case, True, caps)
    assert patched.applied >= 2  # the patch's hunks landed in the quoted upstream methods
    a = _record(patched, tmp_path / "a.safetensors", ids)
    plain = InnerModel(case, False, caps)
    inst = install(plain)
    assert inst is not None
    b = _record(plain, tmp_path / "b.safetensors", ids)
    inst.remove()
    assert set(a) == set(b)
    for name in a:
        assert a[name][1] == b[name][1] and np.array_equal(a[name][0], b[name][0]), name
    streams, _ = capture_streams(tiny("tiny-llama"), ids[None])
    assert np.array_equal(a["input_ids"][0], ids.numpy())
    for k, s in enumerate(caps):  # what the draft receives: the streams the loop captures at
        assert np.allclose(a[f"aux.{k}"][0], streams[f"hidden.{s}"][0].numpy(), atol=1e-5), (case, k)
    comps = {n for n in a if n.count(".") == 2}
    if not components or case not in CLASSIC:
        assert not comps  # boundary layers keep the residual inside the stage: no parts to take
        return
    for k, s in enumerate(caps):
        h = a[f"aux.{k}.hidden_states"][0]
        if s == 0:
            assert f"aux.{k}.residual" not in a and np.array_equal(h, a[f"aux.{k}"][0])
            continue
        # hidden_states alone is the MLP's delta of layer s-1: what a .clone() would feed
        assert np.allclose(h, streams[f"mlp_out.{s - 1}"][0].numpy(), atol=1e-5), (case, k)
        assert np.allclose(h + a[f"aux.{k}.residual"][0], a[f"aux.{k}"][0], atol=1e-5)


@pytest.mark.parametrize("case", list(CASES))
def test_nothing_is_captured_when_the_variable_is_unset(case, tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    caps, ids = CAPTURE[case], _ids()
    plain = InnerModel(case, False, caps)
    assert install(plain) is None  # installs nothing at all
    hooks = [m for m in plain.modules() if m._forward_hooks or m._forward_pre_hooks]
    assert not hooks
    patched = InnerModel(case, True, caps)
    assert recorder.active() is None
    out_p, out_u = run(patched, ids), run(plain, ids)
    assert recorder.active() is None  # the patch never created a recorder
    assert torch.equal(out_p[0], out_u[0])  # and changed nothing in the forward
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_env_activated_patch_writes_the_first_matching_forward(tmp_path):
    """A server process: the patched model file runs; the dump appears only with the variable,
    as soon as the next forward starts (os._exit: no atexit, like a server that is killed)."""
    out = tmp_path / "serve.safetensors"
    code = ("import os, torch; from tests.record.test_patch_models import InnerModel, run;" + CHILD_IDS +
            "m = InnerModel('sglang-classic-llama', True, [2, 6, 9]); run(m, _ids(7)); run(m, _ids());"
            "run(m, _ids()); run(m, _ids(1)); os._exit(0)")
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("CONSISTENCY_")}
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root, env=env)
    assert not out.exists() and not list(tmp_path.iterdir())
    env.update({ENV: str(out), ENV_TOKENS: "20", "CONSISTENCY_SIDE": "serving", "CONSISTENCY_RUNTIME": "sglang"})
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root, env=env)
    with open_dump(out) as d:  # the 7-token warm-up was skipped; the first 20-token forward only, no '#2'
        assert set(d.tensors) == {"input_ids", "positions", "aux.0", "aux.1", "aux.2"}
        assert d.metadata.side == "serving" and d["aux.0"].shape == (20, 64)
        assert d["positions"].read_all().tolist() == list(range(20))  # the engine's own positions argument


def test_token_filter_skips_warmup_and_decode(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, str(tmp_path / "x.safetensors"))
    monkeypatch.setenv(ENV_TOKENS, "20")
    plain = InnerModel("vllm-llama", False, CAPTURE["vllm-llama"])
    install(plain)
    got = _record(plain, tmp_path / "r.safetensors", _ids(5), _ids(20), _ids(1))
    assert set(got) == {"input_ids", "positions", "aux.0", "aux.1", "aux.2", "aux.3"} and got["aux.0"][0].shape == (20, 64)


def test_install_finds_the_inner_model_and_claims_its_streams(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, str(tmp_path / "x.safetensors"))
    inner = InnerModel("sglang-classic-llama", False, [3, 7, 10])
    outer = torch.nn.Module()
    outer.model = inner  # SGLang/vLLM *ForCausalLM keeps the inner model in .model
    assert find_inner(outer) == (inner, "layers_to_capture")
    install(outer)
    with Recorder(tmp_path / "s.safetensors") as rec:
        run(inner, _ids())
    assert rec.metadata.aux.stream_ids == [3, 7, 10] and rec.metadata.aux.convention == "sglang-internal"
    with pytest.raises(ValueError, match="layers_to_capture"):
        find_inner(tiny("tiny-llama"))


def test_monkey_patched_capture_compares_against_training(tmp_path, monkeypatch):
    """End to end: training dump (HF hooks) vs what the patched runtime feeds the draft."""
    monkeypatch.setenv(ENV, str(tmp_path / "x.safetensors"))
    ids = _ids(32)
    ref = record_reference(tiny("tiny-llama"), ids.numpy(), tmp_path / "train.safetensors", [2, 6, 9])
    for caps, verdict in (([2, 6, 9], "pass"), ([3, 7, 10], "fail")):  # the second: SGLang's +1 on stream ids
        model = InnerModel("sglang-classic-llama", False, caps)
        inst = install(model)
        out = tmp_path / f"serve{caps[0]}.safetensors"
        with Recorder(out):
            run(model, ids)
        inst.remove()
        rep = run_compare(str(ref), str(out))
        assert rep.verdict == verdict, rep.summary
        if verdict == "fail":
            assert {f.code for f in rep.findings} >= {"LAYER_OFFSET", "LAYER_MISMATCH"}


@pytest.mark.slow
def test_autopatch_records_a_process_nobody_edited(tmp_path):
    """sitecustomize on PYTHONPATH: classes are patched as they are imported, in any process."""
    import os

    out = tmp_path / "serve.safetensors"
    root = Path(__file__).resolve().parents[2]
    site = subprocess.run([sys.executable, "-m", "consistency.record.autopatch"], capture_output=True, text=True,
                          check=True, cwd=root).stdout.strip()
    code = ("import sitecustomize, torch; from tests.record.test_patch_models import InnerModel, run;" + CHILD_IDS +
            "m = InnerModel('vllm-llama', False, [0, 6, 9, 12]); run(m, _ids(3)); run(m, _ids());"
            "print(hasattr(type(m).__init__, '__wrapped__'), sitecustomize.__file__)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONSISTENCY_")}
    env["PYTHONPATH"] = os.pathsep.join([site, str(root)])
    r = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, check=False)
    assert r.returncode == 0 and r.stdout.split()[0] == "False" and not out.exists()  # inert: nothing patched
    env.update({ENV: str(out), ENV_TOKENS: "20", ENV_COMPONENTS: "1",
                "CONSISTENCY_RECORD_CLASSES": "tests.record.test_patch_models:InnerModel"})
    r = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[0] == "True" and r.stdout.split()[1].startswith(site)
    with open_dump(out) as d:
        assert {"input_ids", "aux.0", "aux.3", "aux.1.residual", "aux.3.hidden_states"} <= set(d.tensors)
        assert d.metadata.aux.stream_ids == [0, 6, 9, 12] and d.metadata.aux.convention == "vllm"
        assert d["aux.0"].shape == (20, 64)
