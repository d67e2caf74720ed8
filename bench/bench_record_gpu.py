"""Recorder overhead on a GPU: an 8B-shaped Llama, prefill and decode, recording off / on.

    python bench/bench_record_gpu.py --out results.json          # on a CUDA machine (H200 here)
    python bench/bench_record_gpu.py --small                     # a quick CPU-free smoke configuration

Modes, interleaved round-robin so clock and thermal drift hit all of them alike:
  off          no hooks at all (the baseline)
  inert        hooks that call consistency.record.capture with recording off (a shipped patch)
  aux3         AsyncRecorder, the 3 aux slots (streams 2, N/2, N-3)
  all          AsyncRecorder, every stream 0..N
  naive_aux3   the naive capture: tensor.cpu() inside the hook, 3 slots
  naive_all    the naive capture, every stream
  aux3_step    aux3/all with every step's staged captures sent alone (staging flush_bytes 0)
  all_step
  aux3_base    aux3/all with the AsyncRecorder of another checkout (--baseline-tree): before/after
  all_base     in the same run
Self-checks (``verified_same_run``, ``graph_verified_same_run``): the dump equals copies the
hooks took on the device of the very tensors captured, in the same run (two runs differ by
kernel non-determinism, which is not the recorder's).
And, with ``--graphs`` (bench/graph_steps.py: a static KV cache, decode and target-verify
steps as ``torch.cuda.CUDAGraph`` replays, as SGLang and vLLM run them by default):
  g_off        graph replays, nothing recorded (the baseline of the g_ modes: always run;
               --graphs with no g_ mode in --modes runs all three)
  g_aux3       graph-safe capture (consistency/record/graphs.py) of the 3 aux slots, every replay
  g_all        graph-safe capture of every stream, every replay
Reported: median milliseconds per prefill (batch x tokens) and its ratio to ``off``; per
eager decode step, the median over interleaved blocks (bench/decode_blocks.py) and the median
(and quartiles) of each block's ratio to that block's ``off``; for the g_ modes per decode replay and per verify replay
([batch, verify-tokens] tokens), ratios to ``g_off``. Random bf16 weights built on the GPU;
nothing is downloaded.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import emit  # noqa: E402

from consistency.record import capture, graphs  # noqa: E402
from bench.decode_blocks import decode_blocks, enter, leave, recorder  # noqa: E402
from consistency.record.async_capture import AsyncRecorder  # noqa: E402

MODES = ("off", "inert", "aux3", "all", "naive_aux3", "naive_all", "aux3_step", "all_step", "aux3_base", "all_base")
GMODES = ("g_off", "g_aux3", "g_all")


def build(small: bool):  # noqa: ANN201
    from transformers import LlamaConfig, LlamaForCausalLM

    if small:
        cfg = LlamaConfig(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                          num_key_value_heads=2, vocab_size=32000, max_position_embeddings=4096)
    else:  # Llama-3-8B shapes
        cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                          num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    return model.eval()


class Hooks:
    """Forward hooks that capture streams the way a runtime patch would."""

    def __init__(self, model, streams: list[int], naive: bool, keep: bool = False) -> None:  # noqa: ANN001
        self.handles = []
        self.sink: list[torch.Tensor] = []
        # keep: each captured tensor also copied on the device, in the same run (the self-check's
        # reference); inside a CUDA-graph capture the copy is a static buffer every replay refreshes
        self.keep: list[tuple[str, torch.Tensor]] | None = [] if keep else None
        layers = model.model.layers
        n = len(layers)
        for s in streams:
            if s == 0:
                self.handles.append(layers[0].register_forward_pre_hook(self._pre(naive)))
            else:
                self.handles.append(layers[s - 1].register_forward_hook(self._post(f"hidden.{s}", naive)))
        assert all(0 <= s <= n for s in streams)

    def _pre(self, naive: bool):  # noqa: ANN202
        def hook(_m, args):  # noqa: ANN001, ANN202
            self._take("hidden.0", args[0], naive)
        return hook

    def _post(self, name: str, naive: bool):  # noqa: ANN202
        def hook(_m, _a, out):  # noqa: ANN001, ANN202
            self._take(name, out[0] if isinstance(out, tuple) else out, naive)
        return hook

    def _take(self, name: str, t: torch.Tensor, naive: bool) -> None:
        if naive:
            self.sink.append(t.cpu())  # blocks until the copy lands
        else:
            capture(name, t)
            if self.keep is not None:
                self.keep.append((name, t.detach().clone()))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def say(msg: str) -> None:
    print(f"[bench_record_gpu] {msg}", file=sys.stderr, flush=True)


def timed(fn) -> float:  # noqa: ANN001
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1000


def run(args: argparse.Namespace) -> dict:
    model = build(args.small)
    n = model.config.num_hidden_layers
    aux = [2, n // 2, n - 3]
    every = list(range(n + 1))
    spec = {"off": None, "inert": (aux, False, False), "aux3": (aux, False, True), "all": (every, False, True),
            "naive_aux3": (aux, True, False), "naive_all": (every, True, False)}
    spec |= {f"{m}_{v}": spec[m] for m in ("aux3", "all") for v in ("step", "base")}
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.tokens), device="cuda")
    times: dict[str, dict[str, list[float]]] = {m: {"prefill": [], "decode": []} for m in MODES}
    dropped: dict[str, int] = {}

    def once(mode: str) -> None:
        s = spec[mode]
        hooks = Hooks(model, s[0], s[1]) if s else None
        rec = recorder(args.tmp, mode, args.baseline_tree, ring_bytes=2 << 30) if s and s[2] else None
        if rec is not None:
            enter(rec)
        try:
            with torch.no_grad():
                cache = {}

                def prefill() -> None:
                    out = model(input_ids=ids, use_cache=True)
                    cache["pkv"] = out.past_key_values
                    cache["next"] = out.logits[:, -1:].argmax(-1)

                times[mode]["prefill"].append(timed(prefill))
                pkv, nxt = cache["pkv"], cache["next"]
                for _ in range(2):  # the decode is timed in blocks (bench/decode_blocks.py)
                    out = model(input_ids=nxt, past_key_values=pkv, use_cache=True)
                    pkv, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
        finally:
            if rec is not None:
                rec.wait()
                dropped[mode] = dropped.get(mode, 0) + sum(rec.dropped.values())
                leave(rec)
                rec.discard()  # only the capture path is timed; writing is measured by bench_compare
            if hooks is not None:
                hooks.remove()
                hooks.sink.clear()

    modes = [m for m in MODES if m in args.modes]
    say(f"model built: {n} layers; capturing graphs" if args.graphs else f"model built: {n} layers")
    graph_run = GraphRun(model, ids, args, {"g_off": None, "g_aux3": aux, "g_all": every}) if args.graphs else None
    named = [m for m in GMODES if m in args.modes] or list(GMODES)  # --graphs, no g_ mode named: all three
    gmodes = ["g_off"] + [m for m in named if m != "g_off"] if graph_run else []  # ratios need g_off: always run
    say("warm-up")
    for mode in modes:  # warm-up: kernels, allocator, pinned pools
        once(mode)
    for mode in gmodes:
        graph_run.once(mode)
    for mode in modes:
        times[mode] = {"prefill": [], "decode": []}
    graph_run and graph_run.times.clear()
    for i in range(args.repeat):
        say(f"round {i + 1} of {args.repeat}")
        for mode in modes:
            once(mode)
        for mode in gmodes:
            graph_run.once(mode)
    if modes and modes[0] == "off":
        say(f"decode: {args.blocks} interleaved blocks of {args.decode_steps} steps")
        blocks, bdropped = decode_blocks(
            model, ids, modes, lambda m: Hooks(model, spec[m][0], spec[m][1]) if spec[m] else None,
            lambda m: recorder(args.tmp, m, args.baseline_tree) if spec[m] and spec[m][2] else None,
            args.decode_steps, args.blocks, timed)
        for m, n_ in bdropped.items():
            dropped[m] = dropped.get(m, 0) + n_
    verified = verify(model, ids, every, args.tmp) if "all" in modes else None

    res: dict = {"verified_same_run": verified, "dropped": dropped, "device": torch.cuda.get_device_name(), "torch": torch.__version__, "batch": args.batch,
                 "tokens": args.tokens, "decode_steps": args.decode_steps, "blocks": args.blocks, "repeat": args.repeat,
                 "layers": n, "hidden": model.config.hidden_size, "modes": {}}
    if "off" in modes:
        base = statistics.median(times["off"]["prefill"])
        for mode in modes:
            med = statistics.median(times[mode]["prefill"])
            res["modes"][mode] = {"prefill_ms": round(med, 3), "prefill_ratio": round(med / base, 4)} | blocks[mode]
    if graph_run is not None:
        res["graph_modes"] = graph_run.summary(gmodes)
        res["graph_verified_same_run"] = graph_run.verify(every, args.tmp)
        res["verify_tokens"] = args.verify_tokens
    return res


class GraphRun:
    """The g_ modes: per mode, decode and verify graphs captured once (with the mode's hooks
    and graph-safe mode on, so their captures become graph buffers), then timed replays."""

    def __init__(self, model, ids: torch.Tensor, args: argparse.Namespace, spec: dict) -> None:  # noqa: ANN001
        from bench.graph_steps import GraphSteps

        self.model, self.ids, self.args, self.spec = model, ids, args, spec
        self.steps = GraphSteps(model, args.batch, args.tokens, args.decode_steps, args.verify_tokens)
        self.times: dict[str, dict[str, list[float]]] = {}
        self.dropped: dict[str, int] = {}
        gen = torch.Generator().manual_seed(0)
        self.bank = torch.randint(0, model.config.vocab_size, (args.decode_steps, args.batch, args.verify_tokens),
                                  generator=gen).to(ids.device)
        self.graphs: dict[str, tuple] = {}
        graphs.enable()
        say("graph modes: prefill")
        with torch.no_grad():
            self.steps.prefill(ids)
            for mode, streams in spec.items():
                say(f"capturing {mode}")
                hooks = Hooks(model, streams, False) if streams else None
                rec = AsyncRecorder(args.tmp / "capture.safetensors", force=True).prepare() if streams else None
                if rec is not None:
                    rec.__enter__()
                try:
                    self.graphs[mode] = (self.steps.capture(self.steps.decode_body),
                                         self.steps.capture(self.steps.verify_body))
                finally:
                    if rec is not None:
                        rec.discard()
                    if hooks is not None:
                        hooks.remove()  # replays run no Python: the hooks are needed at capture only
        graphs.disable()

    def once(self, mode: str) -> None:
        st, args = self.steps, self.args
        dec, ver = self.graphs[mode]
        rec = AsyncRecorder(args.tmp / f"{mode}.safetensors", force=True, max_host_bytes=64 << 30,
                            ring_bytes=2 << 30).prepare() if self.spec[mode] else None
        t = self.times.setdefault(mode, {"decode": [], "verify": []})
        graphs.enable()
        if rec is not None:
            rec.__enter__()
        try:
            with torch.no_grad(), graphs.replay_sizes(real_tokens=args.batch, real_bs=args.batch):
                st.prefill(self.ids)

                def decode() -> None:
                    for _ in range(args.decode_steps):
                        dec.replay()
                        st.advance()

                def verify() -> None:
                    for i in range(args.decode_steps):
                        st.vids.copy_(self.bank[i])
                        ver.replay()

                t["decode"].append(timed(decode) / args.decode_steps)
                st.set_verify(args.tokens + args.decode_steps, torch.Generator().manual_seed(1))
                t["verify"].append(timed(verify) / args.decode_steps)
        finally:
            graphs.disable()
            if rec is not None:
                rec.wait()
                self.dropped[mode] = self.dropped.get(mode, 0) + sum(rec.dropped.values())
                rec.discard()

    def summary(self, modes: list[str]) -> dict:
        base = {k: statistics.median(self.times["g_off"][k]) for k in ("decode", "verify")}
        out: dict = {"dropped": self.dropped}
        for mode in modes:
            med = {k: statistics.median(self.times[mode][k]) for k in ("decode", "verify")}
            out[mode] = {f"{k}_ms": round(v, 4) for k, v in med.items()} | {
                f"{k}_ratio": round(med[k] / base[k], 4) for k in med}
        return out

    def verify(self, streams: list[int], tmp: Path) -> dict:
        """Graphs captured with hooks that also copy each captured tensor into a static buffer
        of their own (refreshed by every replay, like the recorder's): 3 decode replays and a
        verify replay, recorded graph-safe; the dump equals the copies of the same replays."""
        st = self.steps
        hooks = Hooks(self.model, streams, False, keep=True)
        assert hooks.keep is not None
        with torch.no_grad():
            st.prefill(self.ids)
            graphs.enable()
            rec = AsyncRecorder(tmp / "capture.safetensors", force=True).prepare()
            rec.__enter__()
            try:
                made = []
                for body in (st.decode_body, st.verify_body):
                    hooks.keep.clear()
                    g = st.capture(body)  # warm-ups copy eagerly, then the capture: its copies are the last
                    made.append((g, hooks.keep[-len(streams):]))
            finally:
                rec.discard()
                hooks.remove()
            (dec, dec_static), (ver, ver_static) = made
            st.prefill(self.ids)
            copies: list[tuple[str, torch.Tensor]] = []
            with AsyncRecorder(tmp / "graph-steps.safetensors", force=True) as rec:
                for _ in range(3):
                    dec.replay()
                    copies += [(n, b.clone()) for n, b in dec_static]
                    st.advance()
                st.set_verify(self.args.tokens + 3, torch.Generator().manual_seed(2))
                ver.replay()
                copies += [(n, b.clone()) for n, b in ver_static]
            graphs.disable()
        from consistency.dump.reader import open_dump

        with open_dump(rec.written) as d:
            tagged = sum(1 for m in d.metadata.tensors.values() if m.graph is not None)
        return same(rec.written, copies) | {"tagged": tagged}


def same(dump: Path, copies: list[tuple[str, torch.Tensor]]) -> dict:
    """The dump against the device copies the same run took of the same tensors, bit for bit:
    the k-th copy of a name is the dump's ``name#k`` (kernel non-determinism between two runs
    cannot read as a recorder fault here)."""
    from consistency.dump.reader import open_dump

    counts: dict[str, int] = {}
    differ: list[str] = []
    with open_dump(dump) as d:
        for name, t in copies:
            k = counts[name] = counts.get(name, 0) + 1
            key = name if k == 1 else f"{name}#{k}"
            want = t.detach().contiguous().cpu()
            want = (want.view(torch.int16).numpy().view(np.uint16) if want.dtype == torch.bfloat16 else want.numpy())
            if key not in d.tensors or not np.array_equal(d[key].read_all().reshape(want.shape), want):
                differ.append(key)
        extra = len(d.tensors) - len(copies)
    return {"captures": len(copies), "equal": not differ and extra == 0, "differ": differ[:8], "extra_in_dump": extra}


def verify(model, ids: torch.Tensor, streams: list[int], tmp: Path) -> dict:  # noqa: ANN001
    """The async recorder's dump holds exactly what the model computed in the same run: a
    prefill (large captures) and two decode steps (small, staged captures), each tensor also
    copied on the device by the hook that captured it."""

    hooks = Hooks(model, streams, naive=False, keep=True)
    with AsyncRecorder(tmp / "verify.safetensors", force=True, ring_bytes=2 << 30) as rec, torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        pkv, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
        for _ in range(2):
            out = model(input_ids=nxt, past_key_values=pkv, use_cache=True)
            pkv, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
    hooks.remove()
    assert rec.written is not None and hooks.keep is not None
    return same(rec.written, hooks.keep) | {"dropped": sum(rec.dropped.values())}


def main() -> None:
    import faulthandler

    faulthandler.enable()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--decode-steps", type=int, default=16, help="decode steps per timed block (and graph round)")
    ap.add_argument("--blocks", type=int, default=40, help="interleaved eager decode blocks")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--tmp", type=Path, default=Path("/tmp"))
    ap.add_argument("--out", type=Path)
    ap.add_argument("--graphs", action="store_true", help="also the g_ modes: decode and verify as CUDA-graph replays")
    ap.add_argument("--verify-tokens", type=int, default=4)
    ap.add_argument("--modes", default=",".join(MODES[:6] + GMODES))
    ap.add_argument("--baseline-tree", type=Path, help="a checkout whose AsyncRecorder the *_base modes time")
    args = ap.parse_args()
    args.modes = set(args.modes.split(","))
    res = run(args)
    emit(res, args.out)


if __name__ == "__main__":
    main()
