"""What a capture must be before the recorder keeps it, checked when it is made.

The recorder runs inside a server's forward pass. A capture that the writer (or our own
reader) would refuse at exit used to cost the whole recording, with a traceback; one that
numpy or torch cannot convert (complex, object, str, structured arrays, float8_e8m0fnu)
raised into the host. Each capture is therefore turned into what the dump will hold, and
checked against every rule a reader applies, *at capture time*: a bad one is refused alone,
with one line on stderr, counted in the dump's metadata (``extra.refused_captures``), and
the rest of the recording is kept. Nothing here raises anything but :class:`Refused`.
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

from consistency.contract.models import TensorMeta
from consistency.dump import dtypes, safetensors_io
from consistency.dump.reader import MAX_META_TEXT
from consistency.dump.writer import name_problem

_REPEAT = re.compile(r"#\d+$")
META_RESERVE = 1 << 20  # metadata characters kept free for everything but the per-tensor entries
MAX_SAID = 20  # refusal lines per recorder; the rest are only counted
SUPPORTED = "floats of 64/32/16 bits, bfloat16, float8_e4m3fn/e5m2, integers, bool"


class Refused(Exception):
    """A capture the recorder does not keep; ``reason`` says why in a few words."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def check_name(name: object) -> str:
    problem = name_problem(name)
    if problem:
        raise Refused(f"its name {problem}")
    assert isinstance(name, str)
    if _REPEAT.search(name):  # "aux.0#2" is what the recorder calls the second capture of aux.0
        raise Refused("its name ends in #<digits>, the suffix the recorder gives repeated captures")
    return name


def _torch_dtype(t: Any) -> str:
    return str(t.dtype).removeprefix("torch.")


def host_copy(tensor: Any) -> tuple[np.ndarray, str]:
    """(storage array, dtype name) the dump will hold: a copy, so that a host buffer the
    caller reuses after the capture cannot change what was recorded."""
    if isinstance(tensor, np.ndarray):
        try:
            dt = dtypes.from_numpy(tensor.dtype)
        except (KeyError, TypeError):
            raise Refused(f"dtype {tensor.dtype} cannot be stored in a dump ({SUPPORTED})") from None
        out: tuple[np.ndarray, str] = (np.array(tensor, copy=True, order="C"), dt.name)
    elif hasattr(tensor, "detach") and hasattr(tensor, "dtype") and hasattr(tensor, "shape"):
        name = _torch_dtype(tensor)
        if name not in dtypes.BY_NAME:
            raise Refused(f"dtype {name} cannot be stored in a dump ({SUPPORTED})")
        try:
            out = dtypes.torch_storage(tensor)
        except Exception as exc:  # noqa: BLE001 - sparse, meta, quantized...: refused, never raised
            raise Refused(f"cannot be copied to the host ({type(exc).__name__}: {str(exc)[:120]})") from None
    else:
        raise Refused(f"is a {type(tensor).__name__}, not a numpy array or a torch tensor")
    if out[0].ndim > safetensors_io.MAX_RANK:
        raise Refused(f"has rank {out[0].ndim}; readers refuse more than {safetensors_io.MAX_RANK} dimensions")
    return out


def tensor_meta(tensor: Any, producer: str | None, meta: dict[str, Any]) -> TensorMeta:
    """The tensor's metadata entry, validated as the reader will validate it."""
    from pydantic import ValidationError

    from consistency.contract.io import strict_json, validation_line, writable

    base: dict[str, Any] = {"producer": producer}
    if not isinstance(tensor, np.ndarray):
        try:
            base.update(dtype=_torch_dtype(tensor), shape=list(tensor.shape), stride=list(tensor.stride()),
                        contiguous=bool(tensor.is_contiguous()), device=str(tensor.device))
        except Exception:  # noqa: BLE001 - a layout torch cannot state (sparse): recorded without it
            pass
    try:
        tm = TensorMeta.model_validate({**{k: v for k, v in base.items() if v is not None}, **meta})
        strict_json(json.dumps(writable(tm.model_dump(mode="json", exclude_none=True))))
    except ValidationError as exc:
        raise Refused(f"its metadata is invalid at {validation_line(exc)}") from None
    except (ValueError, TypeError) as exc:
        raise Refused(f"its metadata cannot be written: {str(exc)[:120]}") from None
    return tm


def meta_chars(key: str, tm: TensorMeta) -> int:
    """About what one entry adds to the metadata text (the reader bounds the whole)."""
    return len(key) + len(tm.model_dump_json(exclude_none=True)) + 8


def meta_budget() -> int:
    return MAX_META_TEXT - META_RESERVE


def say(name: object, reason: str, said: int) -> None:
    """One stderr line per refusal (the first :data:`MAX_SAID`; then one line that says the
    rest are counted). Written directly: ``warnings.warn`` raises under ``-W error``."""
    from consistency.escape import term

    shown = name if isinstance(name, str) else repr(name)
    if said < MAX_SAID:
        line = f"consistency: capture {term(shown[:200])} refused: {term(reason)}; the rest of the recording is kept"
    elif said == MAX_SAID:
        line = "consistency: further refused captures are not printed; the dump counts them in extra.refused_captures"
    else:
        return
    from consistency.record.fallback import emit

    emit(line)
