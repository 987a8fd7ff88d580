"""Path patching (and the induction trace) on Ray workers: shards of (prompt rows, receiver layers), combined exactly.

>>> res = qk.path_patch("smollm2-135m", "4.2", backend="ray", ray_address="local:2")   # doctest: +SKIP
>>> res = qk.trace_induction("smollm2-135m", backend="ray")                             # doctest: +SKIP

The driver loads no weights (``model`` is a spec): one worker resolves the receivers/senders, draws the
default prompts and computes the mean/resample ``references`` ONCE over the whole prompt set (the
``prepare`` job); ``patch_job`` runs ``patch_shard`` on a worker's own model for one shard (prompt rows
``rows`` × a group of receiver layers) with the shared references sliced to its rows; the driver adds
the shards' sums with ``combine`` / ``combine_attention`` (exact: sums and counts add up). For the
trace, a worker also runs the scan (``trace_receivers_job``) and the weights-only K-composition
agreement (``k_composition_job``). Memory per worker: the model plus one shard's ``CleanCache`` and
one chunk of stacked receiver-layer activations (see ``path_patch``).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .._analysis.metrics import portable
from .._foundation.errors import QKCircuitsError
from .._foundation.heads import Head
from .._foundation.io import check_int
from .._foundation.model import model_name
from .._paths.path_effects import PathEffects
from .._paths.patching import (check_into, check_request, combine, combine_attention, patch_settings, patch_shard,
                               reference_label, references, resolve_metric, shard_replacement)
from .._paths.trace import k_composition_spearman, scan_for_trace, trace_receivers
from .distributed import Pool
from .ray_sweep import driver_tokens

# ------------------------------------------------------------------------------------------ jobs (run in workers)


def prepare(model, shared, *, receivers, senders, into, method, per_position) -> Dict[str, Any]:
    """Validate the request on the model, draw the prompts when ``shared`` (the tokens) is None, and compute
    the references over the WHOLE prompt set (CPU tensors)."""
    recv, snd, into, tokens, sender_layers = check_request(model, receivers, senders, into, method, shared)
    H = model.cfg.n_heads
    repl = references(model, method, tokens, sender_layers, per_position)
    tokens = tokens.cpu()
    repl.z = {k: v.cpu() for k, v in (repl.z or {}).items()}
    n_edges = sum(len([s for s in snd if s.layer < r.layer]) if snd is not None else r.layer * H for r in recv)
    return {"receivers": recv, "senders": snd, "into": into, "tokens": tokens, "replacement": repl,
            "name": model_name(model), "n_layers": model.cfg.n_layers, "n_heads": H,
            "settings": patch_settings(model, tokens, per_position, reference_label(method), n_edges,
                                  len({r.layer for r in recv}))}


def patch_job(model, shared, *, rows: Tuple[int, int], receivers: List[Head], senders, into, metric, chunk,
              method, per_position):
    """``patch_shard`` on this worker's model for prompt rows ``rows`` of ``shared["tokens"]`` and ``receivers``."""
    t0 = time.perf_counter()
    a, b = rows
    tokens = shared["tokens"][a:b].to(model.W_E.device)
    repl = shard_replacement(shared["replacement"], slice(a, b))
    out = patch_shard(model, tokens, repl, receivers, senders, into, metric, None, chunk, rows=(a, b),
                      method=method, per_position=per_position)
    out.seconds = time.perf_counter() - t0
    return out


def trace_receivers_job(model, shared, *, receivers, top) -> Dict[str, Any]:
    """The trace's scan on this worker (``shared``: a ``HeadScores`` to reuse, or None): receivers (default the
    ``top`` induction heads of layer ≥ 1), the senders' labels and the receivers' induction scores."""
    scores = shared if shared is not None else scan_for_trace(model, False)
    recv = trace_receivers(model, scores, receivers, top)
    return {"receivers": recv, "labels": {str(h): v for h, v in scores.labels().items()},
            "receiver_induction": {str(r): float(scores["induction"][r.layer, r.head]) for r in recv},
            "scan": {k: scores.settings.get(k) for k in ("n_seqs", "seq_len", "seed")}}


def k_composition_job(model, shared) -> Dict[str, Optional[float]]:
    """``k_composition_spearman`` of the result ``shared`` with this worker's weights."""
    return k_composition_spearman(model, shared)


# ------------------------------------------------------------------------------------------ driver


def plan_patching(n_prompts: int, receivers: Sequence[Head], n_heads: int, n_into: int, n_workers: int, *,
                  per_worker: int = 2) -> Tuple[List[Dict[str, Any]], List[float]]:
    """Shards of (prompt rows, receivers): prompt rows first (each row's clean pass is then paid once), cut
    into up to ``per_worker`` × ``n_workers`` blocks; when there are fewer prompts than that, the receiver
    layers are also split into groups of about equal cost (a receiver of layer R has R × n_heads senders).
    Cost of a shard: rows × Σ over its receiver layers of senders × inputs. Returns (shards, costs)."""
    want = max(1, per_worker * n_workers)
    blocks = [(int(r[0]), int(r[-1]) + 1) for r in torch.arange(n_prompts).chunk(min(n_prompts, want))]
    layers = sorted({r.layer for r in receivers})
    n_groups = max(1, min(len(layers), -(-want // len(blocks))))
    cost = {R: R * n_heads * n_into for R in layers}
    groups: List[List[int]] = [[]]
    acc, total = 0.0, sum(cost.values())
    for R in layers:
        if groups[-1] and acc + cost[R] / 2 > total * len(groups) / n_groups and len(groups) < n_groups:
            groups.append([])
        groups[-1].append(R)
        acc += cost[R]
    shards, costs = [], []
    for a, b in blocks:
        for g in groups:
            shards.append({"rows": (a, b), "receivers": [r for r in receivers if r.layer in g]})
            costs.append(float((b - a) * sum(cost[R] for R in g)))
    return shards, costs


def ray_path_patch(spec, receivers, into=("q", "k", "v"), senders=None, method: str = "mean", tokens=None,
                   metric=None, *, per_position: bool = True, shards: int = 1, chunk: Optional[int] = None,
                   progress: bool = True, ray_address: Optional[str] = None, workers: Optional[int] = None,
                   threads: int = 1, load_kwargs: Optional[Dict[str, Any]] = None, on_event=None,
                   pool: Optional[Pool] = None):
    """``path_patch(..., backend=qk.Ray(...))`` (what ``Ray.run("path_patch", ...)`` calls): see
    ``qkcircuits.path_patch``; equal to the local result to float rounding. ``spec`` names the model (each
    worker loads it); ``tokens`` are ids (or None: the default prompts, drawn by a worker). ``shards`` is the
    local backend's memory knob: Ray plans its own shards (``plan_patching``). ``pool``: an open ``Pool`` to
    reuse (the trace's)."""
    metrics = {x: resolve_metric(metric, x) for x in check_into(into)}     # a bad metric fails before Ray starts
    if pool is None:
        with Pool(spec, workers=workers, threads=threads, load_kwargs=load_kwargs or {}, address=ray_address,
                  progress=progress, on_event=on_event) as own:
            return ray_path_patch(spec, receivers, into, senders, method, tokens, metric, per_position=per_position,
                                  chunk=chunk, progress=progress, pool=own)
    t0 = time.perf_counter()
    toks = None if tokens is None else driver_tokens(tokens)
    prep = pool.call("qkcircuits._scale.ray_patching:prepare", {"receivers": receivers, "senders": senders, "into": into,
                                                          "method": method, "per_position": per_position}, toks)
    recv, into = prep["receivers"], prep["into"]
    for m in metrics.values():
        if m.check is not None:
            m.check(prep["tokens"])
    shards, costs = plan_patching(prep["tokens"].shape[0], recv, prep["n_heads"], len(into), pool.size)
    jobs = [{**s, "senders": prep["senders"], "into": into, "metric": portable(metric), "chunk": chunk, "method": method,
             "per_position": per_position} for s in shards]
    parts = pool.map("qkcircuits._scale.ray_patching:patch_job", jobs,
                     {"tokens": prep["tokens"], "replacement": prep["replacement"]}, costs=costs, desc="path patching")
    effects, clean = combine(parts, metrics, recv)
    settings = dict(prep["settings"])
    settings["backend"] = {"name": "ray", "workers": pool.size, "shards": len(shards), "retries": pool.retries,
                           "startup_s": round(pool.timing.get("startup_s", 0.0), 3),
                           "load_s": round(pool.timing.get("load_s", 0.0), 3),
                           "patch_s": round(time.perf_counter() - t0, 3),
                           "plan": [{"rows": list(s["rows"]), "receivers": [str(r) for r in s["receivers"]],
                                     "cost": c, "seconds": round(getattr(p, "seconds", 0.0), 3)}
                                    for s, c, p in zip(shards, costs, parts)]}
    return PathEffects(model=prep["name"], method=method, receivers=recv, into=into,
                       metrics={x: m.name for x, m in metrics.items()}, effects=effects, clean=clean, kind="exact",
                       n_layers=prep["n_layers"], n_heads=prep["n_heads"], settings=settings,
                       clean_attention=combine_attention(parts, recv))


def ray_trace(spec, receivers=None, *, top: int = 3, into=("q", "k", "v"), method: str = "mean",
              attribution: bool = False, scores=None, tokens=None, progress: bool = True,
              ray_address: Optional[str] = None, workers: Optional[int] = None, threads: int = 1,
              load_kwargs: Optional[Dict[str, Any]] = None, on_event=None, pool: Optional[Pool] = None):
    """``trace(..., backend=qk.Ray(...))``: the scan, the path patching and the K-composition agreement on Ray
    workers of one pool (each loads the model once); the driver loads no weights. ``pool``: an open ``Pool`` to
    run on, else one is started for this trace."""
    check_int("top", top)
    if attribution:
        raise QKCircuitsError("backend 'ray' runs exact path patching; drop attribution (or use the local backend)")
    if pool is None:
        with Pool(spec, workers=workers, threads=threads, load_kwargs=load_kwargs or {}, address=ray_address,
                  progress=progress, on_event=on_event) as own:
            return ray_trace(spec, receivers, top=top, into=into, method=method, scores=scores, tokens=tokens,
                             progress=progress, pool=own)
    t0 = time.perf_counter()
    info = pool.call("qkcircuits._scale.ray_patching:trace_receivers_job", {"receivers": receivers, "top": top}, scores)
    scan_s = time.perf_counter() - t0
    res = ray_path_patch(spec, info["receivers"], into, None, method, tokens, per_position=True,
                         progress=progress, pool=pool)
    res = replace(res, labels=info["labels"],
                  k_composition_spearman=pool.call("qkcircuits._scale.ray_patching:k_composition_job", {}, res))
    res.settings["receiver_induction"] = info["receiver_induction"]
    res.settings["scan"] = info["scan"]
    res.settings["backend"]["scan_s"] = round(scan_s, 3)
    return res
