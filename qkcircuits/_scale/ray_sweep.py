"""The all-heads ablation sweep on Ray workers: shards of (prompt rows, layers), combined exactly.

>>> res = qk.sweep("smollm2-135m", tokens, backend="ray", ray_address="local:2")   # doctest: +SKIP

The worked example of a job on ``qkcircuits._scale.distributed.Pool`` (docs/scaling.md):
``plan_sweep`` cuts the work into shards balanced by cost, one worker computes the mean/resample
replacement ONCE over the whole prompt set, ``sweep_shard`` runs one shard inside a worker (the
model is the worker's, loaded once), and ``combine_sweep`` combines the shards' metric values
exactly (row-weighted means).
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .._analysis.ablate import check_method, copies_per_forward, prepare_metric, run_groups
from .._analysis.replay import Runner
from .._analysis.metrics import as_metric, portable
from .._analysis.sweep import HeadEffects
from .._foundation.errors import QKCircuitsError
from .._foundation.heads import Head
from .distributed import Pool

def sweep_shard(model, shared, *, rows: Tuple[int, int], layers: List[int], metric, max_batch) -> Dict[str, Any]:
    """Metric on prompt rows ``rows`` clean and with each head of ``layers`` ablated alone."""
    from copy import copy

    t0 = time.perf_counter()
    tokens, metric = prepare_metric(model, shared["tokens"][rows[0]:rows[1]], metric, where="sweep")
    tokens = tokens.to(model.W_E.device)
    repl = copy(shared["replacement"])
    if repl.method == "resample":                 # row i of the prompts gets row i of the reference
        repl.z = {L: z[rows[0]:rows[1]] for L, z in repl.z.items()}
    runner = Runner(model, tokens, from_layer=min(layers))
    baseline = float(metric(runner.clean_logits, tokens))
    runner.clean_logits = None          # read once (as in the local sweep): not held through the shard
    copies = copies_per_forward(model, tokens, max_batch, metric)
    values = {}
    for L in layers:
        groups = [[Head(L, h)] for h in range(model.cfg.n_heads)]
        values[L] = run_groups(runner, groups, repl, metric, copies)
    return {"rows": rows, "weight": rows[1] - rows[0], "baseline": baseline,
            "values": values, "seconds": time.perf_counter() - t0}


def layer_cost(layer: int, n_layers: int, n_heads: int, unembed: float = 0.0) -> float:
    """Block passes per prompt to sweep one layer: each of its heads re-runs blocks ``layer..n_layers-1``
    and the unembedding, which costs ``unembed`` block passes (``unembed_cost``)."""
    return n_heads * (n_layers - layer + unembed)


def unembed_cost(info: Dict[str, Any], n_positions: int, keep: Optional[int]) -> float:
    """The unembedding of one ablated forward in block-pass units: (kept positions x d_model x d_vocab) /
    (positions x parameters of one block). SmolLM2 at 41 tokens, 20 kept: 3.9 blocks; a 7B Llama at 81
    tokens, 40 kept: 0.3 (the small model's vocabulary is large for its width)."""
    if not info.get("block_params"):
        return 0.0
    kept = keep or n_positions
    return kept * info["d_model"] * info["d_vocab"] / (n_positions * info["block_params"])


def plan_sweep(n_prompts: int, layers: Sequence[int], n_layers: int, n_heads: int, n_workers: int, *,
               shard_prompts: Optional[int] = None, per_worker: int = 2,
               unembed: float = 0.0) -> Tuple[List[Dict[str, Any]], List[float]]:
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
    costs = [layer_cost(L, n_layers, n_heads, unembed) for L in layers]
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
            shard_costs.append((r[1] - r[0]) * (sum(layer_cost(L, n_layers, n_heads, unembed) for L in g) + n_layers))
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


def driver_tokens(tokens) -> torch.Tensor:
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
              on_event=None, pool: Optional[Pool] = None):
    """``sweep(..., backend=qk.Ray(...))`` (what ``Ray.run("sweep", ...)`` calls): see ``qkcircuits.sweep``;
    equal to the local sweep to float rounding. ``spec`` is a model spec (``Ray`` turns a loaded model into one).

    ``tokens`` may be a dict of ``default_tokens`` arguments (``n_seqs``, ``seg_len`` or ``seq_len``, ``seed``): a
    worker then draws the prompts for the metric (the driver has no tokenizer). ``pool``: an open ``Pool`` to run
    on (a ``qk.Ray().pool(model)``'s workers), else one is started for this sweep.
    """
    check_method(method)
    metric_obj = as_metric(metric, accept=("logits",), where="sweep")
    make_tokens = isinstance(tokens, dict)         # {"n_seqs", "seg_len" or "seq_len", "seed"}: a worker draws them
    if not make_tokens:
        tokens = driver_tokens(tokens)
        if metric_obj.check is not None:
            metric_obj.check(tokens)
    t_all = time.perf_counter()
    if pool is None:
        with Pool(spec, workers=workers, threads=threads, load_kwargs=load_kwargs or {}, address=ray_address,
                  progress=progress, on_event=on_event) as own:
            res = _sweep_on(own, tokens, make_tokens, metric_obj, method, reference, per_position, layers, max_batch,
                            shard_prompts)
    else:
        res = _sweep_on(pool, tokens, make_tokens, metric_obj, method, reference, per_position, layers, max_batch,
                        shard_prompts)
    res.timing["total_s"] = round(time.perf_counter() - t_all, 3)
    return res


def _sweep_on(pool: Pool, tokens, make_tokens: bool, metric_obj, method: str, reference, per_position: bool, layers,
              max_batch, shard_prompts) -> HeadEffects:
    """The sweep's steps on the open ``pool``: prompts, replacement and shape from one worker, shards on all."""
    info = pool.call("describe")
    if make_tokens:
        tokens = pool.call("default_tokens", {"metric": metric_obj.name, **tokens})
    n_layers, n_heads = info["n_layers"], info["n_heads"]
    layers = sorted(set(range(n_layers) if layers is None else (int(x) for x in layers)))
    if not layers or layers[0] < 0 or layers[-1] >= n_layers:
        raise QKCircuitsError(f"layers must be in 0-{n_layers - 1}, got {layers!r}")
    t0 = time.perf_counter()
    ref = None if reference is None else driver_tokens(reference)
    repl = pool.call("replacement", {"method": method, "layers": layers, "reference": ref,
                                     "per_position": per_position}, tokens)
    keep = metric_obj.keep_last(tokens) if metric_obj.keep_last is not None else None
    shards, costs = plan_sweep(tokens.shape[0], layers, n_layers, n_heads, pool.size, shard_prompts=shard_prompts,
                               unembed=unembed_cost(info, tokens.shape[1], keep))
    shards = [{**s, "metric": portable(metric_obj), "max_batch": max_batch} for s in shards]
    parts = pool.map("qkcircuits._scale.ray_sweep:sweep_shard", shards, {"tokens": tokens, "replacement": repl},
                     costs=costs, desc="sweep")
    timing = {"startup_s": pool.timing["startup_s"], "load_s": pool.timing["load_s"],
              "sweep_s": time.perf_counter() - t0}
    effects, baseline = combine_sweep(parts, n_layers, n_heads)
    effects = -metric_obj.sign * effects           # ablated − clean → the metric's sign (+ = the head matters)
    backend = {"name": "ray", "workers": pool.size, "threads": pool.threads, "shards": len(shards),
               "retries": pool.retries,
               # per shard: prompt rows, layers, planned cost (block passes x prompts), seconds in the worker
               "plan": [{"rows": list(s["rows"]), "layers": s["layers"], "cost": c, "seconds": round(p["seconds"], 3)}
                        for s, c, p in zip(shards, costs, parts)]}
    return HeadEffects(effects, baseline, info["name"], method, metric_obj.name, "sweep", int(tokens.shape[0]),
                       int(tokens.shape[1]), per_position, repl.reference, layers,
                       timing={k: round(v, 3) for k, v in timing.items()}, backend=backend,
                       higher_is_better=metric_obj.higher_is_better,
                       settings={"fingerprint": info["fingerprint"]} if info.get("fingerprint") else {})
