"""Where an analysis runs: backends that hold a model for the steps of a command (``Backend.pool``). A pool does
two things: ``run(job, local=..., **request)``, one step on the model (``local(loaded_model, **request)``), and
``map(sharded, **request)``, an analysis split into shards (``_foundation/shards``: declared ONCE next to each
analysis), whose shards it maps with ``each``.

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

An analysis hands its request to its backend: a split one (``sweep``, ``path_patch``, ``edge_scores``,
``node_scores``, the faithfulness curve) as ``Backend.map(sharded, model, **request)``, a step that is not split
(the CLI's task, roles, a zoo entry, faithfulness' node view, the core circuit) as ``Backend.run(job, model, local=..., **request)``. Either opens a
pool for that one step; a command with several steps opens ONE pool (``with backend.pool(model) as p``) and runs
each step on it (``backend=p`` in the public functions), so the model is loaded once per command, here or on
each Ray worker. ``Local``'s pool loads a spec once (``qk.load``), runs a step on it and maps shards in order;
``Ray``'s pool starts the workers once (each loads the model: a loaded model goes as the spec ``qk.load``
recorded, ``model_spec``), runs a step on one worker and maps shards over all of them (``_foundation/workers``,
imported when a Ray pool opens; never ``ray`` before). Every backend maps the SAME shards (a plan depends on the
request and the model, not on the workers) and combines them with the same function in the same order, so
every backend's result is the local one, bit for bit. Adding a backend: subclass ``Backend`` and write ``pool``
(a ``BackendPool`` with ``open``/``run``/``each``/``close``; docs/architecture.md, "How to add a backend").
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Dict, List, Optional, Sequence

from .errors import QKCircuitsError
from .shards import Plan, Sharded


class BackendPool:
    """What a backend holds for the steps of one command: ``model`` (a loaded model or a spec), loaded ONCE on
    ``open`` (in this process, or on each of its workers) and released on ``close``; ``run(job, local=...,
    **request)`` computes one step on it, ``map(sharded, **request)`` one split analysis (written here, once:
    the plan through ``run``, the shards through ``each``, then ``combine``). Use it as a context manager; entering
    an open pool again (an analysis given ``backend=p``) neither reopens nor closes it: the outermost ``with`` does.

    A subclass writes ``run``, ``each`` (where ``here`` is None: the default runs the shards in order on ``here``)
    and, when it holds something, ``open`` / ``close`` (``LocalPool``, ``RayPool``). ``opened`` counts the opens
    (a test's way to see that one command loaded its model once).
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
        """Compute the step ``job`` (``Backend.run``'s list; a split analysis' plan is a step named after it) on the
        held model: ``local(loaded_model, **request)``, wherever the model is."""
        raise NotImplementedError

    def each(self, job: str, run: Callable[..., Any], shared: Any, shards: Sequence[Dict[str, Any]],
             costs: Optional[Sequence[float]] = None) -> List[Any]:
        """``run(model, shared, scratch, **shard)`` for every shard, the parts in shard order (``job``: the
        analysis' name, ``costs``: relative work, for scheduling). The default: in order, in this process, on
        ``here`` (``scratch`` one dict for them all)."""
        if self.here is None:
            raise QKCircuitsError(f"{type(self).__name__} holds no model in this process; write its each() to map "
                                  f"the shards of {job!r} where its model is")
        scratch: Dict[str, Any] = {}
        return [run(self.here, shared, scratch, **s) for s in shards]

    def map(self, sharded: Sharded, **request: Any) -> Any:
        """The analysis ``sharded`` on this pool: ``check`` here, ``plan`` on the model (a ``run`` step), every
        shard through ``each``, ``combine`` here (``where()`` says where the shards ran)."""
        request = sharded.checked(request)
        plan: Plan = self.run(sharded.name, local=sharded.plan, **request)
        parts = self.each(sharded.name, sharded.run, plan.shared, plan.shards, plan.costs)
        return sharded.combine(plan, parts, self.where(), **request)

    def where(self) -> Optional[Dict[str, Any]]:
        """What a split analysis records of where its shards ran (None: in this process, nothing to say)."""
        return None

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
        """Compute the step ``job`` (``"node_view"``, ``"core_circuit"``, ``"trace_scan"``; the CLI's ``circuit``
        adds ``"task"``, ``"circuit_faithfulness"``, ``"roles"``; the zoo ``"zoo_entry"``; a split analysis' plan
        is a step named after it) for ``model`` (loaded or a spec) on a pool opened for this step alone;
        ``local(loaded_model, **request)`` is the computation, wherever the model is."""
        with self.pool(model) as p:
            return p.run(job, local=local, **request)

    def map(self, sharded: Sharded, model, **request: Any) -> Any:
        """The split analysis ``sharded`` (``"sweep"``, ``"path_patch"``, ``"edge_scores"``, ``"node_scores"``)
        for ``model`` on a pool opened for it alone (``BackendPool.map``)."""
        with self.pool(model) as p:
            return p.map(sharded, **request)


class EachStep(BackendPool):
    """The pool of a backend that writes only ``run``: every step is ``backend.run(job, model, ...)``."""

    def run(self, job: str, *, local: Callable[..., Any], **request: Any) -> Any:
        return self.backend.run(job, self.model, local=local, **request)

    def map(self, sharded: Sharded, **request: Any) -> Any:
        # the backend has no shards of its own: the whole analysis is one step, run where it runs steps
        return self.backend.run(sharded.name, self.model, local=sharded.local, **request)


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
    """Ray workers started once on ``open`` (``_foundation/workers.Pool``: each loads the model once); a step runs
    on one worker (``Pool.call``), a split analysis' shards on all of them (``Pool.map``: ``shared`` sent once
    through Ray's object store). The driver loads no weights (``here`` is None)."""

    workers: Any = None            # the started _foundation.workers.Pool

    def open(self) -> None:
        from .workers import Pool          # ray: only when a Ray pool opens

        b = self.backend
        self.spec, load_kwargs = spec_for_workers(self.model)
        self.workers = Pool(self.spec, workers=b.workers, threads=b.threads, address=b.address,
                            load_kwargs={**load_kwargs, **b.load_kwargs})
        self.workers.start()

    def close(self) -> None:
        if self.workers is not None:
            self.workers.close()
            self.workers = None

    def _open(self):
        if self.workers is None:
            raise QKCircuitsError("this pool is closed; run its steps inside `with backend.pool(model) as p:`")
        return self.workers

    def run(self, job: str, *, local: Callable[..., Any], **request: Any) -> Any:
        return self._open().call(local, request)

    def map(self, sharded: Sharded, **request: Any) -> Any:
        self._open().progress = bool(request.get("progress", True))      # the step's own bar over shards
        return super().map(sharded, **request)

    def each(self, job: str, run: Callable[..., Any], shared: Any, shards: Sequence[Dict[str, Any]],
             costs: Optional[Sequence[float]] = None) -> List[Any]:
        import time

        t0 = time.perf_counter()
        parts = self._open().map(run, list(shards), shared, costs=costs, desc=f"{job} (ray)")
        self._run_s = time.perf_counter() - t0
        return parts

    def where(self) -> Optional[Dict[str, Any]]:
        """The workers, their retries, start-up and load seconds, and the wall seconds of the last map (``run_s``)."""
        w = self._open()
        return {"name": "ray", "workers": w.size, "threads": w.threads, "retries": w.retries,
                "startup_s": round(w.timing.get("startup_s", 0.0), 3), "load_s": round(w.timing.get("load_s", 0.0), 3),
                "run_s": round(getattr(self, "_run_s", 0.0), 3)}


@dataclass(frozen=True)
class Ray(Backend):
    """Ray workers that each load the model once (``_foundation/workers.Pool``).

    ``address``: None → ``$RAY_ADDRESS`` if set, else a new local instance; ``"local:N"`` a local instance of
    N workers; ``host:port`` / ``ray://host:port`` / ``auto`` a running cluster. ``workers``: how many (default:
    one per GPU, else one per ``threads`` CPUs). ``load_kwargs``: ``qk.load`` options for the workers (for a
    loaded model they come from how it was loaded). The driver loads no weights. ``run``/``map`` start workers
    for that one step; ``pool`` starts them once for the steps of a command.
    """

    address: Optional[str] = None
    workers: Optional[int] = None
    threads: int = 1
    load_kwargs: Dict[str, Any] = field(default_factory=dict)
    name: ClassVar[str] = "ray"

    def __post_init__(self) -> None:
        if self.workers is not None and (isinstance(self.workers, bool) or not isinstance(self.workers, int)
                                         or self.workers < 1):
            raise QKCircuitsError(f"Ray workers must be a positive integer, got {self.workers!r}")
        if self.address is not None and not isinstance(self.address, str):
            raise QKCircuitsError(f"Ray address must be a string such as 'host:port' or 'local:2', got "
                                  f"{type(self.address).__name__}")

    def pool(self, model) -> RayPool:
        return RayPool(self, model)

    def map(self, sharded: Sharded, model, **request: Any) -> Any:
        request = sharded.checked(request)         # a bad argument fails before Ray starts
        return super().map(sharded, model, **request)


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
