"""Which runtime releases accept which speculative method: a table read from each release's source.

A method a release removed (Medusa in vLLM 0.33.0) or never had (Medusa in SGLang) fails at
start-up, or worse, is served as something else; a linter must know it before the server is
built. Each row says the releases that accept the method and where that was read. vLLM rows
come from the wheels on PyPI, 0.18.0 to 0.33.0 (``vllm/config/speculative.py``
``SpeculativeMethod`` and ``vllm/model_executor/models/registry.py``), SGLang rows from its wheels
0.5.5 to 0.5.23 (``sglang/srt/speculative/spec_info.py``); a release outside the range read
(``CHECKED``), or between two releases that disagree, is "not known", never "accepted".
"""

from __future__ import annotations

from dataclasses import dataclass

from consistency.contract.versions import Version, VersionRange, vtext

# canonical method names (vLLM's spelling where it has one)
EAGLE, EAGLE3, MTP, MEDUSA, MLP, PEAGLE, DFLASH, NGRAM = ("eagle", "eagle3", "mtp", "medusa", "mlp_speculator",
                                                          "peagle", "dflash", "ngram")
METHODS = (EAGLE, EAGLE3, MTP, MEDUSA, MLP, PEAGLE, DFLASH, NGRAM)
LABEL = {EAGLE: "EAGLE-1/2", EAGLE3: "EAGLE-3", MTP: "MTP/NextN", MEDUSA: "Medusa", MLP: "MLP speculator",
         PEAGLE: "P-EAGLE", DFLASH: "DFlash", NGRAM: "ngram"}

_VSPEC = "vllm/config/speculative.py SpeculativeMethod"
_VREG = "vllm/model_executor/models/registry.py _SPECULATIVE_DECODING_MODELS"
_SSPEC = "sglang python/sglang/srt/speculative/spec_info.py SpeculativeAlgorithm.from_string"

# the releases whose source was read for each runtime; outside it nothing is claimed
CHECKED: dict[str, VersionRange] = {"vllm": VersionRange((0, 18), None), "sglang": VersionRange((0, 5, 5), None)}


@dataclass(frozen=True)
class MethodRow:
    runtime: str
    method: str
    accepted: VersionRange | None  # None: no release accepts it
    source: str
    unread: VersionRange | None = None  # releases between those read, where the answer is not known


ROWS: tuple[MethodRow, ...] = (
    MethodRow("vllm", EAGLE, VersionRange(), f"{_VSPEC} (EagleModelTypes 'eagle', 0.18.0-0.33.0)"),
    MethodRow("vllm", EAGLE3, VersionRange(), f"{_VSPEC} (EagleModelTypes 'eagle3', 0.18.0-0.33.0)"),
    MethodRow("vllm", MTP, VersionRange(), f"{_VSPEC} (MTPModelTypes, 0.18.0-0.33.0)"),
    MethodRow("vllm", NGRAM, VersionRange(), f"{_VSPEC} ('ngram', 0.18.0-0.33.0)"),
    MethodRow("vllm", MEDUSA, VersionRange(None, (0, 33)),
              f"{_VSPEC} has 'medusa' up to 0.32.0 and not in 0.33.0; vllm/v1/spec_decode/medusa.py and "
              f"{_VREG} 'MedusaModel' are gone in 0.33.0"),
    MethodRow("vllm", MLP, None,
              f"{_VSPEC} lists 'mlp_speculator' up to 0.32.0 (not 0.33.0), but {_VREG} has "
              "'MLPSpeculatorPreTrainedModel' commented out in every release 0.18.0-0.32.0 (\"Re-enable this once "
              "the MLP Speculator is supported in V1\"): no model class loads it"),
    MethodRow("vllm", DFLASH, VersionRange((0, 20), None), f"{_VSPEC} (DFlashModelTypes 'dflash' from 0.20.0)"),
    MethodRow("vllm", PEAGLE, VersionRange((0, 22), None),
              f"{_VREG} 'PEagleDraftModel'/'PeagleLlamaForCausalLM' from 0.22.0 (method eagle3, parallel drafting)"),
    # SGLang wheels 0.5.5, 0.5.9, 0.5.12, 0.5.13, 0.5.17, 0.5.21, 0.5.23 (spec_info.py: the registered
    # algorithms, 0.5.5/0.5.9; the SpeculativeAlgorithm enum, 0.5.12+)
    MethodRow("sglang", MEDUSA, None, f"{_SSPEC}: no MEDUSA in any release read (0.5.5-0.5.23)"),
    MethodRow("sglang", MLP, None, f"{_SSPEC}: no MLP speculator in any release read (0.5.5-0.5.23)"),
    MethodRow("sglang", PEAGLE, None, f"{_SSPEC}: no P-EAGLE (parallel drafting) in any release read (0.5.5-0.5.23), "
              "and no PEagle model file in those wheels"),
    MethodRow("sglang", EAGLE, VersionRange(), f"{_SSPEC} (EAGLE, alias NEXTN; 0.5.5-0.5.23)"),
    MethodRow("sglang", EAGLE3, VersionRange(), f"{_SSPEC} (EAGLE3; 0.5.5-0.5.23)"),
    MethodRow("sglang", MTP, VersionRange(), f"{_SSPEC} (NEXTN, an alias of EAGLE on the target's MTP layers)"),
    MethodRow("sglang", NGRAM, VersionRange(), f"{_SSPEC} (NGRAM; 0.5.5-0.5.23)"),
    MethodRow("sglang", DFLASH, VersionRange((0, 5, 12), None),
              f"{_SSPEC}: DFLASH in 0.5.12-0.5.23, not in 0.5.5 or 0.5.9 (0.5.10-0.5.11 not read)",
              unread=VersionRange((0, 5, 10), (0, 5, 12))),
)


@dataclass(frozen=True)
class Support:
    """Whether ``runtime@version`` accepts a method: True, False, or None (not known here)."""

    accepted: bool | None
    why: str
    row: MethodRow | None = None


def support(runtime: str, method: str, version: Version | None) -> Support:
    """The answer for one release; ``version`` None is the newest release."""
    row = next((r for r in ROWS if r.runtime == runtime and r.method == method), None)
    if row is None:
        return Support(None, f"which {runtime} releases accept {LABEL.get(method, method)} was not read")
    at = f"{runtime} {vtext(version)}" if version else f"the newest {runtime}"
    if row.accepted is None:
        return Support(False, f"no {runtime} release accepts {LABEL.get(method, method)} ({row.source})", row)
    checked = CHECKED.get(runtime)
    if version is not None and checked is not None and not checked.covers(version) and row.accepted.covers(version):
        return Support(None, f"{at} is older than the releases read ({checked.label()})", row)
    if version is not None and row.unread is not None and row.unread.covers(version):
        return Support(None, f"{at} lies between the releases read for {LABEL.get(method, method)} ({row.source})", row)
    if row.accepted.covers(version):
        return Support(True, f"{at} accepts {LABEL.get(method, method)} ({row.source})", row)
    return Support(False, f"{at} does not accept {LABEL.get(method, method)}: accepted by {runtime} "
                          f"{row.accepted.label()} ({row.source})", row)


def accepted_anywhere(method: str) -> bool | None:
    """False when no runtime release accepts ``method``; None when a runtime's answer is not known."""
    rows = [r for r in ROWS if r.method == method]
    if any(r.accepted is not None for r in rows):
        return True
    runtimes = {r.runtime for r in rows}
    return False if runtimes >= {"sglang", "vllm"} else None
