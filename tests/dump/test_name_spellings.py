"""Two spellings of one name (``aux.0`` + ``aux.00``, ``model.layers.3`` + ``model.layers.03``)
are refused by every reader, with one line naming the file (exit 2), and never written by any
writer (issue 34 item 4). A reader that keyed on either spelling kept whichever came first or
last: the file's order decided PASS or FAIL. Constructions: a reference whose slots hold
streams [1, 2, 3] and a candidate that holds the right stream under one spelling and a wrong
one under the other, in both orders.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from consistency.dump.writer import write_dump
from consistency.errors import UsageError
from tests.conftest import run_cli

T, H = 12, 16


def _streams() -> list[np.ndarray]:
    rng = np.random.default_rng(3)
    h = [rng.standard_normal((T, H)).astype(np.float32)]
    for _ in range(4):
        h.append(h[-1] + 0.5 * rng.standard_normal((T, H)).astype(np.float32))
    return h


def _reference(tmp: Path) -> Path:
    from consistency.contract.models import AuxInfo, DumpMetadata

    h = _streams()
    return write_dump(tmp / "ref.safetensors", {**{f"hidden.{s}": h[s] for s in range(5)},
                                                **{f"aux.{i}": h[s] for i, s in enumerate((1, 2, 3))}},
                      DumpMetadata(aux=AuxInfo(stream_ids=[1, 2, 3])))


def _refused(r, path: Path, a: str, b: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and path.name in lines[0] and repr(a) in lines[0] and repr(b) in lines[0], r.stderr


@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("right_first", [True, False])
def test_a_torch_archive_with_two_spellings_is_refused(tmp_path, nested, right_first):
    ref, h = _reference(tmp_path), _streams()
    right, wrong = torch.from_numpy(h[1]), torch.from_numpy(h[4])
    pair = [("0", right), ("00", wrong)] if right_first else [("00", wrong), ("0", right)]
    rest = {"1": torch.from_numpy(h[2]), "2": torch.from_numpy(h[3])}
    obj = {"aux": dict(pair + list(rest.items()))} if nested else \
        {f"aux.{k}": v for k, v in pair + list(rest.items())}
    cand = tmp_path / "cand.pt"
    torch.save(obj, cand)
    _refused(run_cli("compare", str(ref), str(cand)), cand, "aux.0", "aux.00")
    out = tmp_path / "out.safetensors"
    _refused(run_cli("convert", str(cand), "-o", str(out)), cand, "aux.0", "aux.00")
    assert not out.exists()  # nothing written


def test_a_dump_with_two_spellings_of_any_name_is_refused(tmp_path):
    """Our own reader refused ``hidden.01`` + ``hidden.1``; other names were kept as two."""
    ref, h = _reference(tmp_path), _streams()
    cand = tmp_path / "cand.npz"
    with open(cand, "wb") as fh:
        np.savez(fh, **{"model.layers.3.mlp": h[3], "model.layers.03.mlp": h[4], "aux.0": h[1]})
    _refused(run_cli("compare", str(ref), str(cand)), cand, "model.layers.03.mlp", "model.layers.3.mlp")


def test_writers_never_write_two_spellings(tmp_path):
    from consistency.dump.reader import open_dump
    from consistency.record import Recorder

    h = _streams()
    out = tmp_path / "w.safetensors"
    with pytest.raises(UsageError, match=r"'aux.0' and 'aux.00' are two spellings"):
        write_dump(out, {"aux.0": h[1], "aux.00": h[4]})
    assert not out.exists()
    rec_out = tmp_path / "rec.safetensors"
    with Recorder(rec_out) as rec:
        rec.capture("model.layers.3.out", h[3])
        rec.capture("model.layers.03.out", h[4])  # refused, said; the recording stays readable
        rec.capture("model.layers.3.out", h[2])  # the same spelling again: a second capture
    with open_dump(rec_out) as d:
        assert sorted(d.tensors) == ["model.layers.3.out", "model.layers.3.out#2"]
        refused = d.metadata.extra["refused_captures"]
        assert list(refused) == ["model.layers.03.out"] and "another spelling" in refused["model.layers.03.out"]["reason"]


# -- stock dumps (the released writers, tests/dump/test_stock_dumps.py) -----------------------------------

@pytest.fixture(scope="module")
def sglang_td(tmp_path_factory):
    from tests.dump.test_stock_dumps import tensor_dump

    out = tmp_path_factory.mktemp("td") / "dump"
    tensor_dump("0.5.5", out)
    return out


@pytest.mark.parametrize("right_first", [True, False])
def test_an_sglang_tensor_dump_with_two_spellings_is_refused(sglang_td, tmp_path, right_first):
    bad = tmp_path / "bad"
    shutil.copytree(sglang_td, bad)
    pas = next(bad.rglob("Pass00000.pt"))
    obj = torch.load(pas, weights_only=True)  # our own test file
    key, twin = "model.layers.3.input_layernorm", "model.layers.03.input_layernorm"
    other = obj["model.layers.5.input_layernorm"]
    items = list(obj.items())
    at = next(i for i, (k, _v) in enumerate(items) if k == key)
    items.insert(at if not right_first else at + 1, (twin, other))
    torch.save(dict(items), pas)
    _refused(run_cli("inspect", str(bad)), pas, key, twin)


def test_two_spellings_of_one_pass_file_are_refused(sglang_td, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(sglang_td, bad)
    rank = next(bad.iterdir())
    shutil.copy(rank / "Pass00001.pt", rank / "Pass000001.pt")  # one pass, two files
    r = run_cli("inspect", str(bad))
    assert r.returncode == 2 and "'Pass000001.pt' and 'Pass00001.pt'" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_an_sglang_dumper_run_with_two_spellings_is_refused(tmp_path):
    from tests.dump.test_stock_dumps import dumper_0523

    d = tmp_path / "d"
    dumper_0523(d, [1, 6, 10])
    src = next(p for p in d.rglob("step=0___*.pt") if "name=non_intrusive__model.layers.3.input_layernorm.output.1_" in p.name)
    twin = src.name.replace("model.layers.3.", "model.layers.03.").replace("dump_index=", "dump_index=9")
    shutil.copy(src, src.parent / twin)
    r = run_cli("inspect", str(d))
    assert r.returncode == 2 and "model.layers.03.input_layernorm.output.1" in r.stderr, r.stderr
    assert "model.layers.3.input_layernorm.output.1" in r.stderr and len(r.stderr.strip().splitlines()) == 1
