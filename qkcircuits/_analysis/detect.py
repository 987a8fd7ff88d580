"""Head detectors: induction, prefix matching, previous-token, duplicate-token and copying scores.

>>> scores = scan(model)                                   # doctest: +SKIP   one streamed pass per prompt set
>>> scores.top(5, "induction")                             # doctest: +SKIP
>>> scores.heads_labelled("previous-token")                # doctest: +SKIP

Every attention score is "the share of a query's attention that lands on its targets",
averaged over queries, with targets found by *token equality* (so a perfect head scores
exactly 1.0 at any length, also when a token repeats inside a segment):

====================  =================================  ==========================================
score                 prompt set                          targets of query i
====================  =================================  ==========================================
induction             [BOS] + R + R                       j with tok[j-1] == tok[i], j-1 < i (2nd R)
prefix_matching       [BOS] + R×4 (Olsson)                same, queries in repeats 2-4
previous_token        [BOS] + R + R                       j = i-1, for i ≥ 2 (BOS is never a target)
duplicate_token       [BOS] + R + R                       j < i with tok[j] == tok[i] (2nd R)
copying (Olsson)      [BOS] + R + R                       see ``olsson_copying`` (0 = chance, +1 copies)
ov_copying            corpus rows (contextual)            median copying rank, see ``_contextual``
eigen_copying         weights only                        sum(λ)/sum(|λ|) of W_E W_V W_O W_U (U centred)
====================  =================================  ==========================================

Attention to BOS is never renormalised away: a head parked on BOS scores low, which is what
"does it do the job" asks. See docs/detectors.md for thresholds and failure modes.
"""

from __future__ import annotations

import sys
from typing import Dict, List, Optional, Sequence

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor
from tqdm.auto import tqdm

from .._foundation.capture import stream
from .._foundation.errors import QKCircuitsError
from .._foundation.args import check_model
from .._foundation.io import check_int, package_version
from .._foundation.model import model_name
from .._foundation.sequences import check_seed, repeated_tokens, segment_length, text_tokens, token_pool
from .._weights import contextual as _contextual
from .._weights.circuits import _unembed_chunk, layer_weights
from .results import HeadScores

# label -> (score, minimum). 0.4 is ARENA's cut-off; chance for any of these is ~1/i (uniform
# attention over i keys), i.e. < 0.05 on the default 81-token prompts: 0.4 is > 8x chance and
# well below what real specialised heads reach (GPT-2's induction heads score 0.6-0.95).
THRESHOLDS = {
    "induction": ("induction", 0.4),
    "previous-token": ("previous_token", 0.4),
    "duplicate-token": ("duplicate_token", 0.4),
}
SCORE_NAMES = ("induction", "prefix_matching", "previous_token", "duplicate_token", "copying", "ov_copying",
               "eigen_copying")
TEXT_SCORES = ("previous_token_text", "duplicate_token_text")

Masks = Dict[str, Bool[Tensor, "batch q k"]]


def target_masks(tokens: Int[Tensor, "batch pos"], seg_len: int, first_query: Optional[int] = None) -> Masks:
    """Boolean [batch, query, key] masks of each score's targets (queries outside the region are all False).

    ``first_query`` (default ``1 + seg_len``: the first token of the second copy) starts the
    query region of the induction and duplicate masks; previous-token uses every i ≥ 2.
    """
    b, n = tokens.shape
    first = 1 + seg_len if first_query is None else first_query
    i = torch.arange(n, device=tokens.device)
    query_region = (i >= first)[None, :, None]
    earlier = i[None, :] < i[:, None]                                  # [q, k]: k < q
    same = tokens[:, :, None] == tokens[:, None, :]                    # tok[q] == tok[k]
    dup = same & earlier & query_region
    # induction: key k follows an earlier copy of tok[q]: tok[k-1] == tok[q], k-1 < q, k >= 1
    shifted = torch.zeros_like(same)
    shifted[:, :, 1:] = same[:, :, :-1] & earlier[None, :, :-1]
    ind = shifted & query_region
    prev = torch.zeros(n, n, dtype=torch.bool, device=tokens.device)
    prev[i[2:], i[2:] - 1] = True
    return {"induction": ind, "duplicate_token": dup, "previous_token": prev[None].expand(b, n, n)}


def mask_score(pattern: Float[Tensor, "batch head q k"], mask: Bool[Tensor, "batch q k"],
               exclude_bos: bool = False) -> Float[Tensor, "head"]:
    """Mean over queries that have targets of the attention mass on those targets.

    ``exclude_bos`` renormalises each query's attention over the keys other than position 0.
    (TransformerLens's ``detect_head(exclude_bos=True)`` instead zeroes the BOS column and takes one
    ratio of sums over all rows, rows without targets included; the two agree on which heads are
    specialised, not on the values.)
    """
    on_target = torch.einsum("bhqk,bqk->bhq", pattern, mask.to(pattern.dtype))
    if exclude_bos:
        on_target = on_target / (1 - pattern[..., 0]).clamp_min(1e-9)
    has = mask.any(-1)                                                 # [b, q]
    if not bool(has.any()):
        return torch.full((pattern.shape[1],), float("nan"), device=pattern.device)
    return (on_target * has[:, None]).sum((0, 2)) / has.sum()


def copying_candidates(tokens: Int[Tensor, "batch pos"]) -> "tuple[Tensor, Tensor, Tensor]":
    """Per sequence, the tokens it could copy: (cand [batch, C] padded with -1, valid [batch, C],
    index [batch, pos] of each position's token in its own row of ``cand``; position 0 (BOS) maps to 0)."""
    body = tokens[:, 1:]
    rows = [torch.unique(r) for r in body]
    C = max(len(r) for r in rows)
    cand = torch.full((len(rows), C), -1, dtype=torch.long, device=tokens.device)
    for b, r in enumerate(rows):
        cand[b, :len(r)] = r
    valid = cand >= 0
    big = torch.where(valid, cand, torch.iinfo(torch.long).max)       # sorted rows, padding last
    index = torch.searchsorted(big, tokens.contiguous()).clamp(max=C - 1)
    return cand, valid, index


def olsson_copying(pattern: Float[Tensor, "batch head q k"], z: Float[Tensor, "batch q head d"],
                   W_O: Float[Tensor, "head d d_model"], U_c: Float[Tensor, "batch d_model C"],
                   valid: Bool[Tensor, "batch C"], cand_index: Int[Tensor, "batch pos"],
                   queries: Bool[Tensor, "batch q"]) -> Float[Tensor, "head"]:
    """Olsson et al.'s copying score of the head's direct-path logits, relative to chance.

    For each query i (second copy) of sequence b: logits ℓ = z_i W_O U_c[b] over that sequence's own
    candidates (the tokens of b; U_c is W_U through the final norm's weight and centring, the same in
    both fold modes; the per-position scale is positive and cancels; ``z`` without the value bias, whose
    constant part (b_V and, with raw weights, the ln1 bias through W_V) folding moves into b_O), p = ReLU(ℓ − mean ℓ), share
    s = p[attended] / Σp with the attended token the key the head attends to most (c = 1/n_b when Σp = 0:
    no preference). Score per query (s − c)/(1 − c), c = 1/n_b: +1 when all positive mass is on the
    attended token, 0 at chance, −1/(n_b − 1) when the attended token gets none; 0 when the head attends
    to BOS (it copies nothing). Mean over queries.
    """
    out = torch.einsum("bqhd,hdm->bqhm", z, W_O)
    logits = torch.einsum("bqhm,bmc->bqhc", out, U_c)
    v = valid[:, None, None, :].to(logits.dtype)
    n = valid.sum(-1).to(logits.dtype)[:, None, None]                    # [b, 1, 1]
    mean = (logits * v).sum(-1, keepdim=True) / n[..., None]
    pos = torch.relu(logits - mean) * v
    attended = pattern.argmax(-1).transpose(1, 2)                       # [b, q, h] key position
    target = torch.gather(cand_index, 1, attended.flatten(1)).view_as(attended)
    total = pos.sum(-1)
    chance = 1.0 / n
    share = torch.where(total > 0, torch.gather(pos, -1, target[..., None])[..., 0] / total.clamp_min(1e-30),
                        chance.expand_as(total))
    score = (share - chance) / (1 - chance).clamp_min(1e-12)
    score = score * (attended != 0)                                     # parked on BOS: no evidence either way
    return (score * queries[..., None]).sum((0, 1)) / queries.sum()


def _wanted(scores, text: bool, copying: bool, eigen_copying: bool) -> List[str]:
    """The score names a scan computes, in JSON order; ``scores`` (names or a comma-separated string) wins."""
    if scores is None:
        names = [n for n in SCORE_NAMES if (copying or n not in ("copying", "ov_copying"))
                 and (eigen_copying or n != "eigen_copying")]
        return names + (list(TEXT_SCORES) if text else [])
    if isinstance(scores, str):
        scores = [x.strip() for x in scores.split(",") if x.strip()]
    names = list(scores)
    allowed = SCORE_NAMES + TEXT_SCORES
    for n in names:
        if n not in allowed:
            raise QKCircuitsError(f"unknown score {n!r}; choose from {', '.join(allowed)}")
    if not names:
        raise QKCircuitsError(f"name at least one score ({', '.join(allowed)})")
    if text:
        names += [n for n in TEXT_SCORES if n not in names]
    return [n for n in allowed if n in names]


def scan(model, *, scores: Optional[Sequence[str]] = None, n_seqs: int = 8, seq_len: Optional[int] = None,
         seed: int = 0, bos: Optional[int] = None, prefix_seqs: int = 10, prefix_len: Optional[int] = None,
         text: bool = False, copying: bool = True, eigen_copying: bool = True, exclude_bos: bool = False,
         confirm_top: int = 0, ov_tokens: int = 64, ov_method: str = "sample", progress: bool = True) -> HeadScores:
    """Score every head of ``model``; see the module docstring for the scores.

    ``scores``: the names to compute (any of ``SCORE_NAMES`` and ``TEXT_SCORES``, or one comma-separated
    string); None computes them all (``copying=False`` drops the two copying scores, ``eigen_copying=False``
    the eigenvalue one, ``text=True`` adds the text scores). Only the passes the names need run:
    induction/previous_token/duplicate_token alone are ONE streamed pass over [BOS]+R+R that reads
    only the patterns and stops after the last layer's attention.

    Passes: [BOS]+R+R (``n_seqs`` × R of ``seq_len``: induction, previous/duplicate-token, Olsson
    ``copying`` from z), [BOS]+R×4 (``prefix_seqs`` × ``prefix_len``: prefix matching), natural text
    (``*_text``), weights only (``eigen_copying``), contextual rows of ``ov_tokens`` corpus tokens
    (``ov_copying``; ``ov_method="exact"`` counts every rank over the whole vocabulary, the default
    ``"sample"`` estimates them from a vocabulary sample, see ``qkcircuits.ov_copying``). ``seq_len`` defaults to 40 and ``prefix_len`` to 25 (Olsson), each capped by the
    context and by the token pool, so that R is drawn without repeats where the vocabulary allows.
    ``exclude_bos`` renormalises each query's attention away from BOS before scoring; the default
    counts attention parked on BOS as attention not on target.
    Memory: one layer's [batch, head, pos, pos] pattern at a time, plus [n_layers, n_heads] scores.
    ``confirm_top=k`` ablates the top-k induction heads and k random heads and stores the loss
    rises in ``extras["confirmation"]``.
    """
    model = check_model(model)
    check_seed(seed)
    check_int("n_seqs", n_seqs)
    check_int("prefix_seqs", prefix_seqs)
    check_int("ov_tokens", ov_tokens)
    names = _wanted(scores, text, copying, eigen_copying)
    L, H = model.cfg.n_layers, model.cfg.n_heads
    pool = token_pool(model, bos=bos)
    seq_len = check_int("seq_len", seq_len, 2) if seq_len is not None else segment_length(model, 2, 40, pool)
    prefix_len = (check_int("prefix_len", prefix_len, 2) if prefix_len is not None
                  else segment_length(model, 4, 25, pool))
    repeat_names = [n for n in ("induction", "previous_token", "duplicate_token", "copying") if n in names]
    do_prefix, do_text = "prefix_matching" in names, any(n in names for n in TEXT_SCORES)
    passes = int(bool(repeat_names)) + int(do_prefix) + int(do_text) + int("ov_copying" in names)
    bar = tqdm(total=passes * L, desc="scan", unit="layer", disable=not progress, file=sys.stderr, leave=False)
    out: Dict[str, Tensor] = {}
    extra_settings: Dict[str, object] = {}

    with torch.no_grad():
        if repeat_names:
            # Pass 1: induction, previous-token, duplicate-token, copying on [BOS] + R + R.
            toks = repeated_tokens(model, n_seqs, seq_len, 2, seed=seed, pool=pool,
                                   length_name="seq_len (--seq-len)")
            masks = {k: m for k, m in target_masks(toks, seq_len).items() if k in names}
            do_copy = "copying" in names
            if do_copy:
                queries = target_masks(toks, seq_len)["induction"].any(-1)
                cand, valid, cand_index = copying_candidates(toks)
                U = model.W_U.detach()
                U_c = _unembed_chunk(model, U[:, cand.clamp_min(0).flatten()], True)       # [d_model, b·C]
                U_c = U_c.view(U.shape[0], *cand.shape).permute(1, 0, 2)                   # [b, d_model, C]

            def reduce_repeat(layer: int, t: Dict[str, Tensor]) -> Dict[str, Tensor]:
                p = t["pattern"]
                res = {name: mask_score(p, m, exclude_bos) for name, m in masks.items()}
                if do_copy:
                    w = layer_weights(model, layer)                      # this layer's weights only
                    # attention sums to 1, so z carries the value's constant part whole (b_V, plus the input
                    # norm's bias through W_V with raw weights): a write that copies nothing and that
                    # folding moves into b_O. Leave it out in both fold modes.
                    const = w.b_V
                    b_ln = _contextual._ln1_bias(model, layer)
                    if b_ln is not None:
                        const = const + torch.einsum("m,hmd->hd", b_ln.to(w.W_V.dtype), w.W_V)
                    z = t["z"] - const.to(t["z"].dtype)
                    res["copying"] = olsson_copying(p, z, w.W_O, U_c.to(w.W_O.dtype), valid, cand_index, queries)
                bar.update(1)
                return res

            rep = stream(model, toks, reduce_repeat, ["pattern", "z"] if do_copy else ["pattern"])
            for name in repeat_names:
                out[name] = torch.stack([rep[layer][name] for layer in range(L)]).float().cpu()

        if do_prefix:
            # Pass 2: Olsson's prefix matching on [BOS] + R x 4.
            ptoks = repeated_tokens(model, prefix_seqs, prefix_len, 4, seed=seed + 1, pool=pool,
                                    length_name="prefix_len")
            pmask = target_masks(ptoks, prefix_len)["induction"]

            def reduce_prefix(layer: int, t: Dict[str, Tensor]) -> Tensor:
                bar.update(1)
                return mask_score(t["pattern"], pmask, exclude_bos)

            pre = stream(model, ptoks, reduce_prefix, ["pattern"])
            out["prefix_matching"] = torch.stack([pre[layer] for layer in range(L)]).float().cpu()

        if do_text:
            # Pass 3: natural text for previous- and duplicate-token heads.
            ttoks = text_tokens(model, seq_len=min(128, model.cfg.n_ctx - 1), n_seqs=n_seqs, bos=bos)
            tmasks = target_masks(ttoks, 0, first_query=1)

            def reduce_text(layer: int, t: Dict[str, Tensor]) -> Dict[str, Tensor]:
                bar.update(1)
                return {f"{k}_text": mask_score(t["pattern"], tmasks[k], exclude_bos)
                        for k in ("previous_token", "duplicate_token")}

            txt = stream(model, ttoks, reduce_text, ["pattern"])
            for name in TEXT_SCORES:
                out[name] = torch.stack([txt[layer][name] for layer in range(L)]).float().cpu()

    if "ov_copying" in names:
        out["ov_copying"], extra_settings["ov_copying"] = _contextual.ov_copying(model, n_tokens=ov_tokens, seed=seed,
                                                                                method=ov_method)
        bar.update(L)
    bar.close()
    eigen_full = None
    if "eigen_copying" in names:
        from .._weights.copying import copying_scores

        # The full circuit W_E·OV·W_U needs input and output vocabularies to match; else fall back
        # to the OV circuit alone (recorded in settings["eigen_copying_circuit"]).
        eigen_full = model.W_E.shape[0] == model.W_U.shape[-1]
        out["eigen_copying"] = copying_scores(model, full=eigen_full).float().cpu()
    ordered = {k: out[k] for k in names}
    result = HeadScores(
        model=model_name(model), n_layers=L, n_heads=H, scores=ordered, thresholds=dict(THRESHOLDS),
        settings=_settings(model, scores=names, n_seqs=n_seqs, seq_len=seq_len, seed=seed, bos=pool.bos_id,
                           prefix_seqs=prefix_seqs, prefix_len=prefix_len, text=do_text, exclude_bos=exclude_bos,
                           pool_size=len(pool.ids),
                           eigen_copying_circuit=None if eigen_full is None else ("full" if eigen_full else "ov"),
                           **extra_settings),
    )
    if confirm_top:
        result.extras["confirmation"] = confirm_induction(model, result, k=confirm_top, seed=seed, pool=pool,
                                                          n_seqs=n_seqs, seq_len=seq_len)
    return result


def confirm_induction(model, scores: HeadScores, *, k: int = 5, n_draws: int = 10, seed: int = 0, pool=None,
                      n_seqs: int = 8, seq_len: int = 40) -> Dict[str, object]:
    """Causal check: rise of the repeated-half loss when the top-``k`` induction heads are zero-ablated
    together, against ``n_draws`` sets of ``k`` random other heads (``qkcircuits.compare_to_random``).

    Returns plain data (JSON-ready): heads, baseline, effect, random_effects, random_heads, seed.
    """
    from .ablate import compare_to_random

    check_int("k", k)
    pool = pool or token_pool(model)
    seq_len = min(seq_len, segment_length(model, 2, seq_len, pool))    # keep R free of repeats, as the scan does
    toks = repeated_tokens(model, n_seqs, seq_len, 2, seed=seed + 2, pool=pool)
    heads = [h for h, _ in scores.top(k, "induction")]
    cmp = compare_to_random(model, heads, toks, "induction-loss", n_draws=n_draws, seed=seed)
    return {"heads": [str(h) for h in cmp.heads], "metric": cmp.metric, "method": cmp.method,
            "baseline": cmp.baseline, "effect": cmp.effect, "random_effects": [float(x) for x in cmp.random_effects],
            "random_heads": [[str(h) for h in hs] for hs in cmp.random_heads], "seed": seed, "n_seqs": n_seqs,
            "seq_len": seq_len}


def _settings(model, **kw) -> Dict[str, object]:
    from .. import __version__

    return {**kw, "fold_ln": bool(getattr(model, "compatibility_mode", False)), "dtype": str(model.W_E.dtype),
            "device": str(model.W_E.device), "qkcircuits": __version__,
            "transformer_lens": package_version("transformer-lens"), "transformers": package_version("transformers"),
            "torch": torch.__version__}
