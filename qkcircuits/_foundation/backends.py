"""Where an analysis runs: backends that hold a model for the steps of a command (``Backend.pool``), and ONE
dispatch point per step, ``BackendPool.run(job, local=..., **request)``.

>>> qk.Local().name, qk.Ray(address="local:2").name
('local', 'ray')
>>> res = qk.sweep(model, tokens, backend=qk.Local(), progress=False)       # the default
>>> res = qk.sweep("toy-induction", tokens, backend="local", progress=False)   # a spec works too
>>> res = qk.sweep(model, tokens, backend=qk.Ray(workers=2))   # doctest: +SKIP (needs Ray; slow to start)
>>> with qk.Local().pool("toy-induction") as p:                # the model loaded once for every step
...     a = qk.sweep(p.model, tokens, backend=p, progress=False)
...     b = qk.path_patch(p.model, "1.0", tokens=tokens, backend=p, progress=False)
>>> p.opened
1

An analysis (``sweep``, ``path_patch``, ``trace``, ``edge_scores``, ...) hands its request to
``as_backend(backend).run``: the job's name, the ``model`` (a loaded model or a spec: both work on every
backend), the function that computes it in this process (``local``) and the request's arguments.
``Backend.run`` opens a pool for that one step; a command with several steps opens ONE pool
(``with backend.pool(model) as p``) and runs each step on it (``p.run(job, local=..., **request)``, or
``backend=p`` in the public functions), so the model is loaded once per command, here or on each Ray worker.
``Local``'s pool loads a spec once (``qk.load``) and calls ``local``; ``Ray``'s pool starts the workers once
(each loads the model: a loaded model goes as the spec ``qk.load`` recorded, ``model_spec``) and calls the
job's Ray implementation, named as ``"module:function"`` in ``Ray.jobs`` and imported only then. So this
module (the bottom layer) and the analyses import nothing of ``qkcircuits._scale`` and never ``ray``;
``_scale`` imports the analyses, never the reverse. Adding a backend: subclass ``Backend`` and write ``pool``
(a ``BackendPool`` with ``open``/``run``/``close``; docs/architecture.md, "How to add a backend").
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Dict, Optional

from .errors import QKCircuitsError


class BackendPool:
    """What a backend holds for the steps of one command: ``model`` (a loaded model or a spec), loaded ONCE on
    ``open`` (in this process, or on each of its workers) and released on ``close``; ``run(job, local=...,
    **request)`` computes one step on it. Use it as a context manager; entering an open pool again (an analysis
    given ``backend=p``) neither reopens nor closes it: the outermost ``with`` does.

    A subclass writes ``run`` and, when it holds something, ``open`` / ``close`` (``LocalPool``, ``RayPool``).
    ``opened`` counts the opens (a test's way to see that one command loaded its model once).
    """

    def __init__(self, backend: "Backend", model):
        self.backend, self.model = backend, model
        self.opened = 0
        self._depth = 0

    def open(self) -> None:
        """Acquire what the steps share (load the model, start workers)."""

    def close(self) -> None:
        """Release it (idempotent: also called after an ``open`` that failed half-way)."""

    def run(self, job: str, *, local: Callable[..., Any], **request: Any) -> Any:
        """Compute ``job`` (``"sweep"``, ``"edge_scores"``, ...; ``Backend.run``'s list) on the held model;
        ``local(loaded_model, **request)`` is its in-process computation."""
        raise NotImplementedError

    @property
    def here(self):
        """The model loaded in this process, if this pool holds one (else None: it lives on workers)."""
        return None

    def holds(self, model) -> bool:
        """Whether ``model`` (as an analysis is given it) is this pool's: the same object, or the same spec."""
        if model is self.model or (model is not None and model is self.here):
            return True
        name = _spec_name(model)
        return name is not None and name == _spec_name(self.model)

    def __enter__(self) -> "BackendPool":
        if self._depth == 0:
            try:
                self.open()
            except BaseException:
                self.close()
                raise
            self.opened += 1
        self._depth += 1
        return self

    def __exit__(self, *exc) -> None:
        self._depth -= 1
        if self._depth == 0:
            self.close()

    def __repr__(self) -> str:
        state = "open" if self._depth else "closed"
        return f"{type(self).__name__}({self.backend.name}, {_describe(self.model)}, {state})"


class Backend:
    """Runs analysis jobs. A subclass sets ``name`` and writes ``pool(model)`` (a ``BackendPool``); ``run`` is one
    job on a pool of its own. (A backend that writes only ``run``, as before pools existed, still works: its
    pool hands each step to ``run``.)"""

    name: ClassVar[str] = "backend"

    def pool(self, model) -> BackendPool:
        """A ``BackendPool`` holding ``model`` (loaded or a spec) for the steps of one command."""
        if type(self).run is Backend.run:
            raise NotImplementedError(f"backend {type(self).__name__} writes neither pool(model) nor run(job, model, "
                                      f"local=..., **request)")
        return EachStep(self, model)

    def run(self, job: str, model, *, local: Callable[..., Any], **request: Any) -> Any:
        """Compute ``job`` (``"sweep"``, ``"path_patch"``, ``"trace"``, ``"edge_scores"``, ``"node_scores"``,
        ``"faithfulness"``, ``"core_circuit"``; the CLI's ``circuit`` adds ``"task"``, ``"circuit_faithfulness"``,
        ``"roles"``; the zoo ``"zoo_entry"``) for ``model`` (loaded or a spec) on a pool opened for this step
        alone; ``local(loaded_model, **request)`` is the in-process computation."""
        with self.pool(model) as p:
            return p.run(job, local=local, **request)


class EachStep(BackendPool):
    """The pool of a backend that writes only ``run``: every step is ``backend.run(job, model, ...)``."""

    def run(self, job: str, *, local: Callable[..., Any], **request: Any) -> Any:
        return self.backend.run(job, self.model, local=local, **request)


class LocalPool(BackendPool):
    """This process: a spec is loaded once on ``open`` (``qk.load(spec, **load_kwargs)``), a loaded model used as
    it is; each step calls ``local`` on it."""

    def open(self) -> None:
        self._model = loaded(self.model, self.backend.load_kwargs)

    def close(self) -> None:
        self._model = None           # a model this pool loaded is released with the pool

    @property
    def here(self):
        return getattr(self, "_model", None)

    def run(self, job: str, *, local: Callable[..., Any], **request: Any) -> Any:
        if self.here is None:
            raise QKCircuitsError("this pool is closed; run its steps inside `with backend.pool(model) as p:`")
        return local(self.here, **request)


@dataclass(frozen=True)
class Local(Backend):
    """This process: a spec is loaded with ``qk.load`` (``load_kwargs``), a loaded model used as it is."""

    load_kwargs: Dict[str, Any] = field(default_factory=dict)
    name: ClassVar[str] = "local"

    def pool(self, model) -> LocalPool:
        return LocalPool(self, model)


class RayPool(BackendPool):
    """Ray workers started once on ``open`` (``qkcircuits._scale.distributed.Pool``: each loads the model once);
    each step is the job's Ray implementation (``Ray.jobs``) called with ``pool=`` these workers. The driver loads
    no weights (``here`` is None)."""

    workers: Any = None            # the started qkcircuits._scale.distributed.Pool

    def open(self) -> None:
        b = self.backend
        self.spec, load_kwargs = spec_for_workers(self.model)
        pool_class = getattr(importlib.import_module("qkcircuits._scale.distributed"), "Pool")
        self.workers = pool_class(self.spec, workers=b.workers, threads=b.threads, address=b.address,
                                  load_kwargs={**load_kwargs, **b.load_kwargs})
        self.workers.start()

    def close(self) -> None:
        if self.workers is not None:
            self.workers.close()
            self.workers = None

    def run(self, job: str, *, local: Callable[..., Any], **request: Any) -> Any:
        if self.workers is None:
            raise QKCircuitsError("this pool is closed; run its steps inside `with backend.pool(model) as p:`")
        self.workers.progress = bool(request.get("progress", True))     # the step's own progress bars
        return self.backend.job(job)(self.spec, **request, pool=self.workers)


@dataclass(frozen=True)
class Ray(Backend):
    """Ray workers that each load the model once (``qkcircuits._scale.distributed.Pool``).

    ``address``: None → ``$RAY_ADDRESS`` if set, else a new local instance; ``"local:N"`` a local instance of
    N workers; ``host:port`` / ``ray://host:port`` / ``auto`` a running cluster. ``workers``: how many (default:
    one per GPU, else one per ``threads`` CPUs). ``load_kwargs``: ``qk.load`` options for the workers (for a
    loaded model they come from how it was loaded). The driver loads no weights. ``run`` starts workers for
    that one job; ``pool`` starts them once for the steps of a command.
    """

    address: Optional[str] = None
    workers: Optional[int] = None
    threads: int = 1
    load_kwargs: Dict[str, Any] = field(default_factory=dict)
    name: ClassVar[str] = "ray"
    # The Ray implementation of each job, imported on first use (module:function, signature
    # fn(spec, **request, ray_address=, workers=, threads=, load_kwargs=) or fn(spec, **request, pool=)).
    jobs: ClassVar[Dict[str, str]] = {
        "sweep": "qkcircuits._scale.ray_sweep:ray_sweep",
        "path_patch": "qkcircuits._scale.ray_patching:ray_path_patch",
        "trace": "qkcircuits._scale.ray_patching:ray_trace",
        "edge_scores": "qkcircuits._scale.ray_tasks:ray_edge_scores",
        "node_scores": "qkcircuits._scale.ray_tasks:ray_node_scores",
        "faithfulness": "qkcircuits._scale.ray_tasks:ray_faithfulness",
        "core_circuit": "qkcircuits._scale.ray_tasks:ray_core_circuit",
        # the CLI's circuit steps (on a pool only: the task is built by a worker, the driver has no tokenizer)
        "task": "qkcircuits._scale.ray_tasks:ray_task",
        "circuit_faithfulness": "qkcircuits._scale.ray_tasks:ray_circuit_faithfulness",
        "roles": "qkcircuits._scale.ray_tasks:ray_circuit_roles",
    }

    def __post_init__(self) -> None:
        if self.workers is not None and (isinstance(self.workers, bool) or not isinstance(self.workers, int)
                                         or self.workers < 1):
            raise QKCircuitsError(f"Ray workers must be a positive integer, got {self.workers!r}")
        if self.address is not None and not isinstance(self.address, str):
            raise QKCircuitsError(f"Ray address must be a string such as 'host:port' or 'local:2', got "
                                  f"{type(self.address).__name__}")

    def job(self, job: str) -> Callable[..., Any]:
        """The Ray implementation of ``job`` (imported now)."""
        if job not in self.jobs:
            raise QKCircuitsError(f"backend 'ray' cannot run {job!r}; it runs {', '.join(sorted(self.jobs))}")
        module, _, attr = self.jobs[job].partition(":")
        return getattr(importlib.import_module(module), attr)

    def pool(self, model) -> RayPool:
        return RayPool(self, model)

    def run(self, job: str, model, *, local: Callable[..., Any], **request: Any) -> Any:
        # one job: its implementation starts workers sized to its work after checking the request (a bad argument
        # fails before Ray starts), and stops them
        impl = self.job(job)
        spec, load_kwargs = spec_for_workers(model)
        return impl(spec, **request, ray_address=self.address, workers=self.workers, threads=self.threads,
                    load_kwargs={**load_kwargs, **self.load_kwargs})


@dataclass(frozen=True)
class OnPool(Backend):
    """An open ``BackendPool`` given as ``backend=``: each analysis runs on it and leaves it open."""

    held: BackendPool
    name: ClassVar[str] = "pool"

    def pool(self, model) -> BackendPool:
        if not self.held._depth:
            raise QKCircuitsError(f"backend={self.held!r} is closed; pass it inside `with backend.pool(model) as p:`")
        if not self.held.holds(model):
            raise QKCircuitsError(f"backend= is a pool of {_describe(self.held.model)}, not of {_describe(model)}; "
                                  f"pass the pool's model (p.model) or open a pool for this one")
        return self.held


# None, "local", "ray", "local:N", a Ray address, a Backend or an open BackendPool: checked by as_backend
# (one-line errors; a narrower annotation would let a runtime type checker raise its own error first).
BackendLike = Any


def as_backend(backend: BackendLike = None, *, address: Optional[str] = None,
               workers: Optional[int] = None) -> Backend:
    """A ``Backend`` from None (``Local``), a ``Backend``, an open ``BackendPool`` (its steps run on it), or a
    string: ``"local"``, ``"ray"``, ``"local:N"`` (a local Ray instance of N workers) or a Ray address.
    ``address``/``workers`` are the older keyword spelling of ``qk.Ray(address=, workers=)`` and need a Ray backend.

    >>> qk.as_backend("local:3")
    Ray(address='local:3', workers=None, threads=1, load_kwargs={})
    """
    if isinstance(backend, BackendPool):
        if address is not None or workers is not None:
            raise QKCircuitsError(f"ray_address/workers given beside backend={backend!r}: an open pool has its "
                                  f"workers already")
        return OnPool(backend)
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
    from .model_cache import recall

    return recall(model, "load spec")


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

        return load(model, **{"verbose": False, **(load_kwargs or {})})
    return model


def _spec_name(model) -> Optional[str]:
    """The spec ``model`` stands for (a name or path, or the one ``qk.load`` recorded), or None."""
    if isinstance(model, (str, os.PathLike)):
        return os.fspath(model)
    spec = model_spec(model)
    return None if spec is None else str(spec["spec"])


def _describe(model) -> str:
    name = _spec_name(model)
    return repr(name) if name is not None else f"a {type(model).__name__}"
