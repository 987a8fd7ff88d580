"""Analyses: detectors and scan, metrics, ablation, sweep, attribution, diagnostics. Private: the public API is re-exported by ``qkcircuits``."""
