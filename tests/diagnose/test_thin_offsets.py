"""Layer offsets against a thin reference, from the distances measured (issue 36, item 5).

A thin reference (aux slots only: a speculators/SpecForge training file, float8 or bf16)
records a few streams. A candidate whose every slot holds the next (or the previous) layer's
stream matches none of them. Real weights do not move monotonically with depth (SmolLM2:
stream 3 lies farther from stream 9 than stream 2 does), so the old "toward the next
recorded stream" reading left such a list UNKNOWN. The bounded reading measures each slot's
move against the reference's own recorded slots: nearer its expected stream than any other
recorded stream is to it, and along the model's own stream directions (an unrelated error
reads cos ~0). Then the list is LAYER_OFFSET, said as consistent and not proven, with the
streams the reference records as its bound -- never PASS; a missing residual or noise is
never told as an offset. Expected answers follow from the construction: which stream each
candidate slot holds.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from consistency.contract.models import AuxInfo, DumpMetadata, ModelInfo
from consistency.pipeline.compare import compare as run
from consistency.dump import dtypes
from consistency.dump.writer import write_dump


def _bf16(x: np.ndarray) -> np.ndarray:
    return dtypes.to_float(dtypes.float32_to_bf16_bits(np.asarray(x, np.float32)), "bfloat16")


def _thin_ref(tmp: Path, hidden, slots: list[int], n: int, fmt: str) -> tuple[str, dict]:  # noqa: ANN001
    """The reference's aux slots only: float8 with no metadata (the streams declared), or a
    bf16 dump whose metadata says its streams."""
    if fmt == "fp8":
        import torch
        from safetensors.torch import save_file

        p = tmp / "ref_fp8.safetensors"
        save_file({f"aux.{i}": torch.as_tensor(np.asarray(hidden[s], np.float32)).to(torch.float8_e4m3fn)
                   for i, s in enumerate(slots)}, str(p))
        return str(p), {"ref_layer_ids": ",".join(map(str, slots))}
    meta = DumpMetadata(side="training", model=ModelInfo(num_layers=n), aux=AuxInfo(stream_ids=slots))
    p = write_dump(tmp / "ref_bf16.safetensors", {f"aux.{i}": (_bf16(hidden[s]), "float32")
                                                  for i, s in enumerate(slots)}, meta, force=True)
    return str(p), {}


def _cand(tmp: Path, arrays: list[np.ndarray], claims: list[int] | None = None) -> str:
    meta = DumpMetadata(side="serving", aux=AuxInfo(stream_ids=claims)) if claims else None
    return str(write_dump(tmp / "cand.safetensors", {f"aux.{i}": (_bf16(x), "float32") for i, x in enumerate(arrays)},
                          meta, force=True))


def _errors(rep) -> list:  # noqa: ANN001
    return [f for f in rep.findings if f.severity.value == "error"]


def _check(rep, case: str, slots: list[int]) -> None:  # noqa: ANN001
    codes = [f.code for f in _errors(rep)]
    assert rep.verdict == "fail", rep.summary
    assert "NUMERIC_DRIFT" not in codes and "SLOT_SHIFT" not in codes and "ORDER_MISMATCH" not in codes
    if case in ("plus", "minus"):
        f = rep.findings[0]
        assert f.code == "LAYER_OFFSET", [(x.code, x.message) for x in _errors(rep)]
        assert f.evidence["measured"] is False and f.evidence["expected"] == slots and f.evidence["recorded"] == slots
        if "direction" in f.evidence:  # the sided reading: its side must be the construction's
            assert f.evidence["direction"] == ("later" if case == "plus" else "earlier"), f.message
        else:  # the bounded reading: no side claimed
            assert f.evidence["proven"] is False and "cannot be proven" in f.message, f.message
            assert f"records streams {slots}" in f.message
    else:  # a missing residual, an unrelated error: no offset is claimed
        assert "LAYER_OFFSET" not in codes, [(x.code, x.message) for x in _errors(rep)]


def _held(case: str, s: int, hidden, mlp_out, seed: int) -> np.ndarray:  # noqa: ANN001
    if case == "plus":
        return hidden[s + 1]
    if case == "minus":
        return hidden[s - 1]
    if case == "residual":  # the fused layer's hidden_states alone: layer s-1's MLP output, residual not added
        return mlp_out[s - 1]
    x = np.asarray(hidden[s], np.float64)
    return x + 0.3 * x.std() * np.random.default_rng(seed + s).standard_normal(x.shape)


CASES = ["plus", "minus", "residual", "noise"]


@pytest.mark.parametrize("fmt", ["fp8", "bf16"])
@pytest.mark.parametrize("case", CASES)
def test_seeded_tiny_llama(case: str, fmt: str, tmp_path) -> None:  # noqa: ANN001
    from tests.scenarios.build import record

    st = record("llama")
    slots, t = [2, 6, 9], st.bf16.tokens  # the bf16 forward records a prefix
    ref, kw = _thin_ref(tmp_path, [x[:t] for x in st.hidden], slots, st.n, fmt)
    cand = _cand(tmp_path, [_held(case, s, st.bf16.hidden, st.bf16.mlp_out, 1) for s in slots])
    _check(run(ref, cand, **kw), case, slots)


@pytest.mark.parametrize("case", CASES)
def test_massive_activations_and_a_sink_row(case: str, tmp_path) -> None:  # noqa: ANN001
    from tests.massive import N_LAYERS, massive

    m = massive()
    slots = [2, 4, 6]
    mlp = [m.bf16_parts[f"mlp_out.{k}"] for k in range(N_LAYERS)]
    ref, kw = _thin_ref(tmp_path, m.hidden, slots, N_LAYERS, "bf16")
    cand = _cand(tmp_path, [_held(case, s, m.bf16, mlp, 2) for s in slots])
    _check(run(ref, cand, **kw), case, slots)


def test_the_candidates_claim_is_compared_not_trusted(tmp_path) -> None:  # noqa: ANN001
    """The candidate's metadata claims streams one higher: the values are consistent with it,
    said as such; still not proven."""
    from tests.scenarios.build import record

    st = record("llama")
    slots, t = [2, 6, 9], st.bf16.tokens
    ref, kw = _thin_ref(tmp_path, [x[:t] for x in st.hidden], slots, st.n, "fp8")
    rep = run(ref, _cand(tmp_path, [st.bf16.hidden[s + 1] for s in slots], claims=[s + 1 for s in slots]), **kw)
    _check(rep, "plus", slots)
    f = rep.findings[0]
    assert f.evidence["claimed_offset"] == 1 and "+1, as candidate's metadata claims" in f.message.replace(
        "serving's", "candidate's"), f.message


# stream 14 lies within 9 bf16 floors of stream 15: that slot reads as NUMERIC_DRIFT (a warning),
# so not every slot is unexplained and the list stays UNKNOWN (no PASS, no wrong cause). Left out
# this round: a drift slot beside unexplained ones inside the bounded reading.
_DRIFT = pytest.mark.xfail(strict=True, reason="a slot within drift reach is not yet part of the bounded reading")
SMOL_CASES = [pytest.param(c, f, s, marks=[_DRIFT] if (c, f, s) == ("minus", "bf16", [3, 9, 15]) else [])
              for c in CASES for f in ("fp8", "bf16") for s in ([3, 9, 15], [2, 9, 20])]


@pytest.mark.pretrained
@pytest.mark.parametrize("case, fmt, slots", SMOL_CASES)
def test_smollm2(case: str, fmt: str, slots: list[int], tmp_path) -> None:  # noqa: ANN001
    """Real pretrained weights, whose streams do not move monotonically with depth."""
    from tests.scenarios.build import SMOL, record, smollm2_dir

    if smollm2_dir() is None:
        pytest.skip("SmolLM2-135M package not installed")
    st, t = record(SMOL), 128
    hidden = [x[:t] for x in st.hidden]
    ref, kw = _thin_ref(tmp_path, hidden, slots, st.n, fmt)
    low = st.bf16
    cand = _cand(tmp_path, [_held(case, s, [x[:t] for x in low.hidden], [x[:t] for x in low.mlp_out], 3)
                            for s in slots])
    _check(run(ref, cand, **kw), case, slots)
