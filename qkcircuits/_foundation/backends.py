"""Where an analysis runs: backend objects with ONE dispatch point, ``Backend.run(job, model, local=..., **request)``.

>>> qk.Local().name, qk.Ray(address="local:2").name
('local', 'ray')
>>> res = qk.sweep(model, tokens, backend=qk.Local(), progress=False)       # the default
>>> res = qk.sweep("toy-induction", tokens, backend="local", progress=False)   # a spec works too
>>> res = qk.sweep(model, tokens, backend=qk.Ray(workers=2))   # doctest: +SKIP (needs Ray; slow to start)

An analysis (``sweep``, ``path_patch``, ``trace``) hands its request to ``as_backend(backend).run``: the job's
name, the ``model`` (a loaded model or a spec: both work on every backend), the function that computes it in
this process (``local``) and the request's arguments. ``Local`` loads a spec (``qk.load``) and calls ``local``;
``Ray`` turns a loaded model into the spec its workers load (``model_spec``: recorded by ``qk.load``) and calls
the job's Ray implementation, named as ``"module:function"`` in ``Ray.jobs`` and imported only then. So this
module (the bottom layer) and the analyses import nothing of ``qkcircuits._scale`` and never ``ray``;
``_scale`` imports the analyses, never the reverse. Adding a backend: subclass ``Backend`` and write ``run``
(docs/architecture.md, "How to add a backend").
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Dict, Optional

from .errors import QKCircuitsError


class Backend:
    """Runs analysis jobs. Subclasses set ``name`` and implement ``run``."""

    name: ClassVar[str] = "backend"

    def run(self, job: str, model, *, local: Callable[..., Any], **request: Any) -> Any:
        """Compute ``job`` (``"sweep"``, ``"path_patch"``, ``"trace"``, ``"edge_scores"``, ``"node_scores"``,
        ``"faithfulness"``) for ``model`` (loaded or a spec);
        ``local(loaded_model, **request)`` is the in-process computation."""
        raise NotImplementedError


@dataclass(frozen=True)
class Local(Backend):
    """This process: a spec is loaded with ``qk.load`` (``load_kwargs``), a loaded model used as it is."""

    load_kwargs: Dict[str, Any] = field(default_factory=dict)
    name: ClassVar[str] = "local"

    def run(self, job: str, model, *, local: Callable[..., Any], **request: Any) -> Any:
        return local(loaded(model, self.load_kwargs), **request)


@dataclass(frozen=True)
class Ray(Backend):
    """Ray workers that each load the model once (``qkcircuits._scale.distributed.Pool``).

    ``address``: None → ``$RAY_ADDRESS`` if set, else a new local instance; ``"local:N"`` a local instance of
    N workers; ``host:port`` / ``ray://host:port`` / ``auto`` a running cluster. ``workers``: how many (default:
    one per GPU, else one per ``threads`` CPUs). ``load_kwargs``: ``qk.load`` options for the workers (for a
    loaded model they come from how it was loaded). The driver loads no weights.
    """

    address: Optional[str] = None
    workers: Optional[int] = None
    threads: int = 1
    load_kwargs: Dict[str, Any] = field(default_factory=dict)
    name: ClassVar[str] = "ray"
    # The Ray implementation of each job, imported on first use (module:function, signature
    # fn(spec, **request, ray_address=, workers=, threads=, load_kwargs=)).
    jobs: ClassVar[Dict[str, str]] = {
        "sweep": "qkcircuits._scale.ray_sweep:ray_sweep",
        "path_patch": "qkcircuits._scale.ray_patching:ray_path_patch",
        "trace": "qkcircuits._scale.ray_patching:ray_trace",
        "edge_scores": "qkcircuits._scale.ray_tasks:ray_edge_scores",
        "node_scores": "qkcircuits._scale.ray_tasks:ray_node_scores",
        "faithfulness": "qkcircuits._scale.ray_tasks:ray_faithfulness",
        "core_circuit": "qkcircuits._scale.ray_tasks:ray_core_circuit",
    }

    def __post_init__(self) -> None:
        if self.workers is not None and (isinstance(self.workers, bool) or not isinstance(self.workers, int)
                                         or self.workers < 1):
            raise QKCircuitsError(f"Ray workers must be a positive integer, got {self.workers!r}")
        if self.address is not None and not isinstance(self.address, str):
            raise QKCircuitsError(f"Ray address must be a string such as 'host:port' or 'local:2', got "
                                  f"{type(self.address).__name__}")

    def run(self, job: str, model, *, local: Callable[..., Any], **request: Any) -> Any:
        if job not in self.jobs:
            raise QKCircuitsError(f"backend 'ray' cannot run {job!r}; it runs {', '.join(sorted(self.jobs))}")
        spec, load_kwargs = spec_for_workers(model)
        module, _, attr = self.jobs[job].partition(":")
        impl = getattr(importlib.import_module(module), attr)
        return impl(spec, **request, ray_address=self.address, workers=self.workers, threads=self.threads,
                    load_kwargs={**load_kwargs, **self.load_kwargs})


# None, "local", "ray", "local:N", a Ray address or a Backend: checked by as_backend (one-line errors; a
# narrower annotation would let a runtime type checker raise its own error first).
BackendLike = Any


def as_backend(backend: BackendLike = None, *, address: Optional[str] = None,
               workers: Optional[int] = None) -> Backend:
    """A ``Backend`` from None (``Local``), a ``Backend``, or a string: ``"local"``, ``"ray"``, ``"local:N"``
    (a local Ray instance of N workers) or a Ray address. ``address``/``workers`` are the older keyword
    spelling of ``qk.Ray(address=, workers=)`` and need a Ray backend.

    >>> qk.as_backend("local:3")
    Ray(address='local:3', workers=None, threads=1, load_kwargs={})
    """
    if isinstance(backend, Backend):
        given = address is not None or workers is not None
        clash = isinstance(backend, Ray) and ((address is not None and backend.address not in (None, address)) or
                                              (workers is not None and backend.workers not in (None, workers)))
        if given and (not isinstance(backend, Ray) or clash):
            raise QKCircuitsError(f"ray_address/workers given beside backend={backend!r}; pass them to "
                                  f"qk.Ray(address=..., workers=...) only")
        if isinstance(backend, Ray) and (address is not None or workers is not None):
            return Ray(address if address is not None else backend.address,
                       workers if workers is not None else backend.workers, backend.threads, backend.load_kwargs)
        return backend
    if backend is None or backend == "local":
        if address is not None or workers is not None:
            raise QKCircuitsError("ray_address/workers need a Ray backend: pass backend=qk.Ray(address=..., "
                                  "workers=...) (or backend='ray')")
        return Local()
    if isinstance(backend, str):
        text = backend.strip()
        if text == "ray":
            return Ray(address, workers)
        if text.startswith("local:") or ":" in text or text == "auto":
            if address is not None:
                raise QKCircuitsError(f"backend {backend!r} is already an address; drop ray_address={address!r}")
            return Ray(text, workers)
    raise QKCircuitsError(f"unknown backend {backend!r}; use qk.Local(), qk.Ray(address=..., workers=...), or "
                          f"'local', 'ray', 'local:N', a Ray address host:port")


def model_spec(model) -> Optional[Dict[str, Any]]:
    """How ``model`` can be loaded again (``{"spec", "dtype", "fold_ln"}``, recorded by ``qk.load``), or None."""
    return getattr(model, "qk_load_spec", None)


def spec_for_workers(model):
    """(spec, load kwargs) a worker loads: a spec as given, a loaded model by the spec ``qk.load`` recorded."""
    if isinstance(model, (str, os.PathLike)):
        return os.fspath(model), {}
    spec = model_spec(model)
    if spec is None:
        raise QKCircuitsError(f"backend 'ray' needs the model's spec so that each worker loads it; this "
                              f"{type(model).__name__} was not loaded by qk.load from a name or path and has no "
                              f"reloadable spec. Pass e.g. 'smollm2-135m' or a folder")
    kwargs = {"fold_ln": spec["fold_ln"]}
    if spec.get("dtype"):
        kwargs["dtype"] = spec["dtype"]
    return spec["spec"], kwargs


def loaded(model, load_kwargs: Optional[Dict[str, Any]] = None):
    """``model`` itself, or ``qk.load(model, **load_kwargs)`` when it is a spec (a name or a path)."""
    if isinstance(model, (str, os.PathLike)):
        from .model import load      # torch and TransformerLens: only when a spec is really loaded (not at --help)

        return load(model, verbose=False, **(load_kwargs or {}))
    return model
