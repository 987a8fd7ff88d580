"""The gradient estimates of edge scores: EAP, EAP-IG (inputs and activations) and clean-corrupted.

>>> points("eap-ig", 4, "left"), points("eap-ig", 4, "right"), points("eap-ig", 4, "midpoint")
([0.0, 0.25, 0.5, 0.75], [0.25, 0.5, 0.75, 1.0], [0.125, 0.375, 0.625, 0.875])
>>> points("eap", 5, None), points("clean-corrupted", 5, None)
([1.0], [1.0, 0.0])

Every method scores an edge s → r as Δ_s · ḡ_r, summed over rows, positions and d_model, with
Δ_s = out_s(clean) − out_s(corrupt) and ḡ_r the mean of the receiver's gradient ∂m/∂x_r over a set of runs:

- ``eap``: the clean run (Syed et al. 2023);
- ``eap-ig`` (inputs; Hanna et al. 2024): runs whose input embedding is e(α) = e_corrupt + α (e_clean − e_corrupt),
  at α = k/steps for k = 0 … steps−1 (``rule="left"``, the authors' code and MIB's: the default), k = 1 … steps
  (``"right"``: the last point is the clean run itself, so its forward gives Δ and m(clean) and one clean
  forward is saved; with one step it is EAP) or (k + ½)/steps (``"midpoint"``);
- ``eap-ig-activations`` (the authors' "EAP-IG-activations"): for each node (the embedding, each layer's
  attention output, each MLP) in turn, a clean run in which only that node's output is the constant
  α·out(clean) + (1 − α)·out(corrupt), at the same α (their code: the right rule); the gradient does not flow
  through the replaced node. (1 + L + L MLPs) × steps runs;
- ``clean-corrupted`` (theirs too): the clean run and the corrupt run, α ∈ {1, 0}.

Where the points do not include the clean run (left, midpoint, activations, clean-corrupted's order aside),
one forward without gradients gives Δ and m(clean) (``runs.plain_run``). Gradients of all runs are summed in
one [R, b, p, d] buffer and meet Δ once at the end (Σ_j Δ·∇_j = Δ·Σ_j ∇_j). On a position-aware graph
(``positions.py``) that last product is taken per position group over the group's positions only, so the groups'
scores add up to the plain ones; the ungrouped graph's k/v gradients arrive per query head (``ungrouped.py``).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .._foundation.errors import QKCircuitsError
from .graph import Graph
from .positions import flat_groups, gather_positions, group_index
from .record import reuse
from .runs import grad_run, plain_run
from .task import Task

GRADIENT_METHODS = ("eap", "eap-ig", "eap-ig-activations", "clean-corrupted")
RULES = ("left", "right", "midpoint")
# each method's rule when none is given: the authors' own (EAP-IG inputs: left; on activations: right)
DEFAULT_RULE = {"eap-ig": "left", "eap-ig-activations": "right"}
# Receiver gradients (up to this many bytes) meet the senders' Δ in one matmul instead of one skinny,
# memory-bound product per receiver group.
GRAD_BLOCK_BYTES = 128 * 2**20


def resolve_rule(method: str, rule: Optional[str]) -> Optional[str]:
    """The rule ``method`` runs with (None for the methods without one); one-line errors for a bad value."""
    if method not in DEFAULT_RULE:
        if rule is not None:
            raise QKCircuitsError(f"rule={rule!r} applies to eap-ig and eap-ig-activations only, not {method!r}")
        return None
    rule = DEFAULT_RULE[method] if rule is None else rule
    if rule not in RULES:
        raise QKCircuitsError(f"unknown rule {rule!r}; use one of {', '.join(RULES)} (left: alpha = k/steps for "
                              f"k = 0..steps-1, the authors' and MIB's)")
    return rule


def points(method: str, steps: int, rule: Optional[str]) -> List[float]:
    """The α of each gradient run (per node for ``eap-ig-activations``)."""
    if method == "eap":
        return [1.0]
    if method == "clean-corrupted":
        return [1.0, 0.0]
    rule = resolve_rule(method, rule)
    shift = {"left": 0.0, "right": 1.0, "midpoint": 0.5}[rule]
    return [(k + shift) / steps for k in range(steps)]


def _nodes(g: Graph) -> List[Tuple[str, int]]:
    """EAP-IG-activations' nodes in forward order: the embedding, then per layer its attention and its MLP."""
    out = [("emb", 0)]
    for L in range(g.n_layers):
        out.append(("attn", L))
        if g.has_mlp:
            out.append(("mlp", L))
    return out


def gradient_scores(model, g: Graph, shard: Task, corr, acc: Tensor, method: str, steps: int, rule: Optional[str],
                    pool: Optional[Dict[str, Tensor]] = None) -> float:
    """One shard's Δ·ḡ (module docstring), added to ``acc`` [groups, S, R] (float64, summed over rows: the caller
    divides by n; one group unless ``g`` is position-aware, whose group γ sums over γ's positions only); returns the shard's m(clean) sum. ``corr``: the corrupt ``record`` (with z only where the heads' Δ can
    come from z; with the attention outputs for ``eap-ig-activations``)."""
    alphas = points(method, steps, rule)
    out = reuse(pool, "clean", tuple(corr.out.shape), corr.out.dtype, corr.out.device)   # every slot written
    b, p, d = out.shape[1:]
    # summed in float32 at least: a bf16 sum of the steps' gradients would round once per step
    gsum = reuse(pool, "gsum", (g.n_receivers, b, p, d), torch.promote_types(out.dtype, torch.float32), out.device)
    # uninitialised: the first run's gradients are copied in, not added (sparing a zero fill of the largest
    # buffer); a receiver group no gradient reached by the end of that run is zeroed then
    written = torch.zeros(g.n_receivers, dtype=torch.bool)
    first = [True]

    def dest(sl: slice) -> Optional[Tensor]:
        return None if bool(written[sl].all()) else gsum[sl]        # the first gradient is written in place

    def on_grad(sl: slice, grad: Tensor) -> None:
        if bool(written[sl].all()):
            gsum[sl] += grad.detach()
        else:
            if grad.data_ptr() != gsum[sl].data_ptr():
                gsum[sl].copy_(grad.detach())
            written[sl] = True

    def run(**kw) -> float:
        v = grad_run(model, g, shard, shard.clean, on_grad, dest=dest if first[0] else None, **kw)
        if first[0]:
            if not bool(written.all()):
                gsum[~written.to(gsum.device)] = 0
                written[:] = True
            first[0] = False
        return v

    # with a record of z only (record(heads=False)) the heads' slots of ``out`` come out as Δ already
    z_minus = None if corr.heads else corr.hooks
    activations = method == "eap-ig-activations"
    keep: Optional[Dict] = {} if activations else None
    n_runs = 0
    if not activations and 1.0 in alphas:        # the α = 1 run IS the clean run: Δ and m(clean) from it
        clean = run(out=out, z_minus=z_minus)
        alphas = [a for a in alphas if a != 1.0]
        n_runs += 1
    else:
        clean = plain_run(model, g, shard, shard.clean, out, z_minus=z_minus, keep=keep)
    e_clean, e_corr = out[0].clone(), corr.out[0]

    def mix(clean_value: Tensor, corrupt_value: Tensor, a: float) -> Tensor:
        return corrupt_value + a * (clean_value - corrupt_value) if a != 1.0 else clean_value

    if not activations:
        for a in alphas:
            run(emb_override=mix(e_clean, e_corr, a))
            n_runs += 1
    else:
        for kind, L in _nodes(g):
            for a in alphas:
                if kind == "emb":
                    run(emb_override=mix(e_clean, e_corr, a))
                else:
                    if kind == "attn":
                        name, value = f"blocks.{L}.attn.hook_out", mix(keep[("attn_out", L)],
                                                                       corr.hooks[("attn_out", L)], a)
                    else:
                        s = g.mlp_sender(L)
                        name, value = f"blocks.{L}.hook_mlp_out", mix(out[s], corr.out[s], a)
                    run(extra_hooks=[(name, _constant(value))], cut_layers=[L] if kind == "attn" else [])
                n_runs += 1
        del keep
    if corr.heads:
        D = out.sub_(corr.out).view(g.n_senders, -1)       # Δ = clean − corrupt, in place
    else:                                                    # the heads' slots hold Δ: the embedding's and MLPs' too
        for lo, hi in non_head_runs(g):
            out[lo:hi].sub_(corr.out[lo:hi])
        D = out.view(g.n_senders, -1)
    G = gsum.view(g.n_receivers, -1)
    if not g.positions:
        _meet(g, D, G, acc[0], n_runs)
        return clean
    # per position group: the Δ·∇ sums over that group's positions only (they add up to the plain sums)
    for gi, idx in enumerate(flat_groups(group_index(shard, g.positions), g.n_groups)):
        if len(idx):
            _meet(g, gather_positions(D.view(g.n_senders, b, p, d), idx),
                  gather_positions(G.view(g.n_receivers, b, p, d), idx), acc[gi], n_runs)
    return clean


def _constant(value: Tensor):
    """A hook returning ``value`` (detached: no gradient flows through the node it replaces) in the hook's dtype."""
    value = value.detach()

    def fn(t: Tensor, hook) -> Tensor:
        return value.to(t.dtype)
    return fn


def _meet(g: Graph, D: Tensor, G: Tensor, acc: Tensor, n_runs: int) -> None:
    """acc[s, r] += Δ_s · G_r / n_runs over the graph's edges. Consecutive receivers (up to GRAD_BLOCK_BYTES of
    gradients) meet the senders below ALL of them in ONE matmul (Δ is read once per block instead of once per
    receiver group); the senders below only some of them (the block's own layers) meet them in quarter-blocks,
    so that of the pairs computed and dropped as non-edges (27 % more products than edges with whole blocks on
    SmolLM2) only a quarter remain."""
    valid = g.valid.to(D.device)
    per_block = max(1, GRAD_BLOCK_BYTES // max(1, G.shape[1] * G.element_size()))
    per_part = max(1, per_block // 4)

    def meet(lo: int, hi: int, r0: int, r1: int) -> None:
        if hi > lo:
            T = D[lo:hi].to(G.dtype) @ G[r0:r1].T                                               # [hi − lo, r1 − r0]
            acc[lo:hi, r0:r1] += torch.where(valid[lo:hi, r0:r1], T, 0).double().cpu() / n_runs

    r0 = 0
    while r0 < g.n_receivers:
        r1 = min(g.n_receivers, r0 + per_block)
        shared = g.n_below(r0)
        meet(0, shared, r0, r1)
        for a in range(r0, r1, per_part):
            b = min(r1, a + per_part)
            meet(shared, g.n_below(b - 1), a, b)
        r0 = r1


def non_head_runs(g: Graph) -> List[Tuple[int, int]]:
    """The sender slots that are not heads, as [lo, hi) runs: the embedding and each layer's MLP."""
    heads = {g.head_sender(L, h) for L in range(g.n_layers) for h in range(g.n_heads)}
    runs: List[Tuple[int, int]] = []
    for s in range(g.n_senders):
        if s in heads:
            continue
        if runs and runs[-1][1] == s:
            runs[-1] = (runs[-1][0], s + 1)
        else:
            runs.append((s, s + 1))
    return runs


def n_runs(g: Graph, method: str, steps: int, rule: Optional[str]) -> int:
    """The gradient runs (forward + backward) per shard: the cost unit of the progress bar."""
    k = len(points(method, steps, rule))
    return k * len(_nodes(g)) if method == "eap-ig-activations" else k


__all__: Sequence[str] = ["GRADIENT_METHODS", "RULES", "gradient_scores", "points", "resolve_rule", "non_head_runs"]
