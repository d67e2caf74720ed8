"""Run the scenario tables and write the misses table (a Markdown file the engine's author reads).

    python -m tests.scenarios.sweep [--pretrained] [--random N] [--out PATH]
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from tests.scenarios import cases
from tests.scenarios.faults import Scenario
from tests.scenarios.run import run

# What a family's construction is, where the table alone would not say (read with the repro).
FAMILY_NOTES = {
    "header_magic": "a valid safetensors file whose u64 header length has low byte 0x80 (1 file in 32 from an "
                    "8-byte-aligning writer, ours included) is refused as pickle: consistency/dump/formats/__init__.py "
                    "MAGIC is checked before the safetensors shape (byte 8 == '{'). Hits any dump, e.g. propagate.",
    "propagate": "candidate = full stream dump, every hidden.s' for s' >= s carries the same 30% row-relative error; "
                 "root cause = hidden.s (first divergent), streams before it are bit-equal to the reference.",
    "token_scale": "each token row scaled by its own factor in [0.5, 2]: not a constant factor, and row norms are not "
                   "equalized, so not a norm either; NORM_* is accepted with an 'after' above the floor.",
    "loose_tolerance": "--tolerance 'aux.*=1' on the seed story ([3, 7, 10] vs [0, 3, 7]); the thin reference has "
                       "no stream 10, so slot 2 matches nothing: the slot table must not say stream 7.",
    "norm_final": "candidate slot = final_norm (HF post-norm last state; SmolLM2's norm has a learned weight) where "
                  "the reference slot is hidden.N; /ref-side: the reverse (SpecForge post-norm training slot).",
    "swapped": "the serving dump passed as the reference: its metadata says side=serving (and the training dump "
               "side=training); the report should say the arguments look swapped.",
    "slot_count": "[more]: serving feeds 4 slots [0, 3, 7, 9] where training has 3 (the draft's fc takes 3H): "
                  "docs/findings.md#extra says an extra aux slot is an error; with a full reference it PASSES "
                  "(EXPECTATION_UNKNOWN warning). [fewer]: 2 slots -> MISSING.",
    "layer_mismatch": "[dup]: one slot holds another trained slot's stream ([7, 3, 7] for [0, 3, 7]); not a shift, "
                      "not a permutation, not an offset: LAYER_MISMATCH only. [other]: one slot holds a stream "
                      "outside the list.",
    "benign": "counts misses: the summary's '(N warnings)' leaves out METADATA_DIFF warnings (issue 13: every "
              "count includes every finding).",
    "drift": "3% element noise x 0.9985 under --threshold 1e-5: an error (>10x floor), and the 0.9985 factor "
             "is no explanation (removing it leaves the error far above the floor).",
}

_ORDER = ("false_pass", "crash", "false_fail", "cause", "identity", "tokens", "counts")


def _axes(sc: Scenario) -> str:
    spec = f", ids{'+N' if sc.ids_with_last else ''}" if sc.ref_container == "speculators" else ""
    return (f"{sc.arch}, ref {sc.ref_container}/{sc.ref_dtype}{spec}, cand {sc.cand_container}/{sc.cand_dtype}, "
            f"T={sc.tokens}")


def _shape(detail: str) -> str:
    return re.sub(r"\d+(\.\d+)?(e-?\d+)?", "#", detail)[:90]


def sweep(scs: list[Scenario], tmp: Path) -> tuple[dict, collections.Counter, collections.Counter]:
    groups: dict[tuple[str, str, str], list[tuple[Scenario, str]]] = collections.defaultdict(list)
    per_family: collections.Counter = collections.Counter()
    ok_family: collections.Counter = collections.Counter()
    for i, sc in enumerate(scs):
        per_family[sc.family] += 1
        _rep, _exc, misses, _b = run(sc, tmp / str(i))
        if not misses:
            ok_family[sc.family] += 1
        for m in misses:
            groups[(m.kind, sc.family, _shape(m.detail))].append((sc, m.detail))
    return groups, per_family, ok_family


def render(groups: dict, per_family: collections.Counter, ok_family: collections.Counter, seconds: float,
           title: str) -> str:
    total, ok = sum(per_family.values()), sum(ok_family.values())
    lines = [f"# Scenario misses ({title})", "",
             f"{total} scenarios in {seconds:.0f} s: {ok} fully right, {total - ok} with at least one miss. "
             f"Refreshed {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} by `python -m tests.scenarios.sweep`.",
             "Kinds, worst first: false_pass (a fault passed), crash, false_fail (benign failed), cause (expected "
             "code absent or a forbidden explanation present), identity (slot table contradicts the construction), "
             "tokens (bad positions not named), counts.", "",
             "| kind | family (fault[variant]/reference thickness) | cases | example axes | expected vs got | repro |",
             "|---|---|---|---|---|---|"]
    key = lambda k: (_ORDER.index(k[0]) if k[0] in _ORDER else 99, k[1])  # noqa: E731
    for k in sorted(groups, key=key):
        items = groups[k]
        sc, detail = items[0]
        axes = {_axes(s) for s, _ in items}
        more = f" (+{len(axes) - 1} more axes)" if len(axes) > 1 else ""
        det = detail.replace("|", "/").replace("\n", " ")[:220]
        lines.append(f"| {k[0]} | {k[1]} | {len(items)}/{per_family[k[1]]} | {_axes(sc)}{more} | {det} | "
                     f"`python -m tests.scenarios {sc.args()}` |")
    shown = sorted({k[1].split("[")[0].split("/")[0] for k in groups} & set(FAMILY_NOTES))
    if shown:
        lines += ["", "## What these families are", ""] + [f"- **{f}**: {FAMILY_NOTES[f]}" for f in shown]
    lines += ["", "## Per fault (for docs/tolerance.md)", "", "| fault | cases | fully right | with a miss |",
              "|---|---|---|---|"]
    by_fault: collections.Counter = collections.Counter()
    ok_fault: collections.Counter = collections.Counter()
    for fam, n in per_family.items():
        by_fault[fam.split("[")[0].split("/")[0]] += n
        ok_fault[fam.split("[")[0].split("/")[0]] += ok_family[fam]
    for f in sorted(by_fault):
        lines.append(f"| {f} | {by_fault[f]} | {ok_fault[f]} | {by_fault[f] - ok_fault[f]} |")
    lines += ["", "## Per family", "", "| family | cases | fully right |", "|---|---|---|"]
    for fam in sorted(per_family):
        lines.append(f"| {fam} | {per_family[fam]} | {ok_family[fam]} |")
    return "\n".join(lines) + "\n"


def emit_known(groups: dict) -> str:
    """KNOWN for tests/compare/test_scenarios.py: wrong-cause families only (a family with a hard miss
    anywhere is left out: its cases must stay failing)."""
    hard = {fam for (kind, fam, _s) in groups if kind in ("false_pass", "false_fail", "crash")}
    fams: dict[str, tuple[list[str], list[str]]] = {}
    for (kind, fam, _s), items in groups.items():
        if fam in hard:
            continue
        reasons, args = fams.setdefault(fam, ([], []))
        reasons.append(f"{kind}: {items[0][1][:110]}")
        args.extend(sc.args() for sc, _d in items if sc.args() not in args)
    lines = ["KNOWN: dict[str, tuple[str, tuple[str, ...]]] = {"]
    for fam in sorted(fams):
        reasons, args = fams[fam]
        why = "; ".join(dict.fromkeys(reasons))[:100]
        lines.append(f"    {fam!r}: (")
        lines.append(f"        {why!r},")
        lines.append("        (" + ",\n         ".join(repr(a) for a in sorted(args)) + ",)),")
    lines.append("}")
    return "\n".join(ln if len(ln) <= 120 else f"{ln}  # noqa: E501" for ln in "\n".join(lines).splitlines())


def write_known(path: Path, block: str) -> None:
    """Replace the KNOWN block (between the KNOWN-BEGIN/END markers) of the test module."""
    text = path.read_text()
    head, rest = text.split("# KNOWN-BEGIN\n", 1)
    _old, tail = rest.split("# KNOWN-END\n", 1)
    path.write_text(f"{head}# KNOWN-BEGIN\n{block}\n# KNOWN-END\n{tail}")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pretrained", action="store_true", help="add the SmolLM2-135M table")
    ap.add_argument("--ci", action="store_true", help="exactly the CI tables (tiny + CI-sized SmolLM2)")
    ap.add_argument("--no-tiny", action="store_true", help="leave out the tiny-family table")
    ap.add_argument("--random", type=int, default=0, help="add N hypothesis-drawn scenarios")
    ap.add_argument("--only", help="regex on the family name")
    ap.add_argument("--out", default="/work/notes/scenario_misses.md")
    ap.add_argument("--emit-known", action="store_true", help="rewrite KNOWN in tests/compare/test_scenarios.py (use with --ci)")
    a = ap.parse_args(argv)
    np.seterr(all="ignore")
    scs = [] if a.no_tiny else cases.table()
    if a.ci:
        from tests.scenarios.build import smollm2_dir

        scs += cases.pretrained_table(False) if smollm2_dir() is not None else []
    if a.pretrained:
        scs += cases.pretrained_table(True)
    if a.random:
        from hypothesis import HealthCheck, given, seed, settings

        drawn: list[Scenario] = []

        @seed(13)
        @settings(max_examples=a.random, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck), deadline=None)
        @given(cases.strategy())
        def collect(sc: Scenario) -> None:
            drawn.append(sc)

        collect()
        scs += drawn
    if a.only:
        scs = [sc for sc in scs if re.search(a.only, sc.family)]
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        groups, per, ok = sweep(scs, Path(tmp))
    text = render(groups, per, ok, time.time() - t0, "pretrained + tiny" if a.pretrained else "tiny families")
    Path(a.out).write_text(text)
    print(text)
    if a.emit_known:
        block = emit_known(groups)
        print(block)
        write_known(Path(__file__).resolve().parents[1] / "test_scenarios.py", block)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
