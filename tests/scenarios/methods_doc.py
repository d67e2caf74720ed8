"""The consumer table of docs/methods.md, generated from ``consistency/contract/consumers.py`` ROWS.

``python -m tests.scenarios.methods_doc``          prints the table
``python -m tests.scenarios.methods_doc --write``  replaces it in docs/methods.md (between the markers)

tests/compare/test_scenarios_mtp.py checks that every row appears in the doc with the same fields, so
the doc and the table the lint rules and ``contract_for`` read cannot drift.
"""

from __future__ import annotations

import sys
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "methods.md"
BEGIN, END = "<!-- ROWS-BEGIN (python -m tests.scenarios.methods_doc --write) -->", "<!-- ROWS-END -->"
HEADER = ("| row | method | runtime | side | step 0 reads | recycle (k >= 1) | pairing | pos 0 | concat | "
          "targets, versions | source |\n|---|---|---|---|---|---|---|---|---|---|---|")


def _families(r) -> str:  # noqa: ANN001
    from consistency.contract import consumers as K

    names = {K.DEEPSEEK_MTP: "DeepSeek-V3/V3.2, GLM-4.5+/GLM-5", K.QWEN3_NEXT_MTP: "Qwen3-Next, Qwen3.5",
             K.MIMO_MTP: "MiMo"}
    if not r.families:
        return "any"
    for fam, label in names.items():
        if r.families == fam:
            return label
        if fam < r.families:
            rest = sorted(r.families - fam)
            return f"{label}, {', '.join(x for x in rest if x.islower())}"
    return ", ".join(sorted(x for x in r.families if x.islower())) or ", ".join(sorted(r.families))


def _versions(r) -> str:  # noqa: ANN001
    v = lambda t: ".".join(map(str, t))  # noqa: E731
    if r.min_version and r.max_version:
        return f"{v(r.min_version)} <= v < {v(r.max_version)}"
    if r.min_version:
        return f">= {v(r.min_version)}"
    if r.max_version:
        return f"< {v(r.max_version)}"
    return ""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def table() -> str:
    from consistency.contract.consumers import ROWS

    lines = [HEADER]
    for r in ROWS:
        where = _families(r) + (f"; {_versions(r)}" if _versions(r) else "")
        src = r.source + (f". {r.note}" if r.note else "") + ("" if r.confirmed else " **(unconfirmed)**")
        lines.append("| " + " | ".join([
            f"`{r.code}`", r.method.value, r.runtime, r.side, f"`{r.step0_norm.value}`", f"`{r.recycle.value}`",
            f"`{r.pairing.value}`", f"`{r.pos0_embed.value}`", f"`{r.concat_order.value}`", _cell(where),
            _cell(src)]) + " |")
    return "\n".join(lines)


def write() -> None:
    text = DOC.read_text()
    i, j = text.index(BEGIN), text.index(END)
    DOC.write_text(text[:i + len(BEGIN)] + "\n" + table() + "\n" + text[j:])


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        write()
    else:
        print(table())
