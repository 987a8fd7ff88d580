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
from typing import Any, Dict, Iterable, List, Optional, Tuple

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
from .metrics import as_metric, default_tokens
from .ablate import ablate, copies_per_forward, make_replacement, prepare_metric, progress_bar, run_groups
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
    of ``qk.Ray``'s). On Ray, workers each load the model once (a loaded model travels as its spec) and
    sweep shards of (prompts, layers); ``tokens`` must be ids. On either backend ``tokens`` may be a dict of
    ``default_tokens`` arguments (``n_seqs``, ``seg_len`` or ``seq_len``, ``seed``): the metric's default prompts. Equal to the local sweep to float rounding
    (docs/scaling.md); ``timing`` gets ``startup_s``, ``load_s``, ``sweep_s``.

    >>> res = qk.sweep(model, tokens, "induction-loss", progress=False)
    >>> res.top(1)[0][0], res.effects.shape
    (Head(layer=1, head=0), torch.Size([2, 2]))
    """
    return as_backend(backend, address=ray_address, workers=workers).run(
        "sweep", model, local=local_sweep, tokens=tokens, metric=metric, method=method, reference=reference,
        per_position=per_position, layers=layers, max_batch=max_batch, progress=progress)


def local_sweep(model, tokens, metric="induction-loss", method: str = "zero", *, reference=None,
                per_position: bool = True, layers: Optional[Iterable[int]] = None, max_batch: Optional[int] = None,
                progress: bool = True) -> HeadEffects:
    """``sweep`` in this process on a loaded model (what ``qk.Local`` runs)."""
    t0 = time.perf_counter()
    model = check_model(model)
    if not isinstance(tokens, dict):
        tokens = check_tokens(tokens)
    if isinstance(tokens, dict):        # {"n_seqs", "seg_len" or "seq_len", "seed"}: the metric's default prompts (as on Ray)
        tokens = default_tokens(model, as_metric(metric, model), **tokens)
    tokens, metric = prepare_metric(model, tokens, metric, where="sweep")
    layers = check_layers(model, layers)
    n_heads = model.cfg.n_heads
    repl = make_replacement(model, method, layers, reference=reference, tokens=tokens, per_position=per_position)
    runner = Runner(model, tokens, from_layer=min(layers))
    baseline = float(metric(runner.clean_logits, tokens))
    runner.clean_logits = None          # read once: not held through the sweep ([b, pos, vocab]: 0.5 GB at 2 × 1,281)
    copies = copies_per_forward(model, tokens, max_batch, metric)
    effects = torch.full((model.cfg.n_layers, n_heads), float("nan"))
    bar = progress_bar(len(layers) * n_heads, "sweep", progress)
    try:
        for layer in layers:
            groups = [[Head(layer, h)] for h in range(n_heads)]
            values = run_groups(runner, groups, repl, metric, copies, bar)
            effects[layer] = metric.effect(baseline, torch.tensor(values))
    finally:
        if bar is not None:
            bar.close()
    return HeadEffects(effects, baseline, model_name(model), method, metric.name, "sweep", int(tokens.shape[0]),
                       int(tokens.shape[1]), per_position, repl.reference, list(layers),
                       timing={"sweep_s": round(time.perf_counter() - t0, 3)}, backend={"name": "local"},
                       higher_is_better=metric.higher_is_better, settings=stamped({}, model))


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
