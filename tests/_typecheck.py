"""Calling a package function beneath the run-time type checker that tests/conftest.py installs.

Under the hook a wrongly typed argument (``parse_heads(5)``, ``seed="0"``) is stopped by the checker before the
function runs. A user without the hook gets the function's own one-line ``QKCircuitsError`` instead; the tests
that pin that message call the function through ``unchecked``.
"""

import inspect


def unchecked(fn):
    """``fn`` without the jaxtyping/beartype wrappers the import hook put around it (``fn`` itself if none)."""
    return inspect.unwrap(fn)
