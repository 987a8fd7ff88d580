"""A head's query (or a KV head's key) as a function of the residual entering its block, with every norm's
per-position scale held at its value in one run: the map QK attribution pushes each source's write through.

>>> from qkcircuits._foundation.arch import adapter
>>> qmap = adapter(model, 1).query_map(0)        # head 1.0 of the hand-built toy
>>> tuple(qmap.W.shape)                           # [d_model, d_qk]
(224, 129)

With ``fr = qmap.frozen(resid)`` (``resid``: the block's ``hook_resid_pre`` [b, p, d_model]), the model's own
query is ``qmap.finish(resid @ qmap.W, fr) + qmap.constant(fr)``, and since ``finish`` is linear, a residual
that is a sum of parts x_a gives the query as Σ_a finish(x_a W, fr) + constant(fr), exactly.

Standard attention (MHA / GQA / MQA; any RMS or LayerNorm in front; QK-norm per head; rotary of any pairing):

    y_p   = s_p · (x_p W) + c        W = P·diag(w)·W_x[h],  c = β W_x[h] + b_x[h]     (= hook_q / hook_k)
    out_p = R_p ( t_p · g ⊙ P'(y_p) + β' )                                              (what the score reads)

s_p = 1/σ(x_p) of the input norm (w, β its weight and bias, P the centring of a LayerNorm, the identity for
RMSNorm), t_p = 1/σ(y_p) of the QK-norm (g, β', P' likewise; t_p = 1, g = 1, β' = 0 without one), R_p the rotary
at position p (the identity without rotary). Multi-head latent attention (DeepSeek-V2/V3) reads the residual through
its latents, whose RMSNorms divide by r_q(p) and r_kv(p) (frozen too):

    query: out_p = R_p ( s_p · r_q(p) · x_p W ),          W = diag(w) W_DQ diag(γ_q) W_UQ^h   (or diag(w) W_Q^h)
    key:   out_p = [ s_p · r_kv(p) · x_p W_nope | R_p(s_p · x_p W_KR) ],   W_nope = diag(w) W_DKV diag(γ_kv) W_UK^h

(the shared rotary key k_R = x W_KR is not normalised, so r_kv scales only the content coordinates).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
from jaxtyping import Float
from torch import Tensor

from ..rope import RotarySpec, rotate_at, rotate_tables
from .norms import Norm


@dataclass
class Frozen:
    """The per-position factors of one run: ``s`` [b, p, 1] (input norm), ``post`` [b, p, 1] or [b, p, d_qk]
    (QK-norm's t_p, or the latent norms' r per coordinate). ``at(rows)`` picks rows (prompt index, position)."""

    s: Tensor
    post: Tensor

    def at(self, rows: Optional[Tuple[Tensor, Tensor]]):
        """(s, post, positions) for ``y`` laid out [..., b, p, d] (rows None) or [..., n, d] (rows = (b_idx, p_idx))."""
        if rows is None:
            b, p = self.s.shape[:2]
            return self.s, self.post, _positions(b, p, self.s.device)
        bi, pi = rows
        return self.s[bi, pi], self.post[bi, pi], pi

    def to(self, dtype: torch.dtype) -> "Frozen":
        """The same factors in ``dtype`` (what the parts are computed in)."""
        return Frozen(self.s.to(dtype), self.post.to(dtype))


_POSITIONS = {}


def _positions(b: int, p: int, device) -> Tensor:
    """One [b, p] position grid per shape (the rotary tables of every part are keyed on it)."""
    key = (b, p, str(device))
    if key not in _POSITIONS:
        _POSITIONS.clear()
        _POSITIONS[key] = torch.arange(p, device=device).expand(b, p)
    return _POSITIONS[key]


class QKMap:
    """How query head ``head`` (side "q") or KV head ``head`` (side "k") of a standard layer is made (module
    docstring). ``W`` [d_model, d_qk] and ``c`` [d_qk] in float64."""

    def __init__(self, side: str, head: int, W: Tensor, c: Tensor, in_norm: Norm, qk_norm: Optional[Norm],
                 rotary: Optional[RotarySpec]):
        self.side, self.head, self.W, self.c = side, int(head), W, c
        self.in_norm, self.qk_norm, self.rotary = in_norm, qk_norm, rotary

    def frozen(self, resid: Float[Tensor, "b p d_model"]) -> Frozen:
        x = resid.double()
        s = self.in_norm.inv_scale(x)
        post = torch.ones_like(s)
        if self.qk_norm is not None:
            post = self.qk_norm.inv_scale(s * (x @ self.W) + self.c)
        return Frozen(s, post)

    def finish(self, y: Float[Tensor, "... n d_qk"], fr: Frozen, rows: Optional[Tuple[Tensor, Tensor]] = None
               ) -> Float[Tensor, "... n d_qk"]:
        """The linear part: ``y`` = a part's x W (before any scale), [..., b, p, d_qk] (or [..., n, d_qk] at
        ``rows``), to what the score reads."""
        s, post, pos = fr.at(rows)
        y = y * s
        if self.qk_norm is not None:
            y = self.qk_norm.linear(y, self._norm_row()) * post
        return self._rotate(y, pos)

    def constant(self, fr: Frozen, rows: Optional[Tuple[Tensor, Tensor]] = None) -> Float[Tensor, "... d_qk"]:
        """What the score reads from the constants (c, the QK-norm's bias), [b, p, d_qk] (or [n, d_qk] at ``rows``)."""
        s, post, pos = fr.at(rows)
        y = self.c.expand(*s.shape[:-1], -1)
        if self.qk_norm is not None:
            y = self.qk_norm.linear(y, self._norm_row()) * post + self.qk_norm.constant(y, self._norm_row())
        return self._rotate(y, pos)

    def contract(self, y: Float[Tensor, "s b p d_qk"], fr: Frozen, weights: Float[Tensor, "n p"], rows: Tensor
                 ) -> Float[Tensor, "n s d_qk"]:
        """Σ_pos weights[n, pos] · finish(y)[:, rows[n], pos] for each row n, without forming finish(y): the
        per-position factors and the rotary's cosines and sines are folded into the weights, so ``y`` is read twice
        and nothing of its size is written. (Rotated: out[c] = Σ_p w_p (f_p[c] C_p[c] y_p[c] + f_p[π c] S_p[c]
        y_p[π c]) with π the rotary's pair partner; the second sum is V[π c] with V = Σ_p w_p f_p S_p[π ·] y_p.)"""
        if self.qk_norm is not None:
            y = self.qk_norm.linear(y, self._norm_row())
        return _contract(y, self._factors(fr, y.dtype), weights.to(y.dtype), rows, self.rotary)

    def contract_static(self, y: Float[Tensor, "b m d_qk"], fr: Frozen, weights: Float[Tensor, "n m p"],
                        rows: Tensor) -> Float[Tensor, "n m d_qk"]:
        """Σ_pos weights[n, m, pos] · finish_pos(y[rows[n], m]) for parts ``y`` that are the same at every position
        (an earlier head's value at source position m through its OV, which a pattern then spreads over the key
        positions): the frozen factors and the rotary are per position and y is not, so each is one small
        matmul over positions — nothing of size [m, rows, p, d] is formed."""
        if self.qk_norm is not None:
            y = self.qk_norm.linear(y, self._norm_row())
        return _contract_static(y, self._factors(fr, y.dtype), weights.to(y.dtype), rows, self.rotary)

    def _factors(self, fr: Frozen, dtype: torch.dtype) -> Tensor:
        """The frozen factor every part is multiplied by at each position before the rotary: [b, p, 1 or d]."""
        return (fr.s * fr.post).to(dtype) if self.qk_norm is not None else fr.s.to(dtype)

    def _norm_row(self) -> Optional[int]:
        w = None if self.qk_norm is None else self.qk_norm.weight
        return self.head if w is not None and w.dim() == 2 else None

    def _rotate(self, y: Tensor, positions: Tensor) -> Tensor:
        if self.rotary is None:
            return y
        # the tables depend only on the positions: kept for the next part at the same positions
        key = (positions.data_ptr(), tuple(positions.shape), positions.stride(), y.dtype)
        cache = self.__dict__.setdefault("_tables", {})
        if key not in cache:
            cache.clear()
            cache[key] = (positions, rotate_tables(self.rotary, positions.to(y.device), y.dtype))
        return rotate_at(self.rotary, y, positions, cache[key][1])


class LatentQKMap(QKMap):
    """Multi-head latent attention's query or key map (module docstring); ``scales(x̂)`` gives the latent norms'
    (1/r_q, 1/r_kv) [b, p] at the normalised input x̂; the ``d_nope`` content coordinates come first."""

    def __init__(self, side: str, head: int, W: Tensor, in_norm: Norm, rotary: Optional[RotarySpec], scales,
                 d_nope: int):
        super().__init__(side, head, W, torch.zeros(W.shape[1], dtype=W.dtype), in_norm, None, rotary)
        self.scales, self.d_nope = scales, int(d_nope)

    def frozen(self, resid: Float[Tensor, "b p d_model"]) -> Frozen:
        s = self.in_norm.inv_scale(resid.double())
        r_q, r_kv = (r.double()[..., None] for r in self.scales(self.in_norm(resid)))
        width = self.W.shape[1]
        if self.side == "q":
            post = r_q.expand(*r_q.shape[:2], width)
        else:
            post = torch.cat([r_kv.expand(*r_kv.shape[:2], self.d_nope),
                              torch.ones(*r_kv.shape[:2], width - self.d_nope, dtype=r_kv.dtype, device=r_kv.device)], -1)
        return Frozen(s, post)

    def finish(self, y: Tensor, fr: Frozen, rows: Optional[Tuple[Tensor, Tensor]] = None) -> Tensor:
        s, post, pos = fr.at(rows)
        return self._rotate(y * s * post, pos)

    def constant(self, fr: Frozen, rows: Optional[Tuple[Tensor, Tensor]] = None) -> Tensor:
        s, _, _ = fr.at(rows)
        return torch.zeros(*s.shape[:-1], self.W.shape[1], dtype=torch.float64, device=s.device)

    def contract(self, y: Tensor, fr: Frozen, weights: Tensor, rows: Tensor) -> Tensor:
        return _contract(y, (fr.s * fr.post).to(y.dtype), weights.to(y.dtype), rows, self.rotary)

    def contract_static(self, y: Tensor, fr: Frozen, weights: Tensor, rows: Tensor) -> Tensor:
        return _contract_static(y, (fr.s * fr.post).to(y.dtype), weights.to(y.dtype), rows, self.rotary)


@dataclass
class ScoreMaps:
    """Everything one layer's score is made of, for some of its query heads (``adapter.score_maps(heads)``): each
    head's query map (``query``, in the order of ``heads``), each KV head's key map (``key[g]``, g = h // ``group``),
    the score's ``scale`` (and where it was read, ``scale_source``), its ``softcap`` (or None), the sliding
    ``window`` (or None), ALiBi's per-head ``alibi_slopes`` [n_heads] (or None), the layer's ``rotary`` (None without
    one; each map holds it too), ``frozen``: what the maps hold at their value in one run (each norm's per-position
    scale), and the adapter's ``family``. s_ij = scale · q_i · k_j (+ slope_h · j), soft-capped where ``softcap``."""

    heads: List[int]
    query: List[QKMap]
    key: Dict[int, QKMap]
    group: int
    scale: float
    scale_source: str
    softcap: Optional[float]
    window: Optional[int]
    alibi_slopes: Optional[Tensor]
    rotary: Optional[RotarySpec]
    frozen: List[str]
    family: str

    def kv(self, head: int) -> int:
        """The KV head query head ``head`` reads."""
        return int(head) // self.group


def _contract_static(y: Tensor, f: Tensor, weights: Tensor, rows: Tensor, rotary: Optional[RotarySpec]) -> Tensor:
    """``contract_static`` once the QK-norm's linear part is applied (``f`` [b, p, 1 or d])."""
    n, m, p = weights.shape
    d = y.shape[-1]
    fr_rows = f[rows].expand(n, p, d) if f.shape[-1] == 1 else f[rows]                 # [n, p, d]
    Y = y[rows]                                                                        # [n, m, d]
    if rotary is None:
        return Y * torch.bmm(weights, fr_rows)
    C, S, perm = rotate_tables(rotary, torch.arange(p, device=y.device), y.dtype)     # [p, d] each
    # out[c] = y[c] · Σ_p w_p f_p[c] C_p[c] + y[π c] · Σ_p w_p f_p[π c] S_p[c]
    A = torch.bmm(weights, fr_rows * C)                                                # [n, m, d]
    B = torch.bmm(weights, fr_rows[..., perm] * S)
    return Y * A + Y[..., perm] * B


def _contract(y: Tensor, f: Tensor, weights: Tensor, rows: Tensor, rotary: Optional[RotarySpec]) -> Tensor:
    """``QKMap.contract`` once the QK-norm's linear part is applied: ``f`` [b, p, 1 or d] the frozen factors."""
    b, p, d = y.shape[1], y.shape[2], y.shape[3]
    wf = weights[:, :, None] * f[rows]                                                # [n, p, 1 or d]
    grouped = _grouped(rows, b)
    Y = y if grouped is not None else y[:, rows]                                      # [s, b, p, d] or [s, n, p, d]
    if rotary is None:
        return _sum_positions(wf.expand(-1, -1, d), Y, grouped)
    C, S, perm = rotate_tables(rotary, torch.arange(p, device=y.device), y.dtype)     # [p, d] each
    A = wf * C
    B = wf * S[:, perm]
    return _sum_positions(A, Y, grouped) + _sum_positions(B, Y, grouped)[..., perm]


def _grouped(rows: Tensor, b: int) -> Optional[int]:
    """Rows per prompt when ``rows`` is every prompt in order, each the same number of times (no gather needed)."""
    n = rows.numel()
    if n % b:
        return None
    r = n // b
    return r if bool((rows == torch.arange(b, device=rows.device).repeat_interleave(r)).all()) else None


def _sum_positions(W: Tensor, Y: Tensor, grouped: Optional[int]) -> Tensor:
    """out[n, s, d] = Σ_p W[n, p, d] · Y[s, row n's prompt, p, d] (Y already gathered per row when not grouped).
    One row per prompt: a product and a sum over p (memory-bound, one pass). Several rows per prompt: a batched
    matmul per (prompt, coordinate), [r, p] @ [p, s], so no [s, rows, p, d] product is formed (measured: 4x faster
    at 9 rows per prompt, 19x at 255)."""
    if grouped is None:
        return (Y * W[None]).sum(2).transpose(0, 1)
    s, b, p, d = Y.shape
    if grouped == 1:
        return (Y * W[None]).sum(2).transpose(0, 1)
    Wg = W.view(b, grouped, p, d).permute(0, 3, 1, 2).reshape(b * d, grouped, p)      # [b·d, r, p]
    Yg = Y.permute(1, 3, 2, 0).reshape(b * d, p, s)                                    # [b·d, p, s]
    out = torch.bmm(Wg, Yg).view(b, d, grouped, s)                                     # [b, d, r, s]
    return out.permute(0, 2, 3, 1).reshape(b * grouped, s, d)
