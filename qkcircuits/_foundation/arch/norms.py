"""The norms on the way in (a block's ``ln1``) and out (``ln_final``, before the unembedding), as the
weight-space analyses read them: the one place that knows where a bridge keeps a norm's weight and bias,
that Gemma's RMSNorm multiplies by (1 + γ), and which epsilon the model uses.

>>> from qkcircuits._foundation.arch.norms import block_norm, final_norm, norm_kind
>>> norm_kind(model)                      # the hand-built toy model has no norm
>>> n = block_norm(model, 0)
>>> (n.kind, n.weight is None, n.bias is None)
(None, True, True)

For a model with norms, ``n.weight`` is the multiplier the norm applies (γ, or 1 + γ under
``rmsnorm_uses_offset``) and ``n.bias`` its bias, both detached, as the module holds them; ``n.folded`` says
whether ``qk.load(fold_ln=True)`` already moved them into the next weights (then the analyses apply only the
centring and the per-row scale).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from torch import Tensor


@dataclass(frozen=True)
class Norm:
    """One norm: ``kind`` ("LN" | "RMS" | None: no norm), ``eps``, ``weight`` (the effective multiplier) and
    ``bias`` (None where absent), ``folded`` (the model's weights have them folded in already)."""

    kind: Optional[str]
    eps: float
    weight: Optional[Tensor]
    bias: Optional[Tensor]
    folded: bool


def norm_kind(model) -> Optional[str]:
    """"LN" (LayerNorm: centre, then scale), "RMS" (scale only) or None (no normalisation)."""
    t = getattr(model.cfg, "normalization_type", None)
    if t is None:
        return None
    return "LN" if str(t).startswith("LN") else "RMS"


def _read(model, mod) -> Norm:
    from . import adapter

    orig = getattr(mod, "original_component", mod)
    w, b = getattr(orig, "weight", None), getattr(orig, "bias", None)
    if isinstance(w, Tensor):   # Gemma-style RMSNorm multiplies by (1 + weight)
        w = w.detach() + (1.0 if getattr(model.cfg, "rmsnorm_uses_offset", False) else 0.0)
    else:
        w = None
    return Norm(norm_kind(model), float(getattr(model.cfg, "eps", 1e-5)), w,
                b.detach() if isinstance(b, Tensor) else None, adapter(model, 0).folded)


def block_norm(model, layer: int) -> Norm:
    """The norm in front of block ``layer``'s attention (``ln1``)."""
    return _read(model, model.blocks[int(layer)].ln1)


def final_norm(model) -> Norm:
    """The norm in front of the unembedding (``ln_final``)."""
    return _read(model, model.ln_final)
