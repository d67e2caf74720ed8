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
