"""SpecForge's training side as data: which backend produced the hidden states a draft was
trained on, release by release, and the evidence a draft directory keeps about it.

SpecForge writes SGLang-layout ids (``eagle_config.eagle_aux_hidden_state_layer_ids``) and
never records which SGLang produced its training data, yet the ids' meaning is that
SGLang release's (docs/conventions.md#specforge): SGLang before 0.5.13 adds 1 to every id,
0.5.13+ keeps DeepSeek/Kimi ids that do not start at 1 (PR #25454). So a SpecForge draft
for a DeepSeek-family target has one reading per capture backend, and lint lists them all
unless the draft itself narrows them. The evidence used is the ``transformers_version``
that ``save_pretrained`` stamps into every exported ``config.json``: SGLang pins one
transformers release exactly, so the stamp names the SGLang releases the training ran
beside (:data:`SGLANG_TRANSFORMERS`, read from each wheel's METADATA).
"""

from __future__ import annotations

from dataclasses import dataclass

from consistency.contract.versions import VersionRange


@dataclass(frozen=True)
class CaptureBackend:
    """One way SpecForge produced hidden states: the SGLang release it ran (or its HF backend)."""

    code: str
    spec: str  # the convention spec its ids are read with: 'specforge-hf' or 'sglang@VER'
    sglang: VersionRange | None  # the SGLang releases this backend stands for (None: HF backend)
    label: str
    source: str


_PYPROJECT = "sgl-project/SpecForge pyproject.toml"
BACKENDS: tuple[CaptureBackend, ...] = (
    CaptureBackend("hf", "specforge-hf", None, "SpecForge's HF backend (0.1.x; hooks layers[j])",
                   "SpecForge 0.1.x specforge/modeling/target (HF backend: output of layer j)"),
    CaptureBackend("sglang-0.5.6", "sglang@0.5.6", VersionRange((0, 5, 4), (0, 5, 13)),
                   "SpecForge pinned to sglang 0.5.6", f"{_PYPROJECT} (sglang==0.5.6, early 2026)"),
    CaptureBackend("sglang-0.5.9", "sglang@0.5.9", VersionRange((0, 5, 4), (0, 5, 13)),
                   "SpecForge pinned to sglang 0.5.9", f"{_PYPROJECT} (sglang==0.5.9, spring 2026)"),
    CaptureBackend("sglang-0.5.14", "sglang@0.5.14", VersionRange((0, 5, 13), None),
                   "SpecForge pinned to sglang 0.5.14 (SpecForge 0.2.0)",
                   f"{_PYPROJECT} (sglang==0.5.14, 2026-07-04); specforge-0.2.0 wheel METADATA Requires-Dist "
                   "sglang==0.5.14; config/schema.py target_backend: Literal['sglang']"),
)
# SpecForge release -> the backend its published wheel pins (specforge-0.2.0-py3-none-any.whl METADATA).
RELEASES: tuple[tuple[VersionRange, str], ...] = (
    (VersionRange(None, (0, 2, 0)), "hf"),
    (VersionRange((0, 2, 0), None), "sglang-0.5.14"),
)

# transformers release each SGLang release pins exactly (sglang-<ver>.dist-info/METADATA Requires-Dist,
# read from the released wheels 0.4.8-0.5.23): a config stamped with one of these names the SGLang beside it.
SGLANG_TRANSFORMERS: tuple[tuple[VersionRange, str], ...] = (
    (VersionRange((0, 4, 8), (0, 4, 9)), "4.52.3"),
    (VersionRange((0, 4, 9), (0, 4, 10)), "4.53.0"),
    (VersionRange((0, 4, 10), (0, 5, 1)), "4.54.1"),
    (VersionRange((0, 5, 1), (0, 5, 2)), "4.55.2"),
    (VersionRange((0, 5, 2), (0, 5, 3)), "4.56.1"),
    (VersionRange((0, 5, 3), (0, 5, 4)), "4.57.0"),
    (VersionRange((0, 5, 4), (0, 5, 10)), "4.57.1"),
    (VersionRange((0, 5, 10), (0, 5, 11)), "5.3.0"),
    (VersionRange((0, 5, 11), (0, 5, 13)), "5.6.0"),
    (VersionRange((0, 5, 13), (0, 5, 15)), "5.8.1"),
    (VersionRange((0, 5, 15), (0, 5, 22)), "5.12.1"),
    (VersionRange((0, 5, 22), None), "5.19.0"),
)
TRANSFORMERS_SOURCE = "sglang wheels 0.4.8-0.5.23, *.dist-info/METADATA Requires-Dist transformers==X"
