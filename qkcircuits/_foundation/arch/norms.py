"""Every norm a head's computation passes through, as one description: the block's input norm (``ln1``), the
final norm, Gemma's post-attention norm and QK-norms inside attention. The one place that knows where a bridge
keeps a norm's weight, bias and epsilon, and that Gemma's RMSNorm multiplies by (1 + γ).

>>> from qkcircuits._foundation.arch.norms import block_norm, final_norm, norm_kind
>>> norm_kind(model)                      # the hand-built toy model has no norm
>>> n = block_norm(model, 0)
>>> (n.kind, n.weight is None, n.bias is None)
(None, True, True)

A norm maps each row x (its last axis, width d) to

    RMSNorm:    w ⊙ x · s + β,          s = (mean_d x² + ε)^-½
    LayerNorm:  w ⊙ (x − mean_d x) · s + β,   s = (mean_d (x − mean_d x)² + ε)^-½

``read_norm`` reads ``w`` (the multiplier the norm really applies: γ, or 1 + γ for Gemma) and ``β`` off the
module's own output on probe rows (so no class-specific attribute is trusted), then checks the formula against
the module on a random row. With ``s`` held at its value in a run (``Norm.inv_scale`` of the full input), a norm
is linear in the parts of its input: ``Norm.linear(x_a) · s`` for each part, ``β`` once (QK attribution relies on
this). ``folded``: ``qk.load(fold_ln=True)`` already moved the input norms' w and β into the next weights (then
the module itself applies w = 1, β = 0, which is what ``read_norm`` reads).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Dict, Iterator, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..errors import QKCircuitsError

EPS_NAMES = ("variance_epsilon", "eps", "epsilon", "layer_norm_eps")


@dataclass(frozen=True)
class Norm:
    """One norm: ``kind`` ("LN" | "RMS" | None: no norm), ``eps``, ``weight`` (the effective multiplier, [d] or,
    for a per-head QK-norm, [heads, d]; None = 1) and ``bias`` (None where absent), ``folded`` (the model's weights
    have them folded in already)."""

    kind: Optional[str]
    eps: float
    weight: Optional[Tensor]
    bias: Optional[Tensor]
    folded: bool

    def inv_scale(self, x: Tensor) -> Tensor:
        """s = 1/σ per row of ``x`` [..., d] as [..., 1], in ``x``'s dtype (ones for no norm)."""
        if self.kind is None:
            return torch.ones_like(x[..., :1])
        c = x - x.mean(-1, keepdim=True) if self.kind == "LN" else x
        return torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + self.eps)

    def linear(self, x: Tensor, head: Optional[int] = None) -> Tensor:
        """The norm's linear part before its scale: w ⊙ x (RMS) or w ⊙ (x − mean x) (LN). A per-head weight
        [heads, d] applies row ``head``, or (``head`` None) broadcasts over x [..., heads, d]."""
        if self.kind == "LN":
            x = x - x.mean(-1, keepdim=True)
        return x if self.weight is None else x * _row(self.weight, head).to(x)

    def constant(self, like: Tensor, head: Optional[int] = None) -> Tensor:
        """β broadcast to ``like``'s shape (zeros without a bias)."""
        if self.bias is None:
            return torch.zeros_like(like)
        return _row(self.bias, head).to(like).expand_as(like)

    def __call__(self, x: Tensor, head: Optional[int] = None) -> Tensor:
        """The norm itself: linear(x) · s(x) + β."""
        return self.linear(x, head) * self.inv_scale(x) + self.constant(x, head)


NO_NORM = Norm(None, 0.0, None, None, False)


def norm_kind(model) -> Optional[str]:
    """"LN" (LayerNorm: centre, then scale), "RMS" (scale only) or None (no normalisation)."""
    t = getattr(model.cfg, "normalization_type", None)
    if t is None:
        return None
    return "LN" if str(t).startswith("LN") else "RMS"


def module_eps(module, default: float) -> float:
    """The epsilon a norm module adds (the HF module's own attribute, behind a bridge too), else ``default``."""
    for mod in (getattr(module, "original_component", None), module):
        for name in EPS_NAMES:
            v = getattr(mod, name, None)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                return float(v)
    return float(default)


# Inside ``read_once()``: (id(module), shape, eps, kind, folded) -> (module, Norm); None outside.
_ONCE: Optional[Dict[Tuple, Tuple[object, Norm]]] = None


@contextlib.contextmanager
def read_once() -> Iterator[None]:
    """Within the block each norm module is read once (``read_norm`` runs the module four times on probe rows;
    a default scan asked the same 31 norms 86 times). For a span in which no weight and no norm hook changes,
    e.g. one ``scan``; nested blocks share the outer one's reads, and they are forgotten when it ends."""
    global _ONCE
    outer = _ONCE
    if outer is None:
        _ONCE = {}
    try:
        yield
    finally:
        if outer is None:
            _ONCE = None


def read_norm(module, shape: Sequence[int], *, eps: float, kind: Optional[str] = None, folded: bool = False,
              what: str = "norm") -> Norm:
    """The norm ``module`` applies to rows of ``shape`` (e.g. ``(d_model,)``, or ``(heads, d_head)`` for a
    per-head QK-norm), read off its own outputs: with u = (+1, −1, +1, …) (mean 0, rms 1), module(±u) =
    ±w ⊙ u / √(1 + ε) + β gives w and β; module(3·1) tells RMS (w·3/√(9+ε) + β) from LayerNorm (β). ``kind``
    breaks a tie (w ≈ 0). Checked on a random row against the formula; a module that is neither fails in one
    line naming ``what``. Inside ``read_once()`` a module already read gives the same ``Norm`` back."""
    memo = _ONCE
    key = (id(module), tuple(int(x) for x in shape), float(eps), kind, bool(folded))
    if memo is not None and key in memo:
        return memo[key][1]
    norm = _read_norm(module, shape, eps=eps, kind=kind, folded=folded, what=what)
    if memo is not None:
        memo[key] = (module, norm)          # the module is held, so its id is not reused while the block lasts
    return norm


def _read_norm(module, shape: Sequence[int], *, eps: float, kind: Optional[str], folded: bool, what: str) -> Norm:
    d = int(shape[-1])
    p = next(iter(module.parameters()), None)
    dev, dt = (p.device, p.dtype) if p is not None else (torch.device("cpu"), torch.float32)
    if d % 2:
        raise QKCircuitsError(f"{what}: cannot read a norm over an odd width {d}")
    u = torch.ones(d, dtype=torch.float64)
    u[1::2] = -1.0
    u = u.expand(*shape).reshape(1, 1, *shape)

    def run(x: Tensor) -> Tensor:
        with torch.no_grad():
            return module(x.to(device=dev, dtype=dt)).double().cpu()

    plus, minus, flat = run(u), run(-u), run(3.0 * torch.ones_like(u))
    bias = (plus + minus) / 2
    weight = (plus - minus) / 2 * (1.0 + eps) ** 0.5 * u
    rms_flat = weight * 3.0 / (9.0 + eps) ** 0.5 + bias
    scale = float(weight.abs().max()) + float(bias.abs().max()) + 1e-30
    is_rms = float((flat - rms_flat).abs().max()) <= 1e-3 * scale
    is_ln = float((flat - bias).abs().max()) <= 1e-3 * scale
    if is_rms and is_ln:
        got_kind = kind or "RMS"
    elif is_rms or is_ln:
        got_kind = "RMS" if is_rms else "LN"
    else:
        raise QKCircuitsError(f"{what} ({type(getattr(module, 'original_component', module)).__name__}) is neither an "
                              f"RMSNorm nor a LayerNorm on its last axis; qkcircuits cannot decompose through it")
    weight, bias = weight[0, 0], bias[0, 0]
    if weight.dim() > 1 and bool((weight == weight[:1]).all()):
        weight, bias = weight[0], bias[0]
    has_bias = bool(bias.abs().max() > 0)
    norm = Norm(got_kind, float(eps), weight.to(dt), bias.to(dt) if has_bias else None, folded)
    x = torch.randn(1, 3, *shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 2 + 0.5
    want = run(x)
    got = norm(x.to(dt)).double().cpu()
    tol = max(1e-4, 8 * float(torch.finfo(dt).eps)) * (float(want.abs().max()) + 1.0)
    if float((got - want).abs().max()) > tol:
        raise QKCircuitsError(f"{what} ({type(getattr(module, 'original_component', module)).__name__}) does not behave "
                              f"as a {got_kind} norm with one weight and bias (max difference "
                              f"{float((got - want).abs().max()):.3g}); qkcircuits cannot decompose through it")
    return norm


def _row(t: Tensor, head: Optional[int]) -> Tensor:
    return t[head] if t.dim() == 2 and head is not None else t


def _read(model, mod) -> Norm:
    kind = norm_kind(model)
    if kind is None:
        return NO_NORM
    # TransformerLens folds norms into the next weights in compatibility mode, except into latent attention (MLA)
    folded = bool(getattr(model, "compatibility_mode", False)) and not hasattr(model.blocks[0].attn, "hook_kv_latent")
    eps = module_eps(mod, getattr(model.cfg, "eps", 1e-5))
    return read_norm(mod, (int(model.cfg.d_model),), eps=eps, kind=kind, folded=folded, what="the input norm")


def block_norm(model, layer: int) -> Norm:
    """The norm in front of block ``layer``'s attention (``ln1``)."""
    return _read(model, model.blocks[int(layer)].ln1)


def final_norm(model) -> Norm:
    """The norm in front of the unembedding (``ln_final``)."""
    return _read(model, model.ln_final)
