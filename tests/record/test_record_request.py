"""Record's door (issue 38 item 5): ``consistency record`` and ``consistency.record`` build one
frozen :class:`RecordRequest`, validated in one place, and hand it to one function; the gate's
[[replay]] keys are ReplayRequest's fields."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from consistency import api
from consistency.cli import record_cmd
from consistency.errors import ConsistencyError, UsageError
from consistency.record.request import RecordRequest
from tests.conftest import run_cli

CLI_DEFAULTS = dict(gguf_file=None, prompt=None, ids_file=None, aux_layers=None, convention="stream",
                    style="training", capture_mode="guarded", components=False, no_components=False, logits=False,
                    dtype="float32", seed=0, force=False)


def _cli(model_spec: str, output: Path, **flags: object) -> RecordRequest:
    """The request the command line builds (its click parameters, with click's defaults)."""
    return record_cmd.request(model_spec=model_spec, output=str(output), **{**CLI_DEFAULTS, **flags})


def test_the_cli_and_the_api_build_the_same_request(tmp_path: Path) -> None:
    out = tmp_path / "t.safetensors"
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps([3, 1, 4, 1, 5]))
    pairs = [
        (_cli("tiny-llama", out, prompt="hello", aux_layers="1,2"),
         api.record_request("tiny-llama", output=out, prompt="hello", aux_layers=[1, 2])),
        (_cli("tiny-llama", out, ids_file=str(ids), style="serving", aux_layers="2,6", convention="sglang@0.5.5",
              capture_mode="add", dtype="bfloat16", seed=3),
         api.record_request("tiny-llama", ids, out, style="serving", aux_layers="2,6", convention="sglang@0.5.5",
                            capture="add", dtype="bfloat16", seed=3)),
        (_cli("tiny-llama", out, prompt="x", no_components=True, logits=True, aux_layers="default"),
         api.record_request("tiny-llama", output=out, prompt="x", components=False, logits=True, aux_layers="default")),
    ]
    for cli_req, api_req in pairs:
        assert cli_req == api_req
    assert pairs[1][0].input_ids == (3, 1, 4, 1, 5) and pairs[1][0].ids_file == str(ids)
    assert pairs[0][0].components and not pairs[1][0].components  # components: on for training, off for serving
    assert pairs[2][0].aux and pairs[2][0].aux_layers is None  # 'default': the runtime's default ids
    with pytest.raises(dataclasses.FrozenInstanceError):
        pairs[0][0].prompt = "other"  # type: ignore[misc]


@pytest.mark.parametrize(("fields", "flags", "needle"), [
    ({"prompt": ""}, ["--prompt", ""], "--prompt is empty: give the text to run (or --input-ids)"),
    ({"prompt": " \n\t"}, ["--prompt", " \n\t"], "--prompt is empty"),
    ({}, [], "give exactly one of --prompt and --input-ids"),
    ({"prompt": "hi", "dtype": "float8"}, ["--prompt", "hi", "--dtype", "float8"], "--dtype 'float8': expected"),
    ({"prompt": "hi", "aux_layers": "2,x"}, ["--prompt", "hi", "--aux-layers", "2,x"], "--aux-layers: cannot parse"),
    ({"prompt": "hi", "convention": "sglnag"}, ["--prompt", "hi", "--convention", "sglnag"], "sglnag"),
])
def test_a_bad_field_is_one_line_from_either_door(tmp_path: Path, fields: dict, flags: list[str], needle: str) -> None:
    """One validator: the API raises the line the command prints (exit 2), before a model loads."""
    out = tmp_path / "r.safetensors"
    with pytest.raises(ConsistencyError) as e:
        api.record_request("tiny-llama", fields.pop("input_ids", None), out, **fields)
    assert needle in str(e.value) and "\n" not in str(e.value)
    r = run_cli("record", "--model", "tiny-llama", *flags, "-o", str(out))
    err = r.stderr.strip()
    assert r.returncode == 2 and err == f"consistency: error: {e.value}", (r.returncode, err)
    assert not out.exists()


@pytest.mark.parametrize(("fields", "needle"), [
    ({"style": "serve"}, "--style 'serve': expected training or serving"),
    ({"capture": "copy"}, "--capture 'copy': expected guarded, add or clone"),
    ({"seed": "1"}, "--seed '1': expected an integer"),
    ({"input_ids": [[1, 2], [3, 4]]}, "expected one sequence"),
    ({"input_ids": [1, -2]}, "negative token id -2"),
    ({"input_ids": []}, "no token ids"),
    ({"input_ids": [1, 2], "gguf_file": "m.gguf"}, "--gguf-file names a file inside the model directory"),
])
def test_what_only_the_api_can_spell_wrong_is_refused_by_the_request(tmp_path: Path, fields: dict,
                                                                     needle: str) -> None:
    fields.setdefault("prompt", None if "input_ids" in fields else "hi")
    model = object() if "gguf_file" in fields else "tiny-llama"
    with pytest.raises(UsageError, match=needle.replace("(", r"\(").replace("[", r"\[")):
        RecordRequest.build(model, tmp_path / "r.safetensors", **fields)


def test_the_cli_and_the_api_record_the_same_dump(tmp_path: Path) -> None:
    """Same inputs, one function: the same tensors, the same aux claims."""
    from consistency.dump.reader import open_dump

    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps(list(range(1, 20))))
    cli_out, api_out = tmp_path / "cli.safetensors", tmp_path / "api.safetensors"
    r = run_cli("record", "--model", "tiny-llama", "--input-ids", str(ids), "--style", "serving", "--aux-layers",
                "2,6", "--convention", "sglang@0.5.5", "-o", str(cli_out))
    assert r.returncode == 0 and "(aux streams [3, 7])" in r.stdout, r.stderr
    got = api.record("tiny-llama", list(range(1, 20)), api_out, style="serving", aux_layers=[2, 6],
                     convention="sglang@0.5.5")
    assert got == api_out
    with open_dump(cli_out) as a, open_dump(api_out) as b:
        assert sorted(a.tensors) == sorted(b.tensors)
        for name in a.tensors:
            np.testing.assert_array_equal(a[name].read_all(), b[name].read_all())
        assert a.metadata.aux == b.metadata.aux and b.metadata.aux.stream_ids == [3, 7]


def test_the_gate_replay_keys_are_the_request_fields(tmp_path: Path) -> None:
    """[[replay]] was the one table whose keys nothing checked: a misspelt key reached the
    replay at run time. Its keys are ReplayRequest's fields now, refused at load otherwise,
    and a field the request gains (method, layer_ids, convention) is a key at once."""
    from consistency.errors import InputError
    from consistency.gate.config import GATE_OWN, REPLAY_KEYS, load
    from consistency.replay.request import ALIASES, ReplayRequest

    assert REPLAY_KEYS == {f.name for f in dataclasses.fields(ReplayRequest)} | set(ALIASES) | GATE_OWN
    (tmp_path / "d.safetensors").write_bytes(b"")
    head = '[[replay]]\nname = "acc"\ndraft = "tiny-llama-eagle3"\nreference = "d.safetensors"\n'
    cfg = tmp_path / "consistency.toml"
    cfg.write_text(head + 'method = "mtp"\nlayer_ids = [0, 3]\nconvention = "stream"\n'
                   'overrides = {norm_output = true}\n')
    opts = load(cfg).checks[0].options
    assert (opts["method"], opts["layer_ids"], opts["overrides"]) == ("mtp", [0, 3], {"norm_output": True})
    cfg.write_text(head + "max_drop_point = 3\n")
    with pytest.raises(InputError, match=r"\[\[replay\]\] entry 1 has unknown key\(s\) \['max_drop_point'\]"):
        load(cfg)
    cfg.write_text(head + 'overrides = {norm_output = "yes"}\n')
    with pytest.raises(InputError, match="overrides = .*expected a table of true/false values"):
        load(cfg)


def test_a_gguf_file_beside_a_built_in_model_is_refused_not_ignored(tmp_path: Path) -> None:
    """A built-in model has no GGUF checkpoint: ``--gguf-file`` used to be dropped in silence
    (a dump of the seeded tiny model written as if read from the file, even a missing one)."""
    out = tmp_path / "g.safetensors"
    ids = tmp_path / "ids.json"
    ids.write_text("[1, 2, 3]")
    with pytest.raises(UsageError) as e:
        api.record_request("tiny-llama", [1, 2, 3], out, gguf_file=tmp_path / "nothere.gguf")
    assert "--gguf-file" in str(e.value) and "built-in" in str(e.value) and "\n" not in str(e.value)
    r = run_cli("record", "--model", "tiny-llama", "--input-ids", str(ids), "--gguf-file", "nothere.gguf",
                "-o", str(out))
    assert r.returncode == 2 and "--gguf-file" in r.stderr and "built-in" in r.stderr, (r.returncode, r.stderr)
    assert len(r.stderr.strip().splitlines()) == 1 and not out.exists()


def test_an_output_that_is_not_a_path_is_a_usage_error(tmp_path: Path) -> None:
    """``record(model, "out.safetensors", ids)`` (output and input_ids swapped) raised a bare
    TypeError from os.fspath; it is the request's one line now, nothing written."""
    ids = tmp_path / "out.safetensors"
    with pytest.raises(UsageError, match=r"output \[1, 2, 3\]: expected a path .* got list"):
        api.record("tiny-llama", ids, [1, 2, 3])  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="output 7: expected a path"):
        RecordRequest.build("tiny-llama", 7, input_ids=[1, 2])  # type: ignore[arg-type]
    assert not ids.exists()


@pytest.mark.parametrize("style", ["training", "serving"])
def test_an_empty_aux_layer_list_is_refused(tmp_path: Path, style: str) -> None:
    """``aux_layers=[]`` recorded a serving dump holding input_ids alone (and a training dump
    claiming aux streams []), where the command's ``--aux-layers ""`` means the default ids:
    the two doors recorded different things for "no ids"."""
    out = tmp_path / "e.safetensors"
    with pytest.raises(UsageError, match=r"--aux-layers \[\]: no aux layer ids"):
        api.record("tiny-llama", [1, 2, 3], out, style=style, aux_layers=[])
    assert not out.exists()


@pytest.mark.parametrize("field", ["components", "logits", "force"])
def test_a_switch_that_is_not_a_bool_is_refused(tmp_path: Path, field: str) -> None:
    """``components="no"`` was read as ``bool("no")``: True, the opposite of what was written."""
    with pytest.raises(UsageError, match=f"{field}: expected True or False, got 'no'"):
        RecordRequest.build("tiny-llama", tmp_path / "s.safetensors", input_ids=[1, 2], **{field: "no"})


def test_an_api_uint64_id_past_int64_is_named_exactly(tmp_path: Path) -> None:
    """A uint64 id of 2**63 + 5 given as an array was named '9223372036854775808' (rounded
    through float64 on its way to the vocabulary check): the id given is named, as the file
    reader names it."""
    ids = np.array([1, 2**63 + 5], dtype=np.uint64)
    with pytest.raises(UsageError, match=r"--input-ids: token id 9223372036854775813 at position 1 does not fit in 64"):
        RecordRequest.build("tiny-llama", tmp_path / "u.safetensors", input_ids=ids)
