"""Parsing serving command lines the way the servers' own argument parsers read them."""

from __future__ import annotations

import pytest

from consistency.errors import InputError
from consistency.lint.serve import parse_serve


def test_sglang_launch_server_with_continuations_and_equals() -> None:
    s = parse_serve("CUDA_VISIBLE_DEVICES=0,1 python3 -m sglang.launch_server \\\n  --model-path moonshotai/Kimi-K2.5 "
                    "--tp 8 --trust-remote-code --speculative-algorithm eagle3 \\\n"
                    "  --speculative-draft-model-path=/models/kimi-eagle3 --speculative-num-steps 1 "
                    "--speculative-eagle-topk 1 --speculative-num-draft-tokens 6 --dtype bf16")
    assert s.runtime == "sglang" and s.env == {"CUDA_VISIBLE_DEVICES": "0,1"}
    assert s.target_model == "moonshotai/Kimi-K2.5" and s.draft_model == "/models/kimi-eagle3"
    assert (s.algorithm, s.num_steps, s.topk, s.num_draft_tokens) == ("EAGLE3", 1, 1, 6)
    assert s.tp == 8 and s.dtype == "bfloat16" and not s.problems


def test_sglang_aliases_and_unset_steps_problem() -> None:
    s = parse_serve("sglang serve --model meta-llama/Llama-3.1-8B-Instruct --speculative-algorithm EAGLE3 "
                    "--speculative-draft-model d --speculative-eagle-topk 4")
    assert s.runtime == "sglang" and s.draft_model == "d" and s.target_model == "meta-llama/Llama-3.1-8B-Instruct"
    assert s.problems and "--speculative-num-steps" in s.problems[0]


def test_vllm_serve_json_config_and_environment() -> None:
    s = parse_serve("VLLM_USE_V2_MODEL_RUNNER=0 vllm serve meta-llama/Llama-3.1-8B-Instruct -tp 2 "
                    "--speculative-config '{\"method\": \"eagle3\", "
                    "\"model\": \"yuhuili/EAGLE3-LLaMA3.1-Instruct-8B\", "
                    "\"num-speculative-tokens\": 5, \"draft_tensor_parallel_size\": 1}'")
    assert s.runtime == "vllm" and s.env["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    assert s.target_model == "meta-llama/Llama-3.1-8B-Instruct" and s.tp == 2
    assert s.algorithm == "eagle3" and s.num_speculative_tokens == 5
    assert s.draft_model == "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B" and not s.problems


def test_vllm_short_and_dotted_forms() -> None:
    s = parse_serve("python -m vllm.entrypoints.openai.api_server --model m -sc '{\"model\": \"d\"}' "
                    "--speculative-config.method eagle3 --spec-tokens 4 -pp 2")
    assert s.runtime == "vllm" and s.spec_config == {"model": "d", "method": "eagle3", "num_speculative_tokens": 4}
    assert s.pp == 2 and not s.problems


def test_vllm_problems_the_server_rejects() -> None:
    s = parse_serve("vllm serve m --speculative-config '{\"method\": \"eagle3\", \"model\": \"d\", "
                    "\"num_speculative_tokens\": 3, \"tensor_parallel_size\": 2}' --spec-method eagle")
    assert len(s.problems) == 2
    assert any("tensor_parallel_size" in p for p in s.problems)
    assert any("--spec-method" in p for p in s.problems)


@pytest.mark.parametrize("cmd,needle", [
    ("python train.py --lr 1", "cannot tell which server"),
    ("vllm serve m --speculative-config '[1, 2]'", "must be a JSON object"),
    ("python -m sglang.launch_server --speculative-num-steps five", "is not an integer"),
    ("python -m sglang.launch_server --model 'unterminated", "cannot split"),
])
def test_unparseable_command_lines_are_input_errors(cmd: str, needle: str) -> None:
    with pytest.raises(InputError, match=needle):
        parse_serve(cmd)
