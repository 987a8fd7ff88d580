"""How heads work together: exact path patching, edge attribution, tracing induction circuits. Private: the public API is re-exported by ``qkcircuits``."""
