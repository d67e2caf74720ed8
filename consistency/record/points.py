"""What the asynchronous recorder keeps of a capture point once it is checked.

A decode step captures the same points with the same layouts step after step: the checks and
the layout facts are made once per point and reused (record/async_capture.py), and a step
that repeats is staged from a plan built of these points (record/step_plan.py). The layout
facts become the dump's TensorMeta only at save, validated as a reader would validate them.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from consistency.dump import dtypes
from consistency.record.graph_plan import resolve

ID_NAMES = frozenset(("positions", "input_ids", "request_ids"))  # 1-D per-token captures, rows selected as [T, 1]


def torch_dtype(t: Any) -> str:
    return str(t.dtype).removeprefix("torch.")


class Point(NamedTuple):
    """What one capture point's last layout was checked and built into; the next capture of
    the same dtype, shape, stride and producer (a decode step's points, step after step) reuses it."""

    dtype: Any
    shape: Any
    stride: tuple[int, ...]
    producer: str | None
    layout: tuple  # the facts TensorMeta is built from at save
    nbytes: int  # of the selected rows
    sel_dtype: Any
    sel_shape: tuple[int, ...]
    sel_dname: str
    cls: type  # the tensor's class: the fast path asks a tensor's device only of this class
    pad: int  # nbytes rounded up to the staging alignment


class StorableDtypes(dict):
    """torch dtype -> whether a dump can hold it, each dtype's name resolved once."""

    def __contains__(self, dt: object) -> bool:
        ok = self.get(dt)
        if ok is None:
            ok = self[dt] = str(dt).removeprefix("torch.") in dtypes.BY_NAME
        return ok


def tensor_metas(layouts: dict[str, tuple]) -> tuple[dict[str, Any], dict[str, str]]:
    """Each key's TensorMeta from its layout facts, and why a key's metadata is invalid (that
    capture is refused alone: never the whole recording)."""
    from consistency.contract.models import TensorMeta

    metas, bad = {}, {}
    for key, (dt, shape, stride, contiguous, device, producer, meta) in layouts.items():
        try:  # validated as the reader will
            metas[key] = TensorMeta.model_validate({"dtype": str(dt).removeprefix("torch."), "shape": list(shape),
                                                    "stride": list(stride), "contiguous": contiguous,
                                                    "device": device, "producer": producer, **resolve(meta)})
        except Exception as exc:  # noqa: BLE001
            bad[key] = f"its metadata is invalid: {' '.join(str(exc).split())[:160]}"
    return metas, bad


def select_rows(t: Any, tokens: Any, last_tokens: int | None) -> Any:
    """Keep the requested token rows (dim -2 of [.., T, H]); their positions are kept the same
    way when the runtime passes ``positions=`` (stitching then knows which tokens these are)."""
    if t.dim() < 2 or (tokens is None and last_tokens is None):
        return t
    if last_tokens is not None:
        return t[..., -last_tokens:, :]
    if isinstance(tokens, slice):
        return t[..., tokens, :]
    import torch

    idx = torch.as_tensor(list(tokens), device=t.device, dtype=torch.long)
    return t.index_select(-2, idx)
