"""Dumps written by the released stock tools, compared with a training dump of the same tokens.

The writers are the upstream files themselves, from the pinned wheels (scripts/upstream_sources.py):
SGLang's ``tensor_dump_forward_hook.py`` (0.5.5 and 0.5.23) and ``dumper.py`` (0.5.5, 0.5.9,
0.5.23), and Megatron's ``activation_logging.py`` with the released ``save_grads`` (megatron-core
0.18.0), imported with minimal stand-ins for the server modules they import, driven over tiny
models with SGLang's and Megatron's module trees (tests/stock_models.py) whose streams equal the
HF model's. vLLM's ``extract_hidden_states`` file is the connector's ``save_file`` layout. Each
must PASS against the training dump, and the seed's faults (slot shift, SGLang's +1, a post-norm
last slot) must be diagnosed as on our own dumps. The expected codes come from the construction.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from consistency.pipeline.compare import compare as run_compare
from consistency.dump.sets import open_side
from consistency.record.api import record_reference
from tests import stock_models as sm
from tests.conftest import prompt_ids, run_cli, tiny

N = 12
ROOT = Path(os.environ.get("CONSISTENCY_UPSTREAM") or
            Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "consistency-upstream")
# (name, training streams, server ids, convention, post-norm last in training, expected first code)
FAULTS = [
    ("pass", [1, 6, 10], "0,5,9", "OK"),
    ("slot shift", [0, 3, 7], "2,6,10", "SLOT_SHIFT"),  # the seed: one slot later, the embedding missing
    ("+1 offset", [2, 6, 9], "2,6,9", "LAYER_OFFSET"),  # stream ids read through SGLang's +1
    ("post-norm", [2, 6, N], "1,5,11", "NORM_MISSING"),  # training fed HF's post-norm last state
]


def _upstream(rel: str) -> Path:
    f = ROOT / rel
    if not f.is_file():
        pytest.skip(f"{f} not unpacked: run `python scripts/upstream_sources.py`")
    return f


def _reference(tmp: Path, fed: torch.Tensor, streams: list[int], tag: str, post_norm: bool | None = None) -> Path:
    """Training's dump; its last slot is HF's post-norm state for stream N unless ``post_norm=False``."""
    return record_reference(tiny("tiny-llama"), fed.numpy(), tmp / f"train-{tag}.safetensors", streams,
                            post_norm_last=(N in streams) if post_norm is None else post_norm, force=True)


def _prompt() -> torch.Tensor:
    return torch.as_tensor(prompt_ids(tiny("tiny-llama"), 40))


def _codes(rep) -> list[str]:  # noqa: ANN001
    return [f.code for f in rep.findings if f.severity.value == "error"]


def _check(rep, want: str) -> None:  # noqa: ANN001
    if want == "OK":
        assert rep.verdict == "pass", rep.summary
        assert not _codes(rep), rep.summary
    else:
        assert rep.verdict == "fail"
        assert want in _codes(rep), (_codes(rep), rep.summary)
        assert want in rep.summary or rep.findings[0].code == want, rep.summary


# -- SGLang --debug-tensor-dump-output-folder --------------------------------------------------------

def tensor_dump(version: str, out: Path, tp: int = 1, target_dir: bool = False,
                layers: list[int] | None = None) -> torch.Tensor:
    hook = _upstream(f"sglang-{version}/sglang/srt/debug_utils/tensor_dump_forward_hook.py")
    fed = None
    for r in range(tp):
        m = sm.SGLangLlama(tiny("tiny-llama").eval())
        with sm.stubbed(sm.sglang_stubs({"sglang.srt.debug_utils.tensor_dump_forward_hook": {}})):
            mod = sm.load_upstream(hook, "sglang.srt.debug_utils.tensor_dump_forward_hook")
            mod.register_forward_hook_for_model(m, str(out / "target" if target_dir else out), layers, tp, r, 0)
            fed = sm.run_passes(m, _prompt(), [24, 16], 2)  # two prefill chunks, two decode steps
    return fed


@pytest.fixture(scope="module")
def sglang_td(tmp_path_factory):
    out = tmp_path_factory.mktemp("td") / "dump"
    fed = tensor_dump("0.5.5", out)
    return out, fed


def test_tensor_dump_is_read_as_streams_per_pass(sglang_td):
    out, fed = sglang_td
    assert sorted(p.name for p in next(out.iterdir()).iterdir()) == [f"Pass{k:05d}.pt" for k in range(4)]
    with open_side(out) as d:
        summary = d.metadata.extra["source_format"]["summary"]
        assert summary == "SGLang tensor dump, 0.5.5-0.5.10 layout (one directory per rank), TP 1, 4 passes, streams 0..12"
        assert {f"hidden.{s}" for s in range(N + 1)} <= set(d.tensors) and "final_norm#4" in d.tensors
        assert d["input_ids#3"].read_all().tolist() == [int(fed[40])]
        assert d["positions#2"].read_all().tolist() == list(range(24, 40))
        assert any("moved back (checked on 3 pass(es))" in n for n in d.notes)
    from consistency.record.hf import capture_streams

    ref, _ = capture_streams(tiny("tiny-llama"), fed[None])
    with open_side(out) as d:  # the same values as the HF model's streams, pass by pass
        import numpy as np

        got = np.concatenate([d[k].rows_float(0, 99, np.float64) for k in ("hidden.5", "hidden.5#2", "hidden.5#3")])
        want = ref["hidden.5"][0, :41].double().numpy()
        assert np.abs(got - want).max() < 1e-5 * np.abs(want).max()


@pytest.mark.parametrize("case", FAULTS, ids=[c[0] for c in FAULTS])
def test_tensor_dump_against_training(sglang_td, tmp_path, case):
    out, fed = sglang_td
    tag, train, ids, want = case
    rep = run_compare(str(_reference(tmp_path, fed, train, tag)), str(out), cand_layer_ids=ids,
                      convention="sglang@0.5.5")
    _check(rep, want)
    if want == "OK":
        assert [s.identified_stream for s in rep.slots] == train


def test_tensor_dump_without_ids_compares_streams_and_says_aux_was_not_checked(sglang_td, tmp_path):
    out, fed = sglang_td
    rep = run_compare(str(_reference(tmp_path, fed, [1, 6, 10], "noids")), str(out))
    assert rep.verdict != "pass"  # the slots were not checked: never a PASS
    ok = {f.tensor for f in rep.findings if f.code == "OK"}
    assert {"hidden.0", f"hidden.{N}", "final_norm", "input_ids"} <= ok


def test_tensor_dump_0523_target_dir_tp2(tmp_path):
    out = tmp_path / "dump"
    fed = tensor_dump("0.5.23", out, tp=2, target_dir=True)
    assert sorted(p.name.split("_pid")[0] for p in (out / "target").iterdir()) == ["TP0_PP0_Rank0", "TP1_PP0_Rank1"]
    with open_side(out) as d:
        assert "0.5.11+ layout (target/ and draft/), TP 2, 4 passes, streams 0..12" in \
            d.metadata.extra["source_format"]["summary"]
        assert d.replica_checks and max(v[0] for v in d.replica_checks.values()) == 0.0
    rep = run_compare(str(_reference(tmp_path, fed, [1, 6, 10], "tp2")), str(out), cand_layer_ids="0,5,9",
                      convention="sglang@0.5.5")
    _check(rep, "OK")
    r = run_cli("inspect", str(out))
    assert r.returncode == 0 and "SGLang tensor dump, 0.5.11+ layout" in r.stdout.splitlines()[0]


def test_tensor_dump_refusals(sglang_td, tmp_path):
    out, _fed = sglang_td
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    rank = next(bad.iterdir())
    (rank / "Pass00001.pt").unlink()
    r = run_cli("inspect", str(bad))
    assert r.returncode == 2 and "Pass00001.pt is missing" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    shutil.copytree(rank, bad / rank.name.replace("_pid", "_pid9"))  # a restarted server: two pids for one rank
    r = run_cli("inspect", str(bad))
    assert r.returncode == 2 and "two processes wrote TP0_PP0" in r.stderr


# -- SGLang dumper ------------------------------------------------------------------------------------

class _Par:
    tp_rank = pp_rank = moe_ep_rank = moe_tp_rank = moe_dp_rank = attn_tp_rank = attn_dp_rank = attn_cp_rank = 0
    tp_size = pp_size = moe_ep_size = moe_tp_size = attn_tp_size = attn_dp_size = attn_cp_size = 1


def _dumper_stubs() -> dict:
    class Unreduced:  # layer_boundary types the plugin checks for
        pass

    return sm.sglang_stubs({
        "zmq": {}, "sglang.srt.managers": {},
        "sglang.srt.managers.io_struct": {"sock_recv": None, "sock_send": None, "wrap_as_pickle": None},
        "sglang.srt.runtime_context": {"get_parallel": _Par, "get_server_args": lambda: None,
                                       "get_serving": lambda: None},
        "sglang.srt.utils": {"get_device": lambda *a: "cpu"}, "sglang.srt.distributed": {},
        "sglang.srt.layers.dp_attention": {"is_dp_attention_enabled": lambda: False, "get_moe_cp_size": lambda: 1},
        "sglang.srt.layers.layer_boundary": {}, "sglang.srt.layers.layer_boundary.output": {"UnreducedOutput": Unreduced},
        "sglang.srt.layers.layer_boundary.residual": {},
        "sglang.srt.layers.layer_boundary.residual.stream": {"OwedOutput": type("OwedOutput", (), {})},
        "sglang.srt.debug_utils.dumper": {},
    })


def dumper_0523(out: Path, capture: list[int], post_norm_last: bool = False, filt: str | None = None) -> torch.Tensor:
    src = _upstream("sglang-0.5.23/sglang/srt/debug_utils/dumper.py")
    env = {"DUMPER_ENABLE": "1", "DUMPER_NON_INTRUSIVE_MODE": "all", "DUMPER_DIR": str(out), "DUMPER_EXP_NAME": "run1",
           "DUMPER_ENABLE_OUTPUT_CONSOLE": "0", **({"DUMPER_FILTER": filt} if filt else {})}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        m = sm.SGLangLlama(tiny("tiny-llama").eval(), capture, post_norm_last)
        with sm.stubbed(_dumper_stubs()):
            d = sm.load_upstream(src, "sglang.srt.debug_utils.dumper").dumper
            d.register_non_intrusive_dumper(m)
            return sm.run_passes(m, _prompt(), [24, 16], 2, between=d.step)
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


# the server's model file decides what the draft is fed: layers_to_capture (+1 applied) and the last slot
DUMPER_FAULTS = [
    ("pass", [1, 6, 10], [1, 6, 10], False, "OK"),
    ("slot shift", [0, 3, 7], [3, 7, 11], False, "SLOT_SHIFT"),
    ("+1 offset", [2, 6, 9], [3, 7, 10], False, "LAYER_OFFSET"),
    ("post-norm", [2, 6, N], [2, 6, N], True, "NORM_APPLIED"),  # the server feeds the post-norm last state
]


@pytest.mark.parametrize("case", DUMPER_FAULTS, ids=[c[0] for c in DUMPER_FAULTS])
def test_dumper_0523_aux_values_against_training(tmp_path, case):
    tag, train, capture, post, want = case
    fed = dumper_0523(tmp_path / "d", capture, post)
    rep = run_compare(str(_reference(tmp_path, fed, train, "t", post_norm=False)), str(tmp_path / "d"))
    _check(rep, want)
    if want == "OK":
        with open_side(tmp_path / "d") as d:
            s = d.metadata.extra["source_format"]["summary"]
            assert s == "SGLang dumper, 0.5.10+ (step=, value+meta), TP 1, 4 steps, streams 0..12, aux states as fed " \
                        "to the draft"
            assert d.metadata.extra["requests"] == {"0": "req-0"}


def test_dumper_layer_filter_keeps_streams_from_layer_outputs(tmp_path):
    """DUMPER_FILTER='layer_id is None or layer_id < 3' drops the norms of layers >= 3; the
    decoder layers' own outputs (no layer_id tag) still give every stream as their sum."""
    fed = dumper_0523(tmp_path / "d", [1, 6, 10], filt="layer_id is None or layer_id < 3")
    with open_side(tmp_path / "d") as d:
        assert "sum of model.layers.7.output.0 and .1" in d.metadata.tensors["hidden.8"].producer
    rep = run_compare(str(_reference(tmp_path, fed, [1, 6, 10], "f")), str(tmp_path / "d"))
    _check(rep, "OK")


@pytest.mark.parametrize("version", ["0.5.5", "0.5.9"])
def test_dumper_forward_pass_era_manual_dumps(tmp_path, version):
    """Up to 0.5.9 the dumper has no hooks: users call dumper.dump(name, value); 0.5.5 saves the
    raw value, 0.5.9 {"value", "meta"}. Dumps under our names are read."""
    src = _upstream(f"sglang-{version}/sglang/srt/debug_utils/dumper.py")
    env = {"SGLANG_DUMPER_DIR": str(tmp_path), "SGLANG_DUMPER_ENABLE": "1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        m = sm.SGLangLlama(tiny("tiny-llama").eval())
        with sm.stubbed(sm.sglang_stubs({"sglang.srt.debug_utils.dumper": {}})):
            mod = sm.load_upstream(src, "sglang.srt.debug_utils.dumper")
            dumper = mod.dumper
            if hasattr(dumper, "_config") and hasattr(mod, "DumperConfig"):
                pytest.skip("not the forward_pass_id era")
            hooks = [m.model.layers[k].input_layernorm.register_forward_hook(
                lambda _m, _i, out, k=k: dumper.dump(f"hidden.{k}", out[1], layer_id=k)) for k in (3, 7)]
            m.model.register_forward_pre_hook(lambda _m, args: (dumper.on_forward_pass_start(),
                                                                 dumper.dump("input_ids", args[0]),
                                                                 dumper.dump("positions", args[1])) and None)
            fed = sm.run_passes(m, _prompt(), [24, 16], 2)
            for h in hooks:
                h.remove()
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    run = next(tmp_path.glob("sglang_dump_*"))
    with open_side(run) as d:
        assert "up to 0.5.9 (forward_pass_id=)" in d.metadata.extra["source_format"]["summary"]
        assert {"hidden.3", "hidden.7", "input_ids", "positions", "hidden.3#4"} <= set(d.tensors)
    rep = run_compare(str(_reference(tmp_path, fed, [3, 7], "m")), str(run))
    assert {f.tensor for f in rep.findings if f.code == "OK"} >= {"hidden.3", "hidden.7", "input_ids"}


# -- Megatron --save-activations-interval ------------------------------------------------------------

def megatron_log(out: Path, tp: int = 1) -> torch.Tensor:
    root = _upstream("megatron-core-0.18.0/megatron/training/activation_logging.py").parent
    ids = _prompt()
    for r in range(tp):
        m = sm.MegatronGPT(tiny("tiny-llama").eval(), sp=(r, tp) if tp > 1 else None)
        with sm.stubbed(sm.megatron_stubs(root / "checkpointing.py", tp=r)):
            al = sm.load_upstream(root / "activation_logging.py", "megatron.training.activation_logging")
            al.enable_activation_logging([m], str(out))
            m(ids[None])
            al.save_activations(7)
    return ids


@pytest.fixture(scope="module")
def megatron_sp(tmp_path_factory):
    out = tmp_path_factory.mktemp("meg")
    return out, megatron_log(out, tp=2)


@pytest.mark.parametrize("case", FAULTS, ids=[c[0] for c in FAULTS])
def test_megatron_sequence_parallel_against_training(megatron_sp, tmp_path, case):
    out, ids = megatron_sp
    tag, train, sgl_ids, want = case
    assert sorted(p.name for p in (out / "activations" / "iter_0000007").iterdir()) == ["mp_rank_00.pth",
                                                                                        "mp_rank_01.pth"]
    rep = run_compare(str(_reference(tmp_path, ids, train, tag)), str(out), cand_layer_ids=sgl_ids,
                      convention="sglang@0.5.5")  # the server's ids, read under SGLang's rule
    _check(rep, want)


def test_megatron_streams_final_norm_and_summary(megatron_sp):
    out, _ids = megatron_sp
    with open_side(out) as d:
        assert d.metadata.extra["source_format"]["summary"] == "Megatron activation log, iter_0000007, TP 2, streams 0..12"
        assert d["hidden.3"].shape == (40, 64)  # [s/2, 1, h] on each rank, concatenated along s
        assert "final_layernorm is not hooked" in d.metadata.tensors[f"hidden.{N}"].producer


# -- vLLM extract_hidden_states ------------------------------------------------------------------------

def vllm_file(path: Path, streams: list[int], post_norm_last: bool = False) -> torch.Tensor:
    from consistency.record.fused import FusedDecoder

    ids = _prompt()
    final, aux = FusedDecoder(tiny("tiny-llama").eval(), streams)(ids[None])
    if post_norm_last:
        aux[-1] = final
    save_file({"hidden_states": torch.stack([a[0] for a in aux], dim=1).contiguous(), "token_ids": ids.clone()},
              str(path))
    return ids


VLLM_FAULTS = [
    ("pass", [1, 6, 10], [1, 6, 10], "1,6,10", False, "OK"),
    ("slot shift", [0, 3, 7], [3, 7, 11], "3,7,11", False, "SLOT_SHIFT"),
    ("+1 offset", [2, 6, 9], [3, 7, 10], "3,7,10", False, "LAYER_OFFSET"),
    ("post-norm", [2, 6, N], [2, 6, N], f"2,6,{N}", True, "NORM_APPLIED"),
]


@pytest.mark.parametrize("case", VLLM_FAULTS, ids=[c[0] for c in VLLM_FAULTS])
def test_vllm_extract_hidden_states_against_training(tmp_path, case):
    tag, train, streams, ids, post, want = case
    f = tmp_path / "0-a1b2c3d4.safetensors"  # a vLLM request id, as the connector names the file
    tok = vllm_file(f, streams, post)
    with open_side(f, [int(x) for x in ids.split(",")], "vllm") as d:
        assert d.format == "vllm-extract-hidden-states" and d.metadata.aux.stream_ids == streams
    with open_side(f.rename(tmp_path / "renamed.safetensors"), None, None) as d:  # any other name: speculators'
        assert d.format == "speculators"
    (tmp_path / "renamed.safetensors").rename(f)
    rep = run_compare(str(_reference(tmp_path, tok, train, tag, post_norm=False)), str(tmp_path), cand_layer_ids=ids,
                      convention="vllm")
    _check(rep, want)


def test_vllm_017_cannot_have_captured_id_0(tmp_path):
    vllm_file(tmp_path / "cmpl-9f2e.safetensors", [1, 6, 10])
    r = run_cli("inspect", str(tmp_path / "cmpl-9f2e.safetensors"), "--layer-ids", "0,6,10", "--convention", "vllm@0.17")
    assert r.returncode == 2 and "which vLLM 0.17 cannot capture" in r.stderr


def _restage(src: Path, out: Path, pp: int, vp: int) -> None:
    """Re-file a PP 1 log as Megatron writes it under pipeline (and virtual pipeline)
    parallelism: virtual stage c * pp + p holds the next N / (pp * vp) layers, named from 0
    in its model_chunk{c} (a ModuleList per chunk); the last one holds output_layer."""
    import re

    e = torch.load(next(src.glob("activations/iter_*/mp_rank_00.pth")), weights_only=True)["model_chunk0"]
    per = N // (pp * vp)
    files = {p: {f"model_chunk{c}": {} for c in range(vp)} for p in range(pp)}
    for k, v in e.items():
        m = re.match(r"^decoder\.layers\.(\d+)\.(.*)$", k)
        if m is None:
            files[pp - 1][f"model_chunk{vp - 1}"][k] = v
            continue
        vs, local = divmod(int(m.group(1)), per)
        files[vs % pp][f"model_chunk{vs // pp}"][f"decoder.layers.{local}.{m.group(2)}"] = v
    d = out / "activations" / "iter_0000007"
    d.mkdir(parents=True)
    for p, obj in files.items():
        torch.save(obj, d / f"mp_rank_00_{p:03d}.pth")


@pytest.mark.parametrize("pp, vp", [(2, 1), (2, 2), (3, 2)])
def test_megatron_pipeline_stages_name_layers_from_zero(tmp_path, pp, vp):
    """Each stage (and virtual chunk) names its layers decoder.layers.0..: read by their
    global numbers, the streams equal the PP 1 log's, and the faults are diagnosed as there."""
    import numpy as np

    ids = megatron_log(tmp_path / "pp1")
    _restage(tmp_path / "pp1", tmp_path / "pp", pp, vp)
    with open_side(tmp_path / "pp1") as one, open_side(tmp_path / "pp") as many:
        assert f"PP {pp}, streams 0..{N}" in many.metadata.extra["source_format"]["summary"]
        assert many.metadata.model.num_layers == N
        for s in range(N + 1):
            a, b = one[f"hidden.{s}"].rows_float(0, 99, np.float64), many[f"hidden.{s}"].rows_float(0, 99, np.float64)
            assert np.array_equal(a, b), s
    for tag, train, sgl_ids, want in FAULTS:
        rep = run_compare(str(_reference(tmp_path, ids, train, tag)), str(tmp_path / "pp"), cand_layer_ids=sgl_ids,
                          convention="sglang@0.5.5")
        _check(rep, want)


def test_dumper_runs_mixed_in_one_directory_are_refused_in_one_line(tmp_path):
    """Files of both eras (a forward_pass_id= file beside step= ones), or a bare value among
    {value, meta} payloads: two writers in one run, refused with one line naming the files."""
    dumper_0523(tmp_path / "d", [1, 6, 10])
    run = tmp_path / "d" / "run1"
    ids = next(run.glob("step=1___*___name=input_ids___*.pt"))
    mixed = tmp_path / "mixed"
    shutil.copytree(run, mixed)
    shutil.copy(ids, mixed / "forward_pass_id=1___rank=0___name=input_ids___dump_index=0.pt")
    bare = tmp_path / "bare"
    shutil.copytree(run, bare)
    f = next(bare.glob("step=2___*___name=non_intrusive__logits_processor.inputs.4.1___*.pt"))
    torch.save(torch.load(f, weights_only=True)["value"], f)
    for d, words in ((mixed, "both dumper eras"), (bare, f"{f.name} holds a bare value")):
        r = run_cli("inspect", str(d))
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and words in r.stderr, r.stderr


@pytest.mark.parametrize("version", ["0.5.5", "0.5.23"])
def test_tensor_dump_of_the_first_layers_does_not_take_them_for_all(tmp_path, version):
    """--debug-tensor-dump-layers 0 1 2 3 4 dumps those layers and model.norm: layers 0..4
    are not a 5-layer model. model.norm's residual is stream 12, not 5; stream 5 is layer 4's
    output (its residual after attention plus its MLP output); the server's ids 0,3,4 are
    streams [1, 4, 5] (SGLang's +1) and PASS against training's [1, 4, 5]."""
    fed = tensor_dump(version, tmp_path / "d", layers=[0, 1, 2, 3, 4])
    with open_side(tmp_path / "d") as d:
        assert d.metadata.model.num_layers is None
        assert "streams 0..5" in d.metadata.extra["source_format"]["summary"]
    rep = run_compare(str(_reference(tmp_path, fed, [1, 4, 5], "sub", post_norm=False)), str(tmp_path / "d"),
                      cand_layer_ids="0,3,4", convention="sglang@0.5.5")
    _check(rep, "OK")
    rep = run_compare(str(_reference(tmp_path, fed, [1, 4, 6], "sub6", post_norm=False)), str(tmp_path / "d"))
    assert rep.verdict != "pass"


def test_megatron_last_stream_adds_the_biases_the_linears_return(tmp_path):
    """With add_bias_linear, TE's linear_proj/linear_fc2 return (output, bias): the bias [h]
    is not in output0. Stream N is the last layer's input plus both outputs and both biases;
    without a linear_fc2 output (an MoE layer) stream N is not formed at all."""
    import numpy as np

    megatron_log(tmp_path / "a")
    f = next((tmp_path / "a").glob("activations/iter_*/mp_rank_00.pth"))
    obj = torch.load(f, weights_only=True)
    e = obj["model_chunk0"]
    last = f"decoder.layers.{N - 1}"
    g = torch.Generator().manual_seed(3)
    for mod in ("self_attention.linear_proj", "mlp.linear_fc2"):
        b = torch.randn(e[f"{last}.{mod}/output0"].shape[-1], generator=g)
        e[f"{last}.{mod}/output0"] = e[f"{last}.{mod}/output0"] - b  # what the linear returns beside its bias
        e[f"{last}.{mod}/output1"] = b
    out = tmp_path / "b" / "activations" / "iter_0000007"
    out.mkdir(parents=True)
    torch.save(obj, out / "mp_rank_00.pth")
    with open_side(tmp_path / "a") as one, open_side(tmp_path / "b") as bias:
        want = one[f"hidden.{N}"].rows_float(0, 99, np.float64)
        got = bias[f"hidden.{N}"].rows_float(0, 99, np.float64)
        assert np.abs(got - want).max() < 1e-5 * np.abs(want).max()
    del e[f"{last}.mlp.linear_fc2/output0"], e[f"{last}.mlp.linear_fc2/output1"]
    torch.save(obj, out / "mp_rank_00.pth")
    with open_side(tmp_path / "b") as moe:
        assert f"hidden.{N}" not in moe.tensors and "final_norm" in moe.tensors
