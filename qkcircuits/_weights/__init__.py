"""Weights: QK/OV circuits, rotary, copying, composition and token views (no forward passes but the corpus one). Private: the public API is re-exported by ``qkcircuits``."""
