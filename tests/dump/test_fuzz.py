"""Short fuzz runs (seconds) of both loaders and the metadata/contract parsers; the long run is bench/fuzz_loaders.py.

Property: every input ends in a result or a clean ConsistencyError -- no other exception,
no leaked file descriptor (checked per input), no hang (hypothesis deadline off, but the
atheris run has a per-input timeout and an RSS limit).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from consistency.contract.io import safe_yaml, strict_json
from fixtures.hostile import fuzz as fz
from tests.conftest import ROOT

SEEDS = fz.seeds()
FAST = settings(max_examples=120, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])


@FAST
@given(fz.safetensors_files())
def test_structured_safetensors(data):
    assert fz.checked(lambda: fz.load_dump_bytes(data, ".safetensors")) in ("ok", "refused")


@FAST
@given(fz.mutated(SEEDS["safetensors"]))
def test_mutated_safetensors(data):
    assert fz.checked(lambda: fz.load_dump_bytes(data, ".safetensors")) in ("ok", "refused")


@FAST
@given(fz.npz_files())
def test_structured_npz(data):
    assert fz.checked(lambda: fz.load_dump_bytes(data, ".npz")) in ("ok", "refused")


@FAST
@given(fz.mutated(SEEDS["npz"]))
def test_mutated_npz(data):
    assert fz.checked(lambda: fz.load_dump_bytes(data, ".npz")) in ("ok", "refused")


@FAST
@given(st.binary(max_size=300), st.sampled_from([".safetensors", ".npz"]))
def test_random_bytes(data, suffix):
    assert fz.checked(lambda: fz.load_dump_bytes(data, suffix)) == "refused"  # no random bytes make a dump


@FAST
@given(fz.metadata_texts())
def test_metadata_parser(text):
    assert fz.parse_metadata_text(text) in ("ok", "refused")


@FAST
@given(fz.mutated(SEEDS["contract_json"] + SEEDS["contract_yaml"]), st.sampled_from(["contract_json", "contract_yaml"]))
def test_contract_parser(data, kind):
    assert fz.checked(lambda: fz.run_kind(kind, data)) in ("ok", "refused")


@FAST
@given(st.text(max_size=200) | fz.json_values.map(lambda v: json.dumps(v, allow_nan=True)))
def test_strict_json_raises_only_value_error(text):
    try:
        obj = strict_json(text)
    except ValueError:
        return
    assert json.loads(json.dumps(obj, allow_nan=False)) == obj  # what it accepts is plain, finite JSON


def _plain(x: object) -> bool:
    """JSON data our models take: str without control characters, int64, finite float, bool, None."""
    import math

    if isinstance(x, dict):
        return all(_plain(k) and _plain(v) for k, v in x.items())
    if isinstance(x, list):
        return all(_plain(v) for v in x)
    if isinstance(x, float):
        return math.isfinite(x)
    if isinstance(x, int):
        return abs(x) < 2**63
    if isinstance(x, str):
        return all(c in "\t\n\r" or (ord(c) >= 0x20 and not 0x7f <= ord(c) < 0xa0) for c in x)
    return x is None


_YAML_BITS = st.sampled_from(["a: 1\n", "- x\n", "d: 2020-01-01\n", "n: .nan\n", "i: .inf\n", "b: !!binary aGk=\n",
                              "s: !!set {a, b}\n", "big: 99999999999999999999\n", "k: [1, {x: y}]\n", "e: \"\\x1b[31m\"\n",
                              "t: 12:30:45\n", "? [a]\n: v\n"])


@FAST
@given(st.text(max_size=200) | st.lists(_YAML_BITS, min_size=1, max_size=6).map("".join)
       | fz.json_values.map(lambda v: json.dumps(v, allow_nan=True)))
def test_safe_yaml_raises_only_value_error_and_accepts_only_plain_data(text):
    try:
        obj = safe_yaml(text)
    except ValueError:
        return
    assert _plain(obj), (text, obj)  # no date, set, bytes, NaN, huge int or terminal escape gets through


def test_yaml_alias_bomb_and_deep_nesting_are_refused_fast():
    lol = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n" for p, c in zip("abcdefgh", "bcdefghi"))
    with pytest.raises(ValueError, match="aliases"):
        safe_yaml(lol)
    with pytest.raises(ValueError, match="nested too deeply"):
        safe_yaml("[" * 5000 + "]" * 5000)
    with pytest.raises(ValueError, match="nested too deeply"):
        strict_json("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match="not a finite number"):
        safe_yaml("x: .nan")


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("atheris") is None, reason="atheris is not installed")
def test_coverage_guided_fuzzing_with_atheris_finds_nothing(tmp_path):
    out = tmp_path / "fuzz.json"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "fuzz_loaders.py"), "--engine", "atheris", "--seconds",
                        "8", "--json", str(out), "--artifacts", str(tmp_path / "crashes")],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    row = json.loads(out.read_text())["rows"][0]
    assert row["exit_code"] == 0 and row["inputs"] > 1000 and row["coverage"] > 100, row
    assert not list((tmp_path / "crashes").glob("crash-*"))


@FAST
@given(st.text(max_size=40), st.dictionaries(st.text(max_size=6), fz.json_values, max_size=3),
       st.dictionaries(st.text(st.characters(min_codepoint=32, max_codepoint=126), min_size=1, max_size=6).filter(
           lambda k: k != "consistency"), st.text(max_size=10), max_size=2), st.sampled_from([".safetensors", ".npz"]))
def test_what_the_writer_writes_the_reader_reads(prompt, extra, header, suffix):
    """A recording is never lost to a stray character, and never written unreadable."""
    import tempfile
    from pathlib import Path

    import numpy as np

    from consistency.contract.models import DumpMetadata
    from consistency.dump.reader import open_dump
    from consistency.dump.writer import write_dump

    with tempfile.TemporaryDirectory(dir=fz.scratch_dir()) as td:
        p = write_dump(Path(td) / f"d{suffix}", {"hidden.1": np.ones((2, 3), np.float32)},
                       DumpMetadata(prompt=prompt, extra=extra), extra_header=header)
        with open_dump(p) as d:
            assert d.metadata is not None and d["hidden.1"].read_all().sum() == 6
            if prompt.isprintable():
                assert d.metadata.prompt == prompt
