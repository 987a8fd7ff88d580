"""Rotary position embeddings as row-vector matrices: the math only, no model (``_weights.rotary`` reads a
model's own frequencies and pairing into a ``RotarySpec``; ``capture`` rebuilds scores with it).

>>> spec = RotarySpec(torch.tensor([1.0, 0.01]), "halves", rotary_dim=4, d_head=8)
>>> rotation(spec, range(3)).shape          # x rotated at position p is x @ R[p]
torch.Size([3, 8, 8])

``halves`` (HF ``rotate_half``: coordinate k pairs with k + rotary_dim/2) or ``pairs`` (adjacent 2k, 2k+1:
GPT-J, the TL-native model); coordinates from ``offset + rotary_dim`` on pass through unrotated.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional

import torch
from jaxtyping import Float
from torch import Tensor

STYLES = ("halves", "pairs")


@dataclass
class RotarySpec:
    """Rotary frequencies ``omega`` [rotary_dim/2] (radians per position), pairing ``style``,
    ``rotary_dim`` of ``d_head`` rotated, ``scaling`` (HF ``attention_scaling`` on cos/sin)."""

    omega: Tensor
    style: str
    rotary_dim: int
    d_head: int
    scaling: float = 1.0
    base: Optional[float] = None
    source: str = ""
    verified_error: Optional[float] = None
    caveats: List[str] = field(default_factory=list)
    layer: int = 0
    layer_type: Optional[str] = None
    window: Optional[int] = None
    offset: int = 0          # first rotated coordinate (MLA: the rope part follows qk_nope_head_dim others)

    def describe(self) -> Dict[str, object]:
        return {"style": self.style, "rotary_dim": self.rotary_dim, "first_rotated": self.offset, "base": self.base, "scaling": self.scaling,
                "source": self.source, "verified_error": self.verified_error, "layer": self.layer,
                "layer_type": self.layer_type, "sliding_window": self.window}


def _pair_index(spec: RotarySpec):
    half = spec.rotary_dim // 2
    k = torch.arange(half)
    a, b = (k, k + half) if spec.style == "halves" else (2 * k, 2 * k + 1)
    return a + spec.offset, b + spec.offset


def rotation(spec: RotarySpec, positions: Iterable[int], relative: bool = False
             ) -> Float[Tensor, "n d_head d_head"]:
    """Row-vector rotary matrices: ``rot(x, p) = x @ R[p]``; with ``relative=True``, R(Δ) with
    q_i·k_j = q R(i−j) kᵀ (scaling² on the rotated coordinates, identity on pass-through ones)."""
    pos = torch.as_tensor(list(positions), dtype=torch.float64)
    omega = spec.omega.to(torch.float64)
    ang = pos[:, None] * omega[None]                         # [n, half]
    c, s = ang.cos(), ang.sin()
    gain = spec.scaling ** 2 if relative else spec.scaling
    R = torch.eye(spec.d_head, dtype=torch.float64).repeat(len(pos), 1, 1)
    a, b = _pair_index(spec)
    R[:, a, a], R[:, b, b] = c * gain, c * gain
    # x'_a = x_a c − x_b s ; x'_b = x_b c + x_a s   (row vector: x' = x R)
    R[:, b, a], R[:, a, b] = -s * gain, s * gain
    return R.to(spec.omega.dtype)


def rotate(spec: RotarySpec, x: Float[Tensor, "batch pos head d"], start: int = 0) -> Float[Tensor, "batch pos head d"]:
    """``x`` (hook layout) rotated by ``spec`` at positions ``start, start+1, ...``: what a rotary bridge that never
    fires ``hook_rot_q/k`` (GPT-J, GPT-NeoX) multiplies. Memory: one [pos, d_head, d_head] table and one copy."""
    R = rotation(spec, range(start, start + x.shape[1])).to(device=x.device, dtype=x.dtype)   # [pos, d, d]
    return torch.einsum("bphd,pde->bphe", x, R)


def rotate_tables(spec: RotarySpec, positions: Tensor, dtype: torch.dtype):
    """(C, S, perm) with ``y`` at ``positions`` rotated = y · C + y[..., perm] · S: per coordinate its cosine (1 where
    it passes through) and signed sine, ``perm`` its pair partner; C and S are [*positions.shape, d_head]."""
    a, b = _pair_index(spec)
    ang = positions.to(torch.float64).unsqueeze(-1) * spec.omega.to(positions.device, torch.float64)
    c, s = ang.cos() * spec.scaling, ang.sin() * spec.scaling
    C = torch.ones(*positions.shape, spec.d_head, dtype=torch.float64, device=positions.device)
    S = torch.zeros_like(C)
    a, b = a.to(positions.device), b.to(positions.device)
    C[..., a], C[..., b] = c, c
    S[..., a], S[..., b] = -s, s                     # x'_a = x_a c − x_b s ; x'_b = x_b c + x_a s
    perm = torch.arange(spec.d_head, device=positions.device)
    perm[a], perm[b] = b, a
    return C.to(dtype), S.to(dtype), perm


def rotate_at(spec: RotarySpec, y: Float[Tensor, "... d"], positions: Tensor, tables=None) -> Float[Tensor, "... d"]:
    """``y`` rotated by ``spec`` where each row sits at ``positions`` (broadcast against ``y.shape[:-1]``):
    the same map as ``y @ rotation(spec, [p])[0]``, elementwise (no [pos, d, d] table), in ``y``'s dtype;
    ``tables``: ``rotate_tables(spec, positions, y.dtype)`` when the caller keeps them."""
    C, S, _ = tables if tables is not None else rotate_tables(spec, positions.to(y.device), y.dtype)
    return torch.addcmul(y * C, _partners(spec, y), S)


def _partners(spec: RotarySpec, y: Tensor) -> Tensor:
    """``y`` with each rotated coordinate replaced by its pair partner (pass-through ones unchanged), by slicing:
    a gather along the last axis is several times slower on CPU."""
    o, rd, h = spec.offset, spec.rotary_dim, spec.rotary_dim // 2
    if spec.style == "halves":
        mid = [y[..., o + h:o + rd], y[..., o:o + h]]
    else:
        mid = [y[..., o:o + rd].unflatten(-1, (h, 2)).flip(-1).flatten(-2)]
    return torch.cat([y[..., :o], *mid, y[..., o + rd:]], -1)
