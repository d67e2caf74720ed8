"""speculators and SpecForge training files, read as dumps and compared with a serving dump.

The files are produced the way those projects produce them:

* speculators ``hs_{i}.safetensors``: vLLM's ``ExampleHiddenStatesConnector`` saves
  ``save_file({"hidden_states": torch.stack(aux, dim=1), "token_ids": ids}, filename)``
  (``example_hidden_states_connector.py``; the stack is ``v1/spec_decode/extract_hidden_states.py``);
  the aux list comes from a vLLM-style fused-residual loop (stream N appended).
* SpecForge ``data_{i}.ckpt[.gz]``: ``prepare_hidden_states.py`` saves the record dict with
  ``torch.save`` inside ``gzip.open(path, "wb", compresslevel=6)`` (or to the path);
  ``aux_hidden_state`` is SGLang's concatenated aux list (+1 ids), ``hidden_state`` its
  post-norm last state.

Same calls, same torch: the same bytes as those tools write.
"""

from __future__ import annotations

import gzip
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from consistency.pipeline.compare import compare as run_compare
from consistency.dump.formats import detect
from consistency.dump.reader import open_dump
from consistency.dump.sets import open_side
from consistency.errors import InputError, UsageError
from consistency.record.api import record_serving
from consistency.record.fused import FusedDecoder
from tests.conftest import twin, cli, cli_batch, prompt_ids, run_cli, tiny

N = 12  # tiny-llama layers
T = 40


def _ids() -> torch.Tensor:
    return torch.as_tensor(prompt_ids(tiny("tiny-llama"), T))


def write_hs(path: Path, streams: list[int], dtype: torch.dtype = torch.bfloat16) -> Path:
    """vLLM extract_hidden_states + ExampleHiddenStatesConnector, on a fused-residual loop."""
    m = tiny("tiny-llama").to(dtype)
    ids = _ids()
    _final, aux = FusedDecoder(m, streams)(ids[None])
    hidden_states = torch.stack([a[0] for a in aux], dim=1)  # [T, n, H], capture (ascending) order
    save_file({"hidden_states": hidden_states.contiguous(), "token_ids": ids.clone()}, str(path))
    return path


def specforge_record(sglang_ids: list[int], dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """What prepare_hidden_states.py persists for one sample (eagle3 OfflineCaptureLayout)."""
    m = tiny("tiny-llama").to(dtype)
    ids = _ids()
    layers_to_capture = [j + 1 for j in sglang_ids]  # SGLang set_eagle3_layers_to_capture
    final, aux = FusedDecoder(m, layers_to_capture)(ids[None])
    aux_hidden_states = torch.cat(aux, dim=-1)[0]  # logits processor: cat on the last dim
    return {"input_ids": ids.clone(), "loss_mask": torch.ones(T, dtype=torch.long),
            "aux_hidden_state": aux_hidden_states.cpu().clone().unsqueeze(0),
            "hidden_state": final[0].cpu().clone().unsqueeze(0)}


def write_specforge(path: Path, record: dict, compress: bool) -> Path:
    if compress:
        with gzip.open(path, "wb", compresslevel=6) as f:
            torch.save(record, f)
    else:
        torch.save(record, path)
    return path


def serving(path: Path, streams: list[int], runtime: str, native: list[int]) -> Path:
    return record_serving(tiny("tiny-llama"), _ids().numpy(), path, streams, native_ids=native, convention=runtime,
                          runtime=runtime, dtype="bfloat16")


def _codes(rep) -> dict[str, list[str]]:  # noqa: ANN001
    out: dict[str, list[str]] = {}
    for f in rep.findings:
        out.setdefault(f.code, []).append(f.tensor or "")
    return out


# -- speculators -------------------------------------------------------------------------------

def test_speculators_file_maps_names_streams_and_values(tmp_path):
    p = write_hs(tmp_path / "hs_0.safetensors", [2, 6, 9, N])
    assert detect(p).name == "speculators"
    raw = __import__("safetensors.torch", fromlist=["load_file"]).load_file(str(p))
    with open_side(p, [2, 6, 9, N], "speculators") as d:
        assert set(d.tensors) == {"input_ids", "aux.0", "aux.1", "aux.2", f"hidden.{N}"}
        assert d.metadata.aux.stream_ids == [2, 6, 9] and d.metadata.side == "training"
        for i in range(3):
            assert np.array_equal(d[f"aux.{i}"].rows_float(0, T), raw["hidden_states"][:, i].float().numpy())
            assert d[f"aux.{i}"].dtype == "bfloat16" and d[f"aux.{i}"].shape == (T, 64)
        assert np.array_equal(d[f"hidden.{N}"].rows_float(0, T), raw["hidden_states"][:, 3].float().numpy())
        assert np.array_equal(d["input_ids"].read_all(), raw["token_ids"].numpy())
    with open_side(p) as d:  # no ids: values mapped, no stream claims, speculators' own name for the last slot
        assert d.metadata.aux is None and "verifier_last_hidden_states" in d.tensors
    with open_side(p, [9, 2, 6], "vllm") as d:  # training's --target-layer-ids, any order: vLLM sorts
        assert d.metadata.aux.stream_ids == [2, 6, 9] and "verifier_last_hidden_states" in d.tensors
        assert any("reordered" in n for n in d.notes)


def test_speculators_reader_sees_what_speculators_trainer_sees(tmp_path):
    """hs_connectors' FileTransfer + speculators' split ([:, :-1] aux, [:, -1] target)."""
    transfer = pytest.importorskip("hs_connectors.transfer")
    offline = pytest.importorskip("speculators.data_generation.offline")
    write_hs(tmp_path / "hs_0.safetensors", [2, 6, 9, N])
    loaded = transfer.FileTransfer(tmp_path).get_cached(0)
    offline.check_hidden_states(loaded, _ids().tolist())  # speculators' own validation accepts the file
    aux = loaded["hidden_states"][:, :-1].flatten(1)
    with open_side(tmp_path / "hs_0.safetensors", [2, 6, 9, N]) as d:
        ours = np.concatenate([d[f"aux.{i}"].rows_float(0, T) for i in range(3)], axis=1)
        assert np.array_equal(ours, aux.float().numpy())
        assert np.array_equal(d[f"hidden.{N}"].rows_float(0, T), loaded["hidden_states"][:, -1].float().numpy())


def test_speculators_against_serving_pass_and_sglang_plus_one(tmp_path):
    hs = write_hs(tmp_path / "hs_0.safetensors", [9, 10, 11, N])
    ok = serving(tmp_path / "vllm.safetensors", [9, 10, 11], "vllm", [9, 10, 11])
    rep = run_compare(str(hs), str(ok), layer_ids=f"9,10,11,{N}", convention="speculators")
    assert rep.verdict == "pass", rep.summary
    assert [f.tensor for f in rep.findings if f.code == "OK"] == ["aux.0", "aux.1", "aux.2", "input_ids"]
    # the same draft config ids on SGLang's Llama model file: +1 -> streams 10, 11, 12
    off = serving(tmp_path / "sglang.safetensors", [10, 11, 12], "sglang@0.5.5", [9, 10, 11])
    rep = run_compare(str(hs), str(off), layer_ids=f"9,10,11,{N}", convention="speculators")
    assert rep.verdict == "fail"
    offset = [f for f in rep.findings if f.code == "LAYER_OFFSET"]
    assert len(offset) == 1 and offset[0].evidence["offset"] == 1
    assert offset[0].evidence["expected"] == [9, 10, 11] and offset[0].evidence["actual"] == [10, 11, 12]
    mism = {f.tensor: f for f in rep.findings if f.code == "LAYER_MISMATCH"}
    assert set(mism) == {"aux.0", "aux.1", "aux.2"}
    assert mism["aux.2"].identified_as == f"hidden.{N}"  # the appended last state proves slot 2
    assert [mism[f"aux.{i}"].evidence["stream"] for i in range(3)] == [10, 11, 12]


def test_speculators_fp8_file_is_dequantized_per_token(tmp_path):
    fp8 = pytest.importorskip("hs_connectors.fp8_utils")
    src = write_hs(tmp_path / "bf16.safetensors", [2, 6, 9, N])
    from safetensors.torch import load_file

    t = load_file(str(src))
    q, scale = fp8.quantize_tensor_to_fp8(t["hidden_states"])  # FP8HiddenStatesConnector._write_tensors
    p = tmp_path / "hs_0.safetensors"
    save_file({**t, "hidden_states": q, fp8.SCALES_KEY: scale}, str(p))
    want = fp8.dequantize_fp8_tensor(q, scale, torch.float32)
    with open_side(p, [2, 6, 9, N]) as d:
        assert d["aux.1"].dtype == "float8_e4m3fn"
        assert np.allclose(d["aux.1"].rows_float(0, T), want[:, 1].numpy(), rtol=1e-6, atol=0)
    ok = serving(tmp_path / "vllm.safetensors", [2, 6, 9], "vllm", [2, 6, 9])
    assert run_compare(str(p), str(ok), layer_ids=f"2,6,9,{N}").verdict == "pass"
    wrong = serving(tmp_path / "wrong.safetensors", [3, 6, 9], "vllm", [3, 6, 9])
    assert run_compare(str(p), str(wrong), layer_ids=f"2,6,9,{N}").verdict == "fail"


# -- SpecForge ---------------------------------------------------------------------------------

@pytest.mark.parametrize("compress", [True, False])
def test_specforge_file_maps_names_and_streams(tmp_path, compress):
    rec = specforge_record([8, 9, 10])
    p = write_specforge(tmp_path / ("data_0.ckpt.gz" if compress else "data_0.ckpt"), rec, compress)
    assert detect(p).name == "specforge"
    with open_side(p, [8, 9, 10], "specforge") as d:
        assert set(d.tensors) == {"input_ids", "loss_mask", "aux.0", "aux.1", "aux.2", "final_norm"}
        assert d.metadata.aux.stream_ids == [9, 10, 11] and d.metadata.aux.native_ids == [8, 9, 10]
        assert d.metadata.tensors["final_norm"].norm.value == "final_norm"
        assert np.array_equal(d["aux.2"].rows_float(0, T), rec["aux_hidden_state"][0, :, 128:].float().numpy())
        assert np.array_equal(d["final_norm"].rows_float(0, T), rec["hidden_state"][0].float().numpy())
        assert d["input_ids"].read_all().tolist() == rec["input_ids"].tolist()


def test_specforge_against_serving(tmp_path):
    p = write_specforge(tmp_path / "data_0.ckpt.gz", specforge_record([8, 9, 10]), True)
    ok = serving(tmp_path / "sglang.safetensors", [9, 10, 11], "sglang@0.5.5", [8, 9, 10])
    rep = run_compare(str(p), str(ok), layer_ids="8,9,10", convention="specforge")
    assert rep.verdict == "pass", rep.summary
    # the exported draft's nested ids read as stream ids (vLLM V1 >= 0.22): one layer early
    early = serving(tmp_path / "vllm.safetensors", [8, 9, 10], "vllm", [8, 9, 10])
    rep = run_compare(str(p), str(early), layer_ids="8,9,10", convention="specforge")
    assert rep.verdict == "fail"
    mism = {f.tensor: f for f in rep.findings if f.code == "LAYER_MISMATCH"}
    assert mism["aux.1"].evidence["stream"] == 9 and mism["aux.1"].evidence["offset"] == -1
    assert mism["aux.2"].evidence["stream"] == 10 and mism["aux.2"].evidence["offset"] == -1
    assert "OK" not in {f.code for f in rep.findings if f.tensor == "aux.0"}


def test_specforge_without_ids_sizes_slots_from_hidden_state(tmp_path):
    p = write_specforge(tmp_path / "data_0.ckpt", specforge_record([1, 5, 8]), False)
    with open_side(p) as d:
        assert [n for n in d.names if n.startswith("aux")] == ["aux.0", "aux.1", "aux.2"]
        assert d.metadata.aux is None
    with pytest.raises(InputError, match="cannot split|do not split"):
        open_side(p, [1, 5], "specforge")


# -- hostile and broken files ----------------------------------------------------------------------

class _Payload:
    """Unpickling this creates a marker file: proof that pickle ran."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: ANN204
        return (Path.touch, (Path(self.marker),))


MALICIOUS = ["zip", "zip.gz", "legacy", "raw-pickle"]


@pytest.fixture(scope="module")
def malicious(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path, object]]:
    """One hostile SpecForge checkpoint per way of writing one, each aiming at its own marker;
    ``compare`` runs on all four in one fresh process (never this one), one run per file."""
    out = {}
    for how in MALICIOUS:
        d = tmp_path_factory.mktemp(how)
        marker = d / "pwned"
        rec = {"aux_hidden_state": torch.zeros(1, 4, 24), "evil": _Payload(str(marker))}
        p = d / ("data_0.ckpt.gz" if how == "zip.gz" else "data_0.ckpt")
        if how == "zip":
            torch.save(rec, p)
        elif how == "zip.gz":
            with gzip.open(p, "wb") as f:
                torch.save(rec, f)
        elif how == "legacy":
            torch.save(rec, p, _use_new_zipfile_serialization=False)
        else:
            p.write_bytes(pickle.dumps(rec))
        out[how] = (p, marker)
    runs = cli_batch(*(["compare", str(p), str(twin(p)), "--layer-ids", "1,2,3"] for p, _m in out.values()))
    return {how: (p, marker, r) for (how, (p, marker)), r in zip(out.items(), runs, strict=True)}


@pytest.mark.parametrize("how", MALICIOUS)
def test_malicious_ckpt_never_executes(malicious, how):
    p, marker, r = malicious[how]
    assert not marker.exists()  # the CLI run (another process) never ran the payload
    assert r.returncode == 2, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "data_0.ckpt" in lines[0] and "refused" in lines[0], r.stderr
    with pytest.raises(InputError, match="refused"):
        open_side(p)
    assert not marker.exists()
    if how in ("zip", "legacy"):  # control: the payload is live, only weights_only stopped it
        torch.load(p, weights_only=False)
        assert marker.exists()


@pytest.mark.parametrize("case", ["truncated-gz", "not-a-dict", "no-aux", "rows", "1d-aux", "garbage"])
def test_broken_specforge_files_are_one_line_errors(tmp_path, case):
    p = tmp_path / "data_0.ckpt.gz"
    rec = specforge_record([1, 5, 8])
    if case == "truncated-gz":
        write_specforge(p, rec, True)
        p.write_bytes(p.read_bytes()[:-200])
    elif case == "not-a-dict":
        write_specforge(p, [rec["aux_hidden_state"]], True)
    elif case == "no-aux":
        write_specforge(p, {k: v for k, v in rec.items() if k != "aux_hidden_state"}, True)
    elif case == "rows":
        write_specforge(p, {**rec, "input_ids": rec["input_ids"][:-1]}, True)
    elif case == "1d-aux":
        write_specforge(p, {**rec, "aux_hidden_state": torch.zeros(7)}, True)
    else:
        p.write_bytes(b"\x1f\x8b" + b"\x00" * 50)
    with pytest.raises(InputError) as exc:
        open_side(p)
    assert "\n" not in str(exc.value) and "data_0.ckpt.gz" in str(exc.value)


@pytest.mark.parametrize("case", ["2d", "tokens", "int"])
def test_broken_speculators_files(tmp_path, case):
    p = tmp_path / "hs_0.safetensors"
    hs, ids = torch.zeros(6, 3, 8), torch.arange(6)
    if case == "2d":
        hs = hs.flatten(1)
    elif case == "tokens":
        ids = torch.arange(5)
    else:
        hs = hs.long()
    save_file({"hidden_states": hs, "token_ids": ids}, str(p))
    with pytest.raises(InputError):
        open_side(p)


def test_layer_id_count_and_convention_errors(tmp_path):
    p = write_hs(tmp_path / "hs_0.safetensors", [2, 6, 9, N])
    with pytest.raises(InputError, match="4 slots"):
        open_side(p, [2, 6])
    with pytest.raises(UsageError, match="convention"):
        open_side(p, [2, 6, 9], "no-such-runtime")
    with pytest.raises(UsageError, match="number of layers"):
        open_side(p, [2, 6, -1], "trtllm")  # -1 means N: the file does not say N
    r = run_cli("compare", str(p), str(twin(p)), "--layer-ids", "2,6")
    assert r.returncode == 2 and "hs_0.safetensors" in r.stderr and len(r.stderr.strip().splitlines()) == 1


# -- convert and the CLI ---------------------------------------------------------------------------

def test_convert_then_compare_gives_the_same_verdict(tmp_path):
    hs = write_hs(tmp_path / "hs_0.safetensors", [9, 10, 11, N])
    out = tmp_path / "train.safetensors"
    # a real process for convert's console-script path; the rest through the same entry in this one
    r = cli("convert", str(hs), "-o", str(out), "--layer-ids", f"9,10,11,{N}", "--convention", "speculators")
    assert r.returncode == 0, r.stderr
    with open_dump(out) as d:
        assert d.metadata.aux.stream_ids == [9, 10, 11] and f"hidden.{N}" in d.tensors
        assert d.metadata.extra["source"]["format"] == "speculators"
    off = serving(tmp_path / "sglang.safetensors", [10, 11, 12], "sglang@0.5.5", [9, 10, 11])
    r = run_cli("compare", str(out), str(off))
    assert r.returncode == 1 and "LAYER_OFFSET" in r.stdout
    r = run_cli("compare", str(hs), str(off), "--layer-ids", f"9,10,11,{N}", "--convention", "speculators")
    assert r.returncode == 1 and "LAYER_OFFSET" in r.stdout
    before = out.read_bytes()
    r = run_cli("convert", str(hs), "-o", str(out))
    assert r.returncode == 2 and "--force" in r.stderr and out.read_bytes() == before
    assert run_cli("convert", str(hs), "-o", str(out), "--force").returncode == 0


def test_convert_specforge_to_npz(tmp_path):
    p = write_specforge(tmp_path / "data_3.ckpt.gz", specforge_record([1, 5, 8]), True)
    out = tmp_path / "train.npz"
    r = run_cli("convert", str(p), "-o", str(out), "--layer-ids", "1,5,8")
    assert r.returncode == 0, r.stderr
    with open_dump(out) as d, open_side(p, [1, 5, 8]) as src:
        assert d.metadata.aux.stream_ids == [2, 6, 9] and d["aux.0"].dtype == "bfloat16"
        for name in src.names:
            assert np.array_equal(d[name].read_all(), src[name].read_all()), name


def test_compare_of_a_speculators_file_does_not_import_torch(tmp_path):
    hs = write_hs(tmp_path / "hs_0.safetensors", [2, 6, 9, N])
    code = ("import sys; from consistency.pipeline.compare import compare as run_compare;"
            f"r = run_compare({str(hs)!r}, {str(twin(hs))!r}, layer_ids='2,6,9,12');"
            "assert r.verdict == 'pass', r.summary; assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])


def test_gzip_bomb_is_refused_before_it_fills_memory(tmp_path, monkeypatch):
    p = tmp_path / "data_0.ckpt.gz"
    with gzip.open(p, "wb", compresslevel=1) as g:
        for _ in range(8):
            g.write(bytes(1 << 20))
    monkeypatch.setenv("CONSISTENCY_MAX_GUNZIP_BYTES", str(2 << 20))
    with pytest.raises(InputError, match="decompresses to more than"):
        open_side(p)
    monkeypatch.setenv("CONSISTENCY_MAX_GUNZIP_BYTES", "lots")
    with pytest.raises(UsageError, match="CONSISTENCY_MAX_GUNZIP_BYTES"):
        open_side(p)


def test_gzip_bomb_bound_scales_with_the_compressed_size(tmp_path, monkeypatch):
    """Without the variable a .ckpt.gz may inflate to 64x its size (at least 256 MiB): a 300 MiB
    run of zeros deflates to ~300 KB, past 256 MiB it is refused (it once could write 16 GiB)."""
    monkeypatch.delenv("CONSISTENCY_MAX_GUNZIP_BYTES", raising=False)
    p = tmp_path / "data_0.ckpt.gz"
    with gzip.open(p, "wb", compresslevel=9) as g:
        for _ in range(300):
            g.write(bytes(1 << 20))
    assert p.stat().st_size * 64 < 256 << 20
    with pytest.raises(InputError, match=r"decompresses to more than 268435456 bytes"):
        open_side(p)
