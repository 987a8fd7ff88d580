"""Ray backend: actors that each load the model once and run named jobs on shards of the work.

>>> res = qk.sweep("smollm2-135m", tokens, "induction-loss", backend="ray")   # doctest: +SKIP
>>> with Pool("smollm2-135m", workers=2) as pool:                            # doctest: +SKIP
...     outs = pool.map("sweep_shard", shards, shared={"tokens": tokens, ...})

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
- ``ray_sweep``: the all-heads ablation sweep on a pool (cut into shards by ``plan_sweep``,
  combined exactly by ``combine_sweep``).

The driver (this process) loads no weights: the token prompts, the model's shape and the
mean/resample replacement are computed by a worker and sent back.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ._errors import QKCircuitsError

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
        from ._model import load

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
            from tqdm.auto import tqdm

            bar = tqdm(total=len(shards), desc=desc, unit="shard", file=sys.stderr, leave=False)
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
    from ._model import model_name

    return {"name": model_name(model), "n_layers": model.cfg.n_layers, "n_heads": model.cfg.n_heads,
            "dtype": str(model.W_E.dtype), "device": str(model.W_E.device)}


@job("default_tokens")
def _default_tokens(model, shared, **kwargs) -> torch.Tensor:
    from ._metrics import default_tokens

    return default_tokens(model, **kwargs).cpu()


@job("replacement")
def _replacement(model, shared, *, method, layers, reference, per_position):
    """The mean/resample replacement over the WHOLE prompt set (``shared`` = the tokens), on the CPU."""
    from ._ablate import make_replacement

    repl = make_replacement(model, method, layers, reference=reference, tokens=shared, per_position=per_position)
    repl.z = {k: v.cpu() for k, v in repl.z.items()}
    return repl


# ---------------------------------------------------------------------------------------------
# The sweep: shards of (prompt rows, layers), combined exactly.


@job("sweep_shard")
def _sweep_shard(model, shared, *, rows: Tuple[int, int], layers: List[int], metric, max_batch) -> Dict[str, Any]:
    """Metric on prompt rows ``rows`` clean and with each head of ``layers`` ablated alone."""
    from copy import copy

    from ._ablate import Runner, _prepare, copies_per_forward, run_groups
    from ._heads import Head

    tokens, metric = _prepare(model, shared["tokens"][rows[0]:rows[1]], metric)
    tokens = tokens.to(model.W_E.device)
    repl = copy(shared["replacement"])
    if repl.method == "resample":                 # row i of the prompts gets row i of the reference
        repl.z = {L: z[rows[0]:rows[1]] for L, z in repl.z.items()}
    runner = Runner(model, tokens, from_layer=min(layers))
    copies = copies_per_forward(model, tokens, max_batch, metric)
    values = {}
    for L in layers:
        groups = [[Head(L, h)] for h in range(model.cfg.n_heads)]
        values[L] = run_groups(runner, groups, repl, metric, copies)
    return {"rows": rows, "weight": rows[1] - rows[0], "baseline": float(metric(runner.clean_logits, tokens)),
            "values": values}


def layer_cost(layer: int, n_layers: int, n_heads: int) -> int:
    """Block passes per prompt to sweep one layer: each of its heads re-runs blocks ``layer..n_layers-1``."""
    return n_heads * (n_layers - layer)


def plan_sweep(n_prompts: int, layers: Sequence[int], n_layers: int, n_heads: int, n_workers: int, *,
               shard_prompts: Optional[int] = None, per_worker: int = 2) -> Tuple[List[Dict[str, Any]], List[float]]:
    """Cut the sweep into shards of (prompt rows, contiguous layers) of about equal cost.

    Prompts are cut first, into chunks of at most ``shard_prompts`` rows (default: all rows in one
    chunk up to 64, which keeps the stacked batches large). The layers are then cut into
    contiguous groups of about equal cost (``layer_cost``: a head of layer L re-runs the
    n_layers − L blocks above it, so equal layer ranges are NOT equal work), so that there are
    about ``per_worker`` × ``n_workers`` shards in all: enough for the workers that free up first
    to take the remaining ones. Each shard also pays one clean pass (n_layers blocks per prompt),
    counted in its cost. Returns (shards, costs in block passes).
    """
    layers = sorted(layers)
    chunk = shard_prompts or min(n_prompts, 64)
    bounds = [(s, min(s + chunk, n_prompts)) for s in range(0, n_prompts, chunk)]
    n_groups = max(1, min(len(layers), -(-per_worker * n_workers // len(bounds))))
    costs = [layer_cost(L, n_layers, n_heads) for L in layers]
    total = sum(costs)
    groups: List[List[int]] = [[]]
    acc = 0.0
    for L, c in zip(layers, costs):
        # start a new group once this one holds its share of the total cost
        if groups[-1] and acc + c / 2 > total * len(groups) / n_groups and len(groups) < n_groups:
            groups.append([])
        groups[-1].append(L)
        acc += c
    shards, shard_costs = [], []
    for r in bounds:
        for g in groups:
            shards.append({"rows": r, "layers": g})
            shard_costs.append((r[1] - r[0]) * (sum(layer_cost(L, n_layers, n_heads) for L in g) + n_layers))
    return shards, shard_costs


def combine_sweep(parts: Sequence[Dict[str, Any]], n_layers: int, n_heads: int) -> Tuple[torch.Tensor, float]:
    """Exact combination: the metric is a mean over prompts (equal tokens each), so the whole set's value
    is the row-weighted mean of the shards' values; effects = that mean ablated − that mean clean."""
    sums = torch.zeros(n_layers, n_heads, dtype=torch.float64)
    weights = torch.zeros(n_layers, dtype=torch.float64)
    base: Dict[Tuple[int, int], Tuple[float, int]] = {}
    for p in parts:
        base[tuple(p["rows"])] = (p["baseline"], p["weight"])
        for L, vals in p["values"].items():
            sums[L] += p["weight"] * torch.tensor(vals, dtype=torch.float64)
            weights[L] += p["weight"]
    W = sum(w for _, w in base.values())
    baseline = sum(b * w for b, w in base.values()) / W
    effects = torch.full((n_layers, n_heads), float("nan"))
    swept = weights > 0
    effects[swept] = (sums[swept] / weights[swept, None] - baseline).float()
    return effects, float(baseline)


def _driver_tokens(tokens) -> torch.Tensor:
    """Token ids as a CPU [batch, pos] tensor; the driver has no tokenizer (it loads no model), so no text."""
    if isinstance(tokens, str) or (isinstance(tokens, (list, tuple)) and tokens and isinstance(tokens[0], str)):
        raise QKCircuitsError("backend 'ray' needs token ids, not text (the driver loads no model); make them with "
                              "qk.repeated_tokens / qk.text_tokens, or the 'default_tokens' job of a Pool")
    t = torch.as_tensor(tokens).cpu()
    if t.dim() == 1:
        t = t[None]
    if t.dim() != 2 or t.numel() == 0 or t.is_floating_point():
        raise QKCircuitsError(f"tokens must be a non-empty [batch, pos] integer tensor, got shape {tuple(t.shape)}")
    return t


def ray_sweep(spec, tokens, metric="induction-loss", method: str = "zero", *, reference=None,
              per_position: bool = True, layers=None, max_batch=None, progress: bool = True,
              ray_address: Optional[str] = None, workers: Optional[int] = None, threads: int = 1,
              load_kwargs: Optional[Dict[str, Any]] = None, shard_prompts: Optional[int] = None,
              on_event=None):
    """``sweep(..., backend="ray")``: see ``qkcircuits.sweep``; equal to the local sweep to float rounding.

    ``tokens`` may be a dict of ``default_tokens`` arguments (``n_seqs``, ``seq_len``, ``seed``): a
    worker then draws the prompts for the metric (the driver has no tokenizer).
    """
    from ._ablate import check_method
    from ._metrics import as_metric
    from ._sweep import HeadEffects

    check_method(method)
    metric_obj = as_metric(metric)
    make_tokens = isinstance(tokens, dict)         # {"n_seqs", "seq_len", "seed"}: a worker draws them
    if not make_tokens:
        tokens = _driver_tokens(tokens)
        if metric_obj.check is not None:
            metric_obj.check(tokens)
    t_all = time.perf_counter()
    with Pool(spec, workers=workers, threads=threads, load_kwargs=load_kwargs or {}, address=ray_address,
              progress=progress, on_event=on_event) as pool:
        info = pool.call("describe")
        if make_tokens:
            tokens = pool.call("default_tokens", {"metric": metric_obj.name, **tokens})
        n_layers, n_heads = info["n_layers"], info["n_heads"]
        layers = sorted(set(range(n_layers) if layers is None else (int(x) for x in layers)))
        if not layers or layers[0] < 0 or layers[-1] >= n_layers:
            raise QKCircuitsError(f"layers must be in 0-{n_layers - 1}, got {layers!r}")
        t0 = time.perf_counter()
        ref = None if reference is None else _driver_tokens(reference)
        repl = pool.call("replacement", {"method": method, "layers": layers, "reference": ref,
                                         "per_position": per_position}, tokens)
        shards, costs = plan_sweep(tokens.shape[0], layers, n_layers, n_heads, pool.size, shard_prompts=shard_prompts)
        shards = [{**s, "metric": metric_obj, "max_batch": max_batch} for s in shards]
        parts = pool.map("sweep_shard", shards, {"tokens": tokens, "replacement": repl}, costs=costs, desc="sweep")
        timing = {"startup_s": pool.timing["startup_s"], "load_s": pool.timing["load_s"],
                  "sweep_s": time.perf_counter() - t0}
        workers_used, retries = pool.size, pool.retries
    effects, baseline = combine_sweep(parts, n_layers, n_heads)
    timing["total_s"] = time.perf_counter() - t_all
    res = HeadEffects(effects, baseline, info["name"], method, metric_obj.name, "sweep", int(tokens.shape[0]),
                      int(tokens.shape[1]), per_position, repl.reference, layers)
    res.timing = {k: round(v, 3) for k, v in timing.items()}
    res.backend = {"name": "ray", "workers": workers_used, "threads": threads, "shards": len(shards),
                   "retries": retries}
    return res
