"""Copying: Elhage's eigenvalue score and ARENA's full-vocabulary top-1 copying accuracy.

>>> [[round(float(x), 2) for x in row] for row in copying_scores(model)]   # [layer, head]: Σλ/Σ|λ| of W_E OV W_U
[[0.0, 0.0], [0.94, 0.0]]
>>> [[round(float(x), 2) for x in row] for row in copying_scores(model, full=False)]     # of OV alone
[[0.0, 0.0], [0.0, 0.0]]
>>> round(float(copying_accuracy(model, "1.0")), 2)   # share of tokens whose full-OV row peaks at itself
0.97

Eigenvalues come from the small side: the non-zero eigenvalues of E·V·O·U [vocab, vocab]
are those of O·(U·E)·V [d_head, d_head] (eig(AB) = eig(BA) for the non-zero part), with
G = U·E [d_model, d_model] formed once. Nothing of size vocab² or d_model² per head is formed.
"""

from __future__ import annotations

from typing import Optional

import torch
from jaxtyping import Float
from torch import Tensor

from .._foundation.errors import QKCircuitsError
from .._foundation.heads import HeadsLike
from .._foundation.io import check_int
from .._foundation.arch.norms import block_norm, norm_kind
from .qk_ov import to_head, embed_factor, is_folded, layer_weights, unembed_embed, unembed_factor


def eigen_copying(eigenvalues: Tensor) -> Tensor:
    """sum(λ)/sum(|λ|) over the last dim (complex λ): +1 for a pure copier, −1 for a pure anti-copier."""
    lam = eigenvalues.to(torch.complex128) if not eigenvalues.is_complex() else eigenvalues
    den = lam.abs().sum(-1)
    return torch.where(den > 0, lam.sum(-1).real / den.clamp_min(1e-300), torch.zeros_like(den)).float()


def _check_square_vocab(model) -> None:
    if model.W_E.shape[0] != model.W_U.shape[-1]:
        raise QKCircuitsError(f"the full OV circuit is square only when d_vocab == d_vocab_out; this model has "
                              f"{model.W_E.shape[0]} and {model.W_U.shape[-1]}; use full=False")


def copying_scores(model, full: bool = True, normalize: bool = True) -> Float[Tensor, "layer head"]:
    """Eigenvalue copying score of every head's OV circuit (``full=False``) or of W_E OV W_U (``full=True``).

    One convention in both fold modes (equal with and without ``fold_ln`` to 1e-4): the ln1 weight sits
    with W_V (``fold_ln`` folds it there; raw weights apply it to E, the same product), no norm bias,
    U = W_U through the final norm's weight and centring, centred over the vocabulary
    (``unembed_embed(..., center_vocab=True)``).

    Memory: one [d_vocab, d_model] normalised W_E and one [d_model, d_model] G = U·E (float32 product, eigenproblems in float64), then
    [n_heads, d_head, d_head] per layer. Time: one vocab·d_model² product, then tiny eigenproblems.
    """
    L, H = model.cfg.n_layers, model.cfg.n_heads
    out = torch.zeros(L, H)
    G = None
    per_layer = full and not (is_folded(model) or not normalize or norm_kind(model) is None)
    if full:
        _check_square_vocab(model)
        if not per_layer:
            G = unembed_embed(model, 0, normalize, center_vocab=True).double()    # same for every layer
    for layer in range(L):
        w = layer_weights(model, layer)
        with torch.no_grad():
            V, O = w.W_V.double(), w.W_O.double()
            if not full and normalize:
                V, O = _fold_convention(model, layer, V, O)
            if not full:
                core = O @ V                                                      # eig(V O) = eig(O V)
            else:
                G_l = G if G is not None else unembed_embed(model, layer, normalize, center_vocab=True).double()
                core = O @ _times_shared(G_l, V)                                  # [H, d_head, d_head]
            out[layer] = eigen_copying(torch.linalg.eigvals(core)).cpu()
    return out


def _times_shared(G: Tensor, V: Tensor) -> Tensor:
    """G @ V[h] for every head, formed once per distinct W_V (query heads of one KV group share theirs, GQA/MQA):
    [H, d_model, d_head]. O (G V) instead of (O G) V: the products G·V are d_model² · d_head per distinct head
    where O·G was d_head · d_model² per query head (SmolLM2's 3 KV heads: 3x fewer)."""
    first, index = [], []
    for h in range(V.shape[0]):
        same = next((i for i, f in enumerate(first) if torch.equal(V[f], V[h])), None)
        if same is None:
            same = len(first)
            first.append(h)
        index.append(same)
    return (G @ V[first])[index]


def _fold_convention(model, layer: int, V: Tensor, O: Tensor) -> "tuple[Tensor, Tensor]":
    """W_V/W_O as ``fold_ln`` leaves them, from raw weights: the ln1 weight moved into W_V and, for
    LayerNorm, the centring folded in (W_V centred over its input, W_O over its output). Identity when
    the model is folded already or has no norm."""
    norm = block_norm(model, layer)
    if norm.folded or norm.kind is None:
        return V, O
    if norm.weight is not None:
        V = norm.weight.double()[None, :, None] * V
    if norm.kind == "LN":
        V = V - V.mean(1, keepdim=True)
        O = O - O.mean(-1, keepdim=True)
    return V, O


def copying_accuracy(model, head: Optional[HeadsLike] = None, *, normalize: bool = True,
                     max_bytes: int = 128 * 2 ** 20, progress: bool = True) -> Tensor:
    """ARENA's full-OV top-1 copying accuracy: the share of tokens t whose row of E_n·OV·U has its argmax at t.

    ``head=None`` scores every head ([layer, head]); else a 0-d tensor. Rows are done in chunks of
    ``max_bytes // (element size · vocab)`` (4 bytes for float32, 8 for float64) so the working set
    is ``max_bytes`` (default 128 MiB; at least one row) plus the
    factors A = E_n W_V [vocab, d_head] and B = W_O U [d_head, vocab] (built in chunks of
    ``CHUNK_ROWS`` vocabulary rows: no normalised [vocab, d_model] copy is held).
    """
    _check_square_vocab(model)
    vocab = model.W_E.shape[0]
    max_bytes = check_int("max_bytes", max_bytes)
    heads = [to_head(model, head)] if head is not None else None
    L, H = model.cfg.n_layers, model.cfg.n_heads
    out = torch.full((L, H), float("nan"))
    todo = [(h.layer, h.head) for h in heads] if heads else [(l, h) for l in range(L) for h in range(H)]
    bar = _bar(todo, progress and len(todo) > 1)
    cache_layer, w = None, None
    for layer, h in bar:
        if layer != cache_layer:
            w, cache_layer = layer_weights(model, layer), layer
        with torch.no_grad():
            A = embed_factor(model, w.W_V[h], layer, normalize)                    # [vocab, d_head]
            B = unembed_factor(model, w.W_O[h], normalize)                         # [d_head, vocab]
            chunk = max(1, max_bytes // (A.element_size() * vocab))                 # rows of the weights' dtype
            hits = 0
            buf = torch.empty(min(chunk, vocab), B.shape[1], dtype=A.dtype, device=A.device)   # the one chunk
            for s in range(0, vocab, chunk):
                rows = torch.mm(A[s:s + chunk], B, out=buf[:min(chunk, vocab - s)])   # [chunk, vocab]
                hits += int((rows.argmax(-1) == torch.arange(s, s + rows.shape[0], device=rows.device)).sum())
            del buf, rows
        out[layer, h] = hits / vocab
    return out[heads[0].layer, heads[0].head] if heads else out


def _bar(items, show: bool):
    if not show:
        return items
    from .._foundation.progress import progress_bar
    return progress_bar(items, desc="copying accuracy", unit="head")
