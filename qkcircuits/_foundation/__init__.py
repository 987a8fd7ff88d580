"""Foundation: errors, I/O, loading, heads, prompt sets, attention internals and hooks. Private: the public API is re-exported by ``qkcircuits``."""
