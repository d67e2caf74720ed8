"""Lint scenarios across the axes a user's setup varies on (issue 34): where the draft config
writes its ids, what training fed, whether (and which) runtime is named, the slot count, the
appended verifier state on the training side, and methods x runtime releases.

The expected answer of each case comes from the construction and from facts typed here from
the released sources, never from the linter's tables (contract/conventions.py, methods.py):

- a Llama target with N layers; the draft's aux streams S (three, away from 0 and N), its
  defaults D = [2, N//2, N-3] (vLLM's, speculators', and SGLang's [1, N//2-1, N-4] + 1);
- SGLang reads only ``eagle_config.eagle_aux_hidden_state_layer_ids``, id j of a Llama model
  file being stream j + 1 (the output of layer j), every release;
- vLLM reads the top-level key as stream ids; its V1 runner falls back to the nested key from
  0.22 (read as stream ids), its V2 runner does not before 0.28 and then reads
  ``eagle_config.layer_ids``; Llama runs V1 on 0.22.0 and V2 from 0.23.0 (0.23.0's
  DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES); without ids it feeds D;
- speculators' data generation appends N to the aux ids; the trainer drops it;
- vLLM accepts Medusa up to 0.32.0 and not in 0.33.0, the MLP speculator in no release read
  (its registry entry is commented out), DFlash from 0.20.0, EAGLE/EAGLE-3/ngram in every
  release read (0.18.0-0.33.0); SGLang has no Medusa and no MLP speculator.
"""

from __future__ import annotations

from dataclasses import dataclass

N = 32
S = [3, 12, 25]  # the draft's aux streams: distinct from D and from S - 1
D = [2, N // 2, N - 3]
LAYOUTS = ("both", "top", "nested")  # which keys the draft config writes (both spell S)
RUNTIMES: tuple[str | None, ...] = (None, "sglang@0.5.23", "vllm@0.22.0", "vllm@0.24.0", "vllm@0.33.0")
TRAININGS = ("S", "D", "S+1", "two", "S+N")  # what --trained-with states


def served(layout: str, runtime: str) -> list[int]:
    """What ``runtime`` feeds a draft whose config writes S in ``layout`` (the facts above)."""
    name, version = runtime.split("@")
    v = tuple(int(x) for x in version.split("."))
    top, nested = layout in ("both", "top"), layout in ("both", "nested")
    if name == "sglang":
        return list(S) if nested else list(D)  # nested ids are written as layer outputs: S - 1, read + 1
    if top:
        return list(S)
    v1 = v < (0, 23)  # Llama: V1 on 0.22.0 (not yet on the default-V2 list), V2 from 0.23.0
    if nested and v1 and v >= (0, 22):
        return [s - 1 for s in S]  # V1 reads the nested layer-output ids as stream ids
    return list(D)


def readings(layout: str) -> list[list[int]]:
    """Every stream list some SGLang or vLLM release feeds this draft (no runtime named)."""
    out = [list(S) if layout != "top" else list(D)]  # SGLang
    out.append(list(S) if layout != "nested" else list(D))  # vLLM before 0.22 and on V2 before 0.28
    if layout == "nested":
        out.append([s - 1 for s in S])  # vLLM V1 from 0.22
    return out


def training(kind: str) -> tuple[str, list[int]]:
    """(--trained-with, the streams training fed the draft's slots)."""
    if kind == "S":
        return "stream:" + ",".join(map(str, S)), list(S)
    if kind == "D":
        return "stream:" + ",".join(map(str, D)), list(D)
    if kind == "S+1":
        return "stream:" + ",".join(str(s + 1) for s in S), [s + 1 for s in S]
    if kind == "two":
        return "stream:" + ",".join(map(str, S[:2])), list(S[:2])
    if kind == "S+N":  # speculators' data-generation ids: the aux ids, then N (the verifier's last state)
        return "speculators:" + ",".join(map(str, [*S, N])), list(S)
    raise ValueError(kind)


@dataclass(frozen=True)
class IdsCase:
    layout: str
    train: str
    runtime: str | None

    @property
    def name(self) -> str:
        return f"{self.layout}-{self.train}-{self.runtime or 'unnamed'}"

    def config(self) -> dict:
        from tests.lint.test_lint_support import sglang_config

        cfg = sglang_config(ids=[s - 1 for s in S] if self.layout in ("both", "nested") else None)
        if self.layout in ("both", "top"):
            cfg["eagle_aux_hidden_state_layer_ids"] = list(S)
        return cfg

    def expect(self) -> tuple[str, str | None]:
        """(verdict, the error code that must say why, or None)."""
        _spec, fed = training(self.train)
        if len(fed) != len(S):
            return "fail", "IDS012"  # a slot-count mismatch, whatever the runtime
        if self.runtime is None:
            rs = readings(self.layout)
            return ("fail", "IDS013") if all(r != fed for r in rs) else ("pass", None)
        return ("pass", None) if served(self.layout, self.runtime) == fed else ("fail", "IDS002")

    def reading_dependent(self) -> bool:
        _spec, fed = training(self.train)
        rs = readings(self.layout)
        return self.runtime is None and len(fed) == len(S) and any(r == fed for r in rs) and any(r != fed for r in rs)


def ids_cases() -> list[IdsCase]:
    return [IdsCase(lay, tr, rt) for lay in LAYOUTS for tr in TRAININGS for rt in RUNTIMES]


# -- methods x runtime releases --------------------------------------------------------------

VLLM_RELEASES = ("0.18.0", "0.20.0", "0.22.0", "0.32.0", "0.33.0")
METHODS = ("eagle", "eagle3", "medusa", "mlp_speculator", "dflash", "ngram")


def vllm_accepts(method: str, release: str) -> bool:
    v = tuple(int(x) for x in release.split("."))
    return {"medusa": v < (0, 33), "mlp_speculator": False, "dflash": v >= (0, 20)}.get(method, True)


@dataclass(frozen=True)
class MethodCase:
    method: str
    release: str | None  # None: vLLM, version not pinned (the newest release read)

    @property
    def name(self) -> str:
        return f"{self.method}-vllm@{self.release or 'newest'}"

    def serve(self) -> str:
        spec = f'{{"method": "{self.method}", "model": "org/draft", "num_speculative_tokens": 3}}'
        if self.method == "ngram":
            spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'
        return f"vllm serve meta-llama/Llama-3.1-8B-Instruct --speculative-config '{spec}'"

    def expect(self) -> str | None:
        """'error', 'warning' (not pinned, refused by the newest release only) or None."""
        newest = VLLM_RELEASES[-1]
        if self.release is not None:
            return None if vllm_accepts(self.method, self.release) else "error"
        if vllm_accepts(self.method, newest):
            return None
        return "warning" if any(vllm_accepts(self.method, r) for r in VLLM_RELEASES) else "error"


def method_cases() -> list[MethodCase]:
    return [MethodCase(m, r) for m in METHODS for r in (*VLLM_RELEASES, None)]


SGLANG_RELEASES = ("0.5.9", "0.5.12", "0.5.23")
SGLANG_ALGOS = ("EAGLE3", "NGRAM", "DFLASH", "MEDUSA")


@dataclass(frozen=True)
class SglangMethodCase:
    algo: str
    release: str

    @property
    def name(self) -> str:
        return f"{self.algo}-sglang@{self.release}"

    def serve(self) -> str:
        return ("python -m sglang.launch_server --model-path meta-llama/Llama-3.1-8B-Instruct "
                f"--speculative-algorithm {self.algo} --speculative-draft-model-path org/draft "
                "--speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4")

    def expect(self) -> str | None:
        """The error code that must refuse it (spec_info.py per wheel: DFLASH from 0.5.12, no MEDUSA), or None."""
        if self.algo == "MEDUSA":
            return "MDS001"
        if self.algo == "DFLASH" and tuple(int(x) for x in self.release.split(".")) < (0, 5, 12):
            return "MTH001"
        return None


def sglang_method_cases() -> list[SglangMethodCase]:
    return [SglangMethodCase(a, r) for a in SGLANG_ALGOS for r in SGLANG_RELEASES]
