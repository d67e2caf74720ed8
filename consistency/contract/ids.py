"""Layer-id lists as users type them ('2,30,58', '[2, 30, 58]', 'default'): one parser for
every command that takes them (compare, convert, record, lint --trained-with)."""

from __future__ import annotations

from collections.abc import Sequence

from consistency.errors import UsageError


def parse_ids(text: str | Sequence[int] | None, where: str = "", what: str = "layer ids") -> list[int] | None:
    """'2,30,58', '[2, 30, 58]' or a list -> [2, 30, 58]; 'default', 'none' or '' -> None (runtime default).
    ``where`` prefixes the error (e.g. the flag), ``what`` names the thing that did not parse."""
    if text is None:
        return None
    if not isinstance(text, str):
        return [int(x) for x in text]
    if text.strip().lower() in ("", "default", "none"):
        return None
    try:
        return [int(x) for x in text.strip().strip("[]").replace(" ", "").split(",") if x != ""]
    except ValueError:
        prefix = f"{where}: " if where else ""
        raise UsageError(f"{prefix}cannot parse {what} {text!r}: expected comma-separated integers") from None
