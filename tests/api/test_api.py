"""The Python API (docs/api.md): top-level functions, in-memory sides, and the report
models the CLI prints. Real tiny models, real dumps; expected answers from the construction."""

from __future__ import annotations

import json
import subprocess
import tempfile
import sys
from pathlib import Path

import numpy as np
import pytest

import consistency
from consistency.contract.findings import CompareReport
from consistency.dump.memory import MemoryDump
from consistency.errors import InputError, UsageError
from consistency.record.api import record_reference, record_serving
from tests.conftest import ROOT, prompt_ids, run_cli, tiny

FIX = ROOT / "fixtures" / "configs"


def _fresh(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)


def test_import_is_torch_free_and_light() -> None:
    r = _fresh("import consistency, sys; assert 'torch' not in sys.modules, 'torch'; "
               "assert 'numpy' not in sys.modules, 'numpy'; assert 'pydantic' not in sys.modules, 'pydantic'; "
               "assert callable(consistency.compare) and callable(consistency.lint); "
               "assert 'torch' not in sys.modules, 'torch after lookup'")
    assert r.returncode == 0, r.stderr


CALLS = {"compare": "object(), object()", "lint": "", "replay": "object(), object(), draft='d'", "record": "object()"}


@pytest.mark.parametrize("sub", ["compare.plan", "lint.report", "replay.report", "record.recorder"])
def test_api_names_survive_importing_the_subpackage_first(sub: str) -> None:
    """Importing ``consistency.compare.plan`` sets ``consistency.compare`` to the package;
    the package must still be the API function (and still a package)."""
    name = sub.split(".")[0]
    r = _fresh(f"import consistency.{sub} as m, consistency, consistency.api as api\n"
               f"pkg = consistency.{name}\n"
               f"assert pkg is __import__('sys').modules['consistency.{name}']\n"
               f"assert getattr(pkg, '{sub.split('.')[1]}') is m\n"
               f"try:\n    pkg({CALLS[name]})\n"
               f"except consistency.errors.UsageError as e:\n    print('usage', e)\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage"), r.stdout  # the call reached consistency.api.<name> and validated its input


def _streams(seed: int = 0, rows: int = 12, width: int = 32, n: int = 5) -> dict[str, np.ndarray]:
    """Independent random streams: each differs from every other by far more than any floor."""
    rng = np.random.default_rng(seed)
    return {f"hidden.{k}": rng.standard_normal((rows, width)).astype(np.float32) for k in range(n)}


def test_compare_dicts_pass_and_shift() -> None:
    h = _streams()
    ref = {**h, "aux.0": h["hidden.1"], "aux.1": h["hidden.3"]}
    ok = consistency.compare(ref, {"aux.0": h["hidden.1"].copy(), "aux.1": h["hidden.3"].copy()})
    assert isinstance(ok, CompareReport) and ok.verdict == "pass", ok.summary
    bad = consistency.compare(ref, {"aux.0": h["hidden.2"], "aux.1": h["hidden.4"]})  # one stream late
    assert bad.verdict == "fail"
    assert [(s.tensor, s.expected_stream, s.identified_stream) for s in bad.slots] == [("aux.0", 1, 2), ("aux.1", 3, 4)]
    assert bad.reference.path == "<reference>" and bad.candidate.format == "memory"


def test_bf16_torch_tensors_keep_their_dtype() -> None:
    import torch

    h = _streams()
    t = torch.from_numpy(h["hidden.2"]).to(torch.bfloat16)
    d = MemoryDump({"aux.0": t})
    v = d["aux.0"]
    assert v.dtype == "bfloat16" and v.shape == (12, 32)
    np.testing.assert_array_equal(v.rows_float(0, v.rows), t.float().numpy())  # bits widen exactly
    ref = {**h, "aux.0": h["hidden.2"]}
    rep = consistency.compare(ref, {"aux.0": t})  # bf16 rounding of the right stream: within bf16's floor
    assert rep.verdict == "pass", rep.summary
    # the bf16 rounding is judged against bf16's noise floor: the dtype reached the tolerance model
    assert all(f.severity != "error" for f in rep.findings)
    assert any("bfloat16" in f.message for f in rep.findings), [f.message for f in rep.findings]


def test_recorded_file_against_live_hf_hidden_states(tmp_path: Path) -> None:
    """A notebook's path: the reference recorded to a file, the candidate straight from
    ``output_hidden_states`` (index k is stream k for k < N)."""
    import torch

    m = tiny()
    ids = prompt_ids(m)
    ref = record_reference(m, ids, tmp_path / "train.safetensors", [1, 2])
    with torch.no_grad():
        hs = m(torch.from_numpy(ids)[None], output_hidden_states=True).hidden_states
    assert consistency.compare(ref, {"aux.0": hs[1][0], "aux.1": hs[2][0]}).verdict == "pass"
    rep = consistency.compare(str(ref), {"aux.0": hs[2][0], "aux.1": hs[3][0]})
    assert rep.verdict == "fail"
    assert [s.identified_stream for s in rep.slots] == [2, 3]


def test_api_report_equals_cli_json(tmp_path: Path) -> None:
    m = tiny()
    ids = prompt_ids(m)
    ref = record_reference(m, ids, tmp_path / "train.safetensors", [1, 2])
    cand = record_serving(tiny(), ids, tmp_path / "serve.safetensors", [2, 3])
    rep = consistency.compare(ref, cand)
    r = run_cli("compare", str(ref), str(cand), "--json", "-")
    assert r.returncode == 1
    data = json.loads(r.stdout)
    assert rep.verdict == data["verdict"] and rep.summary == data["summary"]
    assert [s.model_dump(mode="json") for s in rep.slots] == data["slots"]


def test_memory_dump_metadata_and_bad_input() -> None:
    h = _streams()
    d = MemoryDump({"aux.0": h["hidden.1"]}, metadata={"side": "serving", "aux": {"stream_ids": [1]}}, name="<serve>")
    assert d.metadata.aux.stream_ids == [1] and d.metadata.tensors["aux.0"].dtype == "float32"
    with pytest.raises(InputError, match="no tensors"):
        consistency.compare({}, {"aux.0": h["hidden.1"]})
    with pytest.raises(UsageError, match="candidate"):
        consistency.compare({"aux.0": h["hidden.1"]}, 42)
    with pytest.raises(UsageError, match="not supported|expected a numpy"):
        MemoryDump({"x": np.array(["a", "b"], dtype=object)})
    with pytest.raises(InputError, match="shape"):
        MemoryDump({"aux.0": h["hidden.1"]}, metadata={"tensors": {"aux.0": {"shape": [3, 3]}}})


def test_lint_api_matches_cli() -> None:
    kw = dict(draft=str(FIX / "drafts" / "sglang" / "kimi-k2.5-eagle3-seed.json"),
              target=str(FIX / "targets" / "kimi-k2.5.json"),
              runtime="sglang@0.5.12")
    rep = consistency.lint(**kw)
    r = run_cli("lint", "--draft", kw["draft"], "--target", kw["target"], "--runtime", kw["runtime"], "--format", "json")
    data = json.loads(r.stdout)
    assert rep.verdict == data["verdict"]
    assert sorted(f.code for f in rep.findings) == sorted(f["code"] for f in data["findings"])
    assert r.returncode == (0 if rep.verdict == "pass" else 1)
    with pytest.raises(UsageError, match="fail_on"):
        consistency.lint(draft=kw["draft"], fail_on="warn")


def test_record_api_writes_what_the_recorder_writes(tmp_path: Path) -> None:
    from consistency.dump.reader import open_dump

    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    out = consistency.record("tiny-llama", ids, tmp_path / "t.safetensors", aux_layers=[1, 2])
    with open_dump(out) as d:
        assert d.metadata.aux.stream_ids == [1, 2]
        np.testing.assert_array_equal(d["aux.0"].read_all(), d["hidden.1"].read_all())
        assert d["input_ids"].read_all().tolist() == ids
    serve = consistency.record("tiny-llama", ids, tmp_path / "s.safetensors", style="serving", aux_layers=[1, 2])
    assert consistency.compare(out, serve).verdict == "pass"
    tmp_default = consistency.record(tiny(), prompt="hello", aux_layers="1")
    assert tmp_default.is_file() and tmp_default.name == "training.safetensors"
    with pytest.raises(UsageError, match="exactly one"):
        consistency.record("tiny-llama", ids, prompt="x")


@pytest.mark.slow
def test_replay_api_with_a_path_and_an_in_memory_side(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The committed tiny draft was trained on streams [0, 3, 7]; a +3 shift costs acceptance.
    An in-memory candidate (written to a temporary dump for the replay) scores the same."""
    from consistency.dump.reader import open_dump
    from consistency.record.models import DEMO_PROMPT, load_model, tokenize

    m = load_model("tiny-llama")
    ids = tokenize(m, "tiny-llama", DEMO_PROMPT)
    train = consistency.record(m, ids, tmp_path / "train.safetensors", aux_layers=[0, 3, 7])
    serve = consistency.record(m, ids, tmp_path / "serve.safetensors", style="serving", aux_layers=[3, 7, 10])
    rep = consistency.replay(train, serve, draft="tiny-llama-eagle3", target="tiny-llama")
    assert rep.verdict == "fail" and rep.drop is not None
    with open_dump(serve) as d:
        mem = {n: d[n].read_all() for n in d.names}
    own_tmp = tmp_path / "tmp"  # this test's own temp dir: other processes' replays leave theirs in /tmp
    own_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(own_tmp))
    again = consistency.replay(train, mem, draft="tiny-llama-eagle3", target="tiny-llama")
    assert (again.verdict, again.summary, again.drop) == (rep.verdict, rep.summary, rep.drop)
    assert not list(own_tmp.glob("consistency-*/candidate.safetensors"))  # temporary dump removed
    assert not list(own_tmp.iterdir())
    with pytest.raises(UsageError, match="max_drop"):
        consistency.replay(train, serve, draft="tiny-llama-eagle3", max_drop=-1)


def test_replay_api_takes_every_option_the_command_and_the_gate_take(tmp_path: Path) -> None:
    """``--method``, ``--layer-ids`` and ``--convention`` (and the gate's keys of the same names)
    were a TypeError from ``consistency.replay``: the API could not replay what the command
    replays. A bad value is the request's one line, an unknown name a usage error, and the
    same options reach the command's verdict."""
    ids = list(range(1, 25))
    train = consistency.record("tiny-llama", ids, tmp_path / "train.safetensors", aux_layers=[0, 3, 7])
    serve = consistency.record("tiny-llama", ids, tmp_path / "serve.safetensors", style="serving",
                               aux_layers=[3, 7, 10])
    with pytest.raises(UsageError, match="method must be one of auto, eagle3, mtp, eagle1, got 'medusa'"):
        consistency.replay(train, serve, draft="tiny-llama-eagle3", method="medusa")
    with pytest.raises(UsageError, match="unknown option metod"):
        consistency.replay(train, serve, draft="tiny-llama-eagle3", metod="eagle3")
    rep = consistency.replay(train, serve, draft="tiny-llama-eagle3", target="tiny-llama", method="eagle3",
                             convention="stream")
    r = run_cli("replay", str(train), str(serve), "--draft", "tiny-llama-eagle3", "--target", "tiny-llama",
                "--method", "eagle3", "--convention", "stream", "--json", "-", "-q")
    assert r.returncode == 1 and rep.verdict == "fail", (r.returncode, r.stderr)
    assert json.loads(r.stdout)["summary"] == rep.summary


def test_the_progress_option_is_what_api_md_says(tmp_path: Path) -> None:
    """api.md promised ``progress=True`` (a progress bar); the request drops anything that is
    not a callable, so True showed nothing. The page names what works: a callable
    ``(label, total) -> tick(n)`` such as the command line's bar."""
    from consistency.report.progress import factory

    text = " ".join((ROOT / "docs" / "api.md").read_text(encoding="utf-8").split())
    assert "`progress=True`" not in text and "progress=consistency.report.progress.factory()" in text
    a = np.arange(64, dtype=np.float32).reshape(8, 8) + 1
    heard: list[object] = []

    def make(label: str, total: int):  # noqa: ANN202 - the documented shape
        heard.append((label, total))
        return heard.append

    assert consistency.compare({"aux.0": a}, {"aux.0": a.copy()}, progress=make).verdict == "pass"
    assert heard and heard[0] == ("measuring", 8) and sum(n for n in heard[1:] if isinstance(n, int)) == 8
    assert consistency.compare({"aux.0": a}, {"aux.0": a.copy()}, progress=factory()).verdict == "pass"
