"""The demo's last step: from the diagnosis to the acceptance it costs.

``consistency demo`` records a training and a serving dump of the built-in ``tiny-llama``
and compares them; this replays the built-in draft ``tiny-llama-eagle3`` (trained on streams
[0, 3, 7] of that very target, see :mod:`consistency.replay.assets`) on both, so the user
sees the seed's numbers in miniature: a draft that is right most of the time on what it was
trained on, and mostly wrong on what the server feeds it. No training happens here: the
draft is package data and loads in milliseconds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.text import Text

DRAFT = "tiny-llama-eagle3"
TARGET = "tiny-llama"
STEPS = 3  # SGLang --speculative-num-steps 3, topk 1: 4 draft tokens per verification


def demo_replay(con: Any, out_dir: Path, train_path: Path, serve_path: Path, force: bool = False) -> None:
    import json

    from consistency.dump.atomic import write_text_atomic
    from consistency.record.models import load_model
    from consistency.replay.assets import builtin_dir
    from consistency.replay.engine import run_replay
    from consistency.replay.text import render
    from consistency.replay.train import fingerprint

    draft = builtin_dir(DRAFT)
    target = load_model(TARGET)
    meta = json.loads((draft / "config.json").read_text()).get("consistency_fixture", {})
    if meta.get("target_fingerprint") != fingerprint(target):
        con.print(Text(f"\nreplay skipped: the built-in draft {DRAFT} was trained for another build of {TARGET} "
                       "(its weight fingerprint differs; transformers may have changed its initialisation). "
                       "Regenerate it: python fixtures/train_draft.py --target tiny-llama --preset long "
                       f"--out {draft}", style="yellow"))
        return
    con.print(f"\n$ consistency replay --draft {DRAFT} --target {TARGET} --steps {STEPS} "
              f"{Path(train_path).name} {Path(serve_path).name}", markup=False, highlight=False)
    rep = run_replay(str(draft), target, train_path, serve_path, steps=STEPS)
    render(rep, con)
    write_text_atomic(Path(out_dir) / "replay.json", rep.model_dump_json(indent=2) + "\n", force=force)
    r, c = rep.reference, rep.candidate
    if rep.verdict == "fail":
        con.print(Text(f"what it costs: the draft's acceptance falls from {100 * r.acceptance_rate:.0f}% to "
                       f"{100 * c.acceptance_rate:.0f}%, {r.accept_length:.2f} -> {c.accept_length:.2f} tokens per "
                       f"target pass: speculation buys {100 * (c.accept_length / r.accept_length):.0f}% of what it "
                       "should.", style="bold"))
    else:
        con.print(Text(f"the server feeds the draft what it was trained on: acceptance {100 * c.acceptance_rate:.0f}% "
                       f"(reference {100 * r.acceptance_rate:.0f}%), {c.accept_length:.2f} tokens per target pass.",
                       style="bold green"))
