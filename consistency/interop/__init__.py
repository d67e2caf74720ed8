"""Record from the tools people already use: TransformerLens caches and nnsight traces.

Both map their names onto the dump format (``hidden.s``, ``attn_out.k``, ``mlp_out.k``,
``resid_mid.k``, ``final_norm``, ``logits``) so ``consistency compare`` and its diagnosis
work on them unchanged. Both libraries are optional and imported by nobody here: the
functions read the objects those libraries return (anything with ``keys()`` and item
access works).
"""

from consistency.interop.common import write_streams
from consistency.interop.nnsight import from_nnsight_cache, record_nnsight_cache
from consistency.interop.transformerlens import from_activation_cache, record_activation_cache, tl_names

__all__ = ["from_activation_cache", "from_nnsight_cache", "record_activation_cache", "record_nnsight_cache",
           "tl_names", "write_streams"]
