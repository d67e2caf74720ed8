"""Replay scenarios across the axes of its front door (issue 34): where the labels come from,
whether a target is given, whether each dump carries the target's logits, and what the
candidate is (the streams training used, the seed's shifted streams, or the reference itself).

The expected answer comes from the construction, never from replay's code:

- a side can be scored only against the target's own next tokens: its own ``logits``
  (``--labels logits``, or ``auto`` when the dump has them) or a target forward
  (``--labels target``, or ``auto`` with ``--target``); ``--labels input_ids`` (the recorded
  text) scores no serving acceptance at all. A side that cannot be scored is refused with one
  line (exit 2; an error in the gate), never a PASS;
- two scorable sides that are the same input are SAME_INPUT (fail);
- otherwise the right streams (bf16 serving capture of the same text) keep the acceptance
  (PASS), and the seed's +1 reading loses most of it (ACCEPTANCE_DROP, fail).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

RIGHT, SHIFTED = [0, 3, 7], [3, 7, 10]  # what the built-in draft was trained on; SGLang 0.5.5's reading
LABELS = ("auto", "logits", "target", "input_ids")
CANDIDATES = ("right", "shifted", "same")


@dataclass(frozen=True)
class Case:
    labels: str
    target: bool  # --target given
    ref_logits: bool  # the reference dump records the target's logits
    candidate: str  # right | shifted | same (the reference file itself)

    @property
    def id(self) -> str:
        return (f"{self.labels}-{'target' if self.target else 'no_target'}-"
                f"{'logits' if self.ref_logits else 'no_logits'}-{self.candidate}")

    def scorable(self, has_logits: bool) -> bool:
        return {"auto": has_logits or self.target, "logits": has_logits, "target": self.target,
                "input_ids": False}[self.labels]

    def expected(self) -> str:
        """'refused' (exit 2 / gate error), 'SAME_INPUT', 'pass' or 'ACCEPTANCE_DROP'."""
        cand_logits = self.ref_logits if self.candidate == "same" else False  # serving captures carry no logits
        if not (self.scorable(self.ref_logits) and self.scorable(cand_logits)):
            return "refused"
        if self.candidate == "same":
            return "SAME_INPUT"
        return "pass" if self.candidate == "right" else "ACCEPTANCE_DROP"


def cases() -> list[Case]:
    return [Case(*c) for c in itertools.product(LABELS, (True, False), (True, False), CANDIDATES)]
