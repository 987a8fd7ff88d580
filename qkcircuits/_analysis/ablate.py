"""Ablate attention heads: zero, mean or resample a head's own output ``z`` before ``W_O``.

>>> round(model(tokens, return_type="loss").item(), 2)
2.06
>>> with ablate(model, "1.0"):                                      # zero ablation of the toy's induction head
...     round(model(tokens, return_type="loss").item(), 2)
3.47
>>> with ablate(model, "1.0", method="mean", reference=tokens):
...     logits = model(tokens)
>>> round(group_effect(model, "1.0", tokens, "induction-loss").effect, 2)    # induction loss up by 3.47 nats
3.47
>>> compare_to_random(model, "1.0", tokens, "induction-loss", n_draws=3, seed=0).fraction_at_least
0.0

Where: ``blocks.L.attn.hook_z`` [batch, pos, n_heads, d_head] holds each *query* head's
attention-weighted values, the head's whole contribution before the output projection. With
grouped-query attention several query heads share one K/V head, but each still has its own
z slice, so ablating one query head there leaves its KV group's other heads untouched.

What an ablated head's z becomes (always computed from a *clean* run, never from a partly
ablated one):

- ``zero``: 0.
- ``mean``: the mean of the head's z over the ``reference`` prompts: per position by default
  (``per_position=True``: [pos, d_head], so position 0 / BOS keeps its own mean), or over
  every position of every reference prompt (``per_position=False``: [d_head]).
- ``resample``: the head's z on other prompts: ``reference`` tokens of the same shape as the
  ablated batch (row i's z comes from reference row i). ``sweep``/``group_effect``/
  ``compare_to_random`` default to the batch itself rolled by one row (row i gets row i-1's z).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from jaxtyping import Float, Int
from torch import Tensor

from .._foundation.capture import as_tokens, capture, hook_name
from .._foundation import display as show
from .._foundation.result import Result, stamped
from .._foundation.errors import QKCircuitsError
from .._foundation.args import check_model, check_tokens
from .._foundation.heads import Head, HeadsLike, all_heads, model_heads
from .._foundation.io import json_floats, read_float, read_floats
from .._foundation.sequences import check_seed
from .metrics import Metric, as_metric
from .replay import Runner

METHODS = ("zero", "mean", "resample")
Tokens = Int[Tensor, "batch pos"]
# Default budget for the logits of one batched forward (several ablations stacked along the batch).
LOGITS_BUDGET_BYTES = 512 * 2**20


@dataclass
class Replacement:
    """What each ablated head's z is replaced with; ``z[layer]`` is [batch|1, pos|1, n_heads, d_head]."""

    method: str
    per_position: bool = True
    reference: str = "none"
    z: Dict[int, Tensor] = field(default_factory=dict)

    def value(self, layer: int, head: int, batch: int, pos: int) -> Tensor:
        """The replacement for one head's [batch, pos, d_head] slice (broadcastable)."""
        if self.method == "zero":
            return torch.zeros(())
        z = self.z[layer][:, :, head]
        if self.method == "mean":
            if z.shape[1] == 1:
                return z
            if pos > z.shape[1]:
                raise QKCircuitsError(f"per-position mean ablation has reference means for {z.shape[1]} positions but "
                                      f"the ablated run has {pos}; pass longer reference prompts or per_position=False")
            return z[:, :pos]
        if z.shape[0] != batch or z.shape[1] != pos:
            raise QKCircuitsError(f"resample ablation needs reference tokens shaped like the ablated batch "
                                  f"[{batch}, {pos}], got [{z.shape[0]}, {z.shape[1]}]")
        return z


def check_method(method: str) -> str:
    if method not in METHODS:
        raise QKCircuitsError(f"unknown ablation method {method!r}; use one of {', '.join(METHODS)}")
    return method


def make_replacement(model, method: str, layers: Sequence[int], *, reference=None, tokens=None,
                     per_position: bool = True) -> Replacement:
    """Compute the replacement z for ``layers`` (one clean forward over the reference, none for ``zero``).

    Without ``reference``: mean uses ``tokens``; resample uses ``tokens`` rolled by one row.
    Memory: the reference's z for each listed layer ([batch, pos, n_heads, d_head] each; for mean
    only the reduced [1, pos|1, n_heads, d_head] is kept).
    """
    check_method(method)
    if method == "zero":
        return Replacement("zero", per_position, "none")
    label = "given"
    if reference is None:
        if tokens is None:
            raise QKCircuitsError(f"{method} ablation needs reference= tokens (the prompts whose z replaces the "
                                  f"head's)")
        tokens = as_tokens(model, tokens)
        if method == "mean":
            reference, label = tokens, "the ablated prompts"
        else:
            if tokens.shape[0] < 2:
                raise QKCircuitsError("resample ablation without reference= needs at least 2 prompts (each takes z "
                                      "from another); pass reference= tokens")
            reference, label = tokens.roll(1, dims=0), "the ablated prompts rolled by one row"
    reference = as_tokens(model, reference)
    if method == "resample" and tokens is not None and reference.shape != torch.Size(tokens.shape):
        raise QKCircuitsError(f"resample ablation needs reference tokens shaped like the ablated batch "
                              f"{list(tokens.shape)}, got {list(reference.shape)}")
    acts = capture(model, reference, ["z"], layers=sorted(set(layers)))
    z: Dict[int, Tensor] = {}
    for layer in sorted(set(layers)):
        t = acts["z", layer]
        if method == "mean":
            t = t.mean(0, keepdim=True) if per_position else t.mean((0, 1), keepdim=True)
        z[layer] = t
    return Replacement(method, per_position, label, z)


def _ablation_hooks(groups: Sequence[Sequence[Head]], repl: Replacement, rows: Optional[int]) -> list:
    """Hooks on hook_z that ablate ``groups[i]`` in batch rows ``[i*rows, (i+1)*rows)``.

    ``rows=None`` means one group over the whole batch (the ``ablate`` context manager).
    """
    by_layer: Dict[int, List[tuple]] = {}
    for i, group in enumerate(groups):
        for h in group:
            by_layer.setdefault(h.layer, []).append((i, h.head))

    def make(layer: int, items: List[tuple]):
        def fn(t: Tensor, hook) -> Tensor:
            t = t.clone()                   # never write into a tensor the caller or autograd still holds
            b = t.shape[0] if rows is None else rows
            for i, head in items:
                sl = slice(i * b, (i + 1) * b)
                new = repl.value(layer, head, b, t.shape[1]).to(device=t.device, dtype=t.dtype)
                t[sl, :, head] = new.expand(b, t.shape[1], t.shape[-1])
            return t
        return fn

    return [(hook_name("z", layer), make(layer, items)) for layer, items in sorted(by_layer.items())]


@contextlib.contextmanager
def ablate(model, heads: HeadsLike, method: str = "zero", *, reference=None,
           per_position: bool = True) -> Iterator[Replacement]:
    """Ablate ``heads`` in every forward pass inside the block; hooks removed on exit, also on exceptions.

    ``method``: ``zero``, ``mean`` (needs ``reference`` tokens; ``per_position`` says whether the
    mean is taken per position or over all positions) or ``resample`` (needs ``reference`` tokens
    shaped like the batches you run). Yields the ``Replacement`` used.
    """
    model = check_model(model)
    targets = model_heads(model, heads)
    check_method(method)
    if method != "zero" and reference is None:
        raise QKCircuitsError(f"{method} ablation needs reference= tokens (the prompts whose z replaces the head's)")
    repl = make_replacement(model, method, [h.layer for h in targets], reference=reference,
                            per_position=per_position)
    with model.hooks(fwd_hooks=_ablation_hooks([targets], repl, rows=None)):
        yield repl


# ---------------------------------------------------------------------------------------------
# Batched runs: several ablations stacked along the batch, started from the cached residual stream
# (``replay.Runner``).


def copies_per_forward(model, tokens: Tokens, max_batch: Optional[int] = None, metric: Optional[Metric] = None) -> int:
    """How many copies of the batch one forward may stack: ``max_batch`` sequences, else a logits budget."""
    b, p = tokens.shape
    if metric is not None and metric.keep_last is not None:
        p = min(p, metric.keep_last(tokens))
    if max_batch is not None:
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise QKCircuitsError(f"max_batch must be a positive integer, got {max_batch!r}")
        return max(1, max_batch // b)
    per_copy = b * p * model.cfg.d_vocab * 4
    return max(1, int(LOGITS_BUDGET_BYTES // per_copy))


def run_groups(runner: Runner, groups: Sequence[Sequence[Head]], repl: Replacement, metric: Metric,
               copies: int, progress=None) -> List[float]:
    """Metric with each group ablated (one value per group), ``copies`` groups per forward pass."""
    b = runner.tokens.shape[0]
    keep = metric.keep_last(runner.tokens) if metric.keep_last is not None else None
    out: List[float] = []
    for i in range(0, len(groups), copies):
        chunk = groups[i:i + copies]
        start = min(h.layer for g in chunk for h in g)
        logits = runner.run(start, _ablation_hooks(chunk, repl, rows=b), len(chunk), keep=keep)
        for j in range(len(chunk)):
            out.append(float(metric(logits[j * b:(j + 1) * b], runner.tokens)))
        if progress is not None:
            progress.update(len(chunk))
    return out


def prepare_metric(model, tokens, metric, where: str = "ablation"):
    """(tokens on the model's device, the ``Metric``), checked before any forward: ablation analyses
    evaluate logits metrics only (``as_metric(..., accept=("logits",))``)."""
    tokens = as_tokens(model, tokens)
    metric = as_metric(metric, model, accept=("logits",), where=where)
    if metric.check is not None:
        metric.check(tokens)
    return tokens, metric


@dataclass(frozen=True, repr=False)      # the repr is _text (Result)
class GroupEffect(Result):
    """The metric with a set of heads ablated together: ``baseline`` and ``ablated`` are the metric's own
    values; ``effect = sign · (baseline − ablated)`` is positive when the heads matter (a loss: ``ablated −
    baseline``; a score, ``higher_is_better``: ``baseline − ablated``; see ``metrics``)."""

    SCHEMA = "qkcircuits.group_effect/1"
    WHAT = "a qkcircuits group-effect JSON"
    KEYS = ("heads", "baseline", "ablated", "method", "metric")

    heads: List[Head]
    baseline: float
    ablated: float
    method: str
    metric: str
    higher_is_better: bool = False
    settings: Dict[str, Any] = field(default_factory=dict)      # versions (``settings["versions"]``)

    @property
    def effect(self) -> float:
        return (self.baseline - self.ablated) if self.higher_is_better else (self.ablated - self.baseline)

    def top(self, k: int = 5) -> List[Tuple[Head, float]]:
        """The group's heads (at most ``k``), each with the group's effect (they were ablated together)."""
        return [(h, self.effect) for h in self.heads[:k]]

    def to_frame(self):
        import pandas as pd

        return pd.DataFrame([{"layer": h.layer, "head": h.head, "effect": self.effect, "baseline": self.baseline,
                              "ablated": self.ablated, "metric": self.metric, "method": self.method}
                             for h in self.heads])

    def to_dict(self) -> Dict[str, Any]:
        return {"heads": [str(h) for h in self.heads], "baseline": self.baseline, "ablated": self.ablated,
                "effect": self.effect, "method": self.method, "metric": self.metric,
                "higher_is_better": self.higher_is_better, "settings": self.settings}

    @classmethod
    def _from_dict(cls, d: Dict[str, Any]) -> "GroupEffect":
        return cls([Head.parse(h) for h in d["heads"]], read_float(d["baseline"]), read_float(d["ablated"]),
                   d["method"], d["metric"], bool(d.get("higher_is_better", False)), settings=d.get("settings", {}))

    def _text(self) -> str:
        heads = ", ".join(map(str, self.heads))
        return (f"GroupEffect(heads {heads}; {self.metric} {show.number(self.baseline)} -> {show.number(self.ablated)} "
                f"(effect {self.effect:+.4g}); {self.method} ablation)")

    def _html(self) -> str:
        rows = [("heads", ", ".join(map(str, self.heads))), ("metric", self.metric),
                ("clean", show.number(self.baseline)), ("ablated", show.number(self.ablated)),
                ("effect", f"{self.effect:+.4g}"), ("ablation", self.method)]
        return show.box("GroupEffect", show.table(rows))


def group_effect(model, heads: HeadsLike, tokens, metric="induction-loss", method: str = "zero", *,
                 reference=None, per_position: bool = True) -> GroupEffect:
    """Ablate ``heads`` together on ``tokens``; one clean and one ablated forward pass."""
    model, tokens = check_model(model), check_tokens(tokens)
    targets = model_heads(model, heads)
    tokens, metric = prepare_metric(model, tokens, metric, where="group_effect")
    repl = make_replacement(model, method, [h.layer for h in targets], reference=reference, tokens=tokens,
                            per_position=per_position)
    with torch.no_grad():
        base = float(metric(model(tokens), tokens))
        with model.hooks(fwd_hooks=_ablation_hooks([targets], repl, rows=None)):
            abl = float(metric(model(tokens), tokens))
    return GroupEffect(targets, base, abl, method, metric.name, metric.higher_is_better, stamped({}, model, name=True))


@dataclass(frozen=True, repr=False)      # the repr is _text (Result)
class RandomComparison(Result):
    """Effect of ablating ``heads`` together versus ablating ``k`` random other heads, ``n_draws`` times.

    Effects follow the metric's sign convention (positive = the heads matter; ``metrics``).
    ``random_effects[i]`` is the effect of ablating ``random_heads[i]`` (``k = len(heads)`` heads
    drawn uniformly without replacement from the heads *not* in ``heads``, with ``seed``).
    ``fraction_at_least`` is the share of draws whose effect is ≥ the group's.
    """

    SCHEMA = "qkcircuits.random_comparison/1"
    WHAT = "a qkcircuits random-comparison JSON"
    KEYS = ("heads", "baseline", "effect", "random_effects", "random_heads", "method", "metric", "seed")

    heads: List[Head]
    baseline: float
    effect: float
    random_effects: Float[Tensor, "draw"]
    random_heads: List[List[Head]]
    method: str
    metric: str
    seed: int
    settings: Dict[str, Any] = field(default_factory=dict)      # versions (``settings["versions"]``)

    @property
    def fraction_at_least(self) -> float:
        return float((self.random_effects >= self.effect).float().mean())

    @property
    def ratio_to_random_mean(self) -> float:
        m = float(self.random_effects.mean())
        return self.effect / m if m != 0 else float("inf")

    def top(self, k: int = 5) -> List[Tuple[List[Head], float]]:
        """The ``k`` random draws with the largest effect, largest first: ``(heads drawn, effect)``."""
        order = self.random_effects.float().argsort(descending=True)[:k].tolist()
        return [(self.random_heads[i], float(self.random_effects[i])) for i in order]

    def to_frame(self):
        """One row per random draw: its heads ("L.H,L.H"), effect, and whether it reached the group's effect."""
        import pandas as pd

        return pd.DataFrame([{"draw": i, "heads": ",".join(map(str, hs)), "effect": float(e),
                              "at_least_group": float(e) >= self.effect}
                             for i, (hs, e) in enumerate(zip(self.random_heads, self.random_effects.tolist()))])

    def to_dict(self) -> Dict[str, Any]:
        return {"heads": [str(h) for h in self.heads], "baseline": self.baseline, "effect": self.effect,
                "random_effects": json_floats(self.random_effects),
                "random_heads": [[str(h) for h in hs] for hs in self.random_heads], "method": self.method,
                "metric": self.metric, "seed": self.seed, "fraction_at_least": self.fraction_at_least,
                "settings": self.settings}

    @classmethod
    def _from_dict(cls, d: Dict[str, Any]) -> "RandomComparison":
        return cls([Head.parse(h) for h in d["heads"]], read_float(d["baseline"]), read_float(d["effect"]),
                   read_floats(d["random_effects"]),
                   [[Head.parse(h) for h in hs] for hs in d["random_heads"]], d["method"], d["metric"],
                   int(d["seed"]), settings=d.get("settings", {}))

    def _text(self) -> str:
        heads, re = ", ".join(map(str, self.heads)), self.random_effects.float()
        return (f"RandomComparison(heads {heads}: effect {self.effect:+.4g} on {self.metric}; {re.numel()} random "
                f"sets of {len(self.heads)}: mean {float(re.mean()):+.4g}, max {float(re.max()):+.4g}; "
                f"{self.fraction_at_least:.0%} of draws >= the group; {self.verdict()})")

    def verdict(self) -> str:
        """Whether the effect clears the random sets' spread: "above random: the margin over the random max, +2.1,
        is 4.9 SDs ..." or "WARNING: within the random sets' spread ..." (``stats.random_verdict``)."""
        from .._foundation.stats import random_verdict

        return random_verdict(self.effect, self.random_effects.tolist())

    def _html(self) -> str:
        re = self.random_effects.float()
        rows = [("heads", ", ".join(map(str, self.heads))),
                ("effect", f"{self.effect:+.4g} ({self.metric}, {self.method} ablation, clean "
                           f"{show.number(self.baseline)})"),
                (f"{re.numel()} random sets", f"mean {float(re.mean()):+.4g}, median {float(re.median()):+.4g}, "
                                              f"max {float(re.max()):+.4g}"),
                ("draws ≥ the group", f"{self.fraction_at_least:.0%}"), ("verdict", self.verdict()),
                ("seed", str(self.seed))]
        return show.box("RandomComparison", show.table(rows))


def compare_to_random(model, heads: HeadsLike, tokens, metric="induction-loss", *, n_draws: int = 20,
                      seed: int = 0, method: str = "zero", reference=None, per_position: bool = True,
                      max_batch: Optional[int] = None, progress: bool = False) -> RandomComparison:
    """Ablate ``heads`` together, then ``n_draws`` random sets of as many other heads (seeded).

    Batched: several draws share one forward pass, started at the lowest ablated layer from the
    cached clean residual stream. Memory: as ``sweep``.
    """
    targets = model_heads(model, heads)
    check_seed(seed)
    if isinstance(n_draws, bool) or not isinstance(n_draws, int) or n_draws < 1:
        raise QKCircuitsError(f"n_draws must be a positive integer, got {n_draws!r}")
    others = [h for h in all_heads(model.cfg.n_layers, model.cfg.n_heads) if h not in set(targets)]
    k = len(targets)
    if k > len(others):
        raise QKCircuitsError(f"cannot draw {k} random heads from the {len(others)} heads outside the group; "
                              f"name fewer heads")
    tokens, metric = prepare_metric(model, tokens, metric, where="compare_to_random")
    g = torch.Generator().manual_seed(seed)
    draws = [sorted(others[int(i)] for i in torch.randperm(len(others), generator=g)[:k]) for _ in range(n_draws)]
    layers = sorted({h.layer for grp in [targets] + draws for h in grp})
    repl = make_replacement(model, method, layers, reference=reference, tokens=tokens, per_position=per_position)
    runner = Runner(model, tokens, from_layer=layers[0])
    base = float(metric(runner.clean_logits, tokens))
    runner.clean_logits = None          # read once: not held through the draws
    bar = progress_bar(n_draws + 1, "random draws", progress)
    values = run_groups(runner, [targets] + draws, repl, metric, copies_per_forward(model, tokens, max_batch, metric), bar)
    if bar is not None:
        bar.close()
    return RandomComparison(targets, base, metric.effect(base, values[0]), metric.effect(base, torch.tensor(values[1:])),
                            draws, method, metric.name, seed, stamped({}, model, name=True))


def progress_bar(total: int, desc: str, enabled):
    """A progress bar (``_foundation/progress``) over ``total`` ablations, or None when not ``enabled``."""
    if not enabled:
        return None
    from .._foundation.progress import progress_bar as bar

    return bar(total=total, desc=desc, unit="ablation")
