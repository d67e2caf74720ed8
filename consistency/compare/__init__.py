"""Numbers: align two dumps, fingerprint, identify and measure (docs/architecture.md).

The package is also callable: ``consistency.compare(reference, candidate, **options)`` is
:func:`consistency.api.compare` (see ``consistency/__init__.py`` for why).
"""

from consistency import _callable_package

_callable_package(__name__)
