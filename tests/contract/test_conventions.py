"""The runtime-convention registry: id meaning, where ids are read, what can be captured,
which vLLM runner runs, and the version points a linter evaluates when none is pinned.

Version facts asserted here were read from released wheels (docs/conventions.md cites the
files): vLLM 0.25.0/0.26.0/0.28.0/0.29.0 vllm/config/vllm.py, sglang 0.5.12-0.5.23.
"""

from __future__ import annotations

import pytest

from consistency.contract import conventions as cv
from consistency.contract import resolve as rs
from consistency.contract import runtime_model as rm


def test_public_api_is_unchanged() -> None:
    r = rs.resolve("sglang@0.5.5", "LlamaForCausalLM")
    assert r.convention.to_streams([2, 30, 58], 61) == [3, 31, 59]
    assert r.convention.from_streams([0, 3, 31], 61) == [-1, 2, 30]
    assert rs.describe_streams([0, 3, 61], 61)[0] == "the embedding"
    assert {c.code for c in cv.REGISTRY} >= {"sglang-plus1", "sglang-deepseek", "vllm", "speculators", "specforge-hf"}


@pytest.mark.parametrize("spec,arch,ids,streams", [
    ("sglang@0.5.12", "KimiK25ForConditionalGeneration", [2, 30, 58], [3, 31, 59]),
    ("sglang@0.5.13", "KimiK25ForConditionalGeneration", [2, 30, 58], [2, 30, 58]),
    ("sglang@0.5.13", "KimiK25ForConditionalGeneration", [1, 29, 57], [2, 30, 58]),
    ("sglang@0.5.23", "LlamaForCausalLM", [2, 30, 58], [3, 31, 59]),
    ("sglang@0.5.16", "GptOssForCausalLM", [24, 30, 36], [25, 31, 37]),
    ("sglang@0.5.17", "GptOssForCausalLM", [24, 30, 36], [24, 30, 36]),
    ("vllm@0.33.0", "DeepseekV3ForCausalLM", [2, 30, 58], [2, 30, 58]),
])
def test_id_meaning_per_runtime_version_and_architecture(spec: str, arch: str, ids: list[int],
                                                         streams: list[int]) -> None:
    n = 36 if "GptOss" in arch else 61
    assert rs.resolve(spec, arch).convention.to_streams(ids, n) == streams


def test_id_sources_by_runtime_runner_and_version() -> None:
    assert rm.id_source("sglang", (0, 5, 23)).keys == (cv.NESTED_IDS,)
    assert rm.id_source("vllm", (0, 21), "v1").keys == (cv.TOP_IDS,)
    assert rm.id_source("vllm", (0, 22), "v1").keys == (cv.TOP_IDS, cv.NESTED_IDS)
    assert rm.id_source("vllm", (0, 26), "v2").keys == (cv.TOP_IDS,)
    assert rm.id_source("vllm", None, "v2").keys == (cv.TOP_IDS, cv.NESTED_LAYER_IDS)


@pytest.mark.parametrize("version,arch,moe,env,feature,runner", [
    ((0, 21), "Qwen3ForCausalLM", False, None, None, "v1"),
    ((0, 22), "Qwen3ForCausalLM", False, None, None, "v2"),  # vllm 0.22.0 config/vllm.py: the first default-V2 list
    ((0, 22), "LlamaForCausalLM", False, None, None, "v1"),
    ((0, 23), "LlamaForCausalLM", False, None, None, "v2"),
    ((0, 23), "Qwen2MoeForCausalLM", True, None, None, "v1"),
    ((0, 24), "LlamaForCausalLM", False, None, None, "v2"),
    ((0, 24), "DeepseekV2ForCausalLM", True, None, None, "v2"),
    ((0, 24), "Qwen2ForCausalLM", False, None, None, "v1"),
    ((0, 25), "LlamaForCausalLM", False, None, None, "v2"),
    ((0, 26), "DeepseekV3ForCausalLM", True, None, None, "v1"),
    ((0, 26), "DeepseekV2ForCausalLM", True, None, None, "v2"),
    ((0, 28), "KimiK3ForConditionalGeneration", True, None, None, "v2"),
    ((0, 29), "DeepseekV3ForCausalLM", True, None, None, "v2"),
    ((0, 33), "LlamaForCausalLM", False, "0", None, "v1"),
    ((0, 20), "LlamaForCausalLM", False, "1", None, "v2"),
    ((0, 33), "LlamaForCausalLM", False, None, "EAGLE3 with pipeline parallelism", "v1"),
])
def test_vllm_runner_selection(version: tuple[int, ...], arch: str, moe: bool, env: str | None, feature: str | None,
                               runner: str) -> None:
    assert rm.vllm_runner(version, arch, moe, env, feature)[0] == runner


@pytest.mark.parametrize("runtime,version,arch,first,last", [
    ("sglang", (0, 5, 21), "LlamaForCausalLM", "error", "dropped"),
    ("sglang", (0, 5, 22), "LlamaForCausalLM", "ok", "dropped"),
    ("sglang", (0, 5, 13), "DeepseekV3ForCausalLM", "error", "dropped"),
    ("sglang", (0, 5, 14), "DeepseekV3ForCausalLM", "ok", "dropped"),
    ("sglang", (0, 5, 17), "DeepseekV3ForCausalLM", "ok", "error"),
    ("vllm", (0, 17, 1), "LlamaForCausalLM", "error", "dropped"),
    ("vllm", (0, 18), "LlamaForCausalLM", "ok", "ok"),
    ("vllm", (0, 24), "DeepseekV3ForCausalLM", "error", "dropped"),
    ("vllm", (0, 25), "DeepseekV3ForCausalLM", "error", "ok"),
])
def test_capture_limits(runtime: str, version: tuple[int, ...], arch: str, first: str, last: str) -> None:
    lim = rm.capture_limit(runtime, version, arch)
    assert lim is not None and (lim.first, lim.last) == (first, last)


def test_version_points_cover_every_boundary_once() -> None:
    pts = rm.version_points("sglang")
    his = [hi for _lo, hi, _rep in pts]
    assert his == [(0, 5, 13), (0, 5, 14), (0, 5, 17), (0, 5, 22), None]
    for lo, hi, rep in pts:
        assert rep is None or ((lo is None or rep >= lo) and rep < hi)
    assert rm.range_label((0, 5, 13), None) == ">=0.5.13" and rm.range_label(None, (0, 5, 13)) == "<0.5.13"
    vpts = {hi for _lo, hi, _rep in rm.version_points("vllm")}
    assert {(0, 18), (0, 22), (0, 25), (0, 28), (0, 29)} <= vpts
