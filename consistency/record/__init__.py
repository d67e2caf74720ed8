"""Record tensors from training and serving paths (drop-in ``capture`` and HF hooks)."""

from consistency.record.recorder import Recorder, active, capture, flush, recording

__all__ = ["Recorder", "active", "capture", "flush", "recording"]
