"""Replay: run a trained draft (EAGLE-3; MTP and EAGLE-1/2 in :mod:`consistency.replay.multistep`)
on the states of a dump and predict acceptance.

A relative difference says two tensors differ; it does not say what the difference costs.
Replay answers the question a user asks ("acceptance fell from 75% to 30%: why?") by running
the real draft, loaded from its checkpoint, on what each side would feed it, and scoring it
against the target's own next tokens. Only :mod:`consistency.replay.report` and
:mod:`consistency.replay.config` import without torch.
"""

from consistency import _callable_package  # noqa: E402 - consistency.replay(...) is consistency.api.replay

_callable_package(__name__)
