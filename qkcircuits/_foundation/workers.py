"""Ray workers that each load the model once and run shards of any ``Sharded`` analysis (``RayPool``'s machinery).

>>> with Pool("smollm2-135m", workers=2) as pool:                            # doctest: +SKIP (needs Ray)
...     parts = pool.map(fn, shards, shared={"tokens": tokens})               # fn(model, shared, scratch, **shard)

Imported only when a caller asks for a Ray backend (``import qkcircuits`` never imports ray). It knows no
analysis: a shard is ``fn(model, shared, scratch, **shard)`` for a function of an importable module (Ray pickles
it by reference; ``_foundation/shards``), a whole step ``fn(model, **request)`` on one worker (``Pool.call``).

- ``Worker``: a Ray actor holding ONE loaded model (``qk.load(spec, **load_kwargs)``, loaded once, kept for every
  shard it runs; ``spec=None``: its functions load their own, the zoo). One GPU per worker where the cluster has
  GPUs (``gpus_per_worker=k`` with ``device_map="auto"`` for a model spread over k GPUs), else ``threads`` CPU
  threads.
- ``Pool``: connects (``connect``), starts the workers, and ``map(fn, shards, shared)`` runs the shards as workers
  free up (largest first when given costs), puts ``shared`` into Ray's object store ONCE for all shards, shows a
  bar over shards, and re-runs the shard of a worker that died on a fresh worker: results are kept by shard index
  and a shard's result is recorded only when it comes back, so nothing is counted twice. ``timing`` holds
  ``startup_s`` (connect + worker processes up), ``load_s`` (the parallel model loads) and, after ``map``,
  ``run_s``.

The driver (this process) loads no weights: what needs the model (a plan, a task built with the tokenizer) runs on
a worker and comes back.
"""

from __future__ import annotations

import os
import socket
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .errors import QKCircuitsError

RAY_HINT = "pip install 'qkcircuits[ray]' (or use the local backend: no backend= / no --ray)"


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
        from .model import load

        t0 = time.perf_counter()
        if spec is None:             # a worker whose jobs load their own models (the zoo)
            return 0.0
        kwargs = dict(load_kwargs)
        if kwargs.get("device") in (None, "auto"):
            kwargs["device"] = "cuda" if torch.cuda.is_available() else "cpu"
        self.model = load(spec, verbose=False, **kwargs)
        return time.perf_counter() - t0

    def run(self, fn: Callable[..., Any], shard: Dict[str, Any], shared: Any, key: int) -> Any:
        """One shard: ``fn(model, shared, scratch, **shard)``; ``scratch`` lives for one map (``key``)."""
        if getattr(self, "_key", None) != key:
            self._key, self._scratch = key, {}
        return fn(self.model, shared, self._scratch, **shard)

    def call(self, fn: Callable[..., Any], request: Dict[str, Any]) -> Any:
        """One whole step on this worker's model: ``fn(model, **request)``."""
        return fn(self.model, **request)


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

    def call(self, fn: Callable[..., Any], request: Optional[Dict[str, Any]] = None) -> Any:
        """``fn(model, **request)`` on one worker (a plan, a step that is not split); its errors as they are."""
        ray = import_ray()
        from ray.exceptions import RayTaskError

        try:
            return ray.get(self._actors[0].call.remote(fn, request or {}))
        except RayTaskError as e:
            cause = getattr(e, "cause", None)
            if isinstance(cause, QKCircuitsError):
                raise QKCircuitsError(str(cause)) from None
            raise

    def map(self, fn: Callable[..., Any], shards: Sequence[Dict[str, Any]], shared: Any = None, *,
            costs: Optional[Sequence[float]] = None, progress: Optional[bool] = None, desc: str = "shards") -> List[Any]:
        """``fn(model, shared, scratch, **shard)`` for every shard, results in shard order.

        Shards go to workers as they free up, largest ``costs`` first. A worker that dies takes
        its shard back to the queue and is replaced by a fresh worker (which loads the model).
        """
        ray = import_ray()
        from ray.exceptions import RayActorError, RayTaskError

        name = getattr(fn, "__qualname__", str(fn))
        self._maps = getattr(self, "_maps", 0) + 1
        key = self._maps
        order = sorted(range(len(shards)), key=lambda i: -(costs[i] if costs else 0))
        queue = deque(order)
        shared_ref = ray.put(shared)                      # sent once, read by every shard
        results: Dict[int, Any] = {}
        inflight: Dict[Any, Tuple[int, Any]] = {}
        idle = list(self._actors)
        show = self.progress if progress is None else progress
        bar = None
        if show:
            from .progress import progress_bar

            bar = progress_bar(total=len(shards), desc=desc, unit="shard")
        t0 = time.perf_counter()
        try:
            while queue or inflight:
                while queue and idle:
                    actor = idle.pop()
                    i = queue.popleft()
                    ref = actor.run.remote(fn, shards[i], shared_ref, key)
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
