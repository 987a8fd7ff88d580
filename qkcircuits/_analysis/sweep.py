"""Ablate every head alone and measure the metric: an [n_layers, n_heads] grid of effects.

>>> res = sweep(model, tokens, "induction-loss", method="zero", progress=False)
>>> res.effects.shape, round(res.baseline, 2)       # the toy's induction loss is 0 on the repeated half
(torch.Size([2, 2]), 0.0)
>>> [(str(h), round(e, 2)) for h, e in res.top(2)]     # ablating either head of the circuit costs ~3.4 nats
[('1.0', 3.47), ('0.0', 3.43)]

``sweep`` equals a plain loop of one ``ablate``-d forward pass per head (to float rounding:
the batched matrix products sum in a different order), and is faster because (1) it runs the
clean pass once, caching the residual stream entering each layer, and re-runs only the blocks
from the ablated head's layer on; (2) it stacks the ablations of one layer along the batch, so
each weight matrix is read once per layer instead of once per head.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from jaxtyping import Float
from torch import Tensor

from .._foundation.capture import check_layers
from .._foundation.backends import BackendLike, as_backend
from .._foundation import display as show
from .._foundation.result import Result, stamped
from .._foundation.errors import QKCircuitsError
from .._foundation.args import check_model, check_tokens
from .._foundation.heads import Head
from .._foundation.io import json_floats, read_float, read_floats
from .._foundation.model import model_name
from .._foundation.shards import Plan, Sharded
from .metrics import as_metric, default_tokens, portable
from .ablate import (ablate, check_method, copies_per_forward, make_replacement, prepare_metric, progress_bar,
                     run_groups)
from .replay import Runner


@dataclass(frozen=True, repr=False)      # the repr is _text (Result)
class HeadEffects(Result):
    """Per-head effects with the settings that produced them: ``sign · (metric(clean) − metric(ablated))``,
    positive = the head matters (a loss: ablated − clean; ``higher_is_better``: clean − ablated; see
    ``metrics``). ``baseline`` is the metric's own clean value.

    ``kind`` is ``"sweep"`` (measured: one ablation per head) or ``"attribution"`` (first-order
    estimate). Layers not swept hold NaN.
    """

    SCHEMA = "qkcircuits.head_effects/1"
    WHAT = "an ablate --json output (qkcircuits head-effects JSON)"
    KEYS = ("effects", "baseline", "model", "method", "metric")

    effects: Float[Tensor, "layer head"]
    baseline: float
    model: str
    method: str
    metric: str
    kind: str = "sweep"
    n_prompts: int = 0
    n_positions: int = 0
    per_position: bool = True
    reference: str = "none"
    layers: List[int] = field(default_factory=list)
    timing: Dict[str, float] = field(default_factory=dict)     # startup_s, load_s, sweep_s (seconds)
    backend: Dict[str, Any] = field(default_factory=dict)      # {"name": "ray", "workers", "shards", ...}
    higher_is_better: bool = False                             # the metric's sign convention (effects: + = matters)
    settings: Dict[str, Any] = field(default_factory=dict)  # versions (``settings["versions"]``)

    def top(self, k: int = 5, *, by: str = "value") -> List[Tuple[Head, float]]:
        """The ``k`` heads with the largest effect (``by="abs"``: largest magnitude)."""
        if by not in ("value", "abs"):
            raise QKCircuitsError(f"by must be 'value' or 'abs', got {by!r}")
        key = self.effects.abs() if by == "abs" else self.effects
        # NaN (layers not swept) last: replaced after abs, else -inf would become +inf and rank first.
        key = torch.where(key.isnan(), torch.full_like(key, -float("inf")), key)
        n_heads = key.shape[1]
        order = key.flatten().argsort(descending=True)[:k]
        return [(Head(int(i) // n_heads, int(i) % n_heads), float(self.effects.flatten()[i])) for i in order]

    def to_frame(self):
        """One row per head: layer, head, effect (NaN for layers not swept)."""
        import pandas as pd

        L, H = self.effects.shape
        return pd.DataFrame([{"layer": l, "head": h, "effect": float(self.effects[l, h])}
                             for l in range(L) for h in range(H)])

    def to_dict(self) -> Dict[str, Any]:
        """Every field, exactly; NaN (layers not swept) as ``null``."""
        d = asdict(self)
        d["effects"] = json_floats(self.effects)
        return d

    @classmethod
    def _from_dict(cls, d: Dict[str, Any]) -> "HeadEffects":
        """Keys that are not fields (e.g. the CLI's ``n_seqs``, ``seed``) are ignored."""
        d = dict(d, settings=d.get("settings", {}))
        d["effects"] = read_floats(d["effects"])
        d["baseline"] = read_float(d["baseline"])
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def _text(self) -> str:
        L, H = self.effects.shape
        top = show.top_heads(self.effects, by_abs=True)
        return (f"HeadEffects({self.model}: {L} layers x {H} heads; {self.kind}, {self.method} ablation, {self.metric} "
                f"baseline {show.number(self.baseline)}; largest |effect|: {show.heads_text(top[:3])})")

    def _html(self) -> str:
        top = show.top_heads(self.effects, by_abs=True)
        rows = [("metric", f"{self.metric} (clean {show.number(self.baseline)})"),
                ("ablation", f"{self.method} ({self.kind})"),
                ("prompts", f"{self.n_prompts} × {self.n_positions} tokens"),
                (f"top {show.TOP} by |effect|", show.heads_text(top))]
        return show.box(f"HeadEffects: {self.model}", show.table(rows),
                        show.grid(self.effects, "metric(ablated) − metric(clean)", True))


def sweep(model, tokens, metric="induction-loss", method: str = "zero", *, reference=None,
          per_position: bool = True, layers: Optional[Iterable[int]] = None, max_batch: Optional[int] = None,
          progress: bool = True, backend: BackendLike = None, ray_address: Optional[str] = None,
          workers: Optional[int] = None) -> HeadEffects:
    """Effect of ablating each head of ``layers`` (default all) alone on ``metric`` over ``tokens``.

    ``model``: a loaded model or a spec (``"toy-induction"``, ``"smollm2-135m"``, a path), on any backend.
    ``metric``: a logits metric (a name, a ``qk.Metric``, a callable; ``metrics``); effects are positive when
    the head matters. ``method``/``reference``/``per_position`` as in ``ablate`` (without ``reference``, mean
    uses ``tokens`` and resample uses ``tokens`` rolled by one row). ``max_batch`` caps the sequences per
    forward pass (default: as many copies of the batch as fit 512 MiB of logits).

    Memory: the residual stream entering each layer from the first swept one on (at most
    n_layers × batch × pos × d_model), the replacement z (mean/resample), and one batched
    forward's activations and logits; while the runner starts, the clean logits and its self-check's
    (released once the baseline is read; the loss metrics slice their log-softmax by positions). Measured on
    SmolLM2 at 2 × 1,281 tokens: +1.73 GB over the loaded model (docs/benchmarks.md).

    ``backend``: ``qk.Local()`` (default) or ``qk.Ray(address=..., workers=...)`` (strings ``"local"``,
    ``"ray"``, ``"local:N"`` or a Ray address also work; ``ray_address``/``workers`` are the older spelling
    of ``qk.Ray``'s). Every backend runs the same shards of (prompts, layers) (``SWEEP``, ``plan_sweep``): on
    Ray, workers each load the model once (a loaded model travels as its spec), and the result is the local one
    bit for bit (docs/scaling.md); ``timing`` gets ``startup_s``, ``load_s``, ``sweep_s``. ``tokens`` may be a
    dict of ``default_tokens`` arguments (``n_seqs``, ``seg_len`` or ``seq_len``, ``seed``): the metric's default
    prompts, drawn where the model is.

    >>> res = qk.sweep(model, tokens, "induction-loss", progress=False)
    >>> res.top(1)[0][0], res.effects.shape
    (Head(layer=1, head=0), torch.Size([2, 2]))
    """
    request = dict(tokens=tokens, metric=metric, method=method, reference=reference, per_position=per_position,
                   layers=layers, max_batch=max_batch, progress=progress)
    return as_backend(backend, address=ray_address, workers=workers).map(SWEEP, model, **request)


# ------------------------------------------------------------------------------------------ the sweep's shards
# Shards of (prompt rows, contiguous layers), the same plan on every backend; combined exactly (row-weighted means).

SHARD_PROMPTS = 64      # prompt rows per shard (the stacked batches stay large)
LAYER_GROUPS = 4        # layer groups per row block: each pays one clean pass, and Ray workers take them in parallel


def _check_sweep(*, method: str, metric=None, **rest: Any) -> Dict[str, Any]:
    check_method(method)
    return dict(method=method, metric=metric, **rest)


def _plan_sweep(model, *, tokens, metric, method: str, reference, per_position: bool, layers, max_batch,
                progress: bool) -> Plan:
    """Where the model is: the prompts (a dict: the metric's default ones), the metric checked on them, the
    mean/resample replacement over the WHOLE prompt set, and the shards (``plan_sweep``)."""
    model = check_model(model)
    if not isinstance(tokens, dict):
        tokens = check_tokens(tokens)
    if isinstance(tokens, dict):        # {"n_seqs", "seg_len" or "seq_len", "seed"}: the metric's default prompts
        tokens = default_tokens(model, as_metric(metric, model), **tokens)
    tokens, metric_obj = prepare_metric(model, tokens, metric, where="sweep")
    layers = check_layers(model, layers)
    repl = make_replacement(model, method, layers, reference=reference, tokens=tokens, per_position=per_position)
    repl.z = {k: v.cpu() for k, v in repl.z.items()}
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    keep = metric_obj.keep_last(tokens) if metric_obj.keep_last is not None else None
    block = sum(p.numel() for p in model.blocks[0].parameters())
    unembed = keep_cost(keep or tokens.shape[1], tokens.shape[1], model.cfg.d_model, model.cfg.d_vocab, block)
    shards, costs = plan_sweep(int(tokens.shape[0]), layers, n_layers, n_heads, unembed=unembed)
    info = {"name": model_name(model), "n_layers": n_layers, "n_heads": n_heads, "layers": list(layers),
            "n": int(tokens.shape[0]), "pos": int(tokens.shape[1]), "metric": metric_obj.name,
            "sign": metric_obj.sign, "higher_is_better": metric_obj.higher_is_better, "reference": repl.reference,
            "settings": stamped({}, model)}
    shared = {"tokens": tokens.cpu(), "replacement": repl, "metric": portable(metric_obj), "max_batch": max_batch,
              "progress": progress}
    return Plan(shared, shards, info, costs)


def _sweep_shard(model, shared: Dict[str, Any], scratch: Dict[str, Any], *, rows: Tuple[int, int],
                 layers: List[int]) -> Dict[str, Any]:
    """The metric on prompt rows ``rows`` clean and with each head of ``layers`` ablated alone."""
    from copy import copy

    t0 = time.perf_counter()
    with torch.no_grad():
        # checked on the model's tokens by the plan; a built-in here by name (it pickles), resolved as it was there
        tokens = shared["tokens"][rows[0]:rows[1]].to(model.W_E.device)
        metric = as_metric(shared["metric"], accept=("logits",), where="sweep")
        repl = copy(shared["replacement"])
        dev = model.W_E.device
        if repl.method == "resample":                 # row i of the prompts gets row i of the reference
            repl.z = {L: z[rows[0]:rows[1]].to(dev) for L, z in repl.z.items()}
        else:
            repl.z = {L: z.to(dev) for L, z in repl.z.items()}
        runner = Runner(model, tokens, from_layer=min(layers))
        baseline = float(metric(runner.clean_logits, tokens))
        runner.clean_logits = None      # read once: not held through the shard ([b, pos, vocab])
        copies = copies_per_forward(model, tokens, shared["max_batch"], metric)
        bar = progress_bar(len(layers) * model.cfg.n_heads, "sweep", shared["progress"])
        values = {}
        try:
            for L in layers:
                values[L] = run_groups(runner, [[Head(L, h)] for h in range(model.cfg.n_heads)], repl, metric,
                                       copies, bar)
        finally:
            if bar is not None:
                bar.close()
    return {"rows": rows, "weight": rows[1] - rows[0], "baseline": baseline, "values": values,
            "seconds": time.perf_counter() - t0}


def _combine_sweep(plan: Plan, parts: List[Dict[str, Any]], where: Optional[Dict[str, Any]], *, method: str,
                   per_position: bool, **_: Any) -> HeadEffects:
    info = plan.info
    effects, baseline = combine_sweep(parts, info["n_layers"], info["n_heads"])
    effects = -info["sign"] * effects           # ablated − clean → the metric's sign (+ = the head matters)
    timing = {"sweep_s": round(sum(p["seconds"] for p in parts), 3)}
    backend = {"name": "local"}
    if where:                           # the shards' wall time where they ran in parallel
        timing.update({k: where[k] for k in ("startup_s", "load_s") if k in where})
        timing["sweep_s"] = where.get("run_s", timing["sweep_s"])
        # per shard: prompt rows, layers, planned cost (block passes x prompts), seconds in the worker
        backend = {**where, "shards": len(parts),
                   "plan": [{"rows": list(s["rows"]), "layers": s["layers"], "cost": c, "seconds": round(p["seconds"], 3)}
                            for s, c, p in zip(plan.shards, plan.costs, parts)]}
    return HeadEffects(effects, baseline, info["name"], method, info["metric"], "sweep", info["n"], info["pos"],
                       per_position, info["reference"], info["layers"], timing=timing, backend=backend,
                       higher_is_better=info["higher_is_better"], settings=info["settings"])


def layer_cost(layer: int, n_layers: int, n_heads: int, unembed: float = 0.0) -> float:
    """Block passes per prompt to sweep one layer: each of its heads re-runs blocks ``layer..n_layers-1``
    and the unembedding, which costs ``unembed`` block passes (``keep_cost``)."""
    return n_heads * (n_layers - layer + unembed)


def keep_cost(kept: int, n_positions: int, d_model: int, d_vocab: int, block_params: int) -> float:
    """The unembedding of one ablated forward in block-pass units: (kept positions x d_model x d_vocab) /
    (positions x parameters of one block). SmolLM2 at 41 tokens, 20 kept: 3.9 blocks; a 7B Llama at 81
    tokens, 40 kept: 0.3 (the small model's vocabulary is large for its width)."""
    return kept * d_model * d_vocab / (n_positions * max(block_params, 1))


def plan_sweep(n_prompts: int, layers: Sequence[int], n_layers: int, n_heads: int, *,
               shard_prompts: Optional[int] = None, groups: int = LAYER_GROUPS,
               unembed: float = 0.0) -> Tuple[List[Dict[str, Any]], List[float]]:
    """Cut the sweep into shards of (prompt rows, contiguous layers): prompt chunks of at most ``shard_prompts``
    rows (default ``SHARD_PROMPTS``), times up to ``groups`` contiguous layer groups of about equal cost
    (``layer_cost``: a head of layer L re-runs the n_layers − L blocks above it, so equal layer ranges are NOT
    equal work). Each shard also pays one clean pass (n_layers blocks per prompt), counted in its cost. The plan
    depends on the request alone, not on the workers: every backend runs the same shards. Returns (shards,
    costs in block passes)."""
    layers = sorted(layers)
    chunk = shard_prompts or min(n_prompts, SHARD_PROMPTS)
    bounds = [(s, min(s + chunk, n_prompts)) for s in range(0, n_prompts, chunk)]
    n_groups = max(1, min(len(layers), groups))
    costs = [layer_cost(L, n_layers, n_heads, unembed) for L in layers]
    total = sum(costs)
    cut: List[List[int]] = [[]]
    acc = 0.0
    for L, c in zip(layers, costs):
        # start a new group once this one holds its share of the total cost
        if cut[-1] and acc + c / 2 > total * len(cut) / n_groups and len(cut) < n_groups:
            cut.append([])
        cut[-1].append(L)
        acc += c
    shards, shard_costs = [], []
    for r in bounds:
        for g in cut:
            shards.append({"rows": r, "layers": g})
            shard_costs.append((r[1] - r[0]) * (sum(layer_cost(L, n_layers, n_heads, unembed) for L in g) + n_layers))
    return shards, shard_costs


def combine_sweep(parts: Sequence[Dict[str, Any]], n_layers: int, n_heads: int) -> Tuple[Tensor, float]:
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


# The sweep, declared once: the shards every backend maps (``_foundation/shards``)
SWEEP = Sharded("sweep", _plan_sweep, _sweep_shard, _combine_sweep, _check_sweep)


def naive_sweep(model, tokens, metric="induction-loss", method: str = "zero", *, reference=None,
                layers: Optional[Iterable[int]] = None) -> Float[Tensor, "layer head"]:
    """The reference ``sweep`` must equal: one full ablated forward pass per head, no reuse, no batching.

    Slow on purpose (n_layers × n_heads forwards); tests and benchmarks compare against it. Heads of
    layers not in ``layers`` are NaN, as in ``sweep``.
    """
    tokens, metric = prepare_metric(model, tokens, metric, where="naive_sweep")
    layers = check_layers(model, layers)
    out = torch.full((model.cfg.n_layers, model.cfg.n_heads), float("nan"))
    with torch.no_grad():
        base = float(metric(model(tokens), tokens))
        for L in layers:
            for h in range(model.cfg.n_heads):
                with ablate(model, [(L, h)], method, reference=reference):
                    out[L, h] = metric.effect(base, float(metric(model(tokens), tokens)))
    return out
