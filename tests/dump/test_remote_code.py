"""Model and tokenizer directories never run their own code, never prompt, and are bounded.

A directory may declare classes of its own (``auto_map``) beside a ``.py`` file; left to its
defaults, transformers asks on stdin and runs that file on ``y``. Here the file writes a
marker when imported. A positive control loads the same directory with
``trust_remote_code=True`` and sees the marker appear, so its absence elsewhere means
something. Each entry point that loads a directory (``compare --tokenizer``, ``record
--model``, ``replay --target``) is run through the real CLI.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers")

from tests.conftest import run_cli  # noqa: E402
from consistency.dump.writer import write_dump  # noqa: E402

EVIL = """
import os
open(os.environ["MARKER"], "w").write("ran")
from transformers import PreTrainedTokenizerFast, LlamaConfig, LlamaForCausalLM
class EvilTokenizer(PreTrainedTokenizerFast):
    pass
class EvilConfig(LlamaConfig):
    model_type = "evil"
class EvilModel(LlamaForCausalLM):
    config_class = EvilConfig
"""


def _tokenizer_dir(d: Path, custom_class: bool) -> Path:
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(16)}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")),
                                  unk_token="t0")
    tok.save_pretrained(d)
    cfg_path = d / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["auto_map"] = {"AutoTokenizer": ["evil.EvilTokenizer", "evil.EvilTokenizer"]}
    if custom_class:
        cfg["tokenizer_class"] = "EvilTokenizer"
    cfg_path.write_text(json.dumps(cfg))
    (d / "evil.py").write_text(EVIL)
    return d


def _env(marker: Path, tmp: Path) -> dict[str, str]:
    """A child's environment: the marker's path, offline, and transformers' module cache in
    the test's directory (a positive control that runs the code leaves nothing in $HOME)."""
    return {**os.environ, "MARKER": str(marker), "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp / "hf-modules")}


@pytest.mark.parametrize("custom_class", [False, True])
def test_a_tokenizer_dir_with_its_own_code_never_runs_it(tmp_path: Path, custom_class: bool) -> None:
    d = _tokenizer_dir(tmp_path / "tok", custom_class)
    marker = tmp_path / "PWNED"
    ref, cand = tmp_path / "r.safetensors", tmp_path / "c.safetensors"
    write_dump(ref, {"input_ids": np.arange(8, dtype=np.int64), "aux.0": np.ones((8, 4), np.float32)})
    write_dump(cand, {"input_ids": np.arange(1, 9, dtype=np.int64), "aux.0": np.ones((8, 4), np.float32)})
    argv = ["compare", str(ref), str(cand), "--tokenizer", str(d), "--json", "-"]
    if custom_class:  # a fresh process with stdin closed: transformers' prompt would show, or hang
        r = subprocess.run([sys.executable, "-m", "consistency", *argv], capture_output=True, text=True,
                           env=_env(marker, tmp_path), stdin=subprocess.DEVNULL, timeout=300)
    else:  # transformers' own class serves it: in this process (the code is never imported either way)
        r = run_cli(*argv, env={"MARKER": str(marker)})
    assert not marker.exists(), "the directory's code ran"
    assert "Traceback" not in r.stderr and "[y/N]" not in r.stdout + r.stderr
    if custom_class:  # it cannot load without the code: one line, exit 2
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1, r.stderr
        assert "never runs code from a model or tokenizer directory" in lines[0] and "auto_map" in lines[0]
        assert r.stdout == ""  # --json - stays clean
    else:  # transformers' own class serves it; the code is ignored
        assert r.returncode in (0, 1), r.stderr
        json.loads(r.stdout)


def test_positive_control_the_payload_is_live(tmp_path: Path) -> None:
    d = _tokenizer_dir(tmp_path / "tok", True)
    marker = tmp_path / "PWNED"
    code = ("import sys; from transformers import AutoTokenizer; "
            "AutoTokenizer.from_pretrained(sys.argv[1], trust_remote_code=True, local_files_only=True)")
    subprocess.run([sys.executable, "-c", code, str(d)], env=_env(marker, tmp_path), capture_output=True, timeout=300)
    assert marker.exists()


def _model_dir(d: Path) -> Path:
    d.mkdir()
    cfg = {"model_type": "evil", "architectures": ["EvilModel"], "vocab_size": 32, "hidden_size": 16,
           "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
           "auto_map": {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}}
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "evil.py").write_text(EVIL)
    return d


def test_record_model_and_replay_target_with_their_own_code_are_refused_in_one_line(tmp_path: Path) -> None:
    d = _model_dir(tmp_path / "model")
    marker = tmp_path / "PWNED"
    env = {"MARKER": str(marker), "HF_HUB_OFFLINE": "1"}
    r = run_cli("record", "--model", str(d), "--prompt", "hello", "-o", str(tmp_path / "o.safetensors"), env=env)
    assert not marker.exists()
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "never runs code from a model or tokenizer directory" in r.stderr
    ref = tmp_path / "r.safetensors"
    write_dump(ref, {"aux.0": np.ones((4, 16), np.float32)})
    r = run_cli("replay", "--draft", "tiny-llama-eagle3", "--target", str(d), str(ref), str(ref), env=env)
    assert not marker.exists()
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr


def test_tokenizer_files_are_bounded_before_parsing(tmp_path: Path) -> None:
    d = _tokenizer_dir(tmp_path / "tok", False)
    ref = tmp_path / "r.safetensors"
    write_dump(ref, {"input_ids": np.arange(8, dtype=np.int64), "aux.0": np.ones((8, 4), np.float32)})
    r = run_cli("compare", str(ref), str(ref), "--tokenizer", str(d),
                env={"CONSISTENCY_MAX_TOKENIZER_BYTES": "100"})
    assert r.returncode == 2 and "tokenizer files are over 100 bytes" in r.stderr, r.stderr


def test_a_known_model_with_auto_maps_in_both_configs_runs_no_code_and_names_the_right_one(tmp_path: Path) -> None:
    """A Llama directory (real weights) whose config.json *and* tokenizer_config.json carry an
    ``auto_map``, the tokenizer's class existing only in the directory's code: nothing runs,
    one line, and it names tokenizer_config.json's auto_map (it named config.json's)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    d = tmp_path / "model"
    cfg = LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2)
    LlamaForCausalLM(cfg).save_pretrained(d)
    _tokenizer_dir(d, custom_class=True)
    c = json.loads((d / "config.json").read_text())
    c["auto_map"] = {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}
    (d / "config.json").write_text(json.dumps(c))
    marker = tmp_path / "PWNED"
    r = subprocess.run([sys.executable, "-m", "consistency", "record", "--model", str(d), "--prompt", "t1 t2",
                        "-o", str(tmp_path / "o.safetensors")], capture_output=True, text=True,
                       env=_env(marker, tmp_path), stdin=subprocess.DEVNULL, timeout=300, cwd=tmp_path)
    assert not marker.exists(), "the directory's code ran"
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "tokenizer_config.json auto_map (AutoTokenizer)" in lines[0] and "never runs code" in lines[0], lines[0]
