"""A layer's q/k/v inputs from per-receiver residuals, in closed form where its input norm allows it, and
the closed-form gradient back to each receiver's residual. Both replace running the block's own ``ln1``
(a bridge module that computes its statistics twice) on one residual copy per receiver head.

>>> li = closed_form(model, layer, "q", x, model_q)      # doctest: +SKIP (needs a model with a norm)
>>> q = project(li, resid, heads)                         # doctest: +SKIP (needs a model with a norm)
>>> grads = input_vjp(li, x, dq, heads)                   # doctest: +SKIP (needs a model with a norm)

``closed_form`` is None where the norm is not an RMSNorm/LayerNorm it reproduces; ``project`` gives the heads' inputs
[b, p, n, e], head i's from ``resid[i]``; ``input_vjp`` gives [n, b, p, d], ∂m/∂(head i's own residual copy)
(tests/test_closed_form_inputs.py checks both against autograd on the tiny families).

A head's input is  ln1(x) W_x + b_x  (x in q, k, v; W_x [heads, d_model, d_head]). With the norm's weight w
folded into W̃ = w ⊙ W_x (and its bias β into b̃ = β W_x + b_x), per position:

    RMSNorm:    r · (x W̃) + b_x,            r = (mean_d x² + ε)^-½
    LayerNorm:  s · ((x − μ) W̃) + b̃,        μ = mean_d x,  s = (mean_d (x − μ)² + ε)^-½

so the norm costs one reduction per copy and the projection reads the residual once (no normed copy is
written). For a cotangent c = ∂m/∂(head i's input) [e] per position, u = c W̃ᵀ [d_model], the gradient at
head i's residual is

    RMSNorm:    r·u − x · (r³/d) ⟨u, x⟩
    LayerNorm:  s · (u − mean_d u − x̂ · mean_d(u ⊙ x̂)),    x̂ = (x − μ)·s

computed for all heads of a layer at once from the layer's ONE clean residual (in a gradient run every
receiver's copy equals it, so the copies need not exist). ``closed_form`` reads the norm's kind, weight,
bias and epsilon (``_foundation/arch/norms``) and returns the parts only after they reproduce the model's own
hook value on the run to 1e-5 of its largest entry (float32 rounding: in float64, HF's RMSNorm still
normalises in float32, so the closed form then differs from the module path by ~1e-7 relative, not 1e-15;
a wrong epsilon, weight or bias is far outside it); float32/float64 only (bf16 keeps the module path, whose rounding the
model's own is), and never where the adapter has no ``input_maps`` (multi-head latent attention: its
inputs come from ``adapter.inputs_from_residuals``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from jaxtyping import Float
from torch import Tensor

from .arch import adapter


@dataclass(frozen=True)
class InputParts:
    """One layer input's closed form: ``kind`` "RMS" | "LN", ``eps``, ``W`` = w ⊙ W_x [n, d, e] and ``b`` the
    bias after the projection [n, e] (None where there is none)."""

    kind: str
    eps: float
    W: Tensor
    b: Optional[Tensor]


def _candidates(model, layer: int, into: str, n: int):
    """The closed forms to try for ``n`` heads of ``into``, read through the layer's adapter (its input norm and its
    q/k/v projection): with the norm's weight and bias, and without (a folded norm that only normalises)."""
    a = adapter(model, layer)
    norm = a.input_norm()
    if norm.kind is None:
        return
    maps = a.input_maps(into, range(a.n_heads if into == "q" else a.n_kv_heads))          # [m, d, e], [m, e]
    if maps is None:                  # no linear map of the normed input (latent attention): the module path
        return
    W, bx = maps
    if W.shape[0] != n and n % W.shape[0] == 0:       # a hook with K/V per query head: ungroup the KV heads
        W = W.repeat_interleave(n // W.shape[0], 0)
        bx = None if bx is None else bx.repeat_interleave(n // bx.shape[0], 0)
    for w, beta in ((norm.weight, norm.bias), (None, None)):
        Wt = W * w.to(W.dtype)[None, :, None] if w is not None else W
        b = bx
        if beta is not None and norm.kind == "LN":
            extra = torch.einsum("d,nde->ne", beta.to(W.dtype), W)
            b = extra if b is None else b + extra
        yield InputParts(norm.kind, norm.eps, Wt, b)


def closed_form(model, layer: int, into: str, x: Float[Tensor, "b p d"], hook_value: Float[Tensor, "b p n e"]
                ) -> Optional[InputParts]:
    """The closed form of layer ``layer``'s ``into`` input, checked against the model's own ``hook_value``
    computed from the residual ``x`` (first row only: the formula is per position), or None."""
    if x.dtype not in (torch.float32, torch.float64) or adapter(model, layer).input_maps("q", []) is None:
        return None
    try:
        want = hook_value[:1].detach()
        xs = x[:1].detach()
        n = want.shape[2]
        scale = float(want.abs().max()) + 1e-30
        tol = max(1e-5, 64 * float(torch.finfo(x.dtype).eps)) * scale
        for parts in _candidates(model, layer, into, n):
            if parts.W.shape[0] != n or parts.W.shape[1] != x.shape[-1]:
                return None
            got = project(parts, xs.unsqueeze(0).expand(n, *xs.shape), range(n))
            if got.shape == want.shape and float((got - want).abs().max()) <= tol:
                return parts
    except Exception:   # noqa: BLE001  a bridge without these attributes: the module path
        return None
    return None


def _stats(parts: InputParts, resid: Tensor):
    """(the residual the projection reads: x or x − μ, its per-position scale r or s [..., 1])."""
    d = resid.shape[-1]
    if parts.kind == "LN":
        resid = resid - resid.mean(-1, keepdim=True)
    sq = torch.linalg.vector_norm(resid, dim=-1, keepdim=True).pow_(2).div_(d)
    return resid, sq.add_(parts.eps).rsqrt_()


def project(parts: InputParts, resid: Float[Tensor, "n b p d"], heads: Sequence[int]) -> Float[Tensor, "b p n e"]:
    """Heads ``heads``' inputs, head i read from ITS OWN residual ``resid[i]`` (the closed form above). Holds
    one [n, b, p] scale, the [b, p, n, e] result and, for LayerNorm, a centred copy of ``resid``."""
    heads = list(heads)
    xr, scale = _stats(parts, resid)                                                    # scale [n, b, p, 1]
    W = parts.W[heads].to(resid.dtype)
    out = torch.einsum("nbpd,nde->bpne", xr, W)
    out.mul_(scale.squeeze(-1).permute(1, 2, 0).unsqueeze(-1))
    if parts.b is not None:
        out.add_(parts.b[heads].to(out.dtype))
    return out


def input_vjp(parts: InputParts, x: Float[Tensor, "b p d"], grad: Float[Tensor, "b p n e"],
              heads: Sequence[int], out: Optional[Tensor] = None) -> Float[Tensor, "n b p d"]:
    """∂⟨input_i, grad_i⟩/∂(head i's residual) at the residual ``x`` every head read, for each head i of
    ``heads`` (the formulas above; no autograd). Holds the [n, b, p, d] result (written into ``out`` when
    given: a contiguous tensor of that shape and the weights' dtype) and, for LayerNorm, x − μ."""
    heads = list(heads)
    x = x.detach()
    b, p, d = x.shape
    n = len(heads)
    W = parts.W[heads]                                                                  # [n, d, e]
    gh = grad.to(W.dtype).permute(2, 0, 1, 3).reshape(n, b * p, -1)                     # [n, b·p, e], small
    if out is not None and out.is_contiguous() and out.dtype == W.dtype and tuple(out.shape) == (n, b, p, d):
        u = out
        torch.bmm(gh, W.transpose(1, 2), out=u.view(n, b * p, d))
    else:
        u = torch.bmm(gh, W.transpose(1, 2)).view(n, b, p, d)
    xr, scale = _stats(parts, x)                                                        # [b, p, d], [b, p, 1]
    if parts.kind == "RMS":
        coef = torch.einsum("nbpd,bpd->nbp", u, xr).unsqueeze(-1).mul_(scale.pow(3).div_(d))   # r³/d ⟨u, x⟩
        u.mul_(scale)
        return u.addcmul_(xr.expand_as(u), coef, value=-1)
    xh = xr * scale                                                                     # x̂ = (x − μ)·s
    mean_ux = torch.einsum("nbpd,bpd->nbp", u, xh).unsqueeze(-1).div_(d)
    u.sub_(u.mean(-1, keepdim=True))
    u.addcmul_(xh.expand_as(u), mean_ux, value=-1)
    return u.mul_(scale)
