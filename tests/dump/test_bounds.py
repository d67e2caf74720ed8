"""Bounds and one-line errors for what used to hang, crash or mislead.

A 5,000-deep ``config.json`` (RecursionError), 40,000 aux ids (lint quadratic: 180 s), a
bound override that is only checked when it is used, a text file that starts like one of
our reports, a file that is not a dump (its first 8 bytes printed as a size), a rank-17
tensor (written, then unreadable), a 300-character tensor name through ``--png``
(ENAMETOOLONG, and the FAIL verdict lost).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import run_cli
from consistency.dump.atomic import TEXT_TRAILER, is_report
from consistency.dump.writer import write_dump
from consistency.errors import UsageError
from tests.lint.test_lint_support import FIX

FIXED = FIX / "drafts" / "sglang" / "kimi-k2.5-eagle3-fixed.json"
TARGET = FIX / "targets" / "kimi-k2.5.json"


def _one_line(r) -> str:  # noqa: ANN001
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    return lines[0]


@pytest.mark.parametrize("where", ["draft", "target"])
def test_a_5000_deep_config_json_is_one_line(tmp_path: Path, where: str) -> None:
    base = (FIXED if where == "draft" else TARGET).read_text().rstrip().rstrip("}")
    deep = tmp_path / "deep.json"
    deep.write_text(base + ', "x": ' + "[" * 5000 + "]" * 5000 + "}")
    args = {"draft": str(FIXED), "target": str(TARGET), where: str(deep)}
    r = run_cli("lint", "--draft", args["draft"], "--target", args["target"], "--runtime", "sglang@0.5.23")
    assert "nested too deeply" in _one_line(r) and str(deep) in r.stderr


def test_40000_aux_ids_are_refused_fast_in_the_config_and_on_the_command_line(tmp_path: Path) -> None:
    cfg = json.loads(FIXED.read_text())
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = list(range(40_000))
    many = tmp_path / "many.json"
    many.write_text(json.dumps(cfg))
    t0 = time.perf_counter()
    r = run_cli("lint", "--draft", str(many), "--target", str(TARGET), "--runtime", "sglang@0.5.23")
    assert "lists 40000 ids; at most 1024" in _one_line(r)
    ids = ",".join(map(str, range(40_000)))
    r = run_cli("lint", "--draft", str(FIXED), "--target", str(TARGET), "--runtime", "sglang@0.5.23",
                "--trained-with", f"stream:{ids}")
    line = _one_line(r)
    assert "40000 ids; at most 1024" in line and len(line) < 300  # the list itself is not echoed
    assert time.perf_counter() - t0 < 30


def test_1024_aux_ids_still_lint_in_linear_time(tmp_path: Path) -> None:
    cfg = json.loads(FIXED.read_text())
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = list(range(1024))
    p = tmp_path / "wide.json"
    p.write_text(json.dumps(cfg))
    t0 = time.perf_counter()
    r = run_cli("lint", "--draft", str(p), "--target", str(TARGET), "--runtime", "sglang@0.5.23", "--trained-with",
                "stream:" + ",".join(map(str, range(1024))), "--format", "json")
    # ids past the model's 61 layers: a one-line usage error naming the valid range, in bounded time
    assert r.returncode == 2 and "fall outside the valid streams (0..61" in r.stderr, r.stderr
    assert time.perf_counter() - t0 < 30


@pytest.mark.parametrize("env,needle", [({"CONSISTENCY_MAX_HEADER_BYTES": "-4"}, "must be positive"),
                                        ({"CONSISTENCY_MAX_META_BYTES": "lots"}, "is not an integer"),
                                        ({"CONSISTENCY_MAX_HEADER_BYTE": "4096"}, "no such bound")])
def test_bound_overrides_are_validated_when_any_command_starts(tmp_path: Path, env: dict, needle: str) -> None:
    # lint reads no dump: the override would never have been consulted
    r = run_cli("lint", "--draft", str(FIXED), "--target", str(TARGET), env=env)
    assert needle in _one_line(r)


def test_every_known_bound_is_consulted_somewhere() -> None:
    from consistency.contract.bounds import KNOWN_BOUNDS, check_bound_overrides

    src = "\n".join(p.read_text() for p in (Path(__file__).parents[2] / "consistency").rglob("*.py"))
    for name in KNOWN_BOUNDS:
        assert f'"MAX_{name}"' in src or f"CONSISTENCY_MAX_{name}" in src.replace("KNOWN_BOUNDS", ""), name
    check_bound_overrides({"CONSISTENCY_MAX_JSON_DEPTH": "128"})
    with pytest.raises(UsageError):
        check_bound_overrides({"CONSISTENCY_MAX_JSON_DEPTH": "0"})


def test_a_note_that_starts_like_a_text_report_is_data(tmp_path: Path) -> None:
    note = tmp_path / "notes.txt"
    note.write_text("consistency compare train.safetensors serve.safetensors: remember to rerun\n")
    assert not is_report(note)
    r = run_cli("lint", "--draft", str(FIXED), "--target", str(TARGET), "-o", str(note))
    assert r.returncode == 2 and "output exists" in r.stderr and note.read_text().startswith("consistency compare")
    out = tmp_path / "lint.txt"
    r = run_cli("lint", "--draft", str(FIXED), "--target", str(TARGET), "-o", str(out))
    assert out.read_text().endswith(TEXT_TRAILER.format(kind="lint") + "\n") and is_report(out)
    r = run_cli("lint", "--draft", str(FIXED), "--target", str(TARGET), "-o", str(out))  # its own report: rewritten
    assert r.returncode in (0, 1), r.stderr


@pytest.mark.parametrize("content,needle", [(b"hello world, a text file\n", "it starts with text, not"),
                                            (b"\x00\x01\x02\x03\x04\x05\x06\x07\x08\x09", "starts with binary data"),
                                            (b"%PDF-1.7\n%\xe2\xe3\xcf\xd3\n", "starts with PDF data")])
def test_a_file_that_is_not_a_dump_is_named_for_what_it_starts_with(tmp_path: Path, content: bytes,
                                                                     needle: str) -> None:
    p = tmp_path / "x.safetensors"
    p.write_bytes(content)
    line = _one_line(run_cli("inspect", str(p)))
    assert "not a safetensors file" in line and needle in line and "claims" not in line
    assert "hello" not in line  # a file's content is never echoed (it may be a secret a symlink points at)


def test_a_rank_17_tensor_is_refused_at_write(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="rank 17"):
        write_dump(tmp_path / "r.safetensors", {"x": np.zeros([1] * 17, np.float32)})
    assert not (tmp_path / "r.safetensors").exists()
    write_dump(tmp_path / "ok.safetensors", {"x": np.zeros([1] * 16, np.float32)})
    assert run_cli("inspect", str(tmp_path / "ok.safetensors")).returncode == 0


def test_png_of_a_300_character_tensor_name_is_written_and_the_verdict_shown(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    name = "n" * 300
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 8)).astype(np.float32)
    write_dump(tmp_path / "r.safetensors", {name: x})
    write_dump(tmp_path / "c.safetensors", {name: x + rng.standard_normal((6, 8)).astype(np.float32)})
    r = run_cli("compare", str(tmp_path / "r.safetensors"), str(tmp_path / "c.safetensors"), "-q",
                "--png", str(tmp_path / "png"))
    assert r.returncode == 1 and r.stdout.startswith("FAIL"), r.stdout + r.stderr
    pngs = sorted(p.name for p in (tmp_path / "png").iterdir())
    assert any(p.startswith("per-token-nnnn") for p in pngs) and all(len(p) < 160 for p in pngs)


def test_a_tensor_of_hostile_row_count_is_refused_at_open(tmp_path: Path) -> None:
    # a deflated 1-D member of 2^25 zeros is a ~130 kB file; compared as 2^25 rows it took GBs
    bomb = tmp_path / "bomb.npz"
    np.savez_compressed(bomb, x=np.zeros(1 << 25, np.float32))
    assert bomb.stat().st_size < 1 << 20
    ok = tmp_path / "ok.npz"
    np.savez(ok, x=np.ones(1000, np.float32))
    r = run_cli("compare", str(bomb), str(bomb))
    line = _one_line(r)
    assert "bomb.npz" in line and "33554432 rows" in line and "CONSISTENCY_MAX_ROWS" in line
    big = tmp_path / "big.npz"
    np.savez(big, x=np.ones(1001, np.float32))
    assert "1001 rows" in _one_line(run_cli("compare", str(ok), str(big), env={"CONSISTENCY_MAX_ROWS": "1000"}))
    r = run_cli("compare", str(ok), str(ok), "--json", "-", env={"CONSISTENCY_MAX_ROWS": "1000"})
    assert r.returncode != 2, r.stderr  # at the bound: compared
    r = run_cli("inspect", str(big), env={"CONSISTENCY_MAX_ROWS": "1000"})
    assert r.returncode == 0 and "big.npz" in r.stdout  # inspect reads any row count (it keeps no per-row state)


def test_every_bound_a_reader_consults_is_known_at_start_up() -> None:
    """An override of a bound the start-up check does not know is refused as 'no such bound':
    every env_limit("MAX_...") in the source must be in KNOWN_BOUNDS (and documented)."""
    import re

    from consistency.contract.bounds import KNOWN_BOUNDS

    root = Path(__file__).resolve().parents[2]
    used = {m for p in (root / "consistency").rglob("*.py")
            for m in re.findall(r'env_limit\(\s*"MAX_([A-Z_]+)"', p.read_text())}
    assert used and used <= set(KNOWN_BOUNDS), sorted(used - set(KNOWN_BOUNDS))
    security = (root / "docs" / "security.md").read_text()
    assert all(f"CONSISTENCY_MAX_{b}" in security for b in KNOWN_BOUNDS), \
        [b for b in KNOWN_BOUNDS if f"CONSISTENCY_MAX_{b}" not in security]
