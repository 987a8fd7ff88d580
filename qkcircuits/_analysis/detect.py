"""Head detectors: induction, prefix matching, previous-token, duplicate-token and copying scores.

>>> scores = scan(model, progress=False)                    # one streamed pass per prompt set
>>> scores.top(1, "induction")[0][0], scores.heads_labelled("previous-token")
(Head(layer=1, head=0), [Head(layer=0, head=0)])

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
"does it do the job" asks. See docs/detectors.md for thresholds and failure modes. Each score is one
``Detector`` in the registry (``_analysis/detectors.py``); the built-ins are registered below, and
``qk.register_detector`` adds more.
"""

from __future__ import annotations

import copy
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from .._foundation.capture import stream
from .._foundation.errors import QKCircuitsError
from .._foundation.arch.model_facts import folded
from .._foundation.arch.norms import read_once
from .._foundation.args import check_model
from .._foundation.io import check_int
from .._foundation.result import stamped
from .._foundation.model import model_name
from .._foundation.model_cache import remembered
from .._foundation.progress import progress_bar
from .._foundation.sequences import check_seed, repeated_tokens, segment_length, text_tokens, token_pool
from .._weights import contextual as _contextual
from .._weights.qk_ov import unembed_chunk, layer_weights
from .._weights.copying import copying_scores
from .detectors import (PROMPT_SETS, Detector, ScanContext, detector, detectors, duplicate_token_mask, induction_mask,
                        previous_token_mask, register_detector, select, target_masks, thresholds)
from .head_scores import HeadScores

Masks = Dict[str, Bool[Tensor, "batch q k"]]


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
    # (z W_O) U_c as z (W_O U_c): the head's [d_head, C] logit map per sequence first (h·d·d_model·b·C
    # multiply-adds) instead of every query's d_model write (b·q·h·d·d_model + b·q·h·d_model·C): ~3x fewer
    # on the default prompts; the same sum in another order (equal to float rounding).
    logits = torch.einsum("bqhd,bhdc->bqhc", z, torch.einsum("hdm,bmc->bhdc", W_O, U_c))
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


def copying_reducer(model, tokens: Int[Tensor, "batch pos"], seg_len: int):
    """Olsson's ``copying`` as a per-layer reduction of [BOS]+R+R's pattern and z (see ``olsson_copying``)."""
    queries = target_masks(tokens, seg_len)["induction"].any(-1)
    cand, valid, cand_index = copying_candidates(tokens)
    U = model.W_U.detach()
    U_c = unembed_chunk(model, U[:, cand.clamp_min(0).flatten()], True)       # [d_model, b·C]
    U_c = U_c.view(U.shape[0], *cand.shape).permute(1, 0, 2)                   # [b, d_model, C]

    def reduce(layer: int, t: Dict[str, Tensor]) -> Tensor:
        w = layer_weights(model, layer)                      # this layer's weights only
        # attention sums to 1, so z carries the value's constant part whole (b_V, plus the input norm's bias
        # through W_V with raw weights): a write that copies nothing and that folding moves into b_O. Leave it
        # out in both fold modes.
        const = w.b_V
        b_ln = _contextual._ln1_bias(model, layer)
        if b_ln is not None:
            const = const + torch.einsum("m,hmd->hd", b_ln.to(w.W_V.dtype), w.W_V)
        z = t["z"] - const.to(t["z"].dtype)
        return olsson_copying(t["pattern"], z, w.W_O, U_c.to(w.W_O.dtype), valid, cand_index, queries)

    return reduce


def ov_copying_score(model, ctx: ScanContext):
    """``ov_copying``: a thin call of ``_weights.contextual.ov_copying`` on ``ctx.ov_tokens`` corpus tokens;
    remembered per model while its weights are unchanged (``model_cache``: a second scan of the model skips it)."""
    scores, info = remembered(model, "scan: ov_copying", (ctx.ov_tokens, ctx.seed, ctx.ov_method),
                              lambda: _contextual.ov_copying(model, n_tokens=ctx.ov_tokens, seed=ctx.seed,
                                                             method=ctx.ov_method), depends="weights")
    return scores.clone(), {"ov_copying": copy.deepcopy(info)}


def eigen_copying_score(model, ctx: ScanContext):
    """``eigen_copying`` from the weights; the full circuit W_E·OV·W_U needs input and output vocabularies to
    match, else the OV circuit alone (recorded in ``settings["eigen_copying_circuit"]``). Remembered per model while
    its weights are unchanged (``model_cache``)."""
    full = model.W_E.shape[0] == model.W_U.shape[-1]
    scores = remembered(model, "scan: eigen_copying", full, lambda: copying_scores(model, full=full).float().cpu(),
                        depends="weights")
    return scores.clone(), {"eigen_copying_circuit": "full" if full else "ov"}


# label -> (score, minimum). 0.4 is ARENA's cut-off; chance for any of these is ~1/i (uniform attention over i
# keys), i.e. < 0.05 on the default 81-token prompts: 0.4 is > 8x chance and well below what real specialised
# heads reach (GPT-2's induction heads score 0.6-0.95).
BUILT_INS = (
    Detector("induction", "repeated", mask=induction_mask, threshold=0.4, label="induction",
             description="attention from the second copy of a repeated random sequence to the token after the "
                         "earlier copy"),
    Detector("prefix_matching", "prefix", mask=induction_mask,
             description="Olsson's prefix matching on a sequence repeated 4 times"),
    Detector("previous_token", "repeated", mask=previous_token_mask, threshold=0.4, label="previous-token",
             description="attention to the previous position"),
    Detector("duplicate_token", "repeated", mask=duplicate_token_mask, threshold=0.4, label="duplicate-token",
             description="attention to earlier copies of the current token"),
    Detector("copying", "repeated", reducer=copying_reducer, needs=("pattern", "z"), switch="copying",
             description="Olsson's copying score of the head's direct-path logits, candidates per sequence; "
                         "0 = chance, +1 copies"),
    Detector("ov_copying", "model", score=ov_copying_score, switch="copying",
             description="median rank of the source token in the head's contextual OV logits; 1 = top, "
                         "0 = chance, −1 = last"),
    Detector("eigen_copying", "model", score=eigen_copying_score, switch="eigen_copying",
             description="sum(λ)/sum(|λ|) of W_E W_OV W_U, W_U centred over the vocabulary (Elhage); "
                         "+1 copies, −1 anti"),
    Detector("previous_token_text", "text", mask=previous_token_mask, default=False, switch="text",
             description="previous-token attention on natural text"),
    Detector("duplicate_token_text", "text", mask=duplicate_token_mask, default=False, switch="text",
             description="duplicate-token attention on natural text"),
)
for _d in BUILT_INS:
    register_detector(_d, replace=True)


def prompt_set(model, kind: str, ctx: ScanContext) -> Tuple[Int[Tensor, "batch pos"], int, Optional[int]]:
    """The tokens of prompt set ``kind`` and how its masks read them: ``(tokens, seg_len, first_query)``."""
    if kind == "repeated":
        return (repeated_tokens(model, ctx.n_seqs, ctx.seg_len, 2, seed=ctx.seed, pool=ctx.pool,
                                length_name="seg_len (--seg-len)"), ctx.seg_len, None)
    if kind == "prefix":
        return (repeated_tokens(model, ctx.prefix_seqs, ctx.prefix_len, 4, seed=ctx.seed + 1, pool=ctx.pool,
                                length_name="prefix_len"), ctx.prefix_len, None)
    if kind == "text":
        return text_tokens(model, seq_len=min(128, model.cfg.n_ctx - 1), n_seqs=ctx.n_seqs, bos=ctx.bos), 0, 1
    raise QKCircuitsError(f"prompt set {kind!r} is not streamed; streamed sets: repeated, prefix, text")


def stream_scores(model, dets: Sequence[Detector], tokens: Int[Tensor, "batch pos"], seg_len: int,
                  first_query: Optional[int], exclude_bos: bool = False, bar=None) -> Dict[str, Tensor]:
    """ONE streamed pass over ``tokens`` computing every mask/reducer detector in ``dets``: {name: [L, H]}.

    Memory: one layer's hooks (``needs`` of the detectors, e.g. the [batch, head, pos, pos] pattern) at a time.
    """
    reducers, needs = {}, []
    for d in dets:
        if d.mask is not None:
            m = d.mask(tokens, seg_len, first_query)
            reducers[d.name] = (lambda m: lambda layer, t: mask_score(t["pattern"], m, exclude_bos))(m)
        else:
            reducers[d.name] = d.reducer(model, tokens, seg_len)
        needs += [n for n in d.needs if n not in needs]

    def reduce(layer: int, t: Dict[str, Tensor]) -> Dict[str, Tensor]:
        res = {name: fn(layer, t) for name, fn in reducers.items()}
        if bar is not None:
            bar.update(1)
        return res

    out = stream(model, tokens, reduce, needs)
    return {name: torch.stack([out[layer][name] for layer in range(model.cfg.n_layers)]).float().cpu()
            for name in reducers}


def scan(model, *, scores: Optional[Sequence[str]] = None, n_seqs: int = 8, seg_len: Optional[int] = None,
         seed: int = 0, bos: Optional[int] = None, prefix_seqs: int = 10, prefix_len: Optional[int] = None,
         text: bool = False, copying: bool = True, eigen_copying: bool = True, exclude_bos: bool = False,
         confirm_k: int = 0, ov_tokens: int = 64, ov_method: str = "sample", progress: bool = True) -> HeadScores:
    """Score every head of ``model`` with the registered detectors (``qk.detectors()``; module docstring).

    >>> s = qk.scan(model, scores="induction,previous_token", progress=False)
    >>> s.heads_labelled("induction"), s.heads_labelled("previous-token")
    ([Head(layer=1, head=0)], [Head(layer=0, head=0)])

    ``scores``: the detector names to compute (a list or one comma-separated string); None computes the
    default ones (``copying=False`` drops the two copying scores, ``eigen_copying=False`` the eigenvalue one,
    ``text=True`` adds the text scores). Only the passes the names need run: induction/previous_token/
    duplicate_token alone are ONE streamed pass over [BOS]+R+R that reads only the patterns and stops after
    the last layer's attention.

    Prompt sets: [BOS]+R+R (``n_seqs`` × R of ``seg_len``), [BOS]+R×4 (``prefix_seqs`` × ``prefix_len``),
    natural text; detectors on ``"model"`` make their own (``ov_copying``: rows of ``ov_tokens`` corpus tokens).
    ``seg_len`` defaults to 40 and ``prefix_len`` to 25 (Olsson), each capped by the context and by the
    token pool, so that R is drawn without repeats where the vocabulary allows. ``exclude_bos`` renormalises
    each query's attention away from BOS before scoring; the default counts attention parked on BOS as
    attention not on target. Memory: one layer's [batch, head, pos, pos] pattern at a time, plus
    [n_layers, n_heads] scores. ``confirm_k=k`` ablates the top-k induction heads and k random heads and
    stores the loss rises in ``extras["confirmation"]``.
    ``ov_method``: ``"sample"`` (default) estimates ``ov_copying``'s ranks from a vocabulary sample,
    ``"exact"`` counts every rank over the whole vocabulary (see ``qkcircuits.ov_copying``).
    """
    model = check_model(model)
    names = _check_scan(seed, n_seqs, prefix_seqs, ov_tokens, scores, text, copying, eigen_copying)
    pool = token_pool(model, bos=bos)
    ctx = ScanContext(seed=seed, n_seqs=n_seqs, prefix_seqs=prefix_seqs, ov_tokens=ov_tokens, ov_method=ov_method, pool=pool, bos=bos,
                      exclude_bos=exclude_bos,
                      seg_len=check_int("seg_len", seg_len, 2) if seg_len is not None else segment_length(model, 2, 40, pool),
                      prefix_len=(check_int("prefix_len", prefix_len, 2) if prefix_len is not None
                                  else segment_length(model, 4, 25, pool)))
    chosen = [detector(n) for n in names]
    streamed = [k for k in PROMPT_SETS if k != "model" and any(d.prompts == k for d in chosen)]
    L = model.cfg.n_layers
    bar = progress_bar(total=(len(streamed) + sum(d.prompts == "model" for d in chosen)) * L, desc="scan",
                       unit="layer", enabled=progress)
    out: Dict[str, Tensor] = {}
    extra: Dict[str, object] = {"eigen_copying_circuit": None}
    with read_once():                        # the weights stay as they are: each norm is read once per scan
        with torch.no_grad():
            for kind in streamed:
                toks, seg, first = prompt_set(model, kind, ctx)
                out.update(stream_scores(model, [d for d in chosen if d.prompts == kind], toks, seg, first,
                                         exclude_bos, bar))
        for d in chosen:
            if d.prompts == "model":
                got = d.score(model, ctx)
                out[d.name], info = got if isinstance(got, tuple) else (got, {})
                extra.update(info or {})
                bar.update(L)
    bar.close()
    result = HeadScores(
        model=model_name(model), n_layers=L, n_heads=model.cfg.n_heads, scores={k: out[k] for k in names},
        thresholds=thresholds(),
        settings=_settings(model, scores=names, n_seqs=n_seqs, seq_len=ctx.seg_len, seed=seed, bos=pool.bos_id,
                           prefix_seqs=prefix_seqs, prefix_len=ctx.prefix_len, text="text" in streamed,
                           exclude_bos=exclude_bos, pool_size=len(pool.ids), **extra),
    )
    if confirm_k:
        result.extras["confirmation"] = confirm_induction(model, result, k=confirm_k, seed=seed, pool=pool,
                                                          n_seqs=n_seqs, seg_len=ctx.seg_len)
    return result


def _check_scan(seed, n_seqs, prefix_seqs, ov_tokens, scores, text, copying, eigen_copying) -> List[str]:
    check_seed(seed)
    check_int("n_seqs", n_seqs)
    check_int("prefix_seqs", prefix_seqs)
    check_int("ov_tokens", ov_tokens)
    return select(scores, text=text, copying=copying, eigen_copying=eigen_copying)


def confirm_induction(model, scores: HeadScores, *, k: int = 5, n_draws: int = 10, seed: int = 0, pool=None,
                      n_seqs: int = 8, seg_len: int = 40) -> Dict[str, object]:
    """Causal check: rise of the repeated-half loss when the top-``k`` induction heads are zero-ablated
    together, against ``n_draws`` sets of ``k`` random other heads (``qkcircuits.compare_to_random``), on
    ``n_seqs`` prompts [BOS]+R+R with R of ``seg_len`` tokens.

    Returns plain data (JSON-ready): heads, baseline, effect, random_effects, random_heads, seed, n_seqs and
    ``seq_len`` (the JSON key of the segment length, kept so old files and readers agree).
    """
    from .ablate import compare_to_random

    check_int("k", k)
    pool = pool or token_pool(model)
    seg_len = min(seg_len, segment_length(model, 2, seg_len, pool))    # keep R free of repeats, as the scan does
    toks = repeated_tokens(model, n_seqs, seg_len, 2, seed=seed + 2, pool=pool)
    heads = [h for h, _ in scores.top(k, "induction")]
    cmp = compare_to_random(model, heads, toks, "induction-loss", n_draws=n_draws, seed=seed)
    return {"heads": [str(h) for h in cmp.heads], "metric": cmp.metric, "method": cmp.method,
            "baseline": cmp.baseline, "effect": cmp.effect, "random_effects": [float(x) for x in cmp.random_effects],
            "random_heads": [[str(h) for h in hs] for hs in cmp.random_heads], "seed": seed, "n_seqs": n_seqs,
            "seq_len": seg_len}


def confirmation_sentence(conf: Dict) -> str:
    """The causal check (``confirm_induction``'s dict, ``scores.extras["confirmation"]``) in one sentence: the CLI
    prints it and the report shows it beside its figure.

    >>> confirmation_sentence({"heads": ["1.0"], "effect": 8.25, "random_effects": [0.1, 0.3]})
    'causal check: ablating the top induction heads (1.0) raises the repeated-half loss by +8.250 nats; 2 random sets of as many heads: mean +0.200, max +0.300; above random: the margin over the random max, +7.950, is 56.2 SDs of the 2 random sets (z = 56.9)'

    A margin over the random sets' max that is within their spread ends in a warning (``stats.random_verdict``).
    """
    from .._foundation.stats import random_verdict

    heads = ", ".join(str(h) for h in conf.get("heads", []))
    rnd = [float(x) for x in conf.get("random_effects", [])]
    mean_rnd = sum(rnd) / len(rnd) if rnd else float("nan")
    return (f"causal check: ablating the top induction heads ({heads}) raises the repeated-half loss by "
            f"{float(conf.get('effect', float('nan'))):+.3f} nats; {len(rnd)} random sets of as many heads: mean "
            f"{mean_rnd:+.3f}, max {max(rnd) if rnd else float('nan'):+.3f}; "
            f"{random_verdict(float(conf.get('effect', float('nan'))), rnd)}")


def _settings(model, **kw) -> Dict[str, object]:
    return stamped({**kw, "fold_ln": folded(model), "dtype": str(model.W_E.dtype),
                    "device": str(model.W_E.device)}, model)
