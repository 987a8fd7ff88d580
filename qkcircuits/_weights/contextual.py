"""What a head reads and writes per token, from three places: direct, effective, contextual.

>>> ids = torch.arange(8)                                 # on the toy (no tokenizer: ids of its token pool)
>>> x = token_inputs(model, 1, ids)                       # contextual rows past layer 0 ([n, d_model])
>>> tuple(x.rows.shape), x.source[:3]                     # token 0 never occurs in the corpus: effective instead
((8, 224), ['effective', 'contextual', 'contextual'])
>>> logits, x = head_logits(model, "1.0", ids)            # its write, read as logits: [n, vocab]
>>> grid, x = token_qk(model, "1.0", ids)                 # QK scores over the tokens: [n, n]
>>> tuple(logits.shape), tuple(grid.shape)
((8, 32), (8, 8))
>>> copying_rank(model, "1.0", ids).tolist()              # rank of each source token itself (1 = top)
[32.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
>>> scores, settings = ov_copying(model)                  # [layer, head] in [-1, 1], 0 = chance
>>> tuple(scores.shape)
(2, 2)

Inputs (``input=``), each the row ``W_Q``/``W_K``/``W_V`` of layer L read for token t (after L's input norm;
its bias left out, as ``fold_ln`` moves it into b_Q/b_K/b_V and every circuit leaves biases out, so both
fold modes give the same rows up to the norm weight that ``fold_ln`` moves into the weights):

- ``direct``: ``ln1_L(W_E[t])``, the embedding as if it were the whole residual (right for layer 0 and
  the papers' pictures).
- ``effective``: ``ln1_L(r_t)`` with ``r_t`` the residual after block 0 when t is the whole sequence
  (position 0, no BOS): the embedding (with position 0), block 0's attention (it can only attend to t
  itself) and block 0's MLP on it. ARENA's "effective embedding" (W_E plus MLP0 on it), computed by the
  model itself so any architecture's block 0 (post-norms, embedding scale) is honoured. Layer 0: direct.
- ``contextual`` (default past layer 0): the mean of ``blocks.L.ln1.hook_out`` over t's occurrences in
  the packaged English corpus (``natural_text()``; BOS positions left out), gathered for every layer in
  one streamed pass and cached per model. Tokens that never occur there fall back to ``effective``;
  ``TokenInputs.source`` says which row each token got.

Outputs: the head's write ``o = x W_V W_O`` read through the final norm as the model reads it:
centred (LayerNorm), divided by the run's own normaliser (the mean over the corpus positions of the
final norm's scale, ``sqrt(mean(r²) + eps)``; contextual only, 1 otherwise), times the final norm's
weight, times ``W_U`` (``unembed_cols``). Biases are left out as in every circuit. The per-position
scale is positive, so no rank depends on it.

Copying rank of source token t: ``1 + #{v: ℓ_v > ℓ_t} + ½ #{v ≠ t: ℓ_v = ℓ_t}`` (mid-rank: a head that
writes nothing ties every token and ranks t at (V + 1)/2, chance). ``ov_copying`` maps each head's
median rank r onto [-1, 1] with chance c = (V + 1)/2 at 0: ``log(c/r)/log(c)`` for r ≤ c (1 at r = 1),
``−log(c/(V + 1 − r))/log(c)`` above (−1 at r = V).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
from jaxtyping import Float, Int
from torch import Tensor

from .._foundation import model_cache
from .._foundation.errors import QKCircuitsError
from .._foundation.heads import HeadsLike
from .._foundation.sequences import bos_id, natural_text, repeated_tokens, segment_length, text_tokens, token_pool
from .._foundation.arch import adapter
from .._foundation.arch.norms import block_norm, final_norm, norm_kind
from .qk_ov import to_head, attn_input_hook, is_folded, layer_weights, normalize_rows, unembed_cols

TokenIds = Union[Sequence[int], Int[Tensor, "n"]]     # token ids: a list or a 1-D tensor

INPUTS = ("direct", "effective", "contextual")
CORPUS = "natural_text() (qkcircuits/data/natural_text.txt)"


def default_input(layer: int) -> str:
    """``"direct"`` for layer 0 (its heads read the embeddings), ``"contextual"`` past it."""
    return "direct" if int(layer) == 0 else "contextual"


def check_input(input: Optional[str], layer: int) -> str:
    """``input`` checked (None: ``default_input(layer)``)."""
    if input is None:
        return default_input(layer)
    if input not in INPUTS:
        raise QKCircuitsError(f"input must be one of {', '.join(INPUTS)}, got {input!r}")
    return input


@dataclass
class TokenInputs:
    """Rows a layer's heads read for ``ids``: ``rows`` [n, d_model] (after the layer's input norm),
    ``source`` per token (``"contextual"``, ``"effective"`` or ``"direct"``), the ``input`` asked for,
    ``counts`` (occurrences in the corpus; 0 where a token fell back) and a one-line ``note``."""

    rows: Float[Tensor, "n d_model"]
    source: List[str]
    input: str
    layer: int
    counts: Int[Tensor, "n"]
    note: str = ""

    @property
    def fallbacks(self) -> int:
        return sum(s != self.input for s in self.source)


@dataclass
class _CorpusStats:
    """Per layer, the sum of ``ln1.hook_out`` over each corpus token's occurrences; the final norm's mean scale."""

    ids: Tensor                                     # [u] distinct token ids of the corpus (sorted)
    counts: Tensor                                  # [u]
    sums: Dict[int, Tensor] = field(default_factory=dict)   # layer -> [u, d_model]
    final_scale: float = 1.0
    n_tokens: int = 0
    corpus: str = CORPUS


def corpus_stats(model, refresh: bool = False) -> _CorpusStats:
    """Mean residual rows per corpus token at every layer, in one streamed pass (cached per model and
    fold state). The corpus is ``natural_text()``; a model without a tokenizer gets 16 seeded
    [BOS]+R+R sequences of its token pool instead (what such toy models are made for). The text is cut
    into rows of 128 tokens (the context allowing), each led by BOS, the last row shorter: every token
    counts. Memory: [distinct tokens, d_model] per layer (SmolLM2: 334 × 576 × 30 floats ≈ 23 MB).
    Remembered per model and fold state while the weights are unchanged (``model_cache``, ``depends="weights"``:
    an in-place edit of any parameter makes it again); ``refresh=True`` makes it again anyway. Hooks are not
    weights: hooks active during the pass that makes it (inside ``qk.edit``) are part of what was measured."""
    if refresh:
        model_cache.forget(model, "corpus stats")
    return model_cache.remembered(model, "corpus stats", is_folded(model), lambda: _corpus_pass(model),
                                  depends="weights")


def _corpus_pass(model) -> _CorpusStats:
    """``corpus_stats``'s one streamed pass (not remembered)."""
    dev = model.W_E.device
    if getattr(model, "tokenizer", None) is not None:
        seq_len = max(2, min(128, int(model.cfg.n_ctx) - 1))
        text = model.tokenizer(natural_text(), add_special_tokens=False)["input_ids"]
        full = len(text) // seq_len * seq_len
        batches = [text_tokens(model, seq_len=seq_len)] if full else []  # [rows, 1 + seq_len], BOS first
        if len(text) > full:
            tail = torch.tensor([[bos_id(model)] + text[full:]], dtype=torch.long, device=dev)
            batches.append(tail)
        corpus = CORPUS
    else:   # no tokenizer, no text: the sequences such models are made for, seeded
        seg = segment_length(model, 2, 40)
        batches = [repeated_tokens(model, 16, seg, 2, seed=0)]
        corpus = f"16 seeded [BOS]+R+R sequences of the token pool (R of {seg}; the model has no tokenizer)"
    batches = [b[s:s + 8] for b in batches for s in range(0, len(b), 8)]          # 8 rows at a time
    flat = torch.cat([b[:, 1:].flatten() for b in batches]).cpu()
    ids, inverse = torch.unique(flat, return_inverse=True)
    sizes = [b[:, 1:].numel() for b in batches]
    inverses = [i.to(dev) for i in inverse.split(sizes)]
    current: Dict[str, Tensor] = {}
    stats = _CorpusStats(ids=ids, counts=torch.bincount(inverse, minlength=len(ids)).cpu(),
                         n_tokens=flat.numel(), corpus=corpus)
    L = int(model.cfg.n_layers)
    names = {attn_input_hook(model, layer): layer for layer in range(L)}
    final = "ln_final.hook_in"
    scales: List[Tensor] = []

    def keep(t: Tensor, hook) -> None:
        layer = names[hook.name]
        rows = t.detach()[:, 1:].reshape(-1, t.shape[-1]).float()
        acc = stats.sums.get(layer)
        if acc is None:
            acc = stats.sums[layer] = torch.zeros(len(ids), t.shape[-1], device=t.device)
        acc.index_add_(0, current["inverse"], rows)

    norm = final_norm(model)

    def keep_final(t: Tensor, hook) -> None:
        x = t.detach()[:, 1:].float()
        if norm.kind == "LN":
            x = x - x.mean(-1, keepdim=True)
        scales.append((x.pow(2).mean(-1) + norm.eps).sqrt().flatten())

    hooks = [(n, keep) for n in names]
    if norm.kind is not None and final in model.hook_dict:
        hooks.append((final, keep_final))
    with torch.no_grad():
        for batch, inv in zip(batches, inverses):
            current["inverse"] = inv
            model.run_with_hooks(batch, fwd_hooks=hooks)
    stats.sums = {layer: v.cpu() for layer, v in stats.sums.items()}
    if scales:
        stats.final_scale = float(torch.cat(scales).mean())
    return stats


def _effective_rows(model, ids: Tensor) -> Tensor:
    """Residual after block 0 for each token alone (position 0): [n, d_model], raw (not normalised)."""
    name = "blocks.0.hook_resid_post" if int(model.cfg.n_layers) > 1 else None
    if name is None or name not in model.hook_dict:
        raise QKCircuitsError("effective inputs need a block after block 0 (this model has one layer)")
    with torch.no_grad():
        _, cache = model.run_with_cache(ids.to(model.W_E.device)[:, None], names_filter=lambda n: n == name,
                                        stop_at_layer=1)
    return cache[name][:, 0].float()


def _ln1_bias(model, layer: int) -> Optional[Tensor]:
    """The input norm's bias with raw weights (None when folded or absent): left out of the rows, as
    ``fold_ln`` moves it into b_Q/b_K/b_V, which the circuits leave out; so both fold modes agree."""
    norm = block_norm(model, layer)
    return None if norm.folded or norm.bias is None else norm.bias.float()


def token_inputs(model, layer: int, ids: TokenIds, view: Optional[str] = None) -> TokenInputs:
    """The rows ``layer``'s heads read for tokens ``ids`` (see the module docs for the three inputs).

    Memory: [n, d_model] plus, for ``contextual``, the cached corpus statistics (``corpus_stats``).
    """
    L = int(model.cfg.n_layers)
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < L:
        raise QKCircuitsError(f"layer {layer!r} is out of range: the model has layers 0-{L - 1}")
    input = check_input(view, layer)
    idx = torch.as_tensor(list(ids), dtype=torch.long).flatten()
    V = int(model.cfg.d_vocab)
    if idx.numel() == 0 or int(idx.min()) < 0 or int(idx.max()) >= V:
        raise QKCircuitsError(f"token ids must be a non-empty list within 0-{V - 1}")
    n = idx.numel()
    counts = torch.zeros(n, dtype=torch.long)
    dev, dt = model.W_E.device, model.W_E.dtype
    if input == "direct" or layer == 0 and input == "effective":
        rows = normalize_rows(model, model.W_E.detach()[idx.to(dev)].float(), "ln1", layer, bias=False)
        why = " (layer 0 reads the embeddings: effective = direct)" if input == "effective" else ""
        return TokenInputs(rows.to(dt), ["direct"] * n if input == "direct" else ["effective"] * n, input, layer,
                           counts, f"direct: the token embeddings through layer {layer}'s input norm{why}")
    source = ["effective"] * n
    rows = torch.empty(n, model.cfg.d_model, dtype=torch.float32, device=dev)
    need = torch.ones(n, dtype=torch.bool)
    note = ""
    if input == "contextual":
        stats = corpus_stats(model)
        pos = torch.searchsorted(stats.ids, idx).clamp(max=len(stats.ids) - 1)
        found = stats.ids[pos] == idx
        c = stats.counts[pos] * found
        counts = c
        if bool(found.any()):
            mean = stats.sums[layer][pos[found]] / c[found, None].float()
            bias = _ln1_bias(model, layer)
            rows[found.to(dev)] = (mean.to(dev) - bias) if bias is not None else mean.to(dev)
            need = ~found
            for i in found.nonzero().flatten().tolist():
                source[i] = "contextual"
        k = int(need.sum())
        note = (f"contextual: mean of blocks.{layer}.ln1.hook_out over each token's occurrences in {stats.corpus} "
                f"({stats.n_tokens} tokens)" + (f"; {k} of {n} tokens never occur there and fell back to effective"
                                                 if k else ""))
    if bool(need.any()):
        if layer == 0:
            eff = normalize_rows(model, model.W_E.detach()[idx[need].to(dev)].float(), "ln1", 0, bias=False)
        else:
            eff = normalize_rows(model, _effective_rows(model, idx[need]), "ln1", layer, bias=False)
        rows[need.to(dev)] = eff.to(rows.dtype)
        if input == "effective":
            note = (f"effective: residual after block 0 for each token alone (embedding + block 0 on it), through "
                    f"layer {layer}'s input norm")
    return TokenInputs(rows.to(dt), source, input, layer, counts, note)


def output_reader(model, input: str) -> Tuple[Float[Tensor, "d_model vocab"], float, str]:
    """(U, scale, note): logits of a head's write o are ``o @ U / scale`` (see the module docs)."""
    U = unembed_cols(model)
    scale, note = 1.0, "read through the final norm's weight and centring and W_U (per-position scale left out)"
    if input == "contextual":
        stats = corpus_stats(model)
        if norm_kind(model) is not None:
            scale = stats.final_scale
            note = (f"read through the final norm with the run's own normaliser (mean scale {scale:.4g} over the "
                    f"corpus) and W_U")
    return U, scale, note


def head_logits(model, head: HeadsLike, ids: TokenIds, view: Optional[str] = None
                ) -> Tuple[Float[Tensor, "n vocab"], TokenInputs]:
    """Logits the head's write raises for each source token of ``ids``: [n, vocab] and the inputs used.

    Memory: one [n, vocab] block (keep ``ids`` to a few hundred)."""
    h = to_head(model, head)
    x = token_inputs(model, h.layer, ids, view)
    U, scale, note = output_reader(model, x.input)
    x.note = f"{x.note}; output {note}"
    with torch.no_grad():
        o = adapter(model, h.layer).rows_write(x.rows, h.head)     # MLA: the KV latent's norm at each row
        return (o @ U.to(o.dtype) / scale).float().cpu(), x


def token_qk(model, head: HeadsLike, ids: TokenIds, view: Optional[str] = None
             ) -> Tuple[Float[Tensor, "query key"], TokenInputs]:
    """Pre-softmax score between every pair of ``ids`` (rows query, columns key), no position, no biases:
    X W_Q W_Kᵀ Xᵀ · scale with X the rows of ``view`` (``view="direct"`` = rows/columns of ``full_qk``)."""
    from .qk_ov import attn_scale

    h = to_head(model, head)
    x = token_inputs(model, h.layer, ids, view)
    with torch.no_grad():
        Q, K = adapter(model, h.layer).rows_qk(x.rows, h.head)     # MLA: both latent norms at each row
        grid = Q @ K.T * attn_scale(model, h.layer)
    return grid.float().cpu(), x


def rank_counts(logits: Float[Tensor, "n m"], own: Float[Tensor, "n 1"], rel: float = 1e-5
                ) -> Tuple[Tensor, Tensor]:
    """(#{v: ℓ_v > ℓ_t}, #{v: ℓ_v = ℓ_t}) per row, where "=" is within a relative ``rel`` of the target's
    own logit ℓ_t: a logit computed in another summation order must not break a tie (exact zeros of a
    silent head tie exactly). Counts over the columns given, so a vocabulary can be counted in chunks.

    The comparisons written for speed (5x on SmolLM2's [576, 2048] blocks, the same counts): ℓ_v > ℓ_t + tol as the
    sign of ℓ_v − (ℓ_t + tol), which is exact (a difference of two floats is 0 only when they are equal; NaN is never
    counted), |ℓ_v − ℓ_t| ≤ tol in place, the counts summed in float32 (exact up to 2^24 columns). ``logits`` is
    not modified."""
    tol = own.abs() * rel
    greater = (logits - (own + tol)).gt_(0).sum(-1, dtype=torch.float32)
    equal = (logits - own).abs_().le_(tol).sum(-1, dtype=torch.float32)
    return greater.long(), equal.long()


def mid_rank(logits: Float[Tensor, "n vocab"], target: Int[Tensor, "n"]) -> Float[Tensor, "n"]:
    """1 + #{v: ℓ_v > ℓ_t} + ½ #{v ≠ t: ℓ_v = ℓ_t} per row (ties share the mean of their ranks; "=" as in
    ``rank_counts``)."""
    greater, equal = rank_counts(logits, logits.gather(-1, target[:, None].to(logits.device)))
    return (1 + greater + (equal - 1).clamp_min(0) / 2).float().cpu()


def copying_rank(model, head: HeadsLike, ids: TokenIds, view: Optional[str] = None) -> Float[Tensor, "n"]:
    """Rank (1 = top) of each source token itself among all output logits of the head's write on it."""
    logits, _ = head_logits(model, head, ids, view)
    return mid_rank(logits, torch.as_tensor(list(ids), dtype=torch.long))


def rank_score(rank: Tensor, vocab: int) -> Tensor:
    """Median rank r → [-1, 1]: log(c/r)/log(c) for r ≤ c = (V+1)/2, −log(c/(V+1−r))/log(c) above; chance 0."""
    c = (vocab + 1) / 2
    r = rank.double().clamp(1, vocab)
    up = torch.log(c / r) / math.log(c)
    down = -torch.log(c / (vocab + 1 - r)) / math.log(c)
    return torch.where(r <= c, up, down).float()


def copying_tokens(model, n_tokens: int = 64, seed: int = 0) -> Tuple[Tensor, str]:
    """Source tokens for ``ov_copying``: a seeded sample of ``n_tokens`` corpus tokens that are in the
    token pool (no special tokens, no BOS); without a tokenizer, of the pool itself."""
    pool = token_pool(model)
    stats = corpus_stats(model)
    cands, where = pool.ids, "token pool (no token of it occurs in the corpus: inputs fall back to effective)"
    inside = cands[torch.isin(cands, stats.ids)]
    if len(inside):
        cands, where = inside, f"corpus tokens in the token pool ({len(inside)})"
    g = torch.Generator().manual_seed(seed)
    pick = cands[torch.randperm(len(cands), generator=g)[:n_tokens]].sort().values
    return pick, where


OV_METHODS = ("sample", "exact")


def _exact_counts(o: Tensor, own: Tensor, U: Tensor, chunk: int) -> Tuple[Tensor, Tensor]:
    """(#{v: ℓ_v > ℓ_t}, #{v: ℓ_v = ℓ_t}) over the whole vocabulary for rows ``o`` [r, d_model] (``rank_counts``),
    ``chunk`` columns of ``U`` [d_model, vocab] at a time: memory [r, chunk]."""
    greater = torch.zeros(len(o), device=o.device)
    equal = torch.zeros(len(o), device=o.device)
    for s in range(0, U.shape[1], chunk):
        g, e = rank_counts(o @ U[:, s:s + chunk].to(o.dtype), own)
        greater += g
        equal += e
    return greater, equal


def ov_copying(model, *, n_tokens: int = 64, seed: int = 0, input: str = "contextual", chunk: int = 8192,
               method: str = "sample", vocab_sample: int = 2048, window: int = 4, recount_below: Optional[int] = 64,
               progress: bool = False) -> Tuple[Float[Tensor, "layer head"], Dict[str, object]]:
    """Contextual copying score of every head ([layer, head], 1 = always top-1, 0 = chance, −1 = always last)
    and its settings. Per layer: the head's writes for ``n_tokens`` source tokens, read as logits, the source
    token's mid-rank, the median over tokens, ``rank_score``.

    ``method="exact"``: every rank counted over the whole vocabulary in ``chunk`` columns at a time; time
    n_heads · n_tokens · d_model · vocab multiply-adds per layer (SmolLM2: 16 G, ~0.5 s per layer on one thread).

    ``method="sample"`` (default): each rank estimated from one seeded sample of ``vocab_sample`` vocabulary
    columns, rank ≈ 1 + (V − 1)(g + e/2)/m' (g, e: sampled columns above / tied with the source token's logit,
    m' the sampled columns other than it); then, for every head whose median row has g ≤ ``recount_below``
    (a rank near the top, where a sample's relative error is largest), the ``2·window + 1`` rows around its
    median are recounted exactly and the median taken again (``recount_below=None``: no recount, the plain
    estimate). Cost ≈ (vocab_sample / V + the recounted share)
    of the exact one (SmolLM2: ~5 %). Error against ``"exact"`` on SmolLM2 (docs/benchmarks.md): Spearman over
    the 270 heads 0.999, the same top-10 heads, mean |Δ| 0.003, max |Δ| 0.05. A vocabulary of at most
    4 · ``vocab_sample`` tokens is counted exactly (the sample would be most of it).
    Memory: [n_heads · n_tokens, max(chunk, vocab_sample)] floats.
    """
    if method not in OV_METHODS:
        raise QKCircuitsError(f"ov_copying method must be one of {', '.join(OV_METHODS)}, got {method!r}")
    for name, value, least in (("vocab_sample", vocab_sample, 1), ("window", window, 0),
                               ("recount_below", 0 if recount_below is None else recount_below, 0),
                               ("chunk", chunk, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise QKCircuitsError(f"{name} must be an integer >= {least}, got {value!r}")
    ids, where = copying_tokens(model, n_tokens, seed)
    L, H = int(model.cfg.n_layers), int(model.cfg.n_heads)
    out = torch.zeros(L, H)
    V = int(model.W_U.shape[-1])
    n = len(ids)
    sampled = method == "sample" and V > 4 * vocab_sample
    fallbacks, recounted = 0, 0
    layers = range(L)
    if progress:
        from .._foundation.progress import progress_bar
        layers = progress_bar(layers, desc="ov copying", unit="layer")
    U, _, _ = output_reader(model, input)        # the positive scale changes no rank
    U_tgt = U[:, ids.to(U.device)].T            # [n, d_model] the source tokens' own columns
    if sampled:
        g = torch.Generator().manual_seed(int(seed))
        cols = torch.randperm(V, generator=g)[:vocab_sample].sort().values
        U_s = U[:, cols.to(U.device)]                                                   # [d_model, m]
        others = (vocab_sample - torch.isin(ids, cols).long()).repeat(H).to(U.device)   # m' per row [H·n]
    else:
        U = U.T.contiguous().T                  # column blocks of it contiguous in memory: they multiply fastest
    mid = (n - 1) // 2                                                                  # torch.median's pick
    for layer in layers:
        x = token_inputs(model, layer, ids.tolist(), input)
        fallbacks = max(fallbacks, x.fallbacks)
        w = layer_weights(model, layer)
        with torch.no_grad():
            o = torch.einsum("nd,hde,hem->hnm", x.rows.to(w.W_V.dtype), w.W_V, w.W_O)          # [H, n, d_model]
            own = (o * U_tgt.to(o.dtype)[None]).sum(-1).reshape(-1, 1)                        # [H·n, 1]
            o = o.reshape(H * n, -1)
            # the target's own logit comes from another summation order than its column in the block:
            # rank_counts treats values within a relative 1e-5 of it as ties, as mid_rank does
            if not sampled:
                greater, equal = _exact_counts(o, own, U, chunk)
                rank = 1 + greater + (equal - 1).clamp_min(0) / 2
            else:
                g_s, e_s = rank_counts(o @ U_s.to(o.dtype), own)          # e_s counts t itself if sampled
                e_s = e_s - (others < vocab_sample).long()
                rank = 1 + (V - 1) * (g_s + e_s.clamp_min(0) / 2) / others
                order = rank.view(H, n).argsort(-1)
                lo, hi = max(0, mid - window), min(n, mid + window + 1)
                near_top = g_s.view(H, n).gather(-1, order[:, mid:mid + 1])[:, 0] <= (
                    -1 if recount_below is None else recount_below)                            # [H]
                rows = (order[near_top, lo:hi] + torch.arange(H, device=order.device)[near_top, None] * n).flatten()
                if len(rows):
                    greater, equal = _exact_counts(o[rows], own[rows], U, chunk)
                    rank[rows] = 1 + greater + (equal - 1).clamp_min(0) / 2
                    recounted += len(rows)
        out[layer] = rank_score(rank.view(H, n).median(-1).values.cpu(), V)
    settings = {"n_tokens": n, "tokens": where, "input": input, "seed": seed, "fallbacks": fallbacks,
                "corpus": corpus_stats(model).corpus, "method": "sample" if sampled else "exact",
                "formula": "rank_score(median mid-rank of the source token), chance 0"}
    if sampled:
        settings.update(vocab_sample=vocab_sample, window=window, recount_below=recount_below,
                        recounted_rows=recounted, rows=L * H * n)
    return out, settings
