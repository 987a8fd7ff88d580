"""Multi-head latent attention (DeepSeek-V2/V3: TransformerLens's ``MLAAttentionBridge``).

On a DeepSeek-shaped model (tests/_tiny.py ``tiny_deepseek``; the doctest model is not one):

>>> a = adapter(deepseek, 1)                              # doctest: +SKIP (tests/test_doc_claims.py)
>>> a.family, a.kv_lora_rank, a.d_rope, a.d_qk, a.d_v     # doctest: +SKIP (tests/test_doc_claims.py)
('latent', 16, 8, 24, 16)

One layer, in row-vector form (x: the normalised residual entering attention, [d_model]):

    c_q  = RMS(x W_DQ) ⊙ γ_q                 [q_lora]   (q_lora_rank None: no c_q, q = x W_Q)
    q^h  = c_q W_UQ^h = [q_nope^h | q_rope^h]   [d_nope + d_rope]
    [c_kv | k_r] = x W_DKVR,  c_kv ← RMS(c_kv) ⊙ γ_kv          [kv_lora], [d_rope]  (k_r: shared by all heads)
    k^h  = [c_kv W_UK^h | rot(k_r)],  v^h = c_kv W_UV^h
    s^h_ij = scale · (q_nope,i^h · k_nope,j^h + rot_i(q_rope,i^h) · rot_j(k_r,j))
    out_i = Σ_h z_i^h W_O^h,  z_i^h = Σ_j softmax_j(s^h_ij) v_j^h

``RMS(u) = u / sqrt(mean(u²) + eps)``: a positive scalar per position, so the effective per-head maps
W_Q^h = W_DQ γ_q W_UQ^h, W_K^h = [W_DKV γ_kv W_UK^h | W_KR], W_V^h = W_DKV γ_kv W_UV^h are exact up to
1/r_q(i) on the whole query and 1/r_kv(j) on the content key and the value (never on the rotary key).
Hooks (TL 4.3): hook_q/k/v are what enters attention (post-rotary, [nope | rope]); ``prepare`` makes them
and hook_z fire [batch, pos, head, d] like every other family. hook_rot_k is the shared rotary key
[batch, pos, 1, d_rope]; hook_q_latent / hook_kv_latent the normalised latents.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from jaxtyping import Float
from torch import Tensor

from ..errors import QKCircuitsError
from .base import AttentionAdapter, LayerWeights
from .qkmap import LatentQKMap


class LatentAttention(AttentionAdapter):
    family = "latent"

    def __init__(self, model, layer: int):
        super().__init__(model, layer)
        m = self.module
        cfg = getattr(m, "config", None)
        self.q_lora_rank = getattr(m, "q_lora_rank", None)
        self.kv_lora_rank = int(m.kv_lora_rank)
        self.d_nope, self.d_rope, self.d_v = int(m.qk_nope_head_dim), int(m.qk_rope_head_dim), int(m.v_head_dim)
        self.d_qk = self.d_nope + self.d_rope
        self.n_heads = int(getattr(m, "num_heads", None) or model.cfg.n_heads)
        self.n_kv_heads = self.n_heads          # every head has its own k/v (rebuilt from one shared latent)
        self.interleave = bool(getattr(cfg, "rope_interleave", False))
        arch = type(m).__name__
        # V2 multiplies complex pairs (2k, 2k+1) in place; V3 with rope_interleave rotates the same pairs and
        # then de-interleaves (a permutation applied to q and k alike, so scores are unchanged); V3 without it
        # rotates halves (k, k + d_rope/2).
        self.rope_style = "pairs" if ("V2" in arch or self.interleave) else "halves"
        self.rope_permuted = self.interleave and "V2" not in arch
        self.eps_q = _eps(getattr(m, "q_a_layernorm", None))
        self.eps_kv = _eps(m.kv_a_layernorm)

    # -- weights ----------------------------------------------------------------------------------
    @property
    def folded(self) -> bool:
        return False        # TransformerLens 4.3 cannot fold norms into MLA: the raw weights are what runs

    def factors(self):
        """The raw factors, row-vector form (detached): dict with W_DQ [d_model, q_lora] (or None), γ_q,
        W_UQ [head, q_lora or d_model, d_qk], W_DKV [d_model, kv_lora], γ_kv [kv_lora], W_KR [d_model, d_rope],
        W_UK [head, kv_lora, d_nope], W_UV [head, kv_lora, d_v], W_O [head, d_v, d_model]."""
        m, H = self.module, self.n_heads
        with torch.no_grad():
            f = {}
            if self.q_lora_rank is None:
                f["W_DQ"], f["g_q"] = None, None
                f["W_UQ"] = m.q_proj.weight.detach().T.reshape(-1, H, self.d_qk).transpose(0, 1)
            else:
                f["W_DQ"] = m.q_a_proj.weight.detach().T
                f["g_q"] = _norm_weight(m.q_a_layernorm)
                f["W_UQ"] = m.q_b_proj.weight.detach().T.reshape(-1, H, self.d_qk).transpose(0, 1)
            kva = m.kv_a_proj_with_mqa.weight.detach().T                      # [d_model, kv_lora + d_rope]
            f["W_DKV"], f["W_KR"] = kva[:, : self.kv_lora_rank], kva[:, self.kv_lora_rank:]
            f["g_kv"] = _norm_weight(m.kv_a_layernorm)
            kvb = m.kv_b_proj.weight.detach().T.reshape(self.kv_lora_rank, H, self.d_nope + self.d_v).transpose(0, 1)
            f["W_UK"], f["W_UV"] = kvb[..., : self.d_nope], kvb[..., self.d_nope:]
            f["W_O"] = m.o_proj.weight.detach().T.reshape(H, self.d_v, -1)
        return f

    def biases(self) -> List[str]:
        names = ["q_a_proj", "q_b_proj", "q_proj", "kv_a_proj_with_mqa", "kv_b_proj"]
        return [n for n in names if getattr(getattr(self.module, n, None), "bias", None) is not None]

    def weights(self) -> LayerWeights:
        """Effective per-head maps through the latents (γ applied, per-position RMS scales left out)."""
        f = self.factors()
        if self.biases():
            raise QKCircuitsError(f"layer {self.layer}: this multi-head latent attention has biases on "
                                  f"{', '.join(self.biases())}; qkcircuits' latent circuits support bias-free MLA "
                                  f"(DeepSeek-V2/V3 as released); capture, scan, ablate and path patching still work")
        with torch.no_grad():
            W_Q = f["W_UQ"] if f["W_DQ"] is None else torch.einsum("mr,r,hrd->hmd", f["W_DQ"], f["g_q"], f["W_UQ"])
            dkv = f["W_DKV"] * f["g_kv"]
            k_nope = torch.einsum("mr,hrd->hmd", dkv, f["W_UK"])
            W_K = torch.cat([k_nope, f["W_KR"][None].expand(self.n_heads, -1, -1)], -1)
            W_V = torch.einsum("mr,hrd->hmd", dkv, f["W_UV"])
            z = lambda d: torch.zeros(self.n_heads, d, dtype=W_Q.dtype, device=W_Q.device)  # noqa: E731
        return LayerWeights(W_Q, W_K, W_V, f["W_O"], z(self.d_qk), z(self.d_qk), z(self.d_v), has_bias=False)

    def latent_qk(self, head: int, R: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
        """QK^h through the KV latent: (A [d_model, kv_lora + d_rope], B [kv_lora + d_rope, d_model]) with
        A = [W_Q,nope^h W_UK^hᵀ | W_Q,rope^h R], B = [γ_kv ⊙ W_DKVᵀ ; W_KRᵀ]: content part + rotary part, the
        latent (and the shared rotary key) as the inner dimension. ``R`` [d_rope, d_rope]: R(Δ), default I."""
        f, W_Q = self.factors(), self.weights().W_Q[head]
        with torch.no_grad():
            qr = W_Q[:, self.d_nope:]
            if R is not None:
                qr = qr @ R.to(qr)
            A = torch.cat([W_Q[:, : self.d_nope] @ f["W_UK"][head].T, qr], 1)
            B = torch.cat([(f["W_DKV"] * f["g_kv"]).T, f["W_KR"].T], 0)
        return A, B

    def latent_ov(self, head: int) -> Tuple[Tensor, Tensor]:
        """OV^h = W_DKV·γ_kv·W_UV^h·W_O^h as (W_DKV ⊙ γ_kv [d_model, kv_lora], W_UV^h W_O^h [kv_lora, d_model])."""
        f = self.factors()
        with torch.no_grad():
            return f["W_DKV"] * f["g_kv"], f["W_UV"][head] @ f["W_O"][head]

    def W_O(self) -> Float[Tensor, "head d_v d_model"]:
        return self.module.o_proj.weight.detach().T.reshape(self.n_heads, self.d_v, -1)

    # -- a head's circuits and what it computes at given inputs -----------------------------------------
    def qk_factors(self, head: int, R: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
        """``latent_qk``: the KV latent and the shared rotary key as the inner dimension (R(Δ) on the rope part)."""
        return self.latent_qk(head, None if R is None else R[self.d_nope:, self.d_nope:])

    def ov_factors(self, head: int) -> Tuple[Tensor, Tensor]:
        """``latent_ov``: the KV latent as the inner dimension."""
        return self.latent_ov(head)

    def qk_at(self, x: Float[Tensor, "batch pos d_model"]) -> Tuple[Tensor, Tensor]:
        """The effective maps' x W, then the latent RMS scales at ``x``: 1/r_q(i) on the query, 1/r_kv(j) on the
        content key (the shared rotary key is not normalised)."""
        w = self.weights()
        q, k = self._factored_qk(x, w)
        s_q, s_kv = (s.double() for s in self.latent_scales(x.to(w.W_Q.dtype)))
        q = q * s_q[:, None, :, None]
        k = torch.cat([k[..., : self.d_nope] * s_kv[:, None, :, None], k[..., self.d_nope:]], -1)
        return q, k

    def writes_at(self, x: Float[Tensor, "batch pos d_model"], head: int) -> Float[Tensor, "batch pos d_model"]:
        """(x W_DKV γ_kv / r_kv(j)) · W_UV^h W_O^h: the OV factors through the latent, its norm at ``x``."""
        A, B = self.ov_factors(head)
        s_kv = self.latent_scales(x.to(A.dtype))[1].double()
        return ((x.double() @ A.double()) * s_kv[..., None]) @ B.double()

    def rows_qk(self, X: Float[Tensor, "n d_model"], head: int) -> Tuple[Tensor, Tensor]:
        """X W_Q, X W_K of the effective maps with both latent norms evaluated at each row (not the rotary key)."""
        w = self.weights()
        X = X.to(w.W_Q.dtype)
        Q, K = X @ w.W_Q[head], X @ w.W_K[head]
        s_q, s_kv = (t[0] for t in self.latent_scales(X[None]))
        return Q * s_q[:, None], torch.cat([K[:, : self.d_nope] * s_kv[:, None], K[:, self.d_nope:]], 1)

    def rows_write(self, X: Float[Tensor, "n d_model"], head: int) -> Tensor:
        """X W_V W_O of the effective maps, the KV latent's norm evaluated at each row."""
        w = self.weights()
        X = X.to(w.W_V.dtype)
        o = (X @ w.W_V[head]) @ w.W_O[head]
        return o * self.latent_scales(X[None])[1][0][:, None]

    def inputs_from_residuals(self, resid: Float[Tensor, "n b p d_model"], into: str, heads) -> Tensor:
        """Head i's input is the layer's own recompute from ``resid[i]`` (``head_inputs``: the latent and its norm
        from that residual, then only head i's up-projection; the decoupled rotary key, shared by every head, is
        recomputed from the same residual, so an edge into head i's k carries the sender's effect through both
        parts). One projection per copy, not one einsum for all: fine at MLA test sizes."""
        return torch.stack([self.head_inputs(resid[i], into)[:, :, h] for i, h in enumerate(heads)], 2)

    def output_module(self) -> Optional[torch.nn.Module]:
        return super().output_module() or self.module.o_proj

    # -- per-position norm scales -----------------------------------------------------------------
    def latent_scales(self, x: Float[Tensor, "batch pos d_model"]) -> Tuple[Tensor, Tensor]:
        """(1/r_q, 1/r_kv) [batch, pos] at attention inputs ``x``: the latent RMSNorms' per-position factors
        (1/r_q = 1 without a query latent)."""
        m = self.module
        with torch.no_grad():
            ckv = m.kv_a_proj_with_mqa(x)[..., : self.kv_lora_rank].float()
            s_kv = torch.rsqrt(ckv.pow(2).mean(-1) + self.eps_kv)
            if self.q_lora_rank is None:
                s_q = torch.ones_like(s_kv)
            else:
                cq = m.q_a_proj(x).float()
                s_q = torch.rsqrt(cq.pow(2).mean(-1) + self.eps_q)
        return s_q.to(x.dtype), s_kv.to(x.dtype)

    # -- scores -----------------------------------------------------------------------------------
    def scale(self) -> Tuple[float, str, Optional[float]]:
        """HF's own ``scaling``: qk_head_dim^-0.5, times YaRN's mscale² under YaRN rope scaling."""
        for name in ("scaling", "softmax_scale"):      # trust_remote_code DeepSeek-V2 calls it softmax_scale
            v = getattr(self.module, name, None)
            if isinstance(v, (int, float)) and v > 0:
                return float(v), f"{type(self.module).__name__}.{name}", None
        return self.d_qk ** -0.5, "qk_head_dim ** -0.5 (assumed; module has no scaling)", None

    def caveats(self) -> List[str]:
        return ["multi-head latent attention: the query latent's and the KV latent's RMSNorms divide the query by "
                "r_q(i) and the content key and value by r_kv(j) (the shared rotary key is not normalised), so the "
                "circuit depends on the input's norm; the contextual token views evaluate the norms at the actual "
                "inputs and are the default"]

    def frozen_factors(self) -> List[str]:
        out = ["the input norm's 1/σ at each position"] if self.input_norm().kind else []
        return out + ["the query and KV latents' RMS scales (the shared rotary key is not normalised)"]

    def rotary_module(self) -> torch.nn.Module:
        for _, mod in self.model.original_model.named_modules():
            if isinstance(getattr(mod, "inv_freq", None), Tensor):
                return mod
        raise QKCircuitsError("cannot find the rotary module (no inv_freq buffer) of this DeepSeek model")

    def _maps(self, side: str, heads: List[int]) -> List[LatentQKMap]:
        """The effective per-head maps through the latent (``weights()``), the input norm's weight in front."""
        w = self.weights()
        norm = self.input_norm()
        rotary = self.rotary(verify=False)                # the callers check the result against the model's pattern
        out = []
        for head in heads:
            Wx = (w.W_Q if side == "q" else w.W_K)[head].double()
            M = Wx if norm.weight is None else norm.weight.double()[:, None] * Wx
            out.append(LatentQKMap(side, head, M, norm, rotary, self.latent_scales, self.d_nope))
        return out

    # -- hooks ------------------------------------------------------------------------------------
    def prepare(self) -> None:
        """Make this layer's hooks fire in qkcircuits' layout [batch, pos, head, d], as on every other family.

        TL 4.3's MLA bridge fires hook_q/k/v as [batch, head, pos, d] and splits hook_z by ``cfg.d_head``
        (wrong for MLA: 8 "heads" of 8 on the tiny fixture instead of 4 of v_head_dim 16). A transpose
        conversion on q/k/v and the right (heads, v_head_dim) on z's own conversion fix both; a hook's
        returned edit is converted back, so edits reach the model unchanged. Idempotent.
        """
        for name in ("hook_q", "hook_k", "hook_v"):
            hp = getattr(self.bridge, name)
            if not isinstance(hp.hook_conversion, _HeadsFirst):
                hp.hook_conversion, hp.pos_dim = _HeadsFirst(), None
        zc = getattr(getattr(self.bridge, "o", None), "hook_in", None)
        conv = getattr(zc, "hook_conversion", None)
        if conv is not None and hasattr(conv, "n_heads") and hasattr(conv, "d_head"):
            conv.n_heads, conv.d_head = self.n_heads, self.d_v

    def rotate(self, t: Float[Tensor, "batch pos head d_rope"], positions: Tensor) -> Tensor:
        """The model's rotary on rope coordinates ``t`` at ``positions`` [pos], in the hook's output layout."""
        rot = self.rotary_module()
        inv = rot.inv_freq.detach().to(torch.float64)
        gain = float(getattr(rot, "attention_scaling", 1.0) or 1.0)
        ang = positions.to(torch.float64)[:, None] * inv[None]                  # [pos, d_rope/2]
        c, s = (ang.cos() * gain).to(t.dtype)[None, :, None], (ang.sin() * gain).to(t.dtype)[None, :, None]
        if self.rope_style == "pairs":
            a, b = t[..., 0::2], t[..., 1::2]
            ra, rb = a * c - b * s, b * c + a * s
            if self.rope_permuted:
                return torch.cat([ra, rb], -1)
            return torch.stack([ra, rb], -1).flatten(-2)
        half = self.d_rope // 2
        a, b = t[..., :half], t[..., half:]
        return torch.cat([a * c - b * s, b * c + a * s], -1)

    def head_inputs(self, resid: Float[Tensor, "batch pos d_model"], into: str) -> Tensor:
        """hook_q / hook_k / hook_v (what enters attention, post-rotary) from the residual entering the block,
        [batch, pos, head, d], through the module's own projections and latent norms."""
        if into not in ("q", "k", "v", "q_latent", "kv_latent"):
            raise QKCircuitsError(f"head_inputs recomputes 'q', 'k', 'v', 'q_latent' or 'kv_latent', got {into!r}")
        m, H = self.module, self.n_heads
        b, p = resid.shape[:2]
        pos = torch.arange(p, device=resid.device)
        # differentiable (the task graph's gradient run goes through it); callers that only read use no_grad
        x = self.block.ln1(resid)
        if into in ("q", "q_latent"):
            if self.q_lora_rank is None:
                if into == "q_latent":
                    raise QKCircuitsError("this DeepSeek layer has q_lora_rank None: no query latent (q = x W_Q)")
                q = m.q_proj(x)
            else:
                lat = m.q_a_layernorm(m.q_a_proj(x))
                if into == "q_latent":
                    return lat
                q = m.q_b_proj(lat)
            q = q.view(b, p, H, self.d_qk)
            return torch.cat([q[..., : self.d_nope], self.rotate(q[..., self.d_nope:], pos)], -1)
        kv = m.kv_a_proj_with_mqa(x)
        lat = m.kv_a_layernorm(kv[..., : self.kv_lora_rank])
        if into == "kv_latent":
            return lat
        up = m.kv_b_proj(lat).view(b, p, H, self.d_nope + self.d_v)
        if into == "v":
            return up[..., self.d_nope:]
        k_r = self.rotate(kv[..., self.kv_lora_rank:][:, :, None], pos).expand(b, p, H, self.d_rope)
        return torch.cat([up[..., : self.d_nope], k_r], -1)

    # -- cache ------------------------------------------------------------------------------------
    def kv_floats(self) -> Tuple[int, int]:
        """(floats this layer caches per token: latent + rotary key, its multi-head equivalent: H·(d_qk + d_v))."""
        return self.kv_lora_rank + self.d_rope, self.n_heads * (self.d_qk + self.d_v)

    def kv_kind(self) -> str:
        return f"MLA: latent {self.kv_lora_rank} + rotary key {self.d_rope}"

    # -- what a capture of this layer may name -------------------------------------------------------
    def activation_refusal(self, names, architecture: str) -> Optional[str]:
        if "q_latent" in names and self.q_lora_rank is None:
            return (f"'q_latent' needs a query latent, and this {architecture} has q_lora_rank None (q = x W_Q "
                    f"directly); capture kv_latent, k_rope, q, k, v or z")
        return None

    def shared_by_heads(self, name: str) -> bool:
        return name in ("q_latent", "kv_latent", "rot_k", "k_rope")


class _HeadsFirst:
    """Hook conversion [batch, head, pos, d] -> [batch, pos, head, d] (and back for edits)."""

    splits_attention_heads = True

    def convert(self, t, *context):
        return t.transpose(1, 2) if isinstance(t, Tensor) and t.dim() == 4 else t

    def revert(self, t, *context):
        return t.transpose(1, 2) if isinstance(t, Tensor) and t.dim() == 4 else t


def _norm_weight(mod) -> Tensor:
    w = getattr(mod, "weight", None)
    if w is None:
        raise QKCircuitsError(f"{type(mod).__name__} has no weight; expected DeepSeek's RMSNorm on the latent")
    return w.detach()


def _eps(mod) -> float:
    for name in ("variance_epsilon", "eps"):
        v = getattr(mod, name, None)
        if isinstance(v, float):
            return v
    return 1e-6


