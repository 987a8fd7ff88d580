"""Ray backend: actors that each load the model once and run named jobs on shards of the work.

>>> res = qk.sweep("smollm2-135m", tokens, "induction-loss", backend="ray")   # doctest: +SKIP
>>> with Pool("smollm2-135m", workers=2) as pool:                            # doctest: +SKIP
...     outs = pool.map("qkcircuits._scale.ray_sweep:sweep_shard", shards, shared={"tokens": tokens, ...})

Imported only when a caller asks for ``backend="ray"`` (``import qkcircuits`` never imports ray).

The pieces, generic on purpose (docs/scaling.md shows how a new job plugs in):

- ``JOBS``: name -> ``fn(model, shared, **shard) -> partial result``, run inside a worker. Register
  with ``@job("name")``; the function must live in an importable module (workers import it).
- ``Worker``: a Ray actor holding ONE loaded model (``qk.load(spec, **load_kwargs)``, loaded once,
  kept for every shard it runs). One GPU per worker where the cluster has GPUs (``gpus_per_worker=k``
  with ``device_map="auto"`` for a model spread over k GPUs), else ``threads`` CPU threads.
- ``Pool``: connects (``connect``), starts the workers, and ``map(job, shards, shared)`` runs
  the shards as workers free up (largest first when given costs), puts ``shared`` (prompts,
  replacement activations) into Ray's object store ONCE for all shards, shows a tqdm bar over
  shards, and re-runs the shard of a worker that died on a fresh worker: results are kept by
  shard index and a shard's result is recorded only when it comes back, so nothing is counted
  twice. ``timing`` holds ``startup_s`` (connect + worker processes up), ``load_s`` (the parallel
  model loads) and, after ``map``, ``run_s``.
- ``qkcircuits._scale.ray_sweep``: the all-heads ablation sweep on a pool, the worked example of a job
  (``plan_sweep`` cuts shards, the job ``qkcircuits._scale.ray_sweep:sweep_shard`` runs one,
  ``combine_sweep`` combines them exactly).

The driver (this process) loads no weights: the token prompts, the model's shape and the
mean/resample replacement are computed by a worker and sent back.
"""

from __future__ import annotations

import os
import socket
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .._foundation.errors import QKCircuitsError

JOBS: Dict[str, Callable[..., Any]] = {}
RAY_HINT = "pip install 'qkcircuits[ray]' (or use the local backend: no backend= / no --ray)"


def job(name: str):
    """Register ``fn(model, shared, **shard)`` as the job ``name`` that workers can run."""
    def register(fn):
        JOBS[name] = fn
        return fn
    return register


def find_job(name: str) -> Callable[..., Any]:
    """A registered job, or ``"package.module:function"`` (imported in the worker)."""
    if name in JOBS:
        return JOBS[name]
    if ":" in name:
        import importlib

        module, _, attr = name.partition(":")
        try:
            return getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise QKCircuitsError(f"job {name!r} cannot be imported ({e}); pass 'module:function' of an installed "
                                  f"module") from None
    raise QKCircuitsError(f"unknown job {name!r}; registered: {', '.join(sorted(JOBS))}, or pass 'module:function'")


def import_ray():
    try:
        import ray
    except ImportError:
        raise QKCircuitsError(f"backend 'ray' needs the ray package, which is not installed; {RAY_HINT}") from None
    return ray


# ---------------------------------------------------------------------------------------------
# Connecting


@dataclass
class Target:
    """Where to run: an address (``host:port``, ``ray://host:port``, ``auto``) or a local instance."""

    address: Optional[str] = None       # None: a new local instance
    workers: Optional[int] = None       # local:N

    @classmethod
    def parse(cls, text: Optional[str]) -> "Target":
        """``None`` -> ``$RAY_ADDRESS`` if set, else a local instance; ``local`` / ``local:N``; an address."""
        if text is None or text == "":
            env = os.environ.get("RAY_ADDRESS", "").strip()
            return cls(env or None)
        text = str(text).strip()
        if text == "local" or text.startswith("local:"):
            n = text[len("local:"):] if ":" in text else ""
            if n and (not n.isdigit() or int(n) < 1):
                raise QKCircuitsError(f"--ray {text!r}: N in local:N must be a positive integer, e.g. local:2")
            return cls(None, int(n) if n else None)
        return cls(text)


def connect(target: Target, *, num_cpus: Optional[int] = None) -> bool:
    """Connect to ``target`` (or start a local instance); True when this call started Ray (caller shuts it down)."""
    ray = import_ray()
    if target.address is not None:
        _check_reachable(target.address)
    if ray.is_initialized():
        return False
    if target.address is None:
        # A local instance: no dashboard (its web server is the slowest part of start-up), quiet.
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, logging_level="ERROR",
                 configure_logging=False)
        return True
    try:
        ray.init(address=target.address, log_to_driver=False, logging_level="ERROR", configure_logging=False)
    except Exception as e:  # ConnectionError, RuntimeError, ValueError ... from ray
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise QKCircuitsError(f"cannot connect to Ray at {target.address!r} ({first}); start a cluster with "
                              f"'ray start --head' and pass its address, or use --ray local:N") from None
    return True


def _check_reachable(address: str, timeout: float = 3.0) -> None:
    """Fail in seconds, not after Ray's long retries, when ``host:port`` does not answer."""
    if address == "auto":
        return
    hostport = address.split("://", 1)[-1].rstrip("/")
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise QKCircuitsError(f"Ray address {address!r} is not host:port (e.g. 10.0.0.5:6379 or ray://10.0.0.5:10001);"
                              f" or use --ray local:N for a local instance")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return
    except OSError as e:
        raise QKCircuitsError(f"cannot reach Ray at {address!r} ({e.strerror or e}); start a cluster with "
                              f"'ray start --head' and pass its address, or use --ray local:N") from None


# ---------------------------------------------------------------------------------------------
# Workers


class Worker:
    """One model, loaded once, running registered jobs on shards (wrapped by ``ray.remote`` in ``Pool``)."""

    def __init__(self, threads: Optional[int]):
        if threads:
            torch.set_num_threads(threads)
        self.model = None

    def ping(self) -> Dict[str, Any]:
        return {"pid": os.getpid(), "host": socket.gethostname()}

    def load(self, spec: Optional[str], load_kwargs: Dict[str, Any]) -> float:
        from .._foundation.model import load

        t0 = time.perf_counter()
        if spec is None:             # a worker whose jobs load their own models (the zoo)
            return 0.0
        kwargs = dict(load_kwargs)
        if kwargs.get("device") in (None, "auto"):
            kwargs["device"] = "cuda" if torch.cuda.is_available() else "cpu"
        self.model = load(spec, verbose=False, **kwargs)
        return time.perf_counter() - t0

    def run(self, name: str, shard: Dict[str, Any], shared: Any) -> Any:
        with torch.no_grad():
            return find_job(name)(self.model, shared, **shard)


@dataclass
class Pool:
    """Ray workers, each holding the model ``spec``; use as a context manager (workers stopped on exit).

    ``workers``: how many (default: one per GPU, else one per ``threads`` CPUs of the cluster).
    ``gpus_per_worker``: GPUs each worker holds (default 1 where the cluster has GPUs, else 0);
    more than 1 loads the model with ``device_map="auto"`` across them.
    Memory per worker: one copy of the model (``qk.load``) plus the shard's activations.
    """

    spec: Optional[str]
    workers: Optional[int] = None
    threads: int = 1
    gpus_per_worker: Optional[float] = None
    load_kwargs: Dict[str, Any] = field(default_factory=dict)
    address: Optional[str] = None
    progress: bool = True
    on_event: Optional[Callable[[str, Dict[str, Any]], None]] = None   # ("dispatch"|"result"|"retry", {job, shard, pid})
    timing: Dict[str, float] = field(default_factory=dict)
    retries: int = 0

    max_workers: Optional[int] = None     # never more workers than this (e.g. the number of shards)

    def __post_init__(self) -> None:
        if self.spec is None:
            return
        if not isinstance(self.spec, (str, os.PathLike)):
            raise QKCircuitsError(f"backend 'ray' needs the model's spec (a name or a path) so that each worker "
                                  f"loads it; got a {type(self.spec).__name__}. Pass e.g. 'smollm2-135m'")
        self.spec = os.fspath(self.spec)

    def __enter__(self) -> "Pool":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        target = Target.parse(self.address)
        t0 = time.perf_counter()
        n = self.workers or target.workers
        self._started = connect(target, num_cpus=(n * self.threads) if n else None)
        ray = import_ray()
        res = ray.cluster_resources()
        gpus = float(res.get("GPU", 0))
        per = self.gpus_per_worker if self.gpus_per_worker is not None else (1 if gpus >= 1 else 0)
        if n is None:
            n = int(gpus // per) if per else max(1, int(res.get("CPU", 1) // self.threads))
        n = min(n, self.max_workers or n)
        if per and n * per > gpus:
            raise QKCircuitsError(f"{n} workers x {per} GPUs need {n * per:g} GPUs; the cluster has {gpus:g}")
        if not per and n * self.threads > res.get("CPU", 0):
            raise QKCircuitsError(f"{n} workers x {self.threads} threads need {n * self.threads} CPUs; the Ray "
                                  f"cluster has {res.get('CPU', 0):g}; ask for fewer workers")
        if per and per > 1:
            self.load_kwargs = {**self.load_kwargs, "device_map": "auto"}
        self._cls = ray.remote(num_cpus=0 if per else self.threads, num_gpus=per, max_restarts=0)(Worker)
        self._actors = [self._cls.remote(self.threads) for _ in range(n)]
        self.pids = [p["pid"] for p in ray.get([a.ping.remote() for a in self._actors])]
        t1 = time.perf_counter()
        loads = ray.get([a.load.remote(self.spec, self.load_kwargs) for a in self._actors])
        t2 = time.perf_counter()
        self.timing.update(startup_s=t1 - t0, load_s=t2 - t1, load_s_per_worker=max(loads))

    def close(self) -> None:
        ray = import_ray()
        for a in getattr(self, "_actors", []):
            try:
                ray.kill(a)
            except Exception:  # already dead
                pass
        self._actors = []
        if getattr(self, "_started", False):
            ray.shutdown()
            self._started = False

    @property
    def size(self) -> int:
        return len(self._actors)

    def call(self, name: str, shard: Optional[Dict[str, Any]] = None, shared: Any = None) -> Any:
        """Run one job on one worker (e.g. the prompt set or the replacement, computed once)."""
        return self.map(name, [shard or {}], shared, progress=False)[0]

    def map(self, name: str, shards: Sequence[Dict[str, Any]], shared: Any = None, *,
            costs: Optional[Sequence[float]] = None, progress: Optional[bool] = None, desc: str = "shards") -> List[Any]:
        """``JOBS[name](model, shared, **shard)`` for every shard, results in shard order.

        Shards go to workers as they free up, largest ``costs`` first. A worker that dies takes
        its shard back to the queue and is replaced by a fresh worker (which loads the model).
        """
        ray = import_ray()
        from ray.exceptions import RayActorError, RayTaskError

        order = sorted(range(len(shards)), key=lambda i: -(costs[i] if costs else 0))
        queue = deque(order)
        shared_ref = ray.put(shared)                      # sent once, read by every shard
        results: Dict[int, Any] = {}
        inflight: Dict[Any, Tuple[int, Any]] = {}
        idle = list(self._actors)
        show = self.progress if progress is None else progress
        bar = None
        if show:
            from .._foundation.progress import progress_bar

            bar = progress_bar(total=len(shards), desc=desc, unit="shard")
        t0 = time.perf_counter()
        try:
            while queue or inflight:
                while queue and idle:
                    actor = idle.pop()
                    i = queue.popleft()
                    ref = actor.run.remote(name, shards[i], shared_ref)
                    inflight[ref] = (i, actor)
                    self._event("dispatch", job=name, shard=i, pid=self.pids[self._actors.index(actor)])
                done, _ = ray.wait(list(inflight), num_returns=1)
                for ref in done:
                    i, actor = inflight.pop(ref)
                    try:
                        out = ray.get(ref)
                    except RayActorError:
                        # The worker died (killed, out of memory, node lost): its shard goes back
                        # to the front of the queue and a fresh worker takes its place.
                        self.retries += 1
                        queue.appendleft(i)
                        idle.append(self._replace(actor))
                        self._event("retry", job=name, shard=i)
                        continue
                    except RayTaskError as e:
                        cause = getattr(e, "cause", None)
                        if isinstance(cause, QKCircuitsError):
                            raise QKCircuitsError(str(cause)) from None
                        raise
                    if i in results:       # cannot happen: a shard is queued again only when it failed
                        raise RuntimeError(f"shard {i} returned twice")
                    results[i] = out
                    idle.append(actor)
                    self._event("result", job=name, shard=i)
                    if bar is not None:
                        bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        self.timing["run_s"] = self.timing.get("run_s", 0.0) + time.perf_counter() - t0
        return [results[i] for i in range(len(shards))]

    def _replace(self, dead) -> Any:
        ray = import_ray()
        k = self._actors.index(dead)
        fresh = self._cls.remote(self.threads)
        self.pids[k] = ray.get(fresh.ping.remote())["pid"]
        ray.get(fresh.load.remote(self.spec, self.load_kwargs))
        self._actors[k] = fresh
        return fresh

    def _event(self, kind: str, **info) -> None:
        if self.on_event is not None:
            self.on_event(kind, info)


# ---------------------------------------------------------------------------------------------
# Jobs every backend needs: the model's shape, prompts, replacement activations.


@job("describe")
def _describe(model, shared) -> Dict[str, Any]:
    from .._foundation.fingerprint import fingerprint
    from .._foundation.model import model_name

    return {"name": model_name(model), "fingerprint": fingerprint(model), "n_layers": model.cfg.n_layers,
            "n_heads": model.cfg.n_heads,
            "d_model": model.cfg.d_model, "d_vocab": model.cfg.d_vocab,
            "block_params": sum(p.numel() for p in model.blocks[0].parameters()),
            "dtype": str(model.W_E.dtype), "device": str(model.W_E.device)}


@job("default_tokens")
def _default_tokens(model, shared, **kwargs) -> torch.Tensor:
    from .._analysis.metrics import default_tokens

    return default_tokens(model, **kwargs).cpu()


@job("replacement")
def _replacement(model, shared, *, method, layers, reference, per_position):
    """The mean/resample replacement over the WHOLE prompt set (``shared`` = the tokens), on the CPU."""
    from .._analysis.ablate import make_replacement

    repl = make_replacement(model, method, layers, reference=reference, tokens=shared, per_position=per_position)
    repl.z = {k: v.cpu() for k, v in repl.z.items()}
    return repl
