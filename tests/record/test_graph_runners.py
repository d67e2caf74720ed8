"""The graph-runner hooks (consistency/record/graph_runners.py) against the released runners.

Two halves. (1) What the hooks rely on is read from the pinned SGLang/vLLM wheels
(scripts/upstream_sources.py unpacks them; these checks skip without the trees, like
tests/record/test_patch_upstream.py): the classes and methods they wrap exist with the arguments
they read, the attributes they read after a replay are assigned by the runner, the graphs
are ``torch.cuda.CUDAGraph`` s (what graphs.hook_cuda_graphs sees), ``ForwardBatch.rids``
exists, and vLLM's size method runs before the model forward. (2) The wrapped methods run
on runners with that protocol (the engines cannot run here) over :class:`EagerGraph` s: the
warm-ups are not recorded, padded rows are trimmed to the runner's real rows, request ids
come from ``rids``, and what is drained equals what the same forwards record eagerly.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from consistency.record import Recorder, graph_runners, graphs, patch
from consistency.record.graph_runners import PER_REQUEST, TARGETS, patch_runner
from tests.graph_loop import EagerGraph

SGLANG = ["0.5.12.post1", "0.5.13", "0.5.17", "0.5.21", "0.5.22", "0.5.23"]
VLLM = ["0.25.0", "0.26.0", "0.33.0"]
CLASSIC = {"0.5.12.post1", "0.5.13"}  # model_executor/cuda_graph_runner.py; later: model_executor/runner/


def _root() -> Path:
    root = os.environ.get("CONSISTENCY_UPSTREAM") or \
        str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "consistency-upstream")
    return Path(root)


def _tree(pkg: str, version: str) -> Path:
    t = _root() / f"{pkg}-{version}"
    if not (t / "sglang/srt/model_executor/forward_batch_info.py").is_file() and \
            not (t / "vllm/v1/worker/gpu_model_runner.py").is_file():
        pytest.skip(f"{t}: runner files not unpacked (python scripts/upstream_sources.py)")
    return t


def _classes(tree: Path, module: str) -> dict[str, ast.ClassDef]:
    f = tree / (module.replace(".", "/") + ".py")
    if not f.is_file():
        return {}
    return {n.name: n for n in ast.walk(ast.parse(f.read_text())) if isinstance(n, ast.ClassDef)}


def _methods(cls: ast.ClassDef) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}


def _assigned(cls: ast.ClassDef) -> set[str]:
    return {n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
            and isinstance(n.value, ast.Name) and n.value.id == "self"}


@pytest.mark.parametrize("version", SGLANG)
def test_sglang_runners_have_what_the_hooks_read(version):
    tree = _tree("sglang", version)
    found = {}
    for module, classes in TARGETS.items():
        if not module.startswith("sglang."):
            continue
        defined = _classes(tree, module)
        for name, (capture, replay, _sizes, _ends) in classes.items():
            if name in defined:
                found[name] = defined[name]
                meths = _methods(defined[name])
                cap = [m for m in capture if m in meths]
                rep = [m for m in replay if m in meths]
                assert len(cap) == 1 and len(rep) == 1, (version, name, sorted(meths))
                args = [a.arg for a in meths[cap[0]].args.args]
                assert args[1] in ("bs", "num_seqs", "size") and args[2] == "forward", (version, name, args)
                assert [a.arg for a in meths[rep[0]].args.args][1] == "forward_batch"
                attrs = _assigned(defined[name])
                assert {"bs", "raw_bs"} <= attrs and attrs & set(PER_REQUEST), (version, name)
    want = {"CudaGraphRunner" if version in CLASSIC else "DecodeCudaGraphRunner", "EAGLEDraftCudaGraphRunner",
            "EAGLEDraftExtendCudaGraphRunner"}
    assert set(found) == want, (version, sorted(found))  # no pinned release is left unhooked
    decode = found["CudaGraphRunner" if version in CLASSIC else "DecodeCudaGraphRunner"]
    assert "raw_num_token" in _assigned(decode)  # the target's real token rows (decode and target verify)
    # the graphs are torch.cuda.CUDAGraph (graphs.hook_cuda_graphs wraps its capture_begin/_end/replay)
    src = (tree / ("sglang/srt/model_executor/cuda_graph_runner.py" if version in CLASSIC else
                   "sglang/srt/model_executor/runner_backend/full_cuda_graph_backend.py")).read_text()
    assert "torch.cuda.CUDAGraph()" in src and ".replay()" in src
    fb = _classes(tree, "sglang.srt.model_executor.forward_batch_info")["ForwardBatch"]
    assert "rids" in {n.target.id for n in fb.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


@pytest.mark.parametrize("version", VLLM)
def test_vllm_runner_has_what_the_hooks_read(version):
    tree = _tree("vllm", version)
    runner = _classes(tree, "vllm.v1.worker.gpu_model_runner")["GPUModelRunner"]
    meths = _methods(runner)
    assert [a.arg for a in meths["_warmup_and_capture"].args.args][:2] == ["self", "desc"]
    assert "num_tokens_unpadded" in [a.arg for a in meths["_get_slot_mappings"].args.args]
    assert "_model_forward" in meths
    body = meths["execute_model"]
    calls = {n.func.attr: n.lineno for n in ast.walk(body) if isinstance(n, ast.Call) and
             isinstance(n.func, ast.Attribute) and n.func.attr in ("_get_slot_mappings", "_model_forward")}
    assert calls["_get_slot_mappings"] < calls["_model_forward"]  # the sizes come before the replay
    src = (tree / "vllm/compilation/cuda_graph.py").read_text()
    assert "torch.cuda.CUDAGraph()" in src and "torch.cuda.graph(" in src and "entry.cudagraph.replay()" in src


# -- the wrapped methods, run ------------------------------------------------------------------

class _Model(torch.nn.Module):
    """A model forward as the patches see it: ids, positions, aux slot 0 (what the patch records)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(50, 6)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, forward_batch: object) -> torch.Tensor:
        patch.capture_input_ids(ids, positions, forward_batch)
        h = self.emb(ids) + positions[:, None].float()
        patch.capture_aux(0, h)
        return h


class _Runner:
    """SGLang's runner protocol, as the checks above read it from the releases: a capture
    method per batch size (two eager warm-ups, then the graph), a replay method that pads the
    batch to a captured size, fills the static buffers, sets ``raw_bs``/``bs`` (and, for the
    target runner, ``raw_num_token``) and replays; ``num_tokens_per_bs`` or
    ``captured_req_width`` rows per request."""

    capture_bs = (2, 4)

    def __init__(self, width_attr: str, per: int, sets_raw_tokens: bool) -> None:
        setattr(self, width_attr, per)
        self.per, self.sets_raw_tokens = per, sets_raw_tokens
        self.model = _Model()
        n = max(self.capture_bs) * per
        self.ids, self.pos = torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.long)
        self.graphs: dict[int, EagerGraph] = {}

    def _capture(self, bs: int, forward: object) -> None:
        n = bs * self.per
        fb = SimpleNamespace(rids=None, forward_mode=None)
        for _ in range(2):  # warm-up on dummy inputs, as upstream does
            forward(self.ids[:n], self.pos[:n], fb)
        g = EagerGraph()
        g.capture(lambda: forward(self.ids[:n], self.pos[:n], fb))
        self.graphs[bs] = g

    def _replay(self, forward_batch: SimpleNamespace) -> None:
        raw_bs = len(forward_batch.rids)
        bs = next(b for b in self.capture_bs if b >= raw_bs)
        n = raw_bs * self.per
        self.ids[:n].copy_(forward_batch.input_ids)
        self.pos[:n].copy_(forward_batch.positions)
        self.raw_bs, self.bs = raw_bs, bs
        if self.sets_raw_tokens:
            self.raw_num_token = n
        self.graphs[bs].replay()


class Classic(_Runner):
    def capture_one_batch_size(self, bs: int, forward: object) -> None:
        self._capture(bs, forward)

    def replay(self, forward_batch: SimpleNamespace) -> None:
        self._replay(forward_batch)


class Shaped(_Runner):
    def capture_one_shape(self, size: int, forward: object) -> None:
        self._capture(size, forward)

    def execute(self, forward_batch: SimpleNamespace) -> None:
        self._replay(forward_batch)


def _batches(per: int) -> list[SimpleNamespace]:
    out, g = [], torch.Generator().manual_seed(3)
    for k, real in enumerate((3, 1, 2, 3)):
        n = real * per
        out.append(SimpleNamespace(rids=[f"req-{k}-{i}" for i in range(real)], forward_mode=None,
                                   input_ids=torch.randint(0, 50, (n,), generator=g),
                                   positions=torch.arange(n) + 10 * k, extend_seq_lens=None))
    return out


@pytest.mark.parametrize("cls,width,sets_raw", [(Classic, "num_tokens_per_bs", True),
                                                (Shaped, "captured_req_width", True),
                                                (Shaped, "captured_req_width", False)])  # EAGLE draft runners
def test_wrapped_runner_records_what_the_same_forwards_record_eagerly(cls, width, sets_raw, tmp_path):
    per = 2
    graphs.enable(hook_torch=False)
    try:
        own = ("capture_one_batch_size", "capture_one_shape", "replay", "execute")
        sub = type(f"{cls.__name__}Copy", (cls,), {k: v for k, v in cls.__dict__.items() if k in own})  # fresh class
        spec = TARGETS["sglang.srt.model_executor.cuda_graph_runner"]["CudaGraphRunner"]
        assert sorted(patch_runner(sub, *spec, runtime="sglang")) == sorted(m for m in own if m in sub.__dict__)
        runner = sub(width, per, sets_raw)
        with torch.no_grad(), Recorder(tmp_path / "graph.safetensors") as rec:
            for bs in runner.capture_bs:
                getattr(runner, "capture_one_batch_size" if cls is Classic else "capture_one_shape")(bs, runner.model)
            assert not rec.tensors  # warm-ups and captures record nothing
            for fb in _batches(per):
                getattr(runner, "replay" if cls is Classic else "execute")(fb)
        patch._state.pending_ids = None
        graphs.disable()
        with torch.no_grad(), Recorder(tmp_path / "eager.safetensors") as eager:
            for fb in _batches(per):
                runner.model(fb.input_ids, fb.positions, fb)
    finally:
        graphs.disable()
        patch._state.pending_ids = None
    got, want = dict(rec.tensors), dict(eager.tensors)
    assert sorted(got) == sorted(want) and len(got) == 4 * 4  # input_ids, positions, request_ids, aux.0
    for n in want:
        assert np.array_equal(got[n][0], want[n][0]), n
    label = f"sglang.{sub.__name__}"
    tag = rec.metadata.tensors["aux.0#2"].graph
    assert (tag.label, tag.batch_size, tag.real_batch_size, tag.rows, tag.kept) == (label, 2, 1, 2 * per, per)


def test_vllm_sizes_reach_the_next_replay(tmp_path):
    class Runner:
        def _warmup_and_capture(self, desc: object, cudagraph_runtime_mode: object = None) -> None:
            for _ in range(2):
                capture("aux.0", self.buf[:desc.num_tokens])  # an eager warm-up: not recorded
            self.g = EagerGraph()
            self.g.capture(lambda: capture("aux.0", self.buf[:desc.num_tokens]))

        def _get_slot_mappings(self, num_tokens_padded: int, num_reqs_padded: int, num_tokens_unpadded: int,
                               ubatch_slices: object = None) -> tuple:
            return None, None

        def _model_forward(self, replay: bool) -> None:  # the target: a replay, or an eager forward
            if replay:
                self.g.replay()

    from consistency.record import capture

    TARGET = TARGETS["vllm.v1.worker.gpu_model_runner"]["GPUModelRunner"]
    assert patch_runner(Runner, *TARGET, runtime="vllm") == ["_warmup_and_capture", "_get_slot_mappings",
                                                             "_model_forward"]
    graphs.enable(hook_torch=False)
    r = Runner()
    r.buf = torch.arange(8 * 3, dtype=torch.float32).view(8, 3)
    try:
        with Recorder(tmp_path / "v.safetensors") as rec:
            r._warmup_and_capture(SimpleNamespace(num_tokens=8, num_reqs=8))
            for real in (5, 8, 0, 2):
                r._get_slot_mappings(num_tokens_padded=8, num_reqs_padded=8, num_tokens_unpadded=real)
                r._model_forward(True)
            r._get_slot_mappings(num_tokens_padded=8, num_reqs_padded=8, num_tokens_unpadded=3)
            r._model_forward(False)  # an eager target forward: its sizes are not the drafter's
            r.g.replay()  # the drafter's replay after it: no sizes, kept whole, and the tag says untrimmed
    finally:
        graphs.disable()
    rows = [rec.tensors[k][0].shape[0] for k in ("aux.0", "aux.0#2", "aux.0#3", "aux.0#4")]
    assert rows == [5, 8, 2, 8]  # the idle replay (0 real tokens) records nothing
    tags = [rec.metadata.tensors[k].graph for k in ("aux.0", "aux.0#4")]
    assert (tags[0].label, tags[0].tokens, tags[0].batch_size, tags[0].kept) == ("vllm.Runner", 8, 8, 5)
    assert tags[1].kept is None and tags[1].real_tokens is None


def test_auto_is_inert_without_both_variables(monkeypatch):
    import sys

    monkeypatch.delenv("CONSISTENCY_RECORD_GRAPHS", raising=False)
    monkeypatch.setenv("CONSISTENCY_RECORD", "/tmp/x.safetensors")
    before = list(sys.meta_path)
    graph_runners.auto()
    assert sys.meta_path == before
