"""Put this folder on PYTHONPATH to record a server you cannot edit (inert without CONSISTENCY_RECORD).

    PYTHONPATH=$(python -m consistency.record.autopatch) CONSISTENCY_RECORD=/tmp/serve.safetensors \
        python -m sglang.launch_server ...

Python imports ``sitecustomize`` at start-up in every process, including the workers the
engine spawns; :func:`consistency.record.patch.auto` then patches the engine's model classes
as they are imported, and :func:`consistency.record.mtp_install.auto` its MTP draft classes;
with ``CONSISTENCY_RECORD_GRAPHS=1``, :func:`consistency.record.graph_runners.auto` its
CUDA-graph runners too (docs/integrations/cuda-graphs.md). If your environment already has a
sitecustomize, call these ``auto()`` from it instead.
"""

import os

if os.environ.get("CONSISTENCY_RECORD"):
    from consistency.record import mtp_install
    from consistency.record.patch import auto

    auto()
    mtp_install.auto()
    if os.environ.get("CONSISTENCY_RECORD_GRAPHS", "") not in ("", "0"):
        from consistency.record import graph_runners

        graph_runners.auto()
