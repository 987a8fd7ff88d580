"""Attribution patching: a first-order estimate of every head's ablation effect from one backward pass.

>>> est = attribution(model, tokens, "induction-loss", method="zero")
>>> est.effects.shape                                   # [n_layers, n_heads]
torch.Size([2, 2])
>>> float(est.effects.abs().max()) < 1e-6               # the toy's one-hot attention has no gradient (sweep: 3.47)
True

For head (L, h) with clean output ``z`` and ablated output ``z'`` (zero, mean or resample, as in
``ablate``), the effect of the ablation is estimated by the linear term of its Taylor expansion:

    metric(z') - metric(z)  ≈  Σ_{batch, pos, d_head}  ∂metric/∂z · (z' - z)

reported with the metric's sign (``effect = −sign · that``: positive = the head matters, as ``sweep``).

One forward pass with gradients, one backward pass (plus one clean forward over the reference
for mean/resample). The estimate is exact for a metric linear in z and degrades as the
ablation moves z far from where the gradient was taken (zeroing a large head, or a head whose
removal changes later attention patterns): check it against ``sweep`` before trusting a ranking.
"""

from __future__ import annotations

from typing import Dict, Iterable, Optional

import torch
from torch import Tensor

from .._foundation.capture import check_layers, hook_name
from .._foundation.model import model_name
from .._foundation.result import stamped
from .ablate import make_replacement, prepare_metric
from .sweep import HeadEffects


def attribution(model, tokens, metric="induction-loss", method: str = "zero", *, reference=None,
                per_position: bool = True, layers: Optional[Iterable[int]] = None) -> HeadEffects:
    """Estimated effect of ablating each head alone (``kind="attribution"``); see the module docstring.

    Memory: one forward pass's autograd graph over ``tokens`` plus every layer's z and its gradient
    ([batch, pos, n_heads, d_head] each). Parameters get no ``.grad`` (``torch.autograd.grad``).
    """
    tokens, metric = prepare_metric(model, tokens, metric, where="attribution")
    layers = check_layers(model, layers)
    repl = make_replacement(model, method, layers, reference=reference, tokens=tokens, per_position=per_position)
    zs: Dict[int, Tensor] = {}

    def keep(layer: int):
        def fn(t: Tensor, hook) -> Tensor:
            if not t.requires_grad:
                # Parameters frozen: make the first z a leaf; every later z depends on it and stays in the graph.
                t = t.detach().requires_grad_(True)
            zs[layer] = t
            return t
        return fn

    with torch.enable_grad():
        logits = model.run_with_hooks(tokens, fwd_hooks=[(hook_name("z", L), keep(L)) for L in layers])
        value = metric(logits, tokens)
        grads = torch.autograd.grad(value, [zs[L] for L in layers], allow_unused=True)
    b, p = tokens.shape
    effects = torch.full((model.cfg.n_layers, model.cfg.n_heads), float("nan"))
    with torch.no_grad():
        for L, g in zip(layers, grads):
            z = zs[L].detach()
            if g is None:                  # z does not reach the metric (cannot happen in a causal LM's last layer)
                effects[L] = 0.0
                continue
            target = torch.stack([repl.value(L, h, b, p).to(z).expand(b, p, z.shape[-1])
                                  for h in range(z.shape[2])], dim=2)
            # metric(z') − metric(z) ≈ Σ g·(z' − z); effect = −sign · that (positive = the head matters)
            effects[L] = -metric.sign * ((target - z) * g).sum((0, 1, 3)).float().cpu()
    return HeadEffects(effects, float(value.detach()), model_name(model), method, metric.name, "attribution",
                       int(b), int(p), per_position, repl.reference, list(layers),
                       higher_is_better=metric.higher_is_better, settings=stamped({}, model))
