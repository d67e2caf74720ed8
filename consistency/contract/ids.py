"""Layer-id lists as users type them ('2,30,58', '[2, 30, 58]', 'default'): one parser for
every command that takes them (compare, convert, record, lint --trained-with)."""

from __future__ import annotations

from collections.abc import Sequence

from consistency.errors import UsageError

MAX_IDS = 1024  # no model has more layers; every rule and report over the ids stays cheap


def parse_ids(text: str | Sequence[int] | None, where: str = "", what: str = "layer ids") -> list[int] | None:
    """'2,30,58', '[2, 30, 58]' or a list -> [2, 30, 58]; 'default', 'none' or '' -> None (runtime default).
    ``where`` prefixes the error (e.g. the flag), ``what`` names the thing that did not parse."""
    prefix = f"{where}: " if where else ""
    if text is None:
        return None
    if not isinstance(text, str):
        out = [int(x) for x in text]
    elif text.strip().lower() in ("", "default", "none"):
        return None
    else:
        try:
            out = [int(x) for x in text.strip().strip("[]").replace(" ", "").split(",") if x != ""]
        except ValueError:
            raise UsageError(f"{prefix}cannot parse {what} {text[:80]!r}: expected comma-separated integers") from None
    if len(out) > MAX_IDS:
        raise UsageError(f"{prefix}{len(out)} {what}; at most {MAX_IDS} (a layer id per layer at most)")
    return out


# Conventions whose id lists come from speculators' data generation: scripts/launch_vllm.py
# (--include-last-layer) appends N to the aux ids, vLLM's extract_hidden_states writes one slot per
# id, and the trainer splits the last slot off as verifier_last_hidden_states (train/data.py
# hidden_states[:, :-1] / [:, -1]). The last id is then the verifier's last state, not a draft slot.
APPENDING = ("speculators", "vllm")


def split_appended(ids: Sequence[int], n: int | None, convention: str | None,
                   slots: int | None = None) -> tuple[list[int], int | None, str]:
    """``(aux ids, the appended id or None, a sentence saying so)``: the one rule for the
    verifier's last state appended after the aux ids, shared by lint ``--trained-with``,
    compare's ``--layer-ids`` and the readers.

    The last id is the appended state when it is N (the target's layer count) and the last,
    largest id; a draft ``slots`` count equal to ``len(ids)`` overrules it (N is then a real aux
    id). Without N, one id more than the draft's slots under speculators' convention says the
    same. Any other convention never appends."""
    ids = list(ids)
    name = (convention or "").split("@", 1)[0].strip().lower()
    if name not in APPENDING or len(ids) < 2:
        return ids, None, ""
    last = ids[-1]
    if n is not None:
        hit = last == n and last == max(ids) and (slots is None or slots == len(ids) - 1)
    else:
        hit = name == "speculators" and slots is not None and len(ids) == slots + 1 and last == max(ids)
    if not hit:
        return ids, None, ""
    why = (f"id {last} is N, the verifier's last state that speculators' data generation appends after the aux ids "
           f"(scripts/launch_vllm.py --include-last-layer; the trainer splits it off as verifier_last_hidden_states): "
           f"the draft's aux ids are {ids[:-1]}") if n is not None else (
        f"{len(ids)} ids for {slots} slots under speculators' convention: the last, {last}, is the verifier's last "
        f"state appended by data generation (train/data.py splits it off), the aux ids are {ids[:-1]}")
    return ids[:-1], last, why
