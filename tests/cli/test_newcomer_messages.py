"""A new user's mistakes, each answered by one line that names the file (or the name typed)
and the problem, with the name that was probably meant (issue 39).

Inputs are built here; each expectation is derived from what was built (the one dump a
directory holds, the names of the commands and conventions the tool knows)."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest

from consistency.dump.writer import write_dump
from tests.conftest import run_cli


def _one_line(r) -> str:  # noqa: ANN001
    err = r.stderr.strip()
    assert r.returncode == 2, (r.returncode, r.stdout[-800:], r.stderr[-800:])
    assert err.startswith("consistency: error: ") and "\n" not in err and "Traceback" not in err, err
    return err


def _dumps(tmp: Path, noise: float = 0.0, ids: tuple[int, int] | None = None) -> tuple[Path, Path]:
    rng = np.random.default_rng(0)
    h = {f"hidden.{i}": rng.standard_normal((8, 16)).astype(np.float32) for i in range(3)}
    g = {k: v + noise * rng.standard_normal(v.shape).astype(np.float32) for k, v in h.items()}
    if ids is not None:
        h["input_ids"], g["input_ids"] = np.arange(ids[0], ids[0] + 8), np.arange(ids[1], ids[1] + 8)
    return write_dump(tmp / "ref.safetensors", h), write_dump(tmp / "cand.safetensors", g)


def test_did_you_mean_picks_the_closest_known_name_or_says_nothing() -> None:
    from consistency.contract.resolve import names
    from consistency.errors import did_you_mean

    assert did_you_mean("comapre", ["compare", "record", "inspect"]) == "; did you mean compare?"
    assert did_you_mean("sglnag@0.5.5", names()) == "; did you mean sglang@0.5.5?"
    assert did_you_mean("zzzzzz", names()) == ""


@pytest.mark.parametrize("typed, meant", [("comapre", "compare"), ("inspekt", "inspect"), ("lnt", "lint")])
def test_a_mistyped_subcommand_names_the_command_meant(typed: str, meant: str) -> None:
    from consistency.cli import COMMANDS

    r = run_cli(typed, "x")
    assert r.returncode == 2 and f"did you mean {meant}?" in r.stderr, r.stderr
    assert all(c in r.stderr for c in COMMANDS), r.stderr  # and lists them all
    assert "Traceback" not in r.stderr


def test_a_mistyped_convention_names_the_convention_meant_on_compare_and_record(tmp: Path) -> None:
    a, b = _dumps(tmp)
    err = _one_line(run_cli("compare", a, b, "--convention", "sglnag"))
    assert err.count("'sglnag'") == 1 and err.endswith("did you mean sglang?"), err
    # record refuses the typo before loading a model, even where no --aux-layers use it
    out = tmp / "r.safetensors"
    err = _one_line(run_cli("record", "--model", "tiny-llama", "--prompt", "hi", "--convention", "sglnag", "-o", out))
    assert "did you mean sglang?" in err and not out.exists(), err


def test_the_verdict_line_says_a_token_headline_once(tmp: Path) -> None:
    a, b = _dumps(tmp, ids=(0, 100))  # no token in common
    r = run_cli("compare", a, b, "-q")
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stdout.count("NO_COMMON_TOKENS") == 1, r.stdout


def test_inspect_counts_tensors_once_and_in_the_singular_for_one(tmp: Path) -> None:
    np.savez(tmp / "one.npz", x=np.zeros(3))
    r = run_cli("inspect", tmp / "one.npz")
    first = r.stdout.splitlines()[0]
    assert r.returncode == 0 and "1 tensor," in first and "1 tensors" not in first, first
    pytest.importorskip("torch")
    import torch

    torch.save({f"t{i}": torch.zeros(2, 3) for i in range(4)}, tmp / "four.pt")
    first = run_cli("inspect", tmp / "four.pt").stdout.splitlines()[0]
    assert first.count("4 tensors") == 1, first


def test_gate_given_a_binary_file_says_it_is_not_a_toml_file(tmp: Path) -> None:
    np.savez(tmp / "train.npz", x=np.arange(1000))
    err = _one_line(run_cli("gate", "--config", tmp / "train.npz"))
    assert "train.npz: not a TOML file" in err and "codec" not in err, err


def test_an_rtol_past_the_float_range_prints_no_runtime_warning(tmp: Path) -> None:
    a, b = _dumps(tmp, noise=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for flag in ("--rtol", "--atol"):
            r = run_cli("compare", a, b, "-q", flag, "1e308")
            assert r.returncode in (0, 1) and "Warning" not in r.stderr, r.stderr
            assert r.stdout.startswith(("PASS", "FAIL")), r.stdout


def test_a_directory_holding_one_dump_names_the_file_to_give(tmp: Path) -> None:
    a, b = _dumps(tmp)
    d = tmp / "d"
    d.mkdir()
    b.rename(d / b.name)
    err = _one_line(run_cli("compare", a, d))
    assert f"{d}: is a directory, not a dump" in err and str(d / b.name) in err, err


def test_a_glob_matching_dumps_that_are_not_ranks_says_so_not_no_such_file(tmp: Path) -> None:
    a, b = _dumps(tmp)
    pattern = str(tmp / "c*.safetensors")
    err = _one_line(run_cli("compare", a, pattern))
    assert "no such file" not in err and "matches 1 file(s) (cand.safetensors)" in err, err
    err = _one_line(run_cli("compare", a, str(tmp / "zz*.safetensors")))  # matching nothing: as before
    assert "no such file" in err, err


def test_record_add_capture_at_stream_0_is_one_line_without_the_prompt(tmp: Path) -> None:
    pytest.importorskip("transformers")
    prompt = "a long prompt a new user pasted " * 20
    out = tmp / "s.safetensors"
    err = _one_line(run_cli("record", "--model", "tiny-llama", "--prompt", prompt, "--style", "serving",
                            "--capture", "add", "--aux-layers", "0,2,4", "-o", out))
    assert "--capture add" in err and "stream 0" in err and "TypeError" not in err, err
    assert prompt.strip() not in err and not out.exists(), err


def test_an_unexpected_error_line_names_the_files_but_never_echoes_other_values(tmp: Path) -> None:
    from consistency.cli import _is_path

    assert _is_path(str(tmp)) and not _is_path("hello there") and not _is_path("x" * 5000) and not _is_path("a\0b")


@pytest.mark.parametrize("args, meant", [
    (["compare", "{a}", "{b}", "--consumer", "eagel3"], "did you mean eagle3?"),
    (["lint", "--format", "jsno"], "did you mean json?"),
    (["lint", "--target", "{target}", "--runtime", "sgalng@0.5.5"], "did you mean sglang@0.5.5?"),
    (["lint", "--target", "{target}", "--select", "IDSS"], "did you mean IDS?"),
])
def test_every_name_the_cli_takes_suggests_the_one_meant(tmp: Path, args: list[str], meant: str) -> None:
    from tests.conftest import ROOT

    a, b = _dumps(tmp)
    target = ROOT / "fixtures" / "configs" / "targets" / "kimi-k2.5.json"
    r = run_cli(*[x.format(a=a, b=b, target=target) for x in args])
    assert r.returncode == 2 and meant in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_a_bad_tolerance_names_the_rule_and_its_form(tmp: Path) -> None:
    a, b = _dumps(tmp)
    err = _one_line(run_cli("compare", a, b, "--tolerance", "aux=abc"))
    assert "'aux=abc'" in err and "REGEX=FLOOR" in err, err


@pytest.mark.parametrize("prompt", ["", "   \n"])
def test_an_empty_prompt_is_refused_and_writes_nothing(tmp: Path, prompt: str) -> None:
    # a tokenizer still returns its BOS for "": a one-token dump would compare as PASS
    out = tmp / "r.safetensors"
    err = _one_line(run_cli("record", "--model", "tiny-llama", "--prompt", prompt, "-o", out))
    assert "--prompt is empty" in err, err
    assert not out.exists()


def test_every_fix_text_names_only_options_a_command_has() -> None:
    # a fix that names an option no command has sends the user to a click error (MISSING's
    # fix once said "--only", which only the gate has)
    import re

    import click

    from consistency.cli import COMMANDS, main
    from consistency.contract.codes import ROWS

    known: set[str] = set()
    for name in COMMANDS:
        cmd = main.get_command(click.Context(main), name)
        for p in (cmd.params if cmd is not None else ()):
            if isinstance(p, click.Option):
                known.update(o for o in (*p.opts, *p.secondary_opts) if o.startswith("--"))
    wrong = {(row.code, opt) for row in ROWS for opt in re.findall(r"(?<![\w-])--[a-z][a-z-]*[a-z]", row.fix)
             if opt not in known}
    assert not wrong, sorted(wrong)


@pytest.mark.parametrize("argv, flag", [
    (["compare", "{a}", "{b}", "--html", "-"], "--html"),
    (["lint", "--draft", "tiny-llama-eagle3", "-o", "-"], "--output"),
    (["gate", "--config", "{toml}", "--junit", "-"], "--junit"),
])
def test_dash_is_stdout_only_for_json(tmp: Path, argv: list[str], flag: str) -> None:
    """``--json -`` is stdout; ``-`` given to another output option named a file called '-',
    written after the whole run. Refused first, and no file '-' appears."""
    import os

    a, b = _dumps(tmp)
    toml = tmp / "consistency.toml"
    toml.write_text(f'[[compare]]\nname = "c"\nreference = "{a}"\ncandidate = "{b}"\n')
    args = [x.format(a=a, b=b, toml=toml) for x in argv]
    cwd = os.getcwd()
    os.chdir(tmp)
    try:
        err = _one_line(run_cli(*args))
    finally:
        os.chdir(cwd)
    assert f"{flag} -: only --json writes to stdout" in err, err
    assert not (tmp / "-").exists()


@pytest.mark.parametrize("argv, said", [
    (["compare", "only-one.safetensors"], "Missing argument 'CANDIDATE'"),
    (["compare", "a", "b", "--format", "xml"], "Did you mean '--force'?"),
    (["lint", "--consumer", "eagle"], "No such option '--consumer'"),
    (["compare", "--consumer", "eagel3", "a", "b"], "did you mean eagle3?"),
    (["record", "--model", "tiny-llama", "--prompt", "hi", "--style", "servng", "-o", "x.safetensors"],
     "'servng' is not one of"),
])
def test_click_usage_errors_are_one_line_too(argv: list[str], said: str) -> None:
    """click's own refusals (a missing argument, an unknown option, a bad choice) were three lines
    (usage, "Try --help", the error); every refusal is one line naming the problem and the help."""
    err = _one_line(run_cli(*argv))
    assert said in err and err.endswith("--help)"), err
