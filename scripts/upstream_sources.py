#!/usr/bin/env python3
"""Fetch the SGLang/vLLM model sources our patches claim to apply to, for tests/record/test_patch_upstream.py.

The engines cannot be installed in CI (CUDA wheels, GBs of dependencies), but their model
files are plain Python inside the released wheels. For each pinned release this script
downloads the one wheel (``pip download --no-deps``, with fixed --platform/--python-version
so every host gets the same file), checks its sha256 against the pin, and unpacks only the
files the patches and quotes touch into ``<cache>/<pkg>-<version>/`` (a site-packages-like
tree). Nothing is installed, nothing imported. The cache is ``$CONSISTENCY_UPSTREAM`` or
``~/.cache/consistency-upstream``; a tree already unpacked from the pinned wheel is kept,
and the wheel itself is deleted once unpacked (the trees are 4-8 MB each).

Usage: ``python scripts/upstream_sources.py [--no-vllm] [--cache DIR]``. Prints the time
each step took. Exit 1 when a download or check fails (install-test-references turns that
into a warning; the upstream tests then skip).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

# (package, version) -> (wheel file name, sha256, platform tags): the wheels the quotes in
# tests/test_patch_src_*.py come from and the ends of each patch's claimed range (docs/integrations);
# tests/record/test_patch_upstream.py lists the same sha256 prefixes.
PINS: dict[tuple[str, str], tuple[str, str, tuple[str, ...]]] = {
    ("sglang", "0.5.12.post1"): ("sglang-0.5.12.post1-cp311-cp311-manylinux_2_34_x86_64.whl",
                                 "94b3f3cc6b97f1364f247b8d9c1d106ec63cf22c55d6b65bc40ff29b0206ef5f",
                                 ("manylinux_2_34_x86_64",)),
    ("sglang", "0.5.13"): ("sglang-0.5.13-cp311-cp311-manylinux_2_34_x86_64.whl",
                           "9d26266ab7e99165098f9e173f4a5a0ef6a0b64a6f30ef0b5ee859eead37e75a",
                           ("manylinux_2_34_x86_64",)),
    ("sglang", "0.5.17"): ("sglang-0.5.17-cp311-cp311-manylinux_2_34_x86_64.whl",
                           "575e38f5683624ded3b4bb267f637a098e5ed37d13a1d1ff5ea09bd781a04d16",
                           ("manylinux_2_34_x86_64",)),
    ("sglang", "0.5.21"): ("sglang-0.5.21-cp311-cp311-manylinux_2_34_x86_64.whl",
                           "96c029f75dec99baa33a5db3d41b1bebefdd6bcfba3a2f7c807fe1cf49a87c20",
                           ("manylinux_2_34_x86_64",)),
    ("sglang", "0.5.22"): ("sglang-0.5.22-cp311-cp311-manylinux_2_34_x86_64.whl",
                           "cc9a0f15bd8f877a0584fdb7a1702240177a1f1cc8d17c978715161717b9037b",
                           ("manylinux_2_34_x86_64",)),
    ("sglang", "0.5.23"): ("sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl",
                           "00b3cd5b265ac76c64185fbb6b95424f324ddd9f428d0306b77bc9db9d859937",
                           ("manylinux_2_34_x86_64",)),
    # stock debug dumpers (tests/test_stock_*.py run them): the tensor-dump hook's first release and the
    # dumper's raw-payload era, the {"value", "meta"} payload's first release, and Megatron's activation log
    ("sglang", "0.5.5"): ("sglang-0.5.5-py3-none-any.whl",
                          "3c57f135ec0a7a5cf6ae4ed5e0b231d7bf7e0fae588bbc1a881560f1c18db995", ("any",)),
    ("sglang", "0.5.9"): ("sglang-0.5.9-py3-none-any.whl",
                          "8a936c4d25fea605f44254e533cff2144c73ceffbc1f8738aba393461bbb64d1", ("any",)),
    ("megatron-core", "0.18.0"): ("megatron_core-0.18.0-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl",
                                  "beb6f7b1462a82723cef31773dae60f54a2f7bc809e5e050cf9f59c344b5a373",
                                  ("manylinux_2_28_x86_64",)),
    # SpecForge's data pipeline (tests/pipelines.py runs its build_eagle3_dataset on a real tokenizer)
    ("specforge", "0.2.0"): ("specforge-0.2.0-py3-none-any.whl",
                             "fbc79517adf483c6a8beea52561b1a8c8c8a99a54c820b47d2033a73966b55b0", ("any",)),
    ("vllm", "0.25.0"): ("vllm-0.25.0-cp38-abi3-manylinux_2_28_x86_64.whl",
                         "c82e96b01af2142ef398ca92f1e9c5f4ffc119f2cc09fe68ea28865323532f0c",
                         ("manylinux_2_28_x86_64",)),
    ("vllm", "0.26.0"): ("vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl",
                         "adb1e4c9b46d0dfdb094121ae5aad670a42412dd813ed4e5db069ed6a15006de",
                         ("manylinux_2_28_x86_64",)),
    ("vllm", "0.33.0"): ("vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl",
                         "4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa",
                         ("manylinux_2_28_x86_64",)),
}
# members unpacked: what the patches (+++ b/...) and the quoted sources name, and their neighbours;
# the stock dumpers' files (dump/formats/); the CUDA-graph runners the graph-safe hooks wrap
# (consistency/record/graph_runners.py)
PREFIXES = ("sglang/srt/models/", "sglang/srt/layers/aux_hidden_states.py", "vllm/model_executor/models/",
            "sglang/srt/debug_utils/", "megatron/training/activation_logging.py", "megatron/training/checkpointing.py",
            "sglang/srt/model_executor/cuda_graph_runner.py", "sglang/srt/model_executor/forward_batch_info.py",
            "sglang/srt/model_executor/runner/", "sglang/srt/model_executor/runner_backend/full_cuda_graph_backend.py",
            "sglang/srt/speculative/eagle_draft_cuda_graph_runner.py",
            "sglang/srt/speculative/eagle_draft_extend_cuda_graph_runner.py",
            "vllm/v1/worker/gpu_model_runner.py", "vllm/compilation/cuda_graph.py")
ENGINE_PREFIXES = PREFIXES  # the members digest covers these: adding SpecForge's redoes no engine tree
PREFIXES += ("specforge/__init__.py", "specforge/data/", "specforge/distributed.py", "specforge/utils.py")
MARK = ".consistency-sha256"  # written last: a tree holding it was fully unpacked from the pinned wheel
PYTHON = {("megatron-core", "0.18.0"): "3.12"}  # the wheel's tag (its files are plain Python, read not installed)
# the mark holds the wheel's sha256 and a digest of PREFIXES: a tree unpacked with fewer members is redone
MEMBERS = hashlib.sha256(repr(ENGINE_PREFIXES).encode()).hexdigest()[:16]


def default_cache() -> Path:
    env = os.environ.get("CONSISTENCY_UPSTREAM")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "consistency-upstream"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def download(pkg: str, version: str, wheels: Path) -> Path:
    name, digest, platforms = PINS[(pkg, version)]
    whl = wheels / name
    if whl.is_file() and sha256(whl) == digest:
        return whl
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", PYTHON.get((pkg, version), "3.11"),
           *[a for p in platforms if p != "any" for a in ("--platform", p)], "-d", str(wheels), f"{pkg}=={version}"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    if not whl.is_file():
        raise RuntimeError(f"pip did not produce {name} (got {sorted(p.name for p in wheels.iterdir())})")
    got = sha256(whl)
    if got != digest:
        whl.unlink()
        raise RuntimeError(f"{name}: sha256 {got} is not the pinned {digest}")
    return whl


def unpack(whl: Path, digest: str, tree: Path, pkg: str = "") -> int:
    """Extract the members under PREFIXES; refuses absolute or parent-relative names."""
    n = 0
    with zipfile.ZipFile(whl) as z:
        for info in z.infolist():
            name = info.filename
            if info.is_dir() or not name.startswith(PREFIXES):
                continue
            if name.startswith("/") or ".." in Path(name).parts:
                raise RuntimeError(f"{whl.name}: refusing member {name!r}")
            dst = tree / name
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(z.read(info))
            n += 1
    (tree / MARK).write_text(f"{digest}\n{MEMBERS}\n")
    return n


def fetch(pkg: str, version: str, cache: Path) -> str:
    name, digest, _ = PINS[(pkg, version)]
    tree = cache / f"{pkg}-{version}"
    if (tree / MARK).is_file() and (tree / MARK).read_text().split() == [digest, MEMBERS]:
        return f"{pkg} {version}: cached in {tree}"
    t0 = time.perf_counter()
    whl = download(pkg, version, cache / "wheels")
    t1 = time.perf_counter()
    n = unpack(whl, digest, tree, pkg)
    t2 = time.perf_counter()
    mb = whl.stat().st_size / 1e6
    whl.unlink()  # the unpacked tree is what the tests read; keep the cache small
    return (f"{pkg} {version}: {mb:.0f} MB downloaded in {t1 - t0:.1f} s, "
            f"{n} files unpacked in {t2 - t1:.2f} s -> {tree}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", type=Path, default=None, help="where to keep wheels and trees (default: %(default)s)")
    ap.add_argument("--no-vllm", action="store_true", help="skip the vLLM wheels (250-340 MB each)")
    args = ap.parse_args(argv)
    cache = args.cache or default_cache()
    cache.mkdir(parents=True, exist_ok=True)
    (cache / "wheels").mkdir(exist_ok=True)
    failed = 0
    for pkg, version in PINS:
        if pkg == "vllm" and args.no_vllm:
            continue
        try:
            print(fetch(pkg, version, cache), flush=True)
        except (subprocess.CalledProcessError, RuntimeError, OSError, zipfile.BadZipFile) as exc:
            print(f"upstream_sources: {pkg} {version}: {exc}", file=sys.stderr)
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
