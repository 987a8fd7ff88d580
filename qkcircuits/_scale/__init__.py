"""Scaling out: the Ray backend and the many-model zoo (imported only when asked for). Private: the public API is re-exported by ``qkcircuits``."""
