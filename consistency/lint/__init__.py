"""``consistency lint``: static checks of a draft, its target and the server's settings.

Most train/serve mismatches are visible before a token runs: in the draft's config.json,
the target's config, the checkpoint's tensor names and shapes (read from safetensors
headers only) and the serving command line. This package reads those inputs
(:mod:`.configs`, :mod:`.draft`, :mod:`.serve`, :mod:`.trained`), works out what the
server will feed the draft slot by slot (:mod:`.plan`) and runs a registry of rules
(:mod:`.rules`) over them (:mod:`.engine`). It never imports torch.
"""

from consistency import _callable_package  # noqa: E402 - consistency.lint(...) is consistency.api.lint

_callable_package(__name__)
