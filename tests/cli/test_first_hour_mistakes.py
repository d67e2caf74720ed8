"""What a newcomer trips on in the first hour (issue 28), each answered in one line.

A mistyped model name is named as a typo, not tried on the Hub; an output suffix that is
not a format we write is refused before any work; a token id past the vocabulary names the
id and the size; the API's option names are the CLI's and the gate's; a passing replay
says what passed. Every case runs the real command or function on real files.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import run_cli


def _one_line_error(r: subprocess.CompletedProcess, *needles: str) -> str:
    assert r.returncode == 2, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    err = r.stderr.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    for n in needles:
        assert n in err, (n, err)
    return err


@pytest.mark.parametrize("spec", ["tiny-lama", "meta-llama/Llama-3.1-8B"])
def test_record_with_an_unknown_model_says_typo_not_connection_error(tmp_path: Path, spec: str) -> None:
    """--prompt used to go to AutoTokenizer first, which tried the Hub and printed a connection error."""
    out = tmp_path / "x.safetensors"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}  # no offline flag to hide a Hub call
    r = subprocess.run([sys.executable, "-m", "consistency", "record", "--model", spec, "--prompt", "hi", "-o",
                        str(out)], capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    err = _one_line_error(r, f"{spec}: not a built-in model", "tiny-llama", "nor a local model directory")
    assert not any(w in err.lower() for w in ("connect", "huggingface.co", "hub", "resolve")), err
    assert ("did you mean tiny-llama?" in err) == (spec == "tiny-lama")
    assert not out.exists()


@pytest.mark.parametrize("name,instead", [("x.pt", "x.safetensors"), ("x.bin", "x.safetensors"),
                                          ("out.txt", "out.safetensors"), ("dump", "dump.safetensors"),
                                          ("x.safetensors.tmp", "x.safetensors")])
def test_record_refuses_an_output_suffix_it_does_not_write(tmp_path: Path, name: str, instead: str) -> None:
    out = tmp_path / name
    r = run_cli("record", "--model", "tiny-llama", "--prompt", "hi", "-o", str(out))
    err = _one_line_error(r, str(out), ".safetensors or .npz", f"write {instead} instead")
    assert ("torch.load" in err) == name.endswith((".pt", ".bin"))
    assert list(tmp_path.iterdir()) == []  # refused before the model loaded: nothing written


def test_convert_refuses_an_output_suffix_it_does_not_write(tmp_path: Path) -> None:
    src = tmp_path / "a.safetensors"
    assert run_cli("record", "--model", "tiny-llama", "--prompt", "hi", "--no-components", "-o", str(src)).returncode == 0
    for name in ("out.txt", "out.pt"):
        r = run_cli("convert", str(src), "-o", str(tmp_path / name))
        _one_line_error(r, str(tmp_path / name), ".safetensors or .npz")
        assert not (tmp_path / name).exists()
    assert run_cli("convert", str(src), "-o", str(tmp_path / "out.npz")).returncode == 0  # what does work


def test_the_writer_refuses_the_same_names_for_every_caller(tmp_path: Path) -> None:
    from consistency.dump.writer import write_dump
    from consistency.errors import InputError

    with pytest.raises(InputError, match=r"x\.pt: a dump is written as \.safetensors or \.npz"):
        write_dump(tmp_path / "x.pt", {"a": np.zeros(3, np.float32)})
    assert not (tmp_path / "x.pt").exists()


def test_env_recorder_with_a_pt_name_keeps_the_recording_under_a_dump_name(tmp_path: Path) -> None:
    """A server's CONSISTENCY_RECORD=serve.pt is not refused at exit (the run would be lost): the
    recording gets the suffix that says what it holds, said at the first capture."""
    from consistency.dump.reader import open_dump

    out = tmp_path / "serve.pt"
    code = ("import numpy as np; from consistency.record import capture;"
            "capture('aux.0', np.full((2, 3), 7, np.float32)); print('captured', flush=True)")
    env = {k: v for k, v in os.environ.items() if k != "CONSISTENCY_FORCE"}
    r = subprocess.run([sys.executable, "-c", code], env={**env, "CONSISTENCY_RECORD": str(out)},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout == "captured\n", r.stderr
    kept = tmp_path / "serve.pt.safetensors"
    assert not out.exists() and kept.is_file()
    with open_dump(kept) as d:
        assert float(d["aux.0"].read_all()[0, 0]) == 7.0
    assert len(r.stderr.splitlines()) == 1 and str(kept) in r.stderr and "'.pt'" in r.stderr


@pytest.mark.parametrize("ids,bad,pos", [([1, 2, 512, 3], 512, 2), ([5, 70000], 70000, 1)])
def test_record_input_ids_past_the_vocabulary_name_the_id_and_the_size(tmp_path: Path, ids: list[int], bad: int,
                                                                        pos: int) -> None:
    f = tmp_path / "ids.json"
    f.write_text(json.dumps(ids))
    out = tmp_path / "x.safetensors"
    r = run_cli("record", "--model", "tiny-llama", "--input-ids", str(f), "-o", str(out))
    _one_line_error(r, f"{f}: token id {bad} at position {pos}", "vocab_size 512", "0..511", "tiny-llama")
    assert "IndexError" not in r.stderr and not out.exists()
    f.write_text(json.dumps([0, 511]))  # the last id of the vocabulary is fine
    assert run_cli("record", "--model", "tiny-llama", "--input-ids", str(f), "-o", str(out)).returncode == 0


def test_record_api_names_the_id_past_the_vocabulary(tmp_path: Path) -> None:
    import consistency
    from consistency.errors import UsageError

    with pytest.raises(UsageError, match=r"token id 600 at position 1 is outside the vocabulary .*vocab_size 512"):
        consistency.record("tiny-llama", [3, 600], str(tmp_path / "t.safetensors"))
    assert not (tmp_path / "t.safetensors").exists()


@pytest.fixture(scope="module")
def shifted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The demo's pair: trained on streams [0, 3, 7], served [3, 7, 10] (a real drop of ~60 points)."""
    d = tmp_path_factory.mktemp("replay")
    p = "Speculative decoding drafts several tokens with a small model and verifies them with the target."
    train, serve = d / "train.safetensors", d / "serve.safetensors"
    assert run_cli("record", "--model", "tiny-llama", "--prompt", p, "--aux-layers", "0,3,7", "-o",
                   str(train)).returncode == 0
    assert run_cli("record", "--model", "tiny-llama", "--prompt", p, "--style", "serving", "--aux-layers", "2,6,9",
                   "--convention", "sglang@0.5.5", "--dtype", "bfloat16", "-o", str(serve)).returncode == 0
    return train, serve


def test_a_passing_replay_says_what_passed(shifted: tuple[Path, Path]) -> None:
    """A 60-point drop under a limit of 90 passes, and says so: not "no acceptance drop"."""
    import consistency

    train, serve = shifted
    rep = consistency.replay(str(train), str(serve), draft="tiny-llama-eagle3", target="tiny-llama",
                             max_drop_points=90)
    worst = max(rep.drop.top1_points, rep.drop.acceptance_points)
    assert rep.verdict == "pass" and worst > 20
    assert rep.summary.startswith(f"drop of {worst:.1f} points, within 90: "), rep.summary
    from consistency.dump.reader import open_dump
    from consistency.record.api import record_reference
    from consistency.record.models import load_model

    with open_dump(train) as d:  # the same states recorded again (another file: one file twice is SAME_INPUT)
        ids = d["input_ids"].read_all()
    again = record_reference(load_model("tiny-llama"), ids, train.with_name("again.safetensors"), [0, 3, 7],
                             components=False, force=True)
    same = consistency.replay(str(train), str(again), draft="tiny-llama-eagle3", target="tiny-llama",
                              min_acceptance=0.1)
    assert same.summary.startswith("no drop (within 5 points); acceptance "), same.summary
    assert "clears the floor of 10%" in same.summary


def test_pass_summary_words() -> None:
    from consistency.replay.engine import pass_summary

    assert pass_summary(19.44, 50, 0.5, None) == "drop of 19.4 points, within 50"
    assert pass_summary(0.01, 5, 0.5, None) == "no drop (within 5 points)"
    assert pass_summary(-2.0, 5, 0.5, 0.4) == ("no drop: the candidate gains 2.0 points (limit 5); acceptance 50.0% "
                                               "clears the floor of 40%")


def test_max_drop_points_is_one_name_across_api_cli_and_gate(shifted: tuple[Path, Path], tmp_path: Path) -> None:
    import consistency
    from consistency.errors import UsageError

    train, serve = shifted
    new = consistency.replay(str(train), str(serve), draft="tiny-llama-eagle3", target="tiny-llama",
                             max_drop_points=90)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        old = consistency.replay(str(train), str(serve), draft="tiny-llama-eagle3", target="tiny-llama", max_drop=90)
    assert [w.category for w in seen if "max_drop" in str(w.message)] == [DeprecationWarning]
    assert (old.verdict, old.max_drop_points, old.summary) == (new.verdict, new.max_drop_points, new.summary)
    with pytest.raises(UsageError, match="give one"):
        consistency.replay(str(train), str(serve), draft="tiny-llama-eagle3", max_drop_points=10, max_drop=90)
    from consistency.replay.api import replay_check

    with pytest.raises(UsageError, match="give one"):
        replay_check("tiny-llama-eagle3", train, serve, target="tiny-llama", max_drop_points=10, max_drop=90)
    for flag in ("--max-drop-points", "--max-drop"):  # the CLI's name, and the older spelling
        r = run_cli("replay", "--draft", "tiny-llama-eagle3", "--target", "tiny-llama", str(train), str(serve), flag,
                    "90", "-q")
        assert r.returncode == 0 and r.stdout.startswith("PASS  drop of "), r.stdout + r.stderr
    help_text = run_cli("replay", "--help").stdout
    assert "--max-drop-points" in help_text


def test_sarif_help_links_point_at_the_published_docs(tmp_path: Path) -> None:
    """A relative helpUri would point into the scanned repository, which has no docs/rules/."""
    from tests.conftest import ROOT

    out = tmp_path / "l.sarif"
    fix = ROOT / "fixtures" / "configs"
    r = run_cli("lint", "--draft", str(fix / "drafts" / "sglang" / "kimi-k2.5-eagle3-seed.json"), "--target",
                str(fix / "targets" / "kimi-k2.5.json"), "--runtime", "sglang@0.5.12", "--trained-with",
                "stream:0,3,31", "--format", "sarif", "-o", str(out))
    assert r.returncode == 1, r.stderr
    rules = json.loads(out.read_text())["runs"][0]["tool"]["driver"]["rules"]
    base = "https://github.com/consistency-dev/consistency/blob/main/docs/"
    assert rules and all(rule["helpUri"].startswith(base) for rule in rules), [x["helpUri"] for x in rules][:3]
    for rule in rules:  # and each names a page of this repository's docs
        assert (ROOT / "docs" / rule["helpUri"][len(base):].split("#")[0]).is_file(), rule["helpUri"]
