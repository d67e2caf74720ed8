"""torch tensor -> (numpy storage, dtype name, layout metadata), without losing bf16.

The layout (stride, contiguity, device) is recorded because users suspect it (the seed's
``.clone()`` versus ``hidden_states + residual``); compare reports it as information.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from consistency.contract.models import TensorMeta

def dtype_name(t: Any) -> str:
    return str(t.dtype).removeprefix("torch.")


def layout(t: Any, producer: str | None = None) -> TensorMeta:
    return TensorMeta(dtype=dtype_name(t), shape=list(t.shape), stride=list(t.stride()),
                      contiguous=bool(t.is_contiguous()), device=str(t.device), producer=producer)


def to_numpy(t: Any) -> tuple[np.ndarray, str]:
    """Host copy as (storage array, canonical dtype). Accepts numpy arrays unchanged."""
    if isinstance(t, np.ndarray):
        from consistency.dump import dtypes

        return t, dtypes.from_numpy(t.dtype).name
    from consistency.dump import dtypes

    return dtypes.torch_storage(t)
