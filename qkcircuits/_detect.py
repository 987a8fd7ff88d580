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
copying (Olsson)      [BOS] + R + R                       see ``_olsson_copying``
eigen_copying         weights only                        sum(λ)/sum(|λ|) of W_E W_V W_O W_U
====================  =================================  ==========================================

Attention to BOS is never renormalised away: a head parked on BOS scores low, which is what
"does it do the job" asks. See docs/detectors.md for thresholds and failure modes.
"""

from __future__ import annotations

import sys
from typing import Dict, Optional

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor
from tqdm.auto import tqdm

from ._capture import stream
from ._io import check_int
from ._model import model_name
from ._results import HeadScores
from ._sequences import check_seed, repeated_tokens, segment_length, text_tokens, token_pool

# label -> (score, minimum). 0.4 is ARENA's cut-off; chance for any of these is ~1/i (uniform
# attention over i keys), i.e. < 0.05 on the default 81-token prompts: 0.4 is > 8x chance and
# well below what real specialised heads reach (GPT-2's induction heads score 0.6-0.95).
THRESHOLDS = {
    "induction": ("induction", 0.4),
    "previous-token": ("previous_token", 0.4),
    "duplicate-token": ("duplicate_token", 0.4),
}
SCORE_NAMES = ("induction", "prefix_matching", "previous_token", "duplicate_token", "copying", "eigen_copying")

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


def _olsson_copying(pattern: Float[Tensor, "batch head q k"], z: Float[Tensor, "batch q head d"],
                    W_OU: Float[Tensor, "head d cand"], cand_index: Int[Tensor, "batch pos"],
                    queries: Bool[Tensor, "batch q"]) -> Float[Tensor, "head"]:
    """Olsson et al.'s copying score on the head's direct-path logits.

    For each query: the head's output z·W_O read through W_U (restricted to the candidate
    tokens: those that occur in the prompt set), mean-subtracted over candidates, ReLU; the
    share of that positive mass on the token the head attends to most. Averaged over queries,
    then rescaled from [0, 0.5] to [-1, 1] (4·share − 1, clipped) following the definition in
    shared/REFERENCE.md ("Olsson copying score"): a share of one half or more already means the
    attended token gets at least as much positive logit as all other candidates together.
    """
    logits = torch.einsum("bqhd,hdc->bqhc", z, W_OU)
    pos = torch.relu(logits - logits.mean(-1, keepdim=True))
    attended = pattern.argmax(-1).transpose(1, 2)                      # [b, q, h] key position
    target = torch.gather(cand_index, 1, attended.flatten(1)).view_as(attended)    # candidate index
    share = torch.gather(pos, -1, target[..., None])[..., 0] / pos.sum(-1).clamp_min(1e-12)
    share = share * (attended != 0)                                    # parked on BOS: copies nothing
    share = (share * queries[..., None]).sum((0, 1)) / queries.sum()
    return (4 * share - 1).clamp(-1, 1)


def scan(model, *, n_seqs: int = 8, seq_len: Optional[int] = None, seed: int = 0, bos: Optional[int] = None,
         prefix_seqs: int = 10, prefix_len: Optional[int] = None, text: bool = False, copying: bool = True,
         eigen_copying: bool = True, exclude_bos: bool = False, confirm_top: int = 0,
         progress: bool = True) -> HeadScores:
    """Score every head of ``model``; see the module docstring for the scores.

    Passes: [BOS]+R+R (``n_seqs`` × R of ``seq_len``), [BOS]+R×4 (``prefix_seqs`` × ``prefix_len``),
    ``seq_len`` defaulting to 40 and ``prefix_len`` to 25 (Olsson), each capped by the context and by
    the token pool, so that R is drawn without repeats where the vocabulary allows;
    and with ``text=True`` natural text (adds ``previous_token_text`` and ``duplicate_token_text``).
    ``exclude_bos`` renormalises each query's attention away from BOS before scoring; the default
    counts attention parked on BOS as attention not on target.
    Memory: one layer's [batch, head, pos, pos] pattern at a time, plus [n_layers, n_heads] scores.
    ``confirm_top=k`` ablates the top-k induction heads and k random heads and stores the loss
    rises in ``extras["confirmation"]``.
    """
    check_seed(seed)
    check_int("n_seqs", n_seqs)
    check_int("prefix_seqs", prefix_seqs)
    L, H = model.cfg.n_layers, model.cfg.n_heads
    pool = token_pool(model, bos=bos)
    seq_len = check_int("seq_len", seq_len, 2) if seq_len is not None else segment_length(model, 2, 40, pool)
    prefix_len = (check_int("prefix_len", prefix_len, 2) if prefix_len is not None
                  else segment_length(model, 4, 25, pool))
    passes = 2 + int(text)
    bar = tqdm(total=passes * L, desc="scan", unit="layer", disable=not progress, file=sys.stderr, leave=False)

    # Pass 1: induction, previous-token, duplicate-token, copying on [BOS] + R + R.
    toks = repeated_tokens(model, n_seqs, seq_len, 2, seed=seed, pool=pool)
    masks = target_masks(toks, seq_len)
    queries = masks["induction"].any(-1)
    cand = torch.unique(toks[:, 1:])                                   # candidate tokens for copying
    cand_index = torch.searchsorted(cand, toks).clamp(max=len(cand) - 1)   # BOS (position 0) is masked later
    W_U_c = model.W_U[:, cand]

    def reduce_repeat(layer: int, t: Dict[str, Tensor]) -> Dict[str, Tensor]:
        p = t["pattern"]
        out = {name: mask_score(p, m, exclude_bos) for name, m in masks.items()}
        if copying:
            W_OU = torch.einsum("hdm,mc->hdc", model.blocks[layer].attn.W_O, W_U_c)  # not model.W_O: it stacks all layers
            out["copying"] = _olsson_copying(p, t["z"], W_OU, cand_index, queries)
        bar.update(1)
        return out

    with torch.no_grad():
        rep = stream(model, toks, reduce_repeat, ["pattern", "z"] if copying else ["pattern"])

        # Pass 2: Olsson's prefix matching on [BOS] + R x 4.
        ptoks = repeated_tokens(model, prefix_seqs, prefix_len, 4, seed=seed + 1, pool=pool)
        pmask = target_masks(ptoks, prefix_len)["induction"]

        def reduce_prefix(layer: int, t: Dict[str, Tensor]) -> Tensor:
            bar.update(1)
            return mask_score(t["pattern"], pmask, exclude_bos)

        pre = stream(model, ptoks, reduce_prefix, ["pattern"])

        # Pass 3 (optional): natural text for previous- and duplicate-token heads.
        txt: Dict[int, Dict[str, Tensor]] = {}
        if text:
            ttoks = text_tokens(model, seq_len=min(128, model.cfg.n_ctx - 1), n_seqs=n_seqs, bos=bos)
            tmasks = target_masks(ttoks, 0, first_query=1)

            def reduce_text(layer: int, t: Dict[str, Tensor]) -> Dict[str, Tensor]:
                bar.update(1)
                return {f"{k}_text": mask_score(t["pattern"], tmasks[k], exclude_bos)
                        for k in ("previous_token", "duplicate_token")}

            txt = stream(model, ttoks, reduce_text, ["pattern"])
    bar.close()

    scores: Dict[str, Tensor] = {}
    for name in ("induction", "previous_token", "duplicate_token") + (("copying",) if copying else ()):
        scores[name] = torch.stack([rep[layer][name] for layer in range(L)]).float().cpu()
    scores["prefix_matching"] = torch.stack([pre[layer] for layer in range(L)]).float().cpu()
    for name in ("previous_token_text", "duplicate_token_text") if text else ():
        scores[name] = torch.stack([txt[layer][name] for layer in range(L)]).float().cpu()
    eigen_full = None
    if eigen_copying:
        from ._copying import copying_scores

        # The full circuit W_E·OV·W_U needs input and output vocabularies to match; else fall back
        # to the OV circuit alone (recorded in settings["eigen_copying_circuit"]).
        eigen_full = model.W_E.shape[0] == model.W_U.shape[-1]
        scores["eigen_copying"] = copying_scores(model, full=eigen_full).float().cpu()
    ordered = {k: scores[k] for k in SCORE_NAMES + ("previous_token_text", "duplicate_token_text") if k in scores}
    result = HeadScores(
        model=model_name(model), n_layers=L, n_heads=H, scores=ordered, thresholds=dict(THRESHOLDS),
        settings=_settings(model, n_seqs=n_seqs, seq_len=seq_len, seed=seed, bos=pool.bos_id,
                           prefix_seqs=prefix_seqs, prefix_len=prefix_len, text=text, exclude_bos=exclude_bos,
                           pool_size=len(pool.ids),
                           eigen_copying_circuit=None if eigen_full is None else ("full" if eigen_full else "ov")),
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
    from ._ablate import compare_to_random

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
    import transformer_lens

    from . import __version__

    return {**kw, "fold_ln": bool(getattr(model, "compatibility_mode", False)), "dtype": str(model.W_E.dtype),
            "device": str(model.W_E.device), "qkcircuits": __version__,
            "transformer_lens": getattr(transformer_lens, "__version__", "?"), "torch": torch.__version__}
