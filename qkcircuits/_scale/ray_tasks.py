"""Edge scores, node scores and faithfulness of a task on Ray workers: prompt shards, combined exactly by sums.

>>> s = qk.edge_scores("smollm2-135m", task, backend="ray")                       # doctest: +SKIP
>>> f = qk.faithfulness("smollm2-135m", task, s, backend=qk.Ray(address="local:2"))  # doctest: +SKIP

Why sums are exact: a task's metric is computed per prompt row and SUMMED (``Task.row_values``), and the
model treats rows independently, so every score is a sum over prompts divided by ``n``: EAP and EAP-IG
(Δ_s · ∂m/∂x_r summed over rows, the gradient of a row-sum being each row's own gradient), ``exact``
(m(clean) − m(edge corrupted), both row sums), node scores, and each circuit's m(C) on the faithfulness
grid. A shard job runs the LOCAL function (``edge_scores``, ``node_scores``, ``circuit_metric``, ``node_metric``) on a
sub-task of prompt rows (``Task.rows``) on its worker's model and returns its sums (its means × its rows);
the driver adds the sums and divides by the whole set's ``n``. Faithfulness f = (m(C) − m(∅)) /
(m(full) − m(∅)) is then computed ONCE from the summed numbers (never averaged over shards: a ratio of
means is not a mean of ratios); the node view of the chosen circuit is a second round of shards (its
heads are known only once the whole curve is). The driver loads no weights: the task's token rows travel
to the workers once (Ray's object store), the graph's indexing comes back with the scores.

Memory per worker: its model plus what the local function holds for one shard (``edge_scores``: 2 ×
[senders, rows, pos, d_model] sender outputs, chunked by its own ``shard_rows``).
"""

from __future__ import annotations

import time
import warnings
from contextlib import contextmanager
from dataclasses import replace
from numbers import Real
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .._foundation.errors import QKCircuitsError
from .._tasks.bootstrap import check_bootstrap
from .._tasks.faithfulness import (SIZES, THRESHOLD, Faithfulness, choose, circuit_metric, finish, node_metric,
                                   ratio)
from .._tasks.selection import TaskCircuit, select
from .._tasks.core import CoreCircuit, build_core
from .._tasks.graph import graph
from .._tasks.gradients import resolve_rule
from .._tasks.scores import EdgeScores, NodeScores, check_method, edge_scores, node_scores, shard_rows
from .._tasks.task import NOT_DONE, Task, warn_if_not_done
from .distributed import Pool

JOB = "qkcircuits._scale.ray_tasks:"


# ------------------------------------------------------------------------------------------ jobs (run in workers)


def _rows(task: Task, rows: Tuple[int, int]) -> Task:
    return task.rows(slice(rows[0], rows[1]))


@contextmanager
def _quiet_about_the_task():
    """A shard's own clean/corrupt says nothing of the whole task's: the driver warns once, from the sums."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=NOT_DONE)
        yield


def edge_scores_job(model, shared: Task, *, rows: Tuple[int, int], method: str, steps: int, copies: int,
                    check: bool, rows_per_shard: Optional[int], rule: Optional[str] = None) -> Dict[str, Any]:
    """``edge_scores`` of prompt rows ``rows`` of the task ``shared``; its sums (scores × rows, NaN → 0)."""
    t0 = time.perf_counter()
    sub = _rows(shared, rows)
    with _quiet_about_the_task():
        es = edge_scores(model, sub, method, steps, rule=rule, rows_per_shard=rows_per_shard, copies=copies,
                         progress=False, check=check)
    return {"rows": rows, "n": sub.n, "sum": torch.nan_to_num(es.scores.double(), nan=0.0) * sub.n,
            "clean": es.clean * sub.n, "corrupt": es.corrupt * sub.n, "graph": es.graph, "method": es.method,
            "steps": es.steps, "model": es.model, "settings": es.settings, "seconds": time.perf_counter() - t0}


def node_scores_job(model, shared: Task, *, rows: Tuple[int, int], method: str, steps: int, copies: int,
                    rows_per_shard: Optional[int], rule: Optional[str] = None) -> Dict[str, Any]:
    """``node_scores`` of prompt rows ``rows``; its sums (score × rows per node)."""
    t0 = time.perf_counter()
    sub = _rows(shared, rows)
    with _quiet_about_the_task():
        ns = node_scores(model, sub, method, steps, rule=rule, progress=False, rows_per_shard=rows_per_shard,
                         copies=copies)
    return {"rows": rows, "n": sub.n, "sums": {k: v * sub.n for k, v in ns.scores.items()}, "model": ns.model,
            "clean": ns.settings["clean"] * sub.n, "corrupt": ns.settings["corrupt"] * sub.n,
            "settings": ns.settings, "seconds": time.perf_counter() - t0}


def circuit_metric_job(model, shared: Task, *, rows: Tuple[int, int], masks: List[torch.Tensor],
                       rows_per_shard: Optional[int], per_row: bool = False) -> Dict[str, Any]:
    """``circuit_metric`` (one patched forward per mask) of prompt rows ``rows``: metric sums per mask, and
    the clean and corrupt sums; with ``per_row`` each row's metrics too (for the bootstrap)."""
    t0 = time.perf_counter()
    sub = _rows(shared, rows).to(model.W_E.device)
    per = rows_per_shard or shard_rows(model, graph(model), sub, buffers=3)
    kept: Optional[Dict[str, torch.Tensor]] = {} if per_row else None
    values, clean, corrupt = circuit_metric(model, sub, masks, per, per_row=kept)
    return {"rows": rows, "n": sub.n, "values": [v * sub.n for v in values], "clean": clean * sub.n,
            "corrupt": corrupt * sub.n, "per_row": kept, "seconds": time.perf_counter() - t0}


def node_sets_job(model, shared: Task, *, rows: Tuple[int, int], sets: List[Any],
                  rows_per_shard: Optional[int]) -> Dict[str, Any]:
    """The node views of ``sets`` ((heads, MLPs) kept; ``nodeviews.NodeViews``, the local forwards) on prompt rows
    ``rows``: the metric of each row per set [k, rows], and the clean and corrupt metric of each row."""
    from .._tasks.nodeviews import NodeViews

    t0 = time.perf_counter()
    sub = _rows(shared, rows).to(model.W_E.device)
    views = NodeViews(model, sub, rows_per_shard)
    values = views.sets(sets)
    return {"rows": rows, "n": sub.n, "values": values, "clean": views.clean_rows(), "corrupt": views.corrupt_rows(),
            "forwards": views.forwards, "seconds": time.perf_counter() - t0}


def node_attribute_job(model, shared: Task, *, rows: Tuple[int, int], node_set: Any,
                       rows_per_shard: Optional[int]) -> Dict[str, Any]:
    """``NodeViews.attribute`` at ``node_set`` on prompt rows ``rows``: the metric of each row and the attribution
    sums (a_n × rows), or ``{"none": True}`` where node views are patched runs (no backward there)."""
    from .._tasks.nodeviews import NodeViews

    sub = _rows(shared, rows).to(model.W_E.device)
    views = NodeViews(model, sub, rows_per_shard)
    got = views.attribute(node_set)
    if got is None:
        return {"rows": rows, "n": sub.n, "none": True}
    return {"rows": rows, "n": sub.n, "values": got[0], "sums": {k: v * sub.n for k, v in got[1].items()},
            "forwards": views.forwards}


def node_metric_job(model, shared: Task, *, rows: Tuple[int, int], heads: List[str], need_clean: bool,
                    rows_per_shard: Optional[int]) -> Dict[str, Any]:
    """``node_metric`` (the node view's forwards, the local ones) of prompt rows ``rows``: the metric sums of
    the node view, the corrupt run and, with ``need_clean``, the clean run (else NaN)."""
    t0 = time.perf_counter()
    sub = _rows(shared, rows).to(model.W_E.device)
    m, clean, corrupt = node_metric(model, sub, heads, rows_per_shard, need_clean=need_clean)
    return {"rows": rows, "n": sub.n, "value": m * sub.n, "clean": clean * sub.n, "corrupt": corrupt * sub.n,
            "seconds": time.perf_counter() - t0}


def task_job(model, shared, *, spec: str, n: int, seed: int, prepend_bos: Optional[bool] = None,
             metric: Optional[str] = None, holdout: Optional[Real] = None) -> Dict[str, Any]:
    """The CLI's task (``ioi``, ``induction`` or a .jsonl path the workers can read) built with this worker's
    tokenizer (``holdout.Source``, through the task registry): its selection part and held-out part (None with ``holdout=0``), and the
    graph (the driver has no model)."""
    from .._tasks.holdout import HOLDOUT, Source

    source = Source.of(model, spec, n, seed, prepend_bos, metric)
    sel, held = source.parts(HOLDOUT if holdout is None else holdout, strict=holdout is not None)
    return {"task": sel.to("cpu"), "held": held.to("cpu") if held is not None else None, "graph": graph(model),
            "how": source.how}


def roles_job(model, shared: Task, *, circuit: TaskCircuit, clean: Real, corrupt: Real, also: Sequence[str] = (),
              force: bool = False):
    """``circuit.roles`` on this worker's model (one clean forward for the attention patterns, one more per key
    position for the QK evidence); ``also``: heads outside the circuit judged beside it."""
    return circuit.roles(model, shared, clean=clean, corrupt=corrupt, also=list(also), force=force)


# ------------------------------------------------------------------------------------------ driver


def plan_rows(n: int, n_workers: int, per_worker: int = 2) -> List[Tuple[int, int]]:
    """Prompt rows cut into up to ``per_worker`` × ``n_workers`` contiguous blocks of equal size (±1): every
    row once. Cost is about proportional to rows (each row's runs are independent), so equal blocks balance."""
    blocks = torch.arange(n).tensor_split(min(n, max(1, per_worker * n_workers)))
    return [(int(b[0]), int(b[-1]) + 1) for b in blocks]


def _check_task(task) -> Task:
    if not isinstance(task, Task):
        raise QKCircuitsError(f"task must be a qk.Task (qk.tasks.ioi / induction / from_jsonl), got "
                              f"{type(task).__name__}")
    return task.to("cpu")


def _pool(spec, pool, ray_address, workers, threads, load_kwargs, progress) -> Tuple[Pool, bool]:
    if pool is not None:
        return pool, False
    own = Pool(spec, workers=workers, threads=threads, load_kwargs=load_kwargs or {}, address=ray_address,
               progress=progress)
    own.start()
    return own, True


def _on_shards(pool: Pool, own: bool, task: Task, job: str, desc: str, make_job
               ) -> Tuple[List[Dict[str, Any]], Dict[str, Any]]:
    """Run ``job`` on the task's prompt shards (``make_job(i, rows)`` → the shard's request), cost-balanced by
    rows; closes ``pool`` when this call opened it (``own``). Returns the shards' parts and the backend info."""
    try:
        t0 = time.perf_counter()
        shards = plan_rows(task.n, pool.size)
        parts = pool.map(JOB + job, [make_job(i, r) for i, r in enumerate(shards)], task,
                         costs=[float(b - a) for a, b in shards], desc=desc)
        return parts, _backend(pool, shards, parts, t0)
    finally:
        if own:
            pool.close()


def _backend(pool: Pool, shards: Sequence[Tuple[int, int]], parts: Sequence[Dict[str, Any]], t0: float
             ) -> Dict[str, Any]:
    return {"name": "ray", "workers": pool.size, "shards": len(shards), "retries": pool.retries,
            "startup_s": round(pool.timing.get("startup_s", 0.0), 3), "load_s": round(pool.timing.get("load_s", 0.0), 3),
            "run_s": round(time.perf_counter() - t0, 3),
            "plan": [{"rows": list(r), "seconds": round(p["seconds"], 3)} for r, p in zip(shards, parts)]}


def ray_edge_scores(spec, task, method: str = "eap-ig", steps: int = 5, *, rule: Optional[str] = None,
                    rows_per_shard: Optional[int] = None, copies: int = 32, progress: bool = True, check: bool = True,
                    ray_address: Optional[str] = None, workers: Optional[int] = None, threads: int = 1,
                    load_kwargs: Optional[Dict[str, Any]] = None, pool: Optional[Pool] = None) -> EdgeScores:
    """``edge_scores(..., backend=qk.Ray(...))``: prompt shards on Ray workers, their score sums added (exact,
    module docstring). ``rows_per_shard`` is each worker's memory knob inside its shard. ``pool``: an open
    ``Pool`` to reuse."""
    check_method(method, steps)
    rule = resolve_rule(method, rule)
    task = _check_task(task)
    pool, own = _pool(spec, pool, ray_address, workers, threads, load_kwargs, progress)
    parts, backend = _on_shards(pool, own, task, "edge_scores_job", f"edge scores ({method}, ray)",
                                lambda i, r: {"rows": r, "method": method, "steps": steps, "copies": copies,
                                              "check": check and i == 0, "rows_per_shard": rows_per_shard,
                                              "rule": rule})
    first = parts[0]
    total = sum((p["sum"] for p in parts), torch.zeros_like(first["sum"]))
    scores = (total / task.n).float()
    scores[~first["graph"].valid] = float("nan")
    settings = {**first["settings"], "rows_per_shard": rows_per_shard, "backend": backend}
    clean, corrupt = sum(p["clean"] for p in parts) / task.n, sum(p["corrupt"] for p in parts) / task.n
    warn_if_not_done(task, clean, corrupt)
    return EdgeScores(first["graph"], scores, first["method"], first["steps"], clean, corrupt, task.describe(),
                      first["model"], settings, {"edge_scores_s": backend["run_s"]})


def ray_node_scores(spec, task, method: str = "eap-ig", steps: int = 5, *, rule: Optional[str] = None,
                    progress: bool = True,
                    rows_per_shard: Optional[int] = None, copies: int = 32, ray_address: Optional[str] = None,
                    workers: Optional[int] = None, threads: int = 1, load_kwargs: Optional[Dict[str, Any]] = None,
                    pool: Optional[Pool] = None) -> NodeScores:
    """``node_scores(..., backend=qk.Ray(...))``: per-node sums of prompt shards, added (exact)."""
    check_method(method, steps)
    rule = resolve_rule(method, rule)
    task = _check_task(task)
    pool, own = _pool(spec, pool, ray_address, workers, threads, load_kwargs, progress)
    parts, backend = _on_shards(pool, own, task, "node_scores_job", f"node scores ({method}, ray)",
                                lambda i, r: {"rows": r, "method": method, "steps": steps, "copies": copies,
                                              "rows_per_shard": rows_per_shard, "rule": rule})
    names = list(parts[0]["sums"])
    scores = {k: sum(p["sums"][k] for p in parts) / task.n for k in names}
    clean, corrupt = sum(p["clean"] for p in parts) / task.n, sum(p["corrupt"] for p in parts) / task.n
    warn_if_not_done(task, clean, corrupt)
    return NodeScores(scores, method, parts[0]["model"], {**parts[0]["settings"], "clean": clean, "corrupt": corrupt,
                                                          "backend": backend})


def ray_circuit_metric(pool: Pool, task: Task, masks: Sequence[torch.Tensor], rows_per_shard: Optional[int] = None,
                       desc: str = "faithfulness (ray)", per_row: Optional[Dict[str, torch.Tensor]] = None
                       ) -> Tuple[List[float], float, float, Dict[str, Any]]:
    """``circuit_metric`` over the whole task from prompt shards on ``pool``: (metric mean per mask, clean mean,
    corrupt mean, backend info), each mean = the shards' summed metric / n. ``per_row``: filled as
    ``circuit_metric``'s (the shards' rows, in row order)."""
    t0 = time.perf_counter()
    shards = plan_rows(task.n, pool.size)
    jobs = [{"rows": r, "masks": list(masks), "rows_per_shard": rows_per_shard, "per_row": per_row is not None}
            for r in shards]
    parts = pool.map(JOB + "circuit_metric_job", jobs, task, costs=[float(b - a) for a, b in shards], desc=desc)
    n = task.n
    values = [sum(p["values"][i] for p in parts) / n for i in range(len(masks))]
    if per_row is not None:                 # shards are contiguous row blocks, returned in shard order
        per_row.update({k: torch.cat([p["per_row"][k] for p in parts], dim=-1) for k in ("masks", "clean", "corrupt")})
    return (values, sum(p["clean"] for p in parts) / n, sum(p["corrupt"] for p in parts) / n,
            _backend(pool, shards, parts, t0))


def ray_node_faithfulness(pool: Pool, task: Task, heads: Sequence[str],
                          rows_per_shard: Optional[int] = None, clean: Optional[Real] = None) -> float:
    """``node_faithfulness`` from prompt shards on ``pool``: each shard runs the local ``node_metric`` (one
    forward with the left-out heads' corrupt z where the model allows it), f from the summed metrics,
    computed once. ``clean``: m(clean) when the caller has it (the curve's), sparing the clean forwards."""
    task = _check_task(task)
    shards = plan_rows(task.n, pool.size)
    jobs = [{"rows": r, "heads": list(heads), "need_clean": clean is None, "rows_per_shard": rows_per_shard}
            for r in shards]
    parts = pool.map(JOB + "node_metric_job", jobs, task, costs=[float(b - a) for a, b in shards],
                     desc="node view (ray)")
    n = task.n
    full = sum(p["clean"] for p in parts) / n if clean is None else float(clean)
    return ratio(sum(p["value"] for p in parts) / n, full, sum(p["corrupt"] for p in parts) / n)


def ray_faithfulness(spec, task, scores, sizes: Sequence[Real] = SIZES, *, by: str = "signed",
                     threshold: Real = THRESHOLD, rows_per_shard: Optional[int] = None, progress: bool = True,
                     ray_address: Optional[str] = None, workers: Optional[int] = None, threads: int = 1,
                     load_kwargs: Optional[Dict[str, Any]] = None, pool: Optional[Pool] = None,
                     bootstrap: int = 0, seed: int = 0, holdout: Optional[Task] = None,
                     **selection: Any) -> Faithfulness:
    """``faithfulness(..., backend=qk.Ray(...))``: m(C) per grid size, m(full) and m(∅) summed over prompt
    shards, f / CPR / CMD computed once from the sums; then the chosen circuit's node view (a second round).
    ``selection``: further arguments of ``select`` (the driver picks the circuits), passed as they are."""
    sizes = sorted({float(s) for s in sizes})
    if not sizes or sizes[0] < 0 or sizes[-1] > 100:
        raise QKCircuitsError(f"sizes must be percents in 0-100, got {sizes!r}")
    task = _check_task(task)
    circuits = [select(scores, percent=p, by=by, **selection) for p in sizes]   # the driver selects (no model)
    pool, own = _pool(spec, pool, ray_address, workers, threads, load_kwargs, progress)
    try:
        t0 = time.perf_counter()
        per_row: Optional[Dict[str, torch.Tensor]] = {} if check_bootstrap(bootstrap) else None
        values, clean, corrupt, backend = ray_circuit_metric(pool, task, [c.mask for c in circuits], rows_per_shard,
                                                             per_row=per_row)
        curve, chosen, circuit = choose(sizes, circuits, values, clean, corrupt, threshold)
        t1 = time.perf_counter()
        nf = ray_node_faithfulness(pool, task, circuit.heads, rows_per_shard, clean=clean)
        out = finish(sizes, circuits, values, clean, corrupt, curve, chosen, circuit, nf, getattr(scores, "model", ""),
                     {"by": by, **selection, "threshold": threshold, "rows_per_shard": rows_per_shard,
                      "backend": backend}, t0, t1, per_row, bootstrap, seed, threshold, task)
        if holdout is not None:           # faithfulness.held_out, its sums from prompt shards
            from .._tasks.bootstrap import bootstrap_curve
            from .._tasks.faithfulness import HELD_BOOTSTRAP, _area, ratio

            held = _check_task(holdout)
            per: Dict[str, torch.Tensor] = {}
            hv, hc, hz, _ = ray_circuit_metric(pool, held, [c.mask for c in circuits], rows_per_shard, per_row=per)
            hcurve = {p: ratio(v, hc, hz) for p, v in zip(sizes, hv)}
            xs, hf = [p / 100 for p in sizes], list(hcurve.values())
            out = replace(out, holdout={
                "n": held.n, "clean": hc, "corrupt": hz, "curve": hcurve, "cpr": _area(xs, hf),
                "cmd": _area(xs, [abs(1 - v) for v in hf]),
                "node_faithfulness": ray_node_faithfulness(pool, held, circuit.heads, rows_per_shard, clean=hc),
                "bootstrap": bootstrap_curve(xs, per["masks"], per["clean"], per["corrupt"], bootstrap or HELD_BOOTSTRAP,
                                             seed)})
    finally:
        if own:
            pool.close()
    return out


class RayViews:
    """``NodeViews``' measuring on prompt shards of Ray workers (``node_sets_job``, ``node_attribute_job``; each
    row's metric comes back, concatenated in row order; attributions summed over the shards), so the search on the
    driver takes the same steps as the local one. Where node views are patched runs (post-norms) ``attribute`` is
    None, as locally."""

    fast = True

    def __init__(self, pool: Pool, task: Task, rows_per_shard: Optional[int]):
        self.pool, self.task, self.rows_per_shard = pool, task, rows_per_shard
        self.shards = plan_rows(task.n, pool.size)
        self._ends: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
        self.sets_measured, self.forwards = 0, 0.0

    def sets(self, sets) -> torch.Tensor:
        jobs = [{"rows": r, "sets": list(sets), "rows_per_shard": self.rows_per_shard} for r in self.shards]
        parts = self.pool.map(JOB + "node_sets_job", jobs, self.task, costs=[float(b - a) for a, b in self.shards],
                              progress=False)
        self._ends = (torch.cat([p["clean"] for p in parts]), torch.cat([p["corrupt"] for p in parts]))
        self.sets_measured += len(sets)
        self.forwards += sum(p["forwards"] * p["n"] for p in parts) / self.task.n
        return torch.cat([p["values"] for p in parts], 1)

    def clean_rows(self) -> torch.Tensor:
        if self._ends is None:
            self.sets([])
        return self._ends[0]

    def corrupt_rows(self) -> torch.Tensor:
        if self._ends is None:
            self.sets([])
        return self._ends[1]

    def attribute(self, node_set):
        if not self.fast:
            return None
        jobs = [{"rows": r, "node_set": node_set, "rows_per_shard": self.rows_per_shard} for r in self.shards]
        parts = self.pool.map(JOB + "node_attribute_job", jobs, self.task, costs=[float(b - a) for a, b in self.shards],
                              progress=False)
        if any(p.get("none") for p in parts):
            self.fast = False
            return None
        self.sets_measured += 1
        self.forwards += sum(p["forwards"] * p["n"] for p in parts) / self.task.n
        names = list(parts[0]["sums"])
        return (torch.cat([p["values"] for p in parts]),
                {k: sum(p["sums"][k] for p in parts) / self.task.n for k in names})


def ray_core_circuit(spec, task, scores, *, threshold: Real = THRESHOLD, by: str = "signed", mlps: bool = True,
                     prune: bool = True, margin: str = "interval", holdout: Optional[Task] = None, seed: int = 0,
                     rows_per_shard: Optional[int] = None, progress: bool = True, ray_address: Optional[str] = None,
                     workers: Optional[int] = None, threads: int = 1, load_kwargs: Optional[Dict[str, Any]] = None,
                     pool: Optional[Pool] = None) -> CoreCircuit:
    """``core_circuit(..., backend=qk.Ray(...))``: the same search (``core.build_core``, on the driver), every
    measured batch of node sets run on prompt shards on the workers (``RayViews``)."""
    task = _check_task(task)
    held = _check_task(holdout) if holdout is not None else None
    pool, own = _pool(spec, pool, ray_address, workers, threads, load_kwargs, progress)
    try:
        return build_core(scores.graph, task, scores, RayViews(pool, task, rows_per_shard),
                          RayViews(pool, held, rows_per_shard) if held is not None else None, threshold=threshold,
                          by=by, mlps=mlps, prune=prune, margin=margin, seed=seed, progress=progress,
                          settings={"rows_per_shard": rows_per_shard, "backend": {"name": "ray", "workers": pool.size}})
    finally:
        if own:
            pool.close()


def ray_task_and_graph(pool: Pool, spec: str, n: int, seed: int, prepend_bos: Optional[bool] = None,
                       metric: Optional[str] = None, holdout: Optional[Real] = None
                       ) -> Tuple[Task, Optional[Task], Any, str]:
    """The CLI's task (selection part, held-out part or None) and the model's graph, built on a worker (the
    driver has no tokenizer)."""
    out = pool.call(JOB + "task_job", {"spec": spec, "n": n, "seed": seed, "prepend_bos": prepend_bos,
                                       "metric": metric, "holdout": holdout})
    return out["task"], out["held"], out["graph"], out["how"]


def ray_roles(pool: Pool, task: Task, circuit: TaskCircuit, clean: Real, corrupt: Real, also: Sequence[str] = (),
              force: bool = False):
    """``circuit.roles(model, task)`` on a worker (``also``: heads outside the circuit judged beside it)."""
    return pool.call(JOB + "roles_job", {"circuit": circuit, "clean": clean, "corrupt": corrupt, "also": list(also),
                                         "force": force},
                     task)


# ------------------------------------------------------------------------------------------ the CLI's circuit steps
# (``Ray.jobs``' "task", "circuit_faithfulness", "roles": called by ``RayPool.run`` with the open workers)


def ray_task(spec, *, task: str, n: int, seed: int, prepend_bos: Optional[bool] = None, metric: Optional[str] = None,
             holdout: Optional[Real] = None, pool: Pool, progress: bool = True) -> Tuple[Task, Optional[Task], Any, str]:
    """The step "task" on Ray: the task ``task`` (a registered task's name, or a .jsonl path the workers can read), its
    held-out part and the model's graph, built on a worker (``ray_task_and_graph``)."""
    return ray_task_and_graph(pool, task, n, seed, prepend_bos, metric, holdout)


def ray_circuit_faithfulness(spec, *, task: Task, circuit: TaskCircuit, pool: Pool, graph: Any = None,
                             progress: bool = True) -> Tuple[float, float]:
    """The step "circuit_faithfulness" on Ray: (f, node-view f) of one circuit, from prompt shards (the clean
    metric of the curve's shards reused by the node view)."""
    (m,), clean, corrupt, _ = ray_circuit_metric(pool, task, [circuit.mask])
    return ratio(m, clean, corrupt), ray_node_faithfulness(pool, task, circuit.heads, clean=clean)


def ray_circuit_roles(spec, *, task: Task, circuit: TaskCircuit, clean: Real, corrupt: Real, also: Sequence[str] = (),
                      force: bool = False, pool: Pool, progress: bool = True):
    """The step "roles" on Ray: ``circuit.roles`` on a worker (``ray_roles``)."""
    return ray_roles(pool, task, circuit, clean, corrupt, also=also, force=force)
