"""Parse a serving command line: SGLang ``launch_server`` or ``vllm serve``.

The command is split like a shell would (``shlex``), leading ``VAR=value`` assignments
are kept as the server's environment (``VLLM_USE_V2_MODEL_RUNNER`` picks vLLM's runner),
and only the flags that change what the draft is fed or how far it may run are
interpreted. Anything unparseable is bad input (exit 2); combinations the server itself
would reject at start-up are recorded as problems, which rule SRV002 reports.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from typing import Any

from consistency.errors import InputError

WHERE = "--serve"
_ENV = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_SHORT = {"tp": "tensor-parallel-size", "pp": "pipeline-parallel-size", "sc": "speculative-config",
          "dp": "data-parallel-size"}
_ALIASES = {"tp-size": "tensor-parallel-size", "tp": "tensor-parallel-size", "pp-size": "pipeline-parallel-size",
            "model-path": "model", "speculative-draft-model": "speculative-draft-model-path",
            "speculative-algo": "speculative-algorithm"}
_BOOL_PREFIXES = ("enable-", "disable-", "no-", "trust-remote-code", "skip-", "enforce-", "use-")


@dataclass
class ServeInfo:
    runtime: str  # sglang | vllm
    command: str
    env: dict[str, str] = field(default_factory=dict)
    flags: dict[str, str] = field(default_factory=dict)
    target_model: str | None = None
    draft_model: str | None = None
    algorithm: str | None = None  # SGLang --speculative-algorithm, vLLM method
    method_note: str | None = None  # how vLLM's method was inferred when not given
    num_steps: int | None = None
    topk: int | None = None
    num_draft_tokens: int | None = None
    num_speculative_tokens: int | None = None
    dtype: str | None = None
    tp: int | None = None
    pp: int | None = None
    dp: int | None = None
    dp_attention: bool = False  # SGLang --enable-dp-attention
    pp_partition: list[int] | None = None  # SGLANG_PP_LAYER_PARTITION / VLLM_PP_LAYER_PARTITION
    speculators_model: bool = False  # vLLM: the positional model is a speculators draft (EAGLE-3 on, no flag)
    spec_config: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def parallel_drafting(self) -> bool:
        return bool(self.spec_config.get("parallel_drafting"))


def _tokens(command: str) -> list[str]:
    try:
        return shlex.split(command.replace("\\\n", " "), posix=True)
    except ValueError as exc:
        raise InputError(WHERE, f"cannot split the command line: {exc}") from None


def _runtime(toks: list[str]) -> tuple[str, int]:
    """('sglang'|'vllm', index of the first token after the program)."""
    for i, t in enumerate(toks):
        base = t.rsplit("/", 1)[-1]
        if base in ("sglang.launch_server", "launch_server.py") or t.endswith("sglang.launch_server"):
            return "sglang", i + 1
        if base == "sglang" and i + 1 < len(toks) and toks[i + 1] in ("serve", "launch_server"):
            return "sglang", i + 2
        if base == "vllm" and i + 1 < len(toks) and toks[i + 1] == "serve":
            return "vllm", i + 2
        if "vllm.entrypoints" in t:
            return "vllm", i + 1
    if any(t.startswith("--speculative-algorithm") for t in toks):
        return "sglang", 0
    if any(t.startswith(("--speculative-config", "-sc")) for t in toks):
        return "vllm", 0
    raise InputError(WHERE, "cannot tell which server the command starts (expected `python -m sglang.launch_server "
                            "...` or `vllm serve ...`)")


def _flags(toks: list[str]) -> tuple[dict[str, str], list[str]]:
    flags: dict[str, str] = {}
    positional: list[str] = []
    i = 0
    while i < len(toks):
        t = toks[i]
        if t.startswith("-") and len(t) > 1 and not _number(t):
            name, eq, value = t.lstrip("-").partition("=")
            name = name.replace("_", "-")
            name = _SHORT.get(name, name) if not t.startswith("--") else name
            name = _ALIASES.get(name, name)
            if not eq:
                nxt = toks[i + 1] if i + 1 < len(toks) else None
                takes = nxt is not None and (not nxt.startswith("-") or _number(nxt))
                if takes and not name.startswith(_BOOL_PREFIXES):
                    value, i = nxt, i + 1
                else:
                    value = "true"
            flags[name] = value
        else:
            positional.append(t)
        i += 1
    return flags, positional


def _number(t: str) -> bool:
    return re.fullmatch(r"-?\d+(\.\d+)?", t) is not None


def _int(flags: dict[str, str], name: str, low: int | None = None) -> int | None:
    """An integer flag; below ``low`` (a negative step count, a zero parallel size) it is bad input:
    no server starts with it, so nothing about the command can be linted."""
    v = flags.get(name)
    if v is None:
        return None
    try:
        n = int(v)
    except ValueError:
        raise InputError(WHERE, f"--{name} {v!r} is not an integer") from None
    if low is not None and n < low:
        raise InputError(WHERE, f"--{name} {n}: must be at least {low}")
    return n


def _partition(env: dict[str, str], runtime: str) -> list[int] | None:
    key = "SGLANG_PP_LAYER_PARTITION" if runtime == "sglang" else "VLLM_PP_LAYER_PARTITION"
    raw = env.get(key)
    if raw is None:
        return None
    try:
        parts = [int(x) for x in raw.split(",")]
    except ValueError:
        raise InputError(WHERE, f"{key}={raw!r}: expected comma-separated layer counts") from None
    if any(p < 0 for p in parts):
        raise InputError(WHERE, f"{key}={raw!r}: layer counts must be non-negative")
    return parts


def _dtype(v: str | None) -> str | None:
    from consistency.dump.dtypes import lookup

    if v is None or v == "auto":
        return None
    try:
        return lookup(v).name
    except KeyError:
        return v


def parse_serve(command: str) -> ServeInfo:
    toks = _tokens(command)
    env: dict[str, str] = {}
    while toks and (_ENV.match(toks[0]) or toks[0] == "env"):
        if toks[0] != "env":
            k, _, v = toks[0].partition("=")
            env[k] = v
        toks = toks[1:]
    runtime, start = _runtime(toks)
    flags, positional = _flags(toks[start:])
    info = ServeInfo(runtime=runtime, command=command, env=env, flags=flags)
    info.dtype = _dtype(flags.get("dtype"))
    info.tp = _int(flags, "tensor-parallel-size", 1)
    info.pp = _int(flags, "pipeline-parallel-size", 1)
    info.dp = _int(flags, "data-parallel-size", 1) or _int(flags, "dp-size", 1)
    info.dp_attention = flags.get("enable-dp-attention", "false").lower() not in ("false", "0")
    info.pp_partition = _partition(env, runtime)
    if runtime == "sglang":
        _sglang(info, flags)
    else:
        _vllm(info, flags, positional)
    return info


def _sglang(info: ServeInfo, flags: dict[str, str]) -> None:
    info.target_model = flags.get("model")
    info.draft_model = flags.get("speculative-draft-model-path")
    algo = flags.get("speculative-algorithm")
    info.algorithm = algo.upper() if algo else None
    info.num_steps = _int(flags, "speculative-num-steps", 0)
    info.topk = _int(flags, "speculative-eagle-topk", 1)
    info.num_draft_tokens = _int(flags, "speculative-num-draft-tokens", 1)
    if info.algorithm in ("EAGLE", "EAGLE3", "STANDALONE") and info.num_steps is None and (
            info.topk is not None or info.num_draft_tokens is not None):
        info.problems.append("--speculative-eagle-topk/--speculative-num-draft-tokens given without "
                             "--speculative-num-steps: SGLang asserts all three are unset before choosing them itself "
                             "(server_args.py _handle_speculative_decoding)")


def _vllm(info: ServeInfo, flags: dict[str, str], positional: list[str]) -> None:
    info.target_model = flags.get("model") or (positional[0] if positional else None)
    raw = flags.get("speculative-config")
    spec: dict[str, Any] = {}
    if raw is not None:
        try:
            spec = json.loads(raw)
        except ValueError as exc:
            raise InputError(WHERE, f"--speculative-config is not valid JSON: {exc}") from None
        if not isinstance(spec, dict):
            raise InputError(WHERE, "--speculative-config must be a JSON object")
        spec = {str(k).replace("-", "_"): v for k, v in spec.items()}
    for name, value in flags.items():  # --speculative-config.method eagle3
        if name.startswith("speculative-config."):
            spec[name.split(".", 1)[1].replace("-", "_")] = _scalar(value)
    for short, key in (("spec-method", "method"), ("spec-model", "model"), ("spec-tokens", "num_speculative_tokens")):
        if short in flags:
            if key in spec:
                info.problems.append(f"--{short} and --speculative-config both set {key!r}: vLLM rejects the "
                                     "duplicate (engine/arg_utils.py)")
            spec[key] = _scalar(flags[short])
    if "tensor_parallel_size" in spec:
        info.problems.append("tensor_parallel_size inside --speculative-config is an error in vLLM; use "
                             "draft_tensor_parallel_size (engine/arg_utils.py)")
    info.spec_config = spec
    if not spec:
        _speculators_model(info)
        spec = info.spec_config
    info.draft_model = spec.get("model") if isinstance(spec.get("model"), str) else None
    method = spec.get("method")
    info.algorithm = str(method).lower() if method else None
    n = spec.get("num_speculative_tokens")
    if n is not None:
        if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
            info.problems.append(f"num_speculative_tokens must be a positive integer, got {n!r}")
        else:
            info.num_speculative_tokens = n


def _speculators_model(info: ServeInfo) -> None:
    """``vllm serve <speculators draft dir>`` with no speculative flags turns EAGLE-3 on:
    vLLM reads the draft's config, builds the speculative config from it (method from
    ``speculators_model_type``, tokens from ``proposal_methods[0].speculative_tokens``, model =
    the directory) and serves ``speculators_config.verifier.name_or_path`` as the target
    (vllm/transformers_utils/config.py maybe_override_with_speculators, called from
    engine/arg_utils.py create_engine_config; older releases: EngineArgs.create_speculative_config)."""
    from pathlib import Path

    from consistency.lint.configs import read_json

    model = info.target_model
    if not model or not (Path(model) / "config.json").is_file():
        return
    adopt_speculators(info, read_json(Path(model) / "config.json", "model config"), model)


def adopt_speculators(info: ServeInfo, cfg: dict[str, Any], model: str, note: str = "") -> None:
    """Serve ``model`` (whose config is ``cfg``) as vLLM does when it is a speculators draft."""
    from consistency.lint.configs import dig

    if not isinstance(cfg.get("speculators_config"), dict):
        return
    verifier = dig(cfg, "speculators_config.verifier.name_or_path")
    if not isinstance(verifier, str) or not verifier:
        info.problems.append(f"{model} is a speculators draft without speculators_config.verifier.name_or_path: "
                             "vLLM cannot tell which target to serve")
        return
    spec: dict[str, Any] = {"model": model}
    if isinstance(cfg.get("speculators_model_type"), str):
        spec["method"] = cfg["speculators_model_type"]
    methods = dig(cfg, "speculators_config.proposal_methods")
    if isinstance(methods, list) and methods and isinstance(methods[0], dict):
        tokens = methods[0].get("speculative_tokens")
        if isinstance(tokens, int) and not isinstance(tokens, bool):
            spec["num_speculative_tokens"] = tokens
    info.speculators_model = True
    info.target_model, info.draft_model, info.spec_config = verifier, model, spec
    info.method_note = ("vLLM builds the speculative config from the speculators draft given as the model "
                        "(maybe_override_with_speculators) and serves its verifier as the target" + note)


def _scalar(v: str) -> Any:
    try:
        return json.loads(v)
    except ValueError:
        return v
