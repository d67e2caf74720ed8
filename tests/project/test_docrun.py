"""The page checker's own rules (tests/docrun.py): what a shown line may differ in, and what not."""

from __future__ import annotations

from tests.docrun import Command, Ran, missing

REAL = ("consistency compare a b\n   1 │ aux.1  │ hidden.3 │ hidden.7  │       4.30e-01 │   2.5e+03x │ LAYER_MISMATCH\n"
        "   2 │ aux.2  │ hidden.7 │ hidden.10 │       2.40e-01 │  1.19e+03x │ LAYER_MISMATCH\ncompared 3 tensors in 0.41 s\n")


def _lost(*shown: str) -> list[str]:
    return missing(Ran(Command("consistency compare a b", list(shown)), 1, REAL, ""))


def test_an_e_notation_figure_holds_within_three_percent_as_another_cpus_bf16_kernels_print_it() -> None:
    """The README's 2.52e+03x / 1.2e+03x read 2.5e+03x / 1.19e+03x on a CPU whose bf16 kernels
    round otherwise (a fresh clone's newcomer test failed on nothing else)."""
    assert _lost("1 │ aux.1 │ hidden.3 │ hidden.7 │ 4.30e-01 │ 2.52e+03x │ LAYER_MISMATCH",
                 "2 │ aux.2 │ hidden.7 │ hidden.10 │ 2.40e-01 │ 1.2e+03x │ LAYER_MISMATCH") == []


def test_a_figure_further_off_a_word_or_a_plain_number_changed_is_lost() -> None:
    bad = ["1 │ aux.1 │ hidden.3 │ hidden.7 │ 4.30e-01 │ 2.6e+03x │ LAYER_MISMATCH",  # 4% off
           "1 │ aux.1 │ hidden.3 │ hidden.7 │ 4.30e-01 │ 2.5e+02x │ LAYER_MISMATCH",  # another exponent
           "1 │ aux.1 │ hidden.3 │ hidden.8 │ 4.30e-01 │ 2.5e+03x │ LAYER_MISMATCH",  # another stream
           "2 │ aux.2 │ hidden.7 │ hidden.10 │ 2.40e-01 │ 1.19e+03x │ SLOT_SHIFT",  # another code
           "compared 4 tensors"]
    assert _lost(*bad) == bad


def test_a_timing_is_any_timing() -> None:
    assert _lost("compared 3 tensors in 0.02 s") == []
    assert _lost("compared 3 tensors in 2 ms") == []
