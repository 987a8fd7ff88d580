"""Every head as its QK and OV circuit, as ``FactoredMatrix`` (never materialising d_model² or vocab²).

>>> M = qk.qk(model, "1.0")                 # W_Q W_Kᵀ [d_model, d_model], factored (the toy: d_model 224)
>>> tuple(M.shape), tuple(M.A.shape)
((224, 224), (224, 129))
>>> tuple(qk.ov(model, "1.0").shape)          # W_V W_O
(224, 224)
>>> F = qk.weights.full_ov(model, "1.0")      # W_E W_V W_O W_U [vocab, vocab] as A [vocab, k] @ B [k, vocab]
>>> tuple(F.shape), tuple(F.A.shape)
((32, 32), (32, 129))
>>> values, ids = qk.weights.top_tokens(F, 5, k=2)  # one row: token 5 read, the tokens written most (the toy copies)
>>> ids.tolist()[0], round(float(values[0]), 2)
(5, 30.0)

Conventions (TransformerLens, row vectors): a residual row x produces q = x W_Q + b_Q and
k = x W_K + b_K, so the score is x_i W_Q W_Kᵀ x_jᵀ (plus bias terms); QK = W_Q W_Kᵀ is the
transpose of the papers' column-vector W_Qᵀ W_K, and OV = W_V W_O is the transpose of W_O W_V.
The score the model applies softmax to is that bilinear form times ``attn_scale(model, layer)``.

Grouped-query attention: query head h reads KV head ``h // (n_heads // n_kv_heads)``; every
function here expands W_K/W_V (and b_K/b_V) to one slice per query head.

Biases: ``qk``/``ov`` are the bias-free bilinear parts. ``qk_affine``/``ov_affine`` are the exact
forms on the augmented row [x, 1] (b_Q/b_K/b_V appended as a last row of the factors); bias-free
models (Llama, SmolLM2) get zero rows, so the affine form equals the plain one there. b_O is not
per head and is left out of every circuit.

Inputs: W_Q reads ``attn_input_hook(model, layer)`` = ``blocks.L.ln1.hook_out``. With ``fold_ln``
(the default of ``qk.load``) that is the normalised residual ``ln1.hook_normalized`` (the norm's
weight is folded into W_Q/W_K/W_V); with raw weights it is normalised × weight (+ bias).
"""

from __future__ import annotations

import warnings
from typing import List, Tuple

import torch
from jaxtyping import Float
from torch import Tensor
from transformer_lens.FactoredMatrix import FactoredMatrix

from .._foundation.arch import LayerWeights, adapter  # noqa: F401  (LayerWeights re-exported)
from .._foundation.arch.norms import block_norm, final_norm
from .._foundation.attention import attention_scale, sliding_window  # noqa: F401  (re-exported: the one scale reader)
from .._foundation.errors import QKCircuitsError
from .._foundation.arch.model_facts import positional, rope_type
from .._foundation.heads import Head, HeadsLike, model_heads


# ---------------------------------------------------------------------------------------------- weights

def layer_weights(model, layer: int) -> LayerWeights:
    """Detached per-query-head weights of ``layer``, from its architecture adapter (``_foundation.arch``).

    Standard attention: TL's W_Q/W_K/W_V/W_O with K/V expanded to query heads (GQA/MQA). Multi-head latent
    attention: the effective maps through the latents (docs/circuits.md). Memory: 4 · n_heads · d_model · d_head
    floats.
    """
    return adapter(model, layer).weights()


def to_head(model, head) -> Head:
    heads = model_heads(model, [head] if isinstance(head, Head) else head)
    if len(heads) != 1:
        raise QKCircuitsError(f"expected one head, got {len(heads)} from {head!r}; name one, e.g. '3.1'")
    return heads[0]


def qk(model, head: HeadsLike) -> FactoredMatrix:
    """QK circuit of one head: ``FactoredMatrix(W_Q, W_Kᵀ)``, [d_model, d_model] (papers: W_Qᵀ W_K)."""
    h = to_head(model, head)
    warn_caveats(model, "the QK circuit")
    return FactoredMatrix(*adapter(model, h.layer).qk_factors(h.head))      # MLA: the KV latent inside


def ov(model, head: HeadsLike) -> FactoredMatrix:
    """OV circuit of one head: ``FactoredMatrix(W_V, W_O)``, [d_model, d_model] (papers: W_O W_V).

    Multi-head latent attention: ``FactoredMatrix(W_DKV γ_kv, W_UV^h W_O^h)``, the KV latent as the inner dimension."""
    h = to_head(model, head)
    return FactoredMatrix(*adapter(model, h.layer).ov_factors(h.head))


def qk_affine(model, head: HeadsLike) -> FactoredMatrix:
    """Exact pre-rotary score form on [x, 1]: [x_i, 1] · M · [x_j, 1]ᵀ = q_i · k_j, M [d_model+1, d_model+1].

    M = [[W_Q], [b_Q]] · [[W_K], [b_K]]ᵀ: the four terms x W_Q W_Kᵀ yᵀ + x W_Q b_Kᵀ + b_Q W_Kᵀ yᵀ + b_Q b_Kᵀ.
    (x W_Q b_Kᵀ is constant over keys and cancels in softmax; b_Q W_Kᵀ yᵀ does not.)
    """
    h = to_head(model, head)
    warn_caveats(model, "the QK circuit")
    w = layer_weights(model, h.layer)
    A = torch.cat([w.W_Q[h.head], w.b_Q[h.head][None]], 0)
    B = torch.cat([w.W_K[h.head], w.b_K[h.head][None]], 0)
    return FactoredMatrix(A, B.T)


def ov_affine(model, head: HeadsLike) -> FactoredMatrix:
    """Exact per-head write on [x, 1]: [x, 1] · M = x W_V W_O + b_V W_O, M [d_model+1, d_model] (b_O excluded)."""
    h = to_head(model, head)
    w = layer_weights(model, h.layer)
    return FactoredMatrix(torch.cat([w.W_V[h.head], w.b_V[h.head][None]], 0), w.W_O[h.head])


def all_qk(model) -> FactoredMatrix:
    """QK of every head: [n_layers, n_heads, d_model, d_model] (GQA-expanded). Memory: the stacked weights."""
    warn_caveats(model, "the QK circuit")
    ws = [layer_weights(model, layer) for layer in range(model.cfg.n_layers)]
    return FactoredMatrix(torch.stack([w.W_Q for w in ws]), torch.stack([w.W_K for w in ws]).transpose(-1, -2))


def all_ov(model) -> FactoredMatrix:
    """OV of every head: [n_layers, n_heads, d_model, d_model] (GQA-expanded)."""
    ws = [layer_weights(model, layer) for layer in range(model.cfg.n_layers)]
    return FactoredMatrix(torch.stack([w.W_V for w in ws]), torch.stack([w.W_O for w in ws]))


# ------------------------------------------------------------------------------------- scale, inputs

def attn_scale(model, layer: int) -> float:
    """The multiplier the model applies to q·k before softmax (its own setting, not a guess from d_head).

    The factor of ``attention_scale`` (which also says where it was read and the soft-cap, if any).
    """
    return attention_scale(model, layer)[0]


def attn_input_hook(model, layer: int) -> str:
    """Hook holding the rows W_Q/W_K/W_V read (``ln1.hook_out``; == ``ln1.hook_normalized`` under fold_ln)."""
    return f"blocks.{int(layer)}.ln1.hook_out"


def is_folded(model) -> bool:
    """Whether normalisation weights are folded into the attention weights (``qk.load(fold_ln=True)``;
    never on multi-head latent attention, which TransformerLens 4.3 cannot fold)."""
    return adapter(model, 0).folded


def normalize_rows(model, x: Float[Tensor, "n d_model"], which: str = "ln1", layer: int = 0,
                   bias: bool = True) -> Float[Tensor, "n d_model"]:
    """Apply the model's normalisation to each row as if it were the whole residual at that point.

    Under fold_ln only the centring (LayerNorm) and the per-row scale remain; with raw weights the
    norm's weight (and, unless ``bias=False``, its bias) are applied too. ``which`` is ``"ln1"``
    (before attention) or ``"ln_final"``.
    """
    norm = final_norm(model) if which == "ln_final" else block_norm(model, layer)
    if norm.kind is None:
        return x
    if norm.kind == "LN":
        x = x - x.mean(-1, keepdim=True)
    x = x / (x.pow(2).mean(-1, keepdim=True) + norm.eps).sqrt()
    if not norm.folded:
        if norm.weight is not None:
            x = x * norm.weight
        if bias and norm.bias is not None:
            x = x + norm.bias
    return x


# ---------------------------------------------------------------------------------------- caveats

def circuit_caveats(model) -> List[str]:
    """Ways in which the bilinear form is *not* the whole attention score of this model.

    Checked: query/key normalisation inside attention, attention-logit soft-capping, sliding-window
    (local) attention, ALiBi/relative position biases, rotary settings that depend on the sequence
    length. An empty list means the score is exactly (bilinear form) × ``attn_scale``.
    """
    cfg, out = model.cfg, []
    first = adapter(model, 0)
    out += first.caveats()
    if first.qk_norm:
        out.append("QK-norm: q and k are RMS-normalised per position inside attention, so scores are not x·QK·yᵀ "
                   "(the circuit is right only up to per-position scales; rotary is applied after the norm)")
    cap = max(float(adapter(model, layer).softcap() or -1) for layer in range(int(cfg.n_layers)))
    if cap > 0:
        out.append(f"attention logits are soft-capped (cap·tanh(s/cap), cap={cap:g}): the bilinear form is the "
                   f"pre-cap score")
    windows = {layer: sliding_window(model, layer) for layer in range(int(cfg.n_layers))}
    sliding = sorted(layer for layer, w in windows.items() if w)
    if sliding:
        which = "every layer" if len(sliding) == len(windows) else f"layers {', '.join(map(str, sliding))}"
        out.append(f"sliding-window attention (window {windows[sliding[0]]}) on {which}: keys further back than the "
                   f"window are masked whatever the circuit says")
    pet = positional(model)
    if pet not in ("standard", "rotary", "shortformer"):
        out.append(f"positional embedding type {pet!r} adds a position bias to the scores that the QK circuit "
                   f"does not contain")
    rtype = rope_type(model)
    if rtype in ("dynamic", "longrope"):
        out.append(f"rotary type {rtype!r} changes its frequencies with the sequence length: offset circuits "
                   f"use the short-context frequencies")
    return out


def warn_caveats(model, what: str) -> List[str]:
    """Return ``circuit_caveats(model)`` and warn (UserWarning; Python shows it once per call site) if any."""
    cav = circuit_caveats(model)
    if cav:
        warnings.warn(f"{what} is not the whole attention score on this model: " + "; ".join(cav),
                      UserWarning, stacklevel=3)
    return cav


# ------------------------------------------------------------------------------------ token circuits

def embed_rows(model, layer: int = 0, normalize: bool = True) -> Float[Tensor, "vocab d_model"]:
    """W_E with each row normalised as the input of ``layer``'s attention would be (see module docs).

    Exact for the direct path when a token's embedding is the whole residual (layer 0 of a rotary
    model); with learned positions (GPT-2) the position is left out, an approximation.
    Memory: one [d_vocab, d_model] copy.
    """
    with torch.no_grad():
        E = model.W_E.detach()
        return normalize_rows(model, E, "ln1", layer) if normalize else E


def unembed_cols(model, normalize: bool = True) -> Float[Tensor, "d_model vocab_out"]:
    """W_U as the head's output reaches it: with raw weights the final norm's weight (and LayerNorm
    centring) applied; the final norm's positive per-position scale is left out (it does not change
    which token a row ranks first); b_U and the final norm's bias are left out (not the head's doing).
    Memory: a [d_model, vocab_out] copy unless folded RMSNorm (then W_U itself); see ``unembed_factor``."""
    with torch.no_grad():
        return unembed_chunk(model, model.W_U.detach(), normalize)


def unembed_chunk(model, U: Tensor, normalize: bool) -> Tensor:
    """Apply the final norm's weight / centring to columns ``U`` [d_model, n] (column-local, so chunkable)."""
    norm = final_norm(model)
    if not normalize or norm.kind is None:
        return U
    if not norm.folded and norm.weight is not None:
        U = norm.weight[:, None] * U
    if norm.kind == "LN":
        U = U - U.mean(0, keepdim=True)   # the centred input x C with C symmetric: x C W = x (C W)
    return U


CHUNK_ROWS = 4096   # vocabulary rows normalised at a time: bounds temporaries to 3 · CHUNK_ROWS · d_model floats


def embed_factor(model, W: Float[Tensor, "d_model k"], layer: int = 0, normalize: bool = True
                 ) -> Float[Tensor, "vocab k"]:
    """``embed_rows(model, layer) @ W`` without holding the normalised embedding (chunks of rows).

    Memory: the [vocab, k] result plus 3 · CHUNK_ROWS · d_model floats.
    """
    E = model.W_E.detach()
    with torch.no_grad():
        out = torch.empty(E.shape[0], W.shape[-1], dtype=W.dtype, device=W.device)
        for s in range(0, E.shape[0], CHUNK_ROWS):
            rows = E[s:s + CHUNK_ROWS]
            out[s:s + CHUNK_ROWS] = (normalize_rows(model, rows, "ln1", layer) if normalize else rows) @ W
    return out


def unembed_factor(model, W: Float[Tensor, "k d_model"], normalize: bool = True) -> Float[Tensor, "k vocab_out"]:
    """``W @ unembed_cols(model)`` in column chunks. Memory: the [k, vocab_out] result plus one chunk."""
    U = model.W_U.detach()
    with torch.no_grad():
        out = torch.empty(W.shape[0], U.shape[1], dtype=W.dtype, device=W.device)
        for s in range(0, U.shape[1], CHUNK_ROWS):
            out[:, s:s + CHUNK_ROWS] = W @ unembed_chunk(model, U[:, s:s + CHUNK_ROWS], normalize)
    return out


def unembed_embed(model, layer: int = 0, normalize: bool = True, center_vocab: bool = False
                  ) -> Float[Tensor, "d_model d_model"]:
    """G = unembed_cols · embed_rows [d_model, d_model], summed over vocabulary chunks (square vocab only).

    ``center_vocab=True`` is the eigenvalue-copying convention, the same in both fold modes: U centred
    over the vocabulary (U − mean over its columns; softmax ignores it, eigenvalues do not, and
    ``fold_ln`` applies it) and no norm bias on the embedding rows (``fold_ln`` moves it into b_V,
    which is in no circuit): G = U E_n − V·ū ēᵀ with ū, ē the mean column of U and row of E_n.
    """
    E, U = model.W_E.detach(), model.W_U.detach()
    with torch.no_grad():
        G = torch.zeros(U.shape[0], E.shape[1], dtype=E.dtype, device=E.device)
        u_sum = torch.zeros(U.shape[0], dtype=E.dtype, device=E.device)
        e_sum = torch.zeros(E.shape[1], dtype=E.dtype, device=E.device)
        for s in range(0, E.shape[0], CHUNK_ROWS):
            rows = E[s:s + CHUNK_ROWS]
            Uc = unembed_chunk(model, U[:, s:s + CHUNK_ROWS], normalize)
            En = normalize_rows(model, rows, "ln1", layer, bias=not center_vocab) if normalize else rows
            G += Uc @ En
            if center_vocab:
                u_sum += Uc.sum(1)
                e_sum += En.sum(0)
        if center_vocab:
            G -= torch.outer(u_sum, e_sum) / E.shape[0]
    return G


def full_qk(model, head: HeadsLike, normalize: bool = True) -> FactoredMatrix:
    """Token-to-token QK: ``E_n W_Q W_Kᵀ E_nᵀ`` [vocab, vocab] as A [vocab, d_head] · B [d_head, vocab].

    Rows are query tokens, columns key tokens; biases and positions are left out. Memory: 2 · vocab · d_head.
    """
    h = to_head(model, head)
    warn_caveats(model, "the full QK circuit")
    w = layer_weights(model, h.layer)
    return FactoredMatrix(embed_factor(model, w.W_Q[h.head], h.layer, normalize),
                          embed_factor(model, w.W_K[h.head], h.layer, normalize).T)


def full_ov(model, head: HeadsLike, normalize: bool = True) -> FactoredMatrix:
    """Source token to output logits: ``E_n W_V W_O U`` [vocab, vocab_out] as A [vocab, d_head] · B [d_head, vocab_out].

    Memory: the two factors (vocab · d_head each) plus one chunk.
    """
    h = to_head(model, head)
    w = layer_weights(model, h.layer)
    return FactoredMatrix(embed_factor(model, w.W_V[h.head], h.layer, normalize),
                          unembed_factor(model, w.W_O[h.head], normalize))


def top_tokens(matrix: FactoredMatrix, index: int, k: int = 10, dim: str = "row", largest: bool = True
               ) -> Tuple[Tensor, Tensor]:
    """Top-``k`` (values, indices) of one row (``dim="row"``) or column of a 2-D FactoredMatrix.

    Computes only that row/column: A[index] @ B (or A @ B[:, index]); memory one vocab vector.
    """
    if dim not in ("row", "col"):
        raise QKCircuitsError(f"dim must be 'row' or 'col', got {dim!r}")
    if matrix.A.ndim != 2:
        raise QKCircuitsError(f"top_tokens needs one 2-D circuit, got shape {tuple(matrix.shape)}; index one head first")
    n = matrix.ldim if dim == "row" else matrix.rdim
    if not 0 <= int(index) < n:
        raise QKCircuitsError(f"{dim} index {index} is out of range 0-{n - 1}")
    if not 1 <= int(k) <= (matrix.rdim if dim == "row" else matrix.ldim):
        raise QKCircuitsError(f"k must be between 1 and the {dim} length, got {k}")
    with torch.no_grad():
        vec = matrix.A[int(index)] @ matrix.B if dim == "row" else matrix.A @ matrix.B[:, int(index)]
        return vec.topk(int(k), largest=largest)
