"""The quoted upstream sources are verbatim, and every patch applies to the released files.

The engines cannot be installed here (CUDA wheels, GBs). Their model files can be read from
the released wheels: ``python scripts/upstream_sources.py`` (run by scripts/install-test-references,
so in CI) downloads the pinned wheels, checks their sha256 and unpacks the model files into
``~/.cache/consistency-upstream/<pkg>-<version>/`` (or ``$CONSISTENCY_UPSTREAM``), e.g.
``sglang-0.5.21/sglang/srt/models/llama.py``. Without those trees these checks skip, and
tests/record/test_patch.py still runs the quoted methods. Wheels the quotes come from (sha256 prefix):

* sglang 0.5.12.post1  94b3f3cc6b97f136   * sglang 0.5.21  96c029f75dec99ba
* sglang 0.5.23        00b3cd5b265ac76c   * vllm 0.33.0    4b6bdec4ab269990 (commit g4ba787ec9)

and the ends of each patch's claimed range (docs/integrations):

* sglang 0.5.13        9d26266ab7e99165   * sglang 0.5.17  575e38f5683624de
* sglang 0.5.22        cc9a0f15bd8f877a   * vllm 0.25.0    c82e96b01af2142e
* vllm 0.26.0          adb1e4c9b46d0dfd

and the stock debug dumpers tests/test_stock_*.py run (their debug_utils / activation log):

* sglang 0.5.5         3c57f135ec0a7a5c   * sglang 0.5.9   8a936c4d25fea605
* megatron-core 0.18.0 beb6f7b1462a8272

and SpecForge's data pipeline, which tests/replay/test_pipelines_served.py runs (specforge/data):

* specforge 0.2.0      fbc79517adf483c6
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.record import test_patch_src_sglang_boundary as sb
from tests.record import test_patch_src_sglang_classic as sc
from tests.record import test_patch_src_mtp as sm
from tests.record import test_patch_src_vllm as sv

PATCHES = Path(__file__).resolve().parents[2] / "patches"
QUOTES = {name: (mod, where) for mod in (sc, sb, sv, sm) for name, where in mod.WHERE.items()}
# patch -> upstream trees it must apply to (checked versions; docs/integrations cite them)
APPLIES = {
    "sglang-classic-llama.patch": ["sglang-0.5.12.post1", "sglang-0.5.13", "sglang-0.5.17", "sglang-0.5.21"],
    "sglang-classic-deepseek_v2.patch": ["sglang-0.5.12.post1", "sglang-0.5.13"],
    "sglang-boundary-llama.patch": ["sglang-0.5.23", "sglang-0.5.22", "sglang-0.5.21"],
    "sglang-boundary-deepseek_v2.patch": ["sglang-0.5.23", "sglang-0.5.22", "sglang-0.5.21", "sglang-0.5.17"],
    "vllm-llama.patch": ["vllm-0.25.0", "vllm-0.26.0", "vllm-0.33.0"],
    "vllm-deepseek_v2.patch": ["vllm-0.25.0", "vllm-0.26.0", "vllm-0.33.0"],
    # MTP drafts (docs/integrations/mtp.md); sglang 0.5.12.post1's NextN forward has no try/finally: its own patch
    "sglang-classic-deepseek_nextn.patch": ["sglang-0.5.12.post1"],
    "sglang-deepseek_nextn.patch": ["sglang-0.5.23", "sglang-0.5.22", "sglang-0.5.21", "sglang-0.5.17", "sglang-0.5.13"],
    "vllm-deepseek_mtp.patch": ["vllm-0.25.0", "vllm-0.26.0", "vllm-0.33.0"],
    "vllm-qwen3_next_mtp.patch": ["vllm-0.25.0", "vllm-0.26.0", "vllm-0.33.0"],
}
# MTP patches: where each capture call must land in the patched release, per method: after the
# last line holding the first text and before the next line holding the second (what it records)
MTP_PLACES: dict[str, dict[str, list[tuple[str, str, str]]]] = {
    "sglang-deepseek_nextn.patch": {"DeepseekModelNextN.forward": [
        ("capture_nextn_input", "hidden_states = input_embeds", "if hidden_states.shape[0] > 0:"),
        ("capture_mtp_cat", "hidden_states = self.eh_proj(eh_input)", "self.decoder("),
        ("capture_nextn_output", "shared_head.norm", "return hidden_states")]},
    "sglang-classic-deepseek_nextn.patch": {"DeepseekModelNextN.forward": [
        ("capture_nextn_input", "hidden_states = input_embeds", "if hidden_states.shape[0] > 0:"),
        ("capture_mtp_cat", "hidden_states = self.eh_proj(eh_input)", "self.decoder("),
        ("capture_nextn_output", "shared_head.norm", "return hidden_states")]},
    "vllm-deepseek_mtp.patch": {
        "DeepSeekMultiTokenPredictorLayer.forward": [
            ("capture_mtp_embed", "torch.where(positions.unsqueeze(-1) == 0, 0, inputs_embeds)", "self.enorm("),
            ("capture_mtp_cat", "self.hnorm(previous_hidden_states)", "self.eh_proj("),
            ("capture_mtp_output", "hidden_states = residual + hidden_states", "return hidden_states, self.shared_head")],
        "DeepSeekMultiTokenPredictor.forward": [
            ("capture_mtp_input", "inputs_embeds = self.embed_tokens(input_ids)", "current_step_idx =")]},
    "vllm-qwen3_next_mtp.patch": {
        "Qwen3NextMultiTokenPredictor.forward": [
            ("capture_mtp_input", "assert hidden_states.shape[-1] == inputs_embeds.shape[-1]", "self.pre_fc_norm_embedding("),
            ("capture_mtp_cat", "self.pre_fc_norm_hidden(hidden_states)", "self.fc(")],
        "Qwen3NextMTP.forward": [("capture_mtp_output", "hidden_states = self.model(", "return hidden_states")]},
}


def _root() -> Path:
    """``$CONSISTENCY_UPSTREAM``, else the cache scripts/upstream_sources.py fills (CI runs it)."""
    root = os.environ.get("CONSISTENCY_UPSTREAM") or \
        str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "consistency-upstream")
    if not Path(root).is_dir():
        pytest.skip("no unpacked sglang/vllm wheels: run `python scripts/upstream_sources.py` "
                    "(or set CONSISTENCY_UPSTREAM) to check against upstream files")
    return Path(root)


@pytest.mark.parametrize("name", sorted(QUOTES))
def test_quote_is_verbatim_upstream(name):
    root = _root()
    mod, (pkg, version, path, _qual) = QUOTES[name]
    f = root / f"{pkg}-{version}" / path
    if not f.is_file():
        pytest.skip(f"{f} not unpacked")
    assert getattr(mod, name) in f.read_text(), f"{name} is not verbatim in {f}"


@pytest.mark.parametrize("patch", sorted(APPLIES))
def test_patch_applies_to_released_files(patch, tmp_path):
    root = _root()
    if shutil.which("patch") is None:
        pytest.skip("no patch(1)")
    files = [ln[6:] for ln in (PATCHES / patch).read_text().splitlines() if ln.startswith("+++ b/")]
    for tree in APPLIES[patch]:
        if not all((root / tree / f).is_file() for f in files):
            pytest.skip(f"{root / tree} not unpacked")
        work = tmp_path / tree
        for f in files:  # only the patched files: a wheel tree is large
            (work / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(root / tree / f, work / f)
        r = subprocess.run(["patch", "-p1", "-F0", "--no-backup-if-mismatch"], check=False, input=(PATCHES / patch).read_bytes(),
                           cwd=work, capture_output=True)
        assert r.returncode == 0, (tree, r.stdout.decode(), r.stderr.decode())
        for f in files:
            compile((work / f).read_text(), f, "exec")  # still valid Python


def _method_lines(text: str, qual: str) -> list[str]:
    import ast

    cls, meth = qual.split(".")
    lines = text.splitlines()
    for node in ast.parse(text).body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for fn in node.body:
                if isinstance(fn, ast.FunctionDef) and fn.name == meth:
                    return lines[fn.lineno - 1:fn.end_lineno]
    raise AssertionError(f"{qual} not found")


@pytest.mark.parametrize("patch", sorted(MTP_PLACES))
def test_mtp_capture_calls_sit_where_they_record_in_every_release(patch, tmp_path):
    """Each call once, in its method, between the statement that makes what it records and
    the one that consumes it: a patch applying at the wrong place fails here, not in a server."""
    root = _root()
    if shutil.which("patch") is None:
        pytest.skip("no patch(1)")
    rel = next(ln[6:] for ln in (PATCHES / patch).read_text().splitlines() if ln.startswith("+++ b/"))
    for tree in APPLIES[patch]:
        if not (root / tree / rel).is_file():
            pytest.skip(f"{root / tree} not unpacked")
        work = tmp_path / tree
        (work / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(root / tree / rel, work / rel)
        r = subprocess.run(["patch", "-p1", "-F0", "--no-backup-if-mismatch"], input=(PATCHES / patch).read_bytes(),
                           cwd=work, capture_output=True, check=False)
        assert r.returncode == 0, (tree, r.stdout.decode())
        text = (work / rel).read_text()
        for qual, places in MTP_PLACES[patch].items():
            lines = _method_lines(text, qual)
            for call, before, after in places:
                at = [i for i, ln in enumerate(lines) if ln.strip().startswith(call + "(")]
                assert len(at) == 1, (tree, qual, call, at)
                i = at[0]
                made = [j for j in range(i) if before in lines[j]]
                used = [j for j in range(i + 1, len(lines)) if after in lines[j]]
                assert made and used, (tree, qual, call)
                assert not any(after in lines[j] for j in range(made[-1], i)), (tree, qual, call)
            assert sum(ln.count("from consistency.record.mtp_patch import") for ln in lines) == 1, (tree, qual)


def test_every_checked_tree_is_fetched_by_the_ci_script():
    """scripts/upstream_sources.py pins every tree these tests read, with the hashes above."""
    import importlib.util
    import re

    script = PATCHES.parent / "scripts" / "upstream_sources.py"
    spec = importlib.util.spec_from_file_location("upstream_sources", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    pinned = {f"{pkg}-{ver}" for pkg, ver in mod.PINS}
    wanted = {t for trees in APPLIES.values() for t in trees} | {f"{p}-{v}" for _m, (p, v, _f, _q) in QUOTES.values()}
    assert wanted <= pinned, wanted - pinned
    quoted = dict(re.findall(r"\* (?:sglang|vllm|megatron-core|specforge) ([\w.]+)\s+([0-9a-f]{16})", __doc__ or ""))
    for (pkg, ver), (_name, digest, _plat) in mod.PINS.items():
        assert digest.startswith(quoted[ver]), (pkg, ver)
    patched = {ln[6:] for p in APPLIES for ln in (PATCHES / p).read_text().splitlines() if ln.startswith("+++ b/")}
    for f in patched | {f for _m, (_p, _v, f, _q) in QUOTES.values()}:
        assert f.startswith(mod.PREFIXES), f
