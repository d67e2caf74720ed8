"""Record tensors from training and serving paths (drop-in ``capture`` and HF hooks)."""

from consistency.record.recorder import Recorder, active, capture, flush, recording

__all__ = ["Recorder", "active", "capture", "flush", "recording"]

from consistency import _callable_package  # noqa: E402 - consistency.record(...) is consistency.api.record

_callable_package(__name__)
