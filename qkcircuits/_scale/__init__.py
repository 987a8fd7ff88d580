"""Scaling out: the many-model zoo (one pool per model; on Ray one model per worker). The Ray backend itself is
``_foundation/backends.Ray`` with its workers in ``_foundation/workers``: every analysis declares its shards once
(``_foundation/shards``) and a backend maps them. Private: the public API is re-exported by ``qkcircuits``."""
