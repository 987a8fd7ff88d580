"""Analyses: detectors and scan, metrics, ablation, sweep, attribution, diagnostics. Private: the public API is re-exported by ``qkcircuits``."""

# The built-in detectors register themselves when ``detect`` is imported: importing it with the package means every
# reader of the registry (``detectors.detector``, ``labelled_scores``, ...) sees them, whichever module it came
# through (``qkcircuits zoo`` from the command line read an empty registry).
from . import detect  # noqa: E402,F401
