"""Positions in the QK circuit: learned absolute (W_pos QK W_posᵀ) and rotary (QK at a relative offset).

On SmolLM2 (the doctest model has no rotary; tests/test_doc_claims.py checks these on SmolLM2):

>>> spec = rotary_spec(smollm2)                 # doctest: +SKIP (needs SmolLM2)
>>> {k: spec.describe()[k] for k in ("style", "base")}        # doctest: +SKIP (needs SmolLM2)
{'style': 'halves', 'base': 100000.0}
>>> M = qk_at_offset(smollm2, "3.1", 1)         # doctest: +SKIP (needs SmolLM2)

``qk_at_offset(model, head, δ)`` is W_Q R(δ) W_Kᵀ (query at i, key at i − δ); ``offset_scores(model, layer, x)``
is x_i · QK(i − j) · x_jᵀ · scale for every head, [head, q, k].

Rotary embeddings rotate q at position i and k at position j by angles i·ω and j·ω per pair of
coordinates, so q_i·k_j = q R(i−j) kᵀ: the score depends on positions only through the offset
Δ = i − j (≥ 0 under causal masking; the issue's "QK(j−i)" is the same matrix named by the key's
displacement). QK(Δ) = W_Q R(Δ) W_Kᵀ. ``R`` is built from the model's own frequencies (the HF
rotary module's ``inv_freq`` and ``attention_scaling``, or the TL-native rotary's), never from
``cfg.rotary_base`` (which is wrong for SmolLM2: 10000 vs the true 100000), and its pairing is
detected by rotating the model's own layer-0 queries: ``halves`` (HF ``rotate_half``: coordinate
k pairs with k + rotary_dim/2) or ``pairs`` (adjacent 2k, 2k+1: the TL-native model, GPT-J).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from jaxtyping import Float
from torch import Tensor
from transformer_lens.FactoredMatrix import FactoredMatrix

from .._foundation.arch import adapter
from .._foundation.arch.layer_rotary import has_rotary, rotate_native  # noqa: F401 (re-exported)
from .._foundation.attention import layer_type, native_rotary, sliding_window  # noqa: F401 (re-exported)
from .._foundation import display as show
from .._foundation.result import Result, stamped
from .._foundation.rope import STYLES, RotarySpec, rotate, rotation  # noqa: F401 (re-exported)
from .._foundation.errors import QKCircuitsError
from .._foundation.model_cache import remembered
from .._foundation.arch.model_facts import positional
from .._foundation.heads import HeadsLike
from .._foundation.io import json_floats, read_floats
from .qk_ov import CHUNK_ROWS, to_head, attn_scale, is_folded, layer_weights, normalize_rows, warn_caveats


def rotary_spec(model, base: Optional[float] = None, verify: bool = True, layer: int = 0) -> RotarySpec:
    """The rotary settings of ``layer`` (its own frequencies where the model keeps one set per layer type), as
    its architecture adapter reads them (``_foundation/arch/layer_rotary``); ``base`` replaces the frequencies with
    base^(−2k/rotary_dim) (e.g. to show that a wrong base breaks the identity). ``verify`` rotates the layer's
    queries of a short sequence and compares them with the model's own ``hook_rot_q`` (one partial forward,
    once per layer: the adapter keeps the verified spec). Returns a copy the caller may change."""
    if not has_rotary(model):
        raise QKCircuitsError(f"this model has positional embedding type "
                              f"{positional(model)!r}, not rotary; use "
                              f"qk() (and positional_qk() for learned positions)")
    n_layers = int(model.cfg.n_layers)
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < n_layers:
        raise QKCircuitsError(f"layer {layer!r} is out of range: the model has layers 0-{n_layers - 1}")
    spec = copy.deepcopy(adapter(model, layer).rotary(verify=verify))
    if base is not None:
        if not base > 1:
            raise QKCircuitsError(f"rotary base must be > 1, got {base!r}")
        k = torch.arange(0, spec.rotary_dim, 2, dtype=torch.float64)
        spec.omega = (1.0 / float(base) ** (k / spec.rotary_dim)).float()
        spec.base, spec.source, spec.verified_error = float(base), f"override base {base:g}", None
    return spec


def _spec_for(model, layer: int, spec: Optional[RotarySpec]) -> RotarySpec:
    """``spec`` if given (the caller's choice, e.g. a wrong base on purpose), else ``layer``'s own."""
    return spec if spec is not None else rotary_spec(model, layer=int(layer))


def qk_at_offset(model, head: HeadsLike, offset: int, *, spec: Optional[RotarySpec] = None,
                 affine: bool = False) -> FactoredMatrix:
    """QK(Δ) = W_Q R(Δ) W_Kᵀ [d_model, d_model] for query position i and key position j = i − Δ.

    Score = x_i · QK(Δ) · x_jᵀ · ``attn_scale(model, layer)``. ``affine=True`` gives the form on
    [x, 1] with b_Q/b_K (which are rotated with q/k). Memory: two [d_model(+1), d_head] factors.
    """
    h = to_head(model, head)
    warn_caveats(model, "the QK circuit at an offset")
    spec = _spec_for(model, h.layer, spec)
    R = rotation(spec, [int(offset)], relative=True)[0]
    if not affine:                               # the adapter's factors (MLA: through the KV latent + rotary at Δ)
        return FactoredMatrix(*adapter(model, h.layer).qk_factors(h.head, R))
    return _qk_offset(layer_weights(model, h.layer), h.head, R, affine)


def _qk_offset(w, head: int, R: Tensor, affine: bool) -> FactoredMatrix:
    Q, K = w.W_Q[head], w.W_K[head]
    if affine:
        Q, K = torch.cat([Q, w.b_Q[head][None]], 0), torch.cat([K, w.b_K[head][None]], 0)
    return FactoredMatrix(Q @ R.to(device=Q.device, dtype=Q.dtype), K.T)   # no copy when R is there already


def offset_scores(model, layer: int, x: Float[Tensor, "pos d_model"], *, spec: Optional[RotarySpec] = None,
                  heads: Optional[Sequence[int]] = None, affine: bool = True) -> Float[Tensor, "head pos pos"]:
    """Scores every (i, j ≤ i) from residual rows ``x`` through the circuits: x_i·QK(i−j)·x_jᵀ·scale.

    Rotary models use ``qk_at_offset``; others the (affine) QK. Entries j > i are NaN. Computed on
    the weights' device and dtype; returned on ``x``'s. Memory: one [pos, pos] grid per head plus
    the pos rotations [pos, d_head, d_head].
    """
    warn_caveats(model, "the bilinear score")
    x = x.detach()
    p = x.shape[0]
    heads = list(range(model.cfg.n_heads)) if heads is None else list(heads)
    scale = attn_scale(model, layer)
    rotary = has_rotary(model)
    spec = _spec_for(model, layer, spec) if rotary else None
    xa = torch.cat([x, torch.ones(p, 1, dtype=x.dtype, device=x.device)], 1) if affine else x
    w = layer_weights(model, layer)                                  # read once; every offset reuses it
    dev, dt = w.W_Q.device, w.W_Q.dtype
    # Rows, every R(Δ) (or the identity), the position index and the result live on the weights'
    # device, moved there once: nothing crosses devices inside the loops.
    out = torch.full((len(heads), p, p), float("nan"), dtype=dt, device=dev)
    Rs = rotation(spec, range(p), relative=True).to(device=dev, dtype=dt) if rotary \
        else torch.eye(w.W_Q.shape[-1], dtype=dt, device=dev)[None]
    pos = torch.arange(p, device=dev)
    x_w = xa.to(device=dev, dtype=dt)
    with torch.no_grad():
        for n, hd in enumerate(heads):
            for d in (range(p) if rotary else [None]):
                # the same FactoredMatrix qk_at_offset / qk_affine / qk return
                M = _qk_offset(w, hd, Rs[d or 0], affine)
                left, right = x_w @ M.A, (M.B @ x_w.T).T                         # [p, d_head] each
                if d is None:
                    out[n] = torch.tril(left @ right.T) + torch.triu(out[n], 1)
                else:
                    i = pos[d:]
                    out[n, i, i - d] = (left[i] * right[i - d]).sum(-1)
    return (out * scale).to(device=x.device, dtype=x.dtype)


def positional_qk(model, head: HeadsLike, normalize: bool = False) -> FactoredMatrix:
    """Learned absolute positions: W_pos QK W_posᵀ [n_ctx, n_ctx] (rows query positions, columns key positions).

    ``normalize`` treats each W_pos row as a whole residual (an approximation: the model normalises
    W_E[t] + W_pos[p] together).
    """
    if positional(model) not in ("standard", "shortformer"):
        raise QKCircuitsError(f"positional_qk needs learned absolute positions; this model has "
                              f"{model.cfg.positional_embedding_type!r} (use qk_at_offset for rotary models)")
    h = to_head(model, head)
    warn_caveats(model, "the positional QK circuit")
    w = layer_weights(model, h.layer)
    P = model.W_pos.detach()
    if normalize:
        P = normalize_rows(model, P, "ln1", h.layer)
    with torch.no_grad():
        return FactoredMatrix(P @ w.W_Q[h.head], (P @ w.W_K[h.head]).T)


@dataclass(frozen=True, repr=False)      # the repr is _text (Result)
class OffsetProfile(Result):
    """Per-head score against offset: ``mean_score[Δ]`` = scale · q̄ R(Δ) k̄ᵀ for the mean query/key of
    the rows used, and ``norm[Δ]`` = scale · ‖QK(Δ)‖_F; ``settings`` says which rows and rotary."""

    SCHEMA = "qkcircuits.offset_profile/1"
    WHAT = "a qkcircuits offset-profile JSON"
    KEYS = ("head", "offsets", "mean_score", "norm")

    head: str
    offsets: Tensor
    mean_score: Tensor
    norm: Tensor
    settings: Dict[str, object]

    def summary(self) -> Dict[str, object]:
        i = int(self.mean_score.argmax())
        return {"head": self.head, "preferred_offset": int(self.offsets[i]), "score_at_preferred": float(self.mean_score[i]),
                "score_at_0": float(self.mean_score[0]), "score_range": float(self.mean_score.max() - self.mean_score.min()),
                "offsets": [int(self.offsets[0]), int(self.offsets[-1])]}

    def top(self, k: int = 5) -> List[Tuple[int, float]]:
        """The ``k`` offsets with the highest mean score, highest first: ``(offset, mean score)``."""
        idx = self.mean_score.float().topk(min(k, self.mean_score.numel())).indices.tolist()
        return [(int(self.offsets[i]), float(self.mean_score[i])) for i in idx]

    def to_frame(self):
        """One row per offset: offset, mean_score, norm."""
        import pandas as pd

        return pd.DataFrame({"offset": self.offsets.tolist(), "mean_score": self.mean_score.tolist(),
                             "norm": self.norm.tolist()})

    def to_dict(self) -> Dict[str, Any]:
        return {"head": self.head, "offsets": [int(x) for x in self.offsets.tolist()],
                "mean_score": json_floats(self.mean_score), "norm": json_floats(self.norm), "settings": self.settings}

    @classmethod
    def _from_dict(cls, d: Dict[str, Any]) -> "OffsetProfile":
        return cls(str(d["head"]), torch.tensor([int(x) for x in d["offsets"]]),
                   read_floats(d["mean_score"]), read_floats(d["norm"]),
                   d.get("settings", {}))

    def _text(self) -> str:
        sm = self.summary()
        return (f"OffsetProfile(head {self.head}; offsets {sm['offsets'][0]}..{sm['offsets'][1]}; preferred offset "
                f"{sm['preferred_offset']} (score {show.number(sm['score_at_preferred'])}); score at 0 "
                f"{show.number(sm['score_at_0'])})")

    def _html(self) -> str:
        sm = self.summary()
        y = self.mean_score.float()[:: max(1, self.mean_score.numel() // 256)].tolist()   # at most ~256 points
        lo, hi = min(y), max(y)
        pts = " ".join(f"{i * 300 / max(1, len(y) - 1):.1f},{55 - 50 * (v - lo) / ((hi - lo) or 1):.1f}"
                       for i, v in enumerate(y))
        svg = (f'<div class="m">mean score against offset Δ ({sm["offsets"][0]} … {sm["offsets"][1]})</div>'
               f'<svg width="310" height="60"><polyline fill="none" stroke="#2a6fb0" points="{pts}"/></svg>')
        return show.box(f"OffsetProfile: head {self.head}", show.table([(k, str(v)) for k, v in sm.items()]), svg)



def offset_profile(model, head: HeadsLike, offsets: Iterable[int] = range(0, 65),
                   x: Optional[Float[Tensor, "n d_model"]] = None, *, spec: Optional[RotarySpec] = None) -> OffsetProfile:
    """How much a rotary head's score depends on the offset alone, for content ``x``.

    ``x``: residual rows feeding the head's layer (``attn_input_hook``); default every token's
    normalised embedding (exact input only at layer 0). Only the rows' mean enters (mean(x W) = mean(x) W);
    for the embeddings it is computed in chunks and cached per model while W_E is unchanged.
    Memory: [n_offsets, d_head, d_head] plus one [d_model] mean row per layer kind.
    """
    h = to_head(model, head)
    spec = _spec_for(model, h.layer, spec)
    w = layer_weights(model, h.layer)
    offs = list(offsets)
    if not offs or min(offs) < 0:
        raise QKCircuitsError(f"offsets must be a non-empty list of integers >= 0, got {offs[:5]}")
    scale = attn_scale(model, h.layer)
    with torch.no_grad():
        # mean(rows W) = mean(rows) W: one [d_model] mean row (cached for the embeddings), not [n, d_head] per head
        xbar = (_mean_embed_row(model, h.layer) if x is None else x.detach().float().mean(0)).to(w.W_Q.dtype)
        qbar = xbar @ w.W_Q[h.head] + w.b_Q[h.head]
        kbar = xbar @ w.W_K[h.head] + w.b_K[h.head]
        R = rotation(spec, offs, relative=True).to(qbar.dtype).to(qbar.device)       # [n, d, d]
        mean = torch.einsum("d,nde,e->n", qbar, R, kbar) * scale
        # ‖W_Q R W_Kᵀ‖_F = ‖R_q R R_kᵀ‖_F with W = Q·R_w (QR): computed on the d_head side only
        Rq, Rk = torch.linalg.qr(w.W_Q[h.head])[1], torch.linalg.qr(w.W_K[h.head])[1]
        norm = torch.linalg.matrix_norm(Rq @ R @ Rk.T, "fro") * abs(scale)
    settings = {"rotary": spec.describe(), "caveats": warn_caveats(model, "the offset profile") + list(spec.caveats),
                "rows": "normalised token embeddings" if x is None else f"{x.shape[0]} given rows",
                "attn_scale": scale}
    return OffsetProfile(str(h), torch.tensor(offs), mean.cpu(), norm.cpu(), stamped(settings, model, name=True))


def _mean_embed_row(model, layer: int) -> Float[Tensor, "d_model"]:
    """The mean over the vocabulary of ``embed_rows(model, layer)`` (float32), in chunks of ``CHUNK_ROWS`` rows:
    no normalised [vocab, d_model] copy. Remembered per model while W_E is unchanged (``model_cache``,
    ``depends="embed"``); under ``fold_ln`` every layer's rows are the same, so one mean serves all layers."""
    E = model.W_E.detach()

    def mean() -> Tensor:
        total = torch.zeros(E.shape[1], dtype=torch.float64, device=E.device)
        with torch.no_grad():
            for s in range(0, E.shape[0], CHUNK_ROWS):
                total += normalize_rows(model, E[s:s + CHUNK_ROWS], "ln1", int(layer)).double().sum(0)
        return (total / E.shape[0]).float()
    return remembered(model, "mean embed row", None if is_folded(model) else int(layer), mean, depends="embed")
