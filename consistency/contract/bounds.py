"""The ``CONSISTENCY_MAX_*`` bounds: one reader of the environment, checked at start-up.

Light on purpose (``os`` only): the CLI validates every override before any command runs,
and ``consistency --help`` must not pay for pydantic to do it.
"""

from __future__ import annotations

import os
from typing import Any

from consistency.errors import UsageError


def env_limit(name: str, default: int, environ: Any = None) -> int:
    """A bound, overridable as ``CONSISTENCY_<NAME>`` (bytes or a count); bad values are usage errors."""
    key = f"CONSISTENCY_{name}"
    raw = (os.environ if environ is None else environ).get(key)
    if raw is None or raw.strip() == "":
        return default
    try:
        v = int(raw.strip().replace("_", ""))
    except ValueError:
        raise UsageError(f"{key}={raw[:40]!r} is not an integer") from None
    if v < 1:
        raise UsageError(f"{key}={raw!r} must be positive")
    return v


# every CONSISTENCY_MAX_<NAME> a reader consults (docs/security.md#bounds-and-their-overrides);
# checked all at once when a command starts, so a bad or misspelt override is one line before
# any work, not a surprise in the middle of a run (or never noticed: a typo is otherwise ignored)
KNOWN_BOUNDS = ("HEADER_BYTES", "MEMBER_BYTES", "INFLATE_BYTES", "META_BYTES", "JSON_DEPTH", "FORTRAN_BYTES",
                "CONTRACT_BYTES", "GUNZIP_BYTES", "TOKENIZER_BYTES", "CRC_BYTES", "PICKLE_BYTES", "VIEW_BYTES",
                "ROWS", "PICKLE_OPS", "FILE_MEMORY")

# performance knobs (CONSISTENCY_<NAME>, a positive integer) -> default: validated at start-up
# like the bounds, so `abc`, 0 or -5 is one line before any work, never a ValueError at import
# or a zero-byte chunk that loops forever
KNOBS = {"CHUNK_MB": 64, "SAMPLE_MB": 192}


def knob(name: str, default: int | None = None, environ: Any = None) -> int:
    """A performance knob's value (``CONSISTENCY_<NAME>``), its default when unset."""
    return env_limit(name, KNOBS[name] if default is None else default, environ)


def check_bound_overrides(environ: Any = None) -> None:
    """Validate every ``CONSISTENCY_MAX_*`` variable and every performance knob set: a known
    name, a positive integer."""
    env = os.environ if environ is None else environ
    for name, default in KNOBS.items():
        env_limit(name, default, env)
    for key in sorted(k for k in env if k.startswith("CONSISTENCY_MAX_")):
        name = key[len("CONSISTENCY_MAX_"):]
        if name not in KNOWN_BOUNDS:
            raise UsageError(f"{key}: no such bound; known: {', '.join('CONSISTENCY_MAX_' + b for b in KNOWN_BOUNDS)}")
        env_limit(f"MAX_{name}", 1, env)
