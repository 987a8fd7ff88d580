"""Path patching: how much each earlier head feeds a receiver head's queries, keys or values.

>>> res = qk.path_patch(model, "1.0", into=("q", "k", "v"), progress=False)    # every earlier head as sender
>>> [(str(h), round(e, 2)) for h, e in res.top(1, receiver="1.0", into="k")]   # the toy's keys: from 0.0
[('0.0', 1.0)]

For sender head s = (L, h) and receiver r at layer R > L, the sender's output is replaced
(``method``: its mean over the prompt set per position, zero, or its output on another prompt)
**only on its path into one input of r**; everything else is the clean run. With ``z`` the
sender's clean output and ``z'`` the replacement, the residual stream entering layer R changes by

    Δ = (z' − z) W_O[L, h]                                 (pre-norm blocks: GPT-2, Llama)
    Δ = post_L(y_L + (z' − z) W_O[L, h]) − post_L(y_L)      (Gemma: block norms its attention output y_L)

and the receiver's input (say k) is recomputed from ``resid_R + Δ`` by the model's own modules:
its input norm (ln1), K projection, k-norm where it has one, rotary (per layer type), attention
scale, soft-cap and (sliding-window) mask, while q and v stay clean. Nothing is linearised.
Grouped-query attention: keys and values belong to a KV head; patching the K (V) input for one
query head changes the keys (values) of its whole KV group, so every query head of the group sees
it; effects are reported per query head.

Effect = how much the patch harms the receiver's metric (clean − patched for a score, patched −
clean for a loss). Default metrics: the receiver's induction attention for q and k (the scan's
score on ``[BOS]+R+R``) and, for v, its direct contribution to the correct next token's logit.

Cost: one clean pass (caching what is listed under ``clean_pass``), then per receiver layer and
input one run of that layer's attention only (the forward is stopped once its pattern/z exist) on
``n_senders`` stacked copies of the batch, in chunks; every receiver head of that layer is read
from the same run. ``metric="induction-loss"`` adds, per receiver head, a forward from the receiver's layer
to the logits for every sender (the ARENA recipe), which costs about ``n_layers - R`` blocks each.

The split into ``references`` (mean/resample values, computed once over the whole prompt set),
``patch_shard`` (sums over one shard of prompts and one chunk of receivers × senders) and
``combine`` is exact: sums and counts add up, so shards can run anywhere and be combined.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from jaxtyping import Int
from torch import Tensor

from .._analysis.ablate import Replacement, check_method
from .._analysis.metrics import INDUCTION, Metric
from .._foundation.backends import BackendLike, as_backend
from .._foundation.capture import as_tokens
from .._foundation.errors import QKCircuitsError
from .._foundation.arch.model_facts import folded
from .._foundation.args import check_int, check_model, check_tokens
from .._foundation.heads import Head, HeadsLike, model_heads
from .._foundation.io import package_version
from .._foundation.model import model_name
from .._foundation.shards import Plan, Sharded
from .._foundation.sequences import repeated_tokens, segment_length
from .path_core import (CHUNK_BYTES, CleanCache, MetricLike, Scorer, clean_pass, is_direct_logit,  # noqa: F401
                        post_norm, receiver_run, references, replacement_from_cache, resolve_metric, sender_deltas,
                        shard_replacement)
from .path_effects import INPUTS, PathEffects

# ------------------------------------------------------------------------------------------ shards

@dataclass
class ShardSums:
    """Additive results of one shard (prompt rows ``rows`` × ``receivers`` × the senders it was given):
    ``patched[x]`` [n_receivers, n_layers, n_heads] metric sums (NaN where not computed), ``clean[x]``
    [n_receivers] sums, ``count[x]`` the metric's denominator over these rows."""

    patched: Dict[str, Tensor]
    clean: Dict[str, Tensor]
    count: Dict[str, float]
    receivers: List[Head] = field(default_factory=list)
    rows: Tuple[int, int] = (0, 0)
    # the receivers' clean induction attention (sums, count): the trace JSON's "clean" whatever ``into`` is
    attention: Optional[Tensor] = None
    attention_count: float = 0.0


def _chunk(model, tokens: Tensor) -> int:
    b, p = tokens.shape
    per_copy = b * model.cfg.n_heads * p * p * 4 * 3 + b * p * model.cfg.d_model * 4 * 8
    return max(1, int(CHUNK_BYTES // per_copy))


def patch_shard(model, tokens: Tensor, repl: Optional[Replacement], receivers: Sequence[Head],
                senders: Optional[Sequence[Head]], into: Sequence[str], metric: MetricLike = None,
                progress=None, chunk: Optional[int] = None, rows: Optional[Tuple[int, int]] = None,
                method: str = "mean", per_position: bool = True) -> ShardSums:
    """Path-patch one shard of prompts (``tokens``) for a chunk of receivers and senders.

    ``repl`` must come from ``references`` over the WHOLE prompt set (sliced to these rows with
    ``shard_replacement`` for resample). Memory: the ``CleanCache`` of this shard plus one chunk of
    ``chunk`` stacked copies of the receiver layer's activations (default: ~256 MiB of patterns).
    ``rows`` names the prompt rows of the whole set these are (default ``(0, len(tokens))``), for ``combine``.
    ``repl=None`` takes the references from this shard's own clean pass (only right when the shard is the
    whole prompt set: then it saves the reference forward).
    """
    L, H = model.cfg.n_layers, model.cfg.n_heads
    metrics = {x: resolve_metric(metric, x) for x in into}
    need_final = any(is_direct_logit(m) for m in metrics.values())
    cache = clean_pass(model, tokens, [r.layer for r in receivers], need_final=need_final,
                       need_logits=any(m.needs == "logits" for m in metrics.values()))
    if repl is None:
        repl = replacement_from_cache(cache, method, per_position)
    n_chunk = chunk or _chunk(model, tokens)
    patched = {x: torch.full((len(receivers), L, H), float("nan")) for x in into}
    clean = {x: torch.full((len(receivers),), float("nan")) for x in into}
    count: Dict[str, float] = {}
    attention = torch.full((len(receivers),), float("nan"))
    attention_count = 0.0
    by_layer: Dict[int, List[int]] = {}
    for i, r in enumerate(receivers):
        by_layer.setdefault(r.layer, []).append(i)
    for R, idx in sorted(by_layer.items()):
        heads = [receivers[i].head for i in idx]
        snd = [s for s in (senders if senders is not None else
                           [Head(l, h) for l in range(R) for h in range(H)]) if s.layer < R]
        induction = Scorer(model, cache, R, heads, INDUCTION)
        attention_count = induction.count()
        with torch.no_grad():
            attention[idx] = induction.clean_sums().float().cpu()
        for x in into:
            m = metrics[x]
            scorer = Scorer(model, cache, R, heads, m)
            count[x] = scorer.count()
            with torch.no_grad():
                clean[x][idx] = scorer.clean_sums().float().cpu()
            for c0 in range(0, len(snd), n_chunk):
                part = snd[c0:c0 + n_chunk]
                delta = sender_deltas(model, cache, repl, part)
                with torch.no_grad():
                    pattern, z = receiver_run(cache, R, x, delta, need_z=m.needs != "pattern")
                    vals = (scorer.logits_sums(z, len(part)) if m.needs == "logits"
                            else scorer.sums(pattern, z, len(part))).float().cpu()     # results live on the CPU
                for j, s in enumerate(part):
                    patched[x][idx, s.layer, s.head] = vals[j]
                if progress is not None:
                    progress.update(len(part))
    return ShardSums(patched, clean, count, list(receivers), rows or (0, int(tokens.shape[0])), attention,
                     attention_count)


def combine(shards: Sequence[ShardSums], metrics: Dict[str, Metric], receivers: Sequence[Head]
            ) -> Tuple[Dict[str, Tensor], Dict[str, Tensor]]:
    """Effects and clean values of ``receivers`` from shard sums, exactly.

    Shards over the same prompt rows but different receivers/senders are merged by placement (each entry
    computed once); prompt-row groups are then added: mean = Σ sums / Σ counts, effect = sign · (clean −
    patched) (``Metric.effect``: positive = the sender matters). An entry missing from any row group stays NaN.
    """
    groups: Dict[Tuple[int, int], List[ShardSums]] = {}
    for s in shards:
        groups.setdefault(s.rows, []).append(s)
    pos = {r: i for i, r in enumerate(receivers)}
    effects, clean = {}, {}
    for x, m in metrics.items():
        tot_p = tot_c = None
        n = 0.0
        for parts in groups.values():
            gp = torch.full((len(receivers),) + tuple(parts[0].patched[x].shape[1:]), float("nan"))
            gc = torch.full((len(receivers),), float("nan"))
            for s in parts:
                for i, r in enumerate(s.receivers):
                    have = ~s.patched[x][i].isnan()
                    gp[pos[r]][have] = s.patched[x][i][have]
                    if not s.clean[x][i].isnan():
                        gc[pos[r]] = s.clean[x][i]
            n += parts[0].count[x]
            tot_p = gp if tot_p is None else tot_p + gp
            tot_c = gc if tot_c is None else tot_c + gc
        c = tot_c / n
        effects[x] = m.effect(c[:, None, None], tot_p / n)
        clean[x] = c
    return effects, clean


def combine_attention(shards: Sequence[ShardSums], receivers: Sequence[Head]) -> Tensor:
    """[n_receivers] each receiver's clean induction attention (mean over the query positions that have a
    target), exactly from the shards' sums: Σ sums / Σ counts over prompt-row groups."""
    groups: Dict[Tuple[int, int], List[ShardSums]] = {}
    for s in shards:
        groups.setdefault(s.rows, []).append(s)
    pos = {r: i for i, r in enumerate(receivers)}
    total = torch.zeros(len(receivers))
    n = 0.0
    for parts in groups.values():
        g = torch.full((len(receivers),), float("nan"))
        for s in parts:
            for i, r in enumerate(s.receivers):
                if s.attention is not None and not s.attention[i].isnan():
                    g[pos[r]] = s.attention[i]
        total += g
        n += parts[0].attention_count
    return total / n


# ------------------------------------------------------------------------------------------ public API

def default_prompts(model, n_seqs: int = 8, seed: int = 0) -> Int[Tensor, "batch pos"]:
    """The scan's induction prompts: ``n_seqs`` × [BOS] + R + R, R of ``segment_length(model)`` distinct tokens."""
    return repeated_tokens(model, n_seqs, segment_length(model), 2, seed=seed)


def check_into(into) -> List[str]:
    """``into`` ("q,k", ["k"], ...) as the list of inputs in q, k, v order; one line naming a bad one."""
    if isinstance(into, str):
        into = [t for t in into.replace(" ", "").split(",") if t]
    into = list(into)
    for x in into:
        if x not in INPUTS:
            raise QKCircuitsError(f"unknown receiver input {x!r}; choose from q, k, v")
    if not into:
        raise QKCircuitsError("into names no input; use any of q, k, v")
    return [x for x in INPUTS if x in into]


def check_request(model, receivers, senders, into, method: str, tokens):
    """Validate a path-patching request (shared by the plan of ``path_patch`` and ``edge_attribution``):
    (receivers, senders or None for all earlier heads, inputs, prompt tokens on the model's device, sender
    layers). Layer-0 receivers are kept with an empty sender set (their effects are NaN: no head precedes
    them); a request whose receivers are ALL in layer 0 fails."""
    recv = model_heads(model, receivers)
    if all(r.layer == 0 for r in recv):
        raise QKCircuitsError(f"receiver {recv[0]} is in layer 0: no earlier heads can send to it")
    snd = model_heads(model, senders) if senders is not None else None
    into = check_into(into)
    check_method(method)
    tokens = as_tokens(model, tokens if tokens is not None else default_prompts(model))
    if method == "resample" and tokens.shape[0] < 2:
        raise QKCircuitsError("resample needs at least 2 prompts (each takes the sender's z from another)")
    sender_layers = sorted({s.layer for s in snd} if snd is not None else set(range(max(r.layer for r in recv))))
    return recv, snd, into, tokens, sender_layers


def path_patch(model, receivers: HeadsLike, into: Sequence[str] = ("q", "k", "v"), senders: Optional[HeadsLike] = None,
               method: str = "mean", tokens=None, metric: MetricLike = None, *, per_position: bool = True,
               shards: int = 1, chunk: Optional[int] = None, progress: bool = True, backend: BackendLike = None,
               ray_address: Optional[str] = None, workers: Optional[int] = None) -> PathEffects:
    """Exact path patching of every sender → (q | k | v of) every receiver; see the module docstring.

    ``model``: a loaded model or a spec, on any backend. ``receivers``/``senders``: heads ("18.6,17.3",
    [(18, 6)], Head objects); senders default to every head of an earlier layer than each receiver (a layer-0
    receiver has none: its row is NaN). ``tokens`` default to ``default_prompts(model)``. ``metric``: None
    (``induction`` for q/k, ``direct-logit`` for v), any name, ``qk.Metric`` or declared callable of ``as_metric``:
    receiver metrics ``fn(pattern [b, q, k], z [b, p, d_head], tokens)`` read the receiver head, logits
    metrics (``induction-loss``, ``qk.induction_loss()``, ``logit-diff:C,W``) run the patched
    receiver z to the logits. Effects are positive when the sender matters (``Metric.effect``). ``shards``
    splits the prompts into that many row blocks run one after another (same result; less memory).

    Memory: ``CleanCache`` (residual per layer from the lowest receiver on, z of every layer up to
    the highest, q/k/v and patterns of receiver layers) plus one chunk of stacked receiver-layer
    activations (``chunk`` copies; default sized to ~256 MiB of patterns).

    ``backend``: ``qk.Local()`` (default) or ``qk.Ray(address=..., workers=...)`` (or the strings of
    ``as_backend``; ``ray_address``/``workers`` are the older spelling). The shards (``PATH_PATCH``: ``shards``
    prompt-row blocks x up to ``RECEIVER_GROUPS`` receiver-layer groups, the references computed once over all
    prompts) run where the backend runs them (on Ray, each worker loads the model), combined exactly: the same
    result on every backend.

    >>> res = qk.path_patch(model, "1.0", into="k", metric=qk.induction_loss(), progress=False)
    >>> res.metrics["k"], res.top(1, receiver="1.0", into="k")[0][0]
    ('induction-loss', Head(layer=0, head=0))
    """
    request = dict(receivers=receivers, into=into, senders=senders, method=method, tokens=tokens, metric=metric,
                   per_position=per_position, shards=shards, chunk=chunk, progress=progress)
    return as_backend(backend, address=ray_address, workers=workers).map(PATH_PATCH, model, **request)


# ------------------------------------------------------------------------------------------ path patching's shards
# (prompt-row blocks: ``shards`` of them) x (receiver-layer groups: up to RECEIVER_GROUPS), the same plan on every
# backend; combined exactly (sums and counts add up: ``combine``).

RECEIVER_GROUPS = 4


def _check_patch(*, into, metric=None, shards: int = 1, **rest: Any) -> Dict[str, Any]:
    """The driver's checks (a bad input or metric fails before anything loads or starts); a built-in metric by
    name (it pickles)."""
    from .._analysis.metrics import portable

    check_int("shards", shards)
    into = check_into(into)
    for x in into:
        resolve_metric(metric, x)
    return dict(into=into, metric=portable(metric), shards=shards, **rest)


def _plan_patch(model, *, receivers, into, senders, method: str, tokens, metric, per_position: bool, shards: int,
                chunk: Optional[int], progress: bool) -> Plan:
    """Where the model is: the request checked, the prompts, the references over the WHOLE prompt set (with more
    than one row block; one block takes them from its own clean pass) and the shards."""
    model, tokens = check_model(model), check_tokens(tokens)
    metrics = {x: resolve_metric(metric, x) for x in check_into(into)}
    recv, snd, into, tokens, sender_layers = check_request(model, receivers, senders, into, method, tokens)
    check_metric_tokens(metrics.values(), tokens)
    n_shards = max(1, min(shards, tokens.shape[0]))
    repl = references(model, method, tokens, sender_layers, per_position) if n_shards > 1 else None
    if repl is not None:
        repl.z = {k: v.cpu() for k, v in (repl.z or {}).items()}
    H = model.cfg.n_heads
    n_edges = sum(len([s for s in snd if s.layer < r.layer]) if snd is not None else r.layer * H for r in recv)
    blocks = [(int(r[0]), int(r[-1]) + 1) for r in torch.arange(tokens.shape[0]).chunk(n_shards)]
    plan, costs = [], []
    for group in _receiver_groups(recv, H, len(into)):
        for a, b in blocks:
            plan.append({"rows": (a, b), "receivers": [r for r in recv if r.layer in group]})
            costs.append(float((b - a) * sum(R * H * len(into) for R in group)))
    info = {"name": model_name(model), "receivers": recv, "into": into, "n_layers": model.cfg.n_layers, "n_heads": H,
            "settings": patch_settings(model, tokens, per_position, reference_label(method), n_edges,
                                       len({r.layer for r in recv}))}
    shared = {"tokens": tokens.cpu(), "replacement": repl, "senders": snd, "into": into, "metric": metric,
              "chunk": chunk, "method": method, "per_position": per_position, "progress": progress}
    return Plan(shared, plan, info, costs)


def _receiver_groups(receivers: Sequence[Head], n_heads: int, n_into: int) -> List[List[int]]:
    """The receiver layers cut into up to ``RECEIVER_GROUPS`` contiguous groups of about equal cost (a receiver of
    layer R has R x n_heads senders); each group pays one clean pass of its rows."""
    layers = sorted({r.layer for r in receivers})
    n_groups = max(1, min(len(layers), RECEIVER_GROUPS))
    cost = {R: R * n_heads * n_into for R in layers}
    groups: List[List[int]] = [[]]
    acc, total = 0.0, sum(cost.values())
    for R in layers:
        if groups[-1] and acc + cost[R] / 2 > total * len(groups) / n_groups and len(groups) < n_groups:
            groups.append([])
        groups[-1].append(R)
        acc += cost[R]
    return groups


def _patch_shard_run(model, shared: Dict, scratch: Dict, *, rows: Tuple[int, int], receivers: List[Head]
                     ) -> ShardSums:
    """``patch_shard`` on this model for prompt rows ``rows`` and ``receivers``."""
    import time

    t0 = time.perf_counter()
    a, b = rows
    dev = model.W_E.device
    tokens = shared["tokens"][a:b].to(dev)
    repl = shared["replacement"]
    if repl is not None:
        repl = shard_replacement(repl, slice(a, b))
        repl = Replacement(repl.method, repl.per_position, repl.reference, {L: z.to(dev) for L, z in repl.z.items()})
    H, snd = model.cfg.n_heads, shared["senders"]
    bar = None
    if shared["progress"]:
        from .._foundation.progress import progress_bar

        total = sum(len([s for s in snd if s.layer < R]) if snd is not None else R * H
                    for R in {r.layer for r in receivers}) * len(shared["into"])
        bar = progress_bar(total=total, desc="path patching", unit="sender")
    try:
        out = patch_shard(model, tokens, repl, receivers, snd, shared["into"], shared["metric"], bar, shared["chunk"],
                          rows=(a, b), method=shared["method"], per_position=shared["per_position"])
    finally:
        if bar is not None:
            bar.close()
    out.seconds = time.perf_counter() - t0
    return out


def _combine_patch(plan: Plan, parts: List[ShardSums], where: Optional[Dict], *, method: str, metric=None,
                   **_) -> PathEffects:
    info, recv = plan.info, plan.info["receivers"]
    metrics = {x: resolve_metric(metric, x) for x in info["into"]}
    effects, clean = combine(parts, metrics, recv)
    settings = dict(info["settings"])
    if where:
        settings["backend"] = {**where, "shards": len(parts), "patch_s": where.get("run_s", round(sum(p.seconds for p in parts), 3)),
                               "plan": [{"rows": list(s["rows"]), "receivers": [str(r) for r in s["receivers"]],
                                         "cost": c, "seconds": round(p.seconds, 3)}
                                        for s, c, p in zip(plan.shards, plan.costs, parts)]}
    return PathEffects(model=info["name"], method=method, receivers=recv, into=info["into"],
                       metrics={x: m.name for x, m in metrics.items()}, effects=effects, clean=clean, kind="exact",
                       n_layers=info["n_layers"], n_heads=info["n_heads"], settings=settings,
                       clean_attention=combine_attention(parts, recv))


# Path patching, declared once: the shards every backend maps (``_foundation/shards``)
PATH_PATCH = Sharded("path_patch", _plan_patch, _patch_shard_run, _combine_patch, _check_patch)


def check_metric_tokens(metrics, tokens: Tensor) -> None:
    """Each metric's own check of the prompts (``Metric.check``: e.g. induction-loss needs [BOS]+R+R)."""
    for m in metrics:
        if m.check is not None:
            m.check(tokens)


def reference_label(method: str) -> str:
    """What the sender's replacement z was computed from, for the settings."""
    return {"zero": "none", "mean": "the ablated prompts", "resample": "the ablated prompts rolled by one row"}[method]


def patch_settings(model, tokens: Tensor, per_position: bool, reference: str, n_edges: int, n_layers_recv: int) -> dict:
    """The settings (prompts, reference) a ``PathEffects`` records; ``stamped`` adds the versions."""
    from .._foundation.result import stamped

    return stamped({"n_prompts": int(tokens.shape[0]), "n_positions": int(tokens.shape[1]), "per_position": per_position,
            "reference": reference, "n_edges": n_edges, "receiver_layers": n_layers_recv,
            "fold_ln": folded(model), "dtype": str(model.W_E.dtype)}, model)
