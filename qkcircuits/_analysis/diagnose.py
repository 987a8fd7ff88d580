"""Head health diagnostics: check the textbook √d_k story, saturation, sinks and causal-mask leaks per head.

>>> import qkcircuits as qk
>>> diag = qk.diagnose(model, progress=False)                # one streamed pass per prompt set
>>> diag["qk_var_ratio"].shape                               # Var(q·k)/d_k per head: [layer, head]
torch.Size([2, 2])
>>> diag.flagged()[:1]                                       # hand-built heads attend one-hot
[(Head(layer=0, head=0), ['near_one_hot'])]
>>> diag = qk.diagnose(qk.load("smollm2-135m"))              # doctest: +SKIP (needs SmolLM2)

The measures work on pure tensors too, e.g. random Gaussian queries and keys:

>>> g = torch.Generator().manual_seed(0)
>>> q, k = torch.randn(8, 128, 1, 64, generator=g), torch.randn(8, 128, 1, 64, generator=g)
>>> s = qk_statistics(q, k, scale=64 ** -0.5)
>>> round(float(s["qk_var"][0]) / 64, 1), round(float(s["scaled_var"][0]), 1)   # Var ≈ d_k, ≈ 1 after 1/√d_k
(1.0, 1.0)

What is measured, per head (``_diagnose_result.MEASURES`` lists every name): the raw q·k of
the q and k the model really multiplies (post-rotary, K expanded for grouped-query
attention) over causal pairs j ≤ i; the model's own scores (from ``hook_attn_scores`` where
that hook carries scores; on ``boot_native`` models it carries the pattern, a TransformerLens
quirk, so the scores are rebuilt from q·k, the module's scale and its soft-cap); attention
entropy, largest weight, first-token share and saturation Σ p(1−p) per query row i ≥ 1
(row 0 can only attend to itself), with the model's scaling and counterfactually without it;
the variance that independence of query and key would predict; and two causal-mask checks.
"""

from __future__ import annotations

from typing import Dict, Iterable, Optional, Sequence, Tuple, Union

import torch
from jaxtyping import Float, Int
from torch import Tensor

from .._foundation.capture import check_layers, has_rotary, stream
from .._foundation.errors import QKCircuitsError
from .._foundation.io import check_int
from .._foundation.model import model_name
from .._foundation.result import stamped
from .._foundation.sequences import check_seed, repeated_tokens, segment_length, text_tokens, token_pool
from .._foundation.arch import adapter
from .._weights.qk_ov import attention_scale
from .._weights.rotary import native_rotary, rotary_spec, rotate, rotate_native
from .diagnose_result import HeadDiagnostics, MEASURES, check_thresholds

# Sums that combine by max instead of addition.
_MAX_KEYS = ("pattern_err", "scores_err", "future_weight")
_PERTURB = ("perturb_change", "perturb_input_change")


def _softcap(x: Tensor, cap: Optional[float]) -> Tensor:
    return x if not cap or cap <= 0 else cap * torch.tanh(x / cap)


def _masked_softmax(scores: Tensor, causal: Tensor) -> Tensor:
    return torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)


def attended(p: int, window: Optional[int] = None, device=None) -> Tensor:
    """[q, k] bool: the pairs a query attends, keys at or before it (and, with a sliding ``window``, fewer than
    ``window`` positions back, as Gemma's and Mistral's local layers and GPT-Neo's local ones mask)."""
    mask = torch.ones(p, p, dtype=torch.bool, device=device).tril()
    return mask & ~torch.ones(p, p, dtype=torch.bool, device=device).tril(-int(window)) if window else mask


def head_sums(q: Float[Tensor, "batch pos head d"], k: Float[Tensor, "batch pos head d"], *, scale: float,
              softcap: Optional[float] = None, scores: Optional[Float[Tensor, "batch head q k"]] = None,
              pattern: Optional[Float[Tensor, "batch head q k"]] = None, window: Optional[int] = None
              ) -> Dict[str, Tensor]:
    """Additive per-head sums over one batch; ``combine_sums`` merges batches, ``finish_sums`` turns them into measures.

    ``q``/``k`` are what the model multiplies (post-rotary; k per query head). ``scores`` are the
    model's pre-softmax scores (default ``softcap(scale · q·k)``), ``pattern`` its attention
    (default the masked softmax of ``scores``). Every statistic is over the pairs the layer attends: causal,
    and within its sliding ``window`` where it has one (a windowed layer's own scores are −inf outside it).
    Memory: a few [batch, head, pos, pos] tensors.
    """
    b, p, h, d = q.shape
    if k.shape != q.shape:
        raise QKCircuitsError(f"q and k must have the same [batch, pos, head, d] shape, got {tuple(q.shape)} "
                              f"and {tuple(k.shape)} (expand K per query head first)")
    dev = q.device
    causal = attended(p, window, dev)
    raw = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float())
    rebuilt = _softcap(raw * scale, softcap)
    model_scores = rebuilt if scores is None else scores.float()
    recomputed = _masked_softmax(model_scores, causal)
    pat = recomputed if pattern is None else pattern.float()

    tri = causal.double()
    no_first = tri.clone()
    no_first[:, 0] = 0
    r64, s64 = raw.double(), model_scores.double().masked_fill(~causal, 0.0)
    out: Dict[str, Tensor] = {
        "n_pairs": torch.full((h,), b * float(tri.sum()), dtype=torch.float64, device=dev),
        "s_qk": (r64 * tri).sum((0, 2, 3)), "s_qk2": (r64.square() * tri).sum((0, 2, 3)),
        "n_nf": torch.full((h,), b * float(no_first.sum()), dtype=torch.float64, device=dev),
        "s_nf": (r64 * no_first).sum((0, 2, 3)), "s_nf2": (r64.square() * no_first).sum((0, 2, 3)),
        "s_sc": s64.sum((0, 2, 3)), "s_sc2": s64.square().sum((0, 2, 3)),
    }
    # Moments of q and k under the marginals of the causal pair distribution: query i pairs with
    # i+1 keys, key j with p-j queries. The variance independence predicts is then exact for pairs
    # drawn as (query, key) independently from those marginals.
    # (causal: query i pairs with i + 1 keys, key j with p − j queries; a window caps both)
    for name, x, w in (("q", q, tri.sum(1)), ("k", k, tri.sum(0))):
        x64 = x.double()
        out[f"w{name}"] = torch.full((h,), b * float(w.sum()), dtype=torch.float64, device=dev)
        out[f"m{name}"] = torch.einsum("bihd,i->hd", x64, w)
        xs = (x64 * w.sqrt()[None, :, None, None]).permute(2, 0, 1, 3).reshape(h, b * p, d)
        out[f"M{name}"] = xs.transpose(1, 2) @ xs                # Σ w x xᵀ as one batched matmul per head

    # Row statistics on rows i >= 1 (row 0 has a single key: entropy 0, weight 1, no information).
    rows = slice(1, p)
    log_n = torch.log(tri.sum(1)[1:]).float()                   # log(keys attended): uniform attention's entropy
    unscaled = _masked_softmax(raw, causal)
    out["n_rows"] = torch.full((h,), b * float(p - 1), dtype=torch.float64, device=dev)
    for suffix, pp in (("", pat), ("_u", unscaled)):
        ent = torch.special.entr(pp[:, :, rows]).sum(-1)         # [b, h, p-1]; entr(0) = 0
        frac = ent / log_n
        out[f"s_ent{suffix}"], out[f"s_ent2{suffix}"] = ent.double().sum((0, 2)), ent.double().square().sum((0, 2))
        out[f"s_frac{suffix}"] = frac.double().sum((0, 2))
        out[f"s_frac2{suffix}"] = frac.double().square().sum((0, 2))
        out[f"s_max{suffix}"] = pp[:, :, rows].amax(-1).double().sum((0, 2))
        out[f"s_sat{suffix}"] = (1 - pp[:, :, rows].square().sum(-1)).double().sum((0, 2))
    out["s_sink"] = pat[:, :, rows, 0].double().sum((0, 2))
    out["future_weight"] = future_weight(pat)
    out["pattern_err"] = (recomputed - pat).abs().amax((0, 2, 3)).double()
    # Where the model's scores come from a hook, check that q, k and the scale read rebuild them.
    out["scores_err"] = (rebuilt - model_scores).masked_fill(~causal, 0.0).abs().amax((0, 2, 3)).double()
    return out


def future_weight(pattern: Float[Tensor, "batch head q k"]) -> Float[Tensor, "head"]:
    """The largest weight any query puts on a later key, per head (exactly 0 under a causal mask)."""
    p = pattern.shape[-1]
    later = torch.ones(p, p, dtype=torch.bool, device=pattern.device).triu(1)
    return (pattern.double() * later).amax((0, 2, 3))


def combine_sums(a: Optional[Dict[str, Tensor]], b: Dict[str, Tensor]) -> Dict[str, Tensor]:
    if a is None:
        return dict(b)
    return {k: torch.maximum(a[k], b[k]) if k in _MAX_KEYS else a[k] + b[k] for k in a}


def finish_sums(s: Dict[str, Tensor], d_head: int) -> Dict[str, Float[Tensor, "head"]]:
    """Measures (see ``MEASURES``) from accumulated sums."""
    def mean_var(n, s1, s2):
        m = s1 / n
        return m, (s2 / n - m.square()).clamp_min(0)

    out: Dict[str, Tensor] = {}
    out["qk_mean"], out["qk_var"] = mean_var(s["n_pairs"], s["s_qk"], s["s_qk2"])
    out["qk_var_ratio"] = out["qk_var"] / d_head
    out["qk_var_no_first"] = mean_var(s["n_nf"], s["s_nf"], s["s_nf2"])[1]
    out["scaled_var"] = mean_var(s["n_pairs"], s["s_sc"], s["s_sc2"])[1]
    mu_q, mu_k = s["mq"] / s["wq"][:, None], s["mk"] / s["wk"][:, None]
    M_q, M_k = s["Mq"] / s["wq"][:, None, None], s["Mk"] / s["wk"][:, None, None]
    dq, dk = M_q.diagonal(dim1=1, dim2=2), M_k.diagonal(dim1=1, dim2=2)
    out["q_var"] = (dq - mu_q.square()).mean(-1)
    out["k_var"] = (dk - mu_k.square()).mean(-1)
    out["pred_var_zero_mean"] = ((dq - mu_q.square()) * (dk - mu_k.square())).sum(-1)
    out["pred_var_components"] = (dq * dk - (mu_q * mu_k).square()).sum(-1)
    out["pred_var_indep"] = torch.einsum("hde,hed->h", M_q, M_k) - (mu_q * mu_k).sum(-1).square()
    out["indep_ratio"] = out["qk_var"] / out["pred_var_indep"]
    n = s["n_rows"]
    out["entropy_mean"], ev = mean_var(n, s["s_ent"], s["s_ent2"])
    out["entropy_std"] = ev.sqrt()
    out["entropy_frac_mean"], fv = mean_var(n, s["s_frac"], s["s_frac2"])
    out["entropy_frac_std"] = fv.sqrt()
    out["max_weight"] = s["s_max"] / n
    out["sink"] = s["s_sink"] / n
    out["saturation"] = s["s_sat"] / n
    out["saturation_unscaled"] = s["s_sat_u"] / n
    out["entropy_frac_unscaled"] = s["s_frac_u"] / n
    out["max_weight_unscaled"] = s["s_max_u"] / n
    out["pattern_err"] = s["pattern_err"]
    out["scores_err"] = s["scores_err"]
    out["future_weight"] = s["future_weight"]
    return out


def qk_statistics(q: Float[Tensor, "batch pos head d"], k: Float[Tensor, "batch pos head d"], *,
                  scale: Optional[float] = None, softcap: Optional[float] = None,
                  pattern: Optional[Float[Tensor, "batch head q k"]] = None, window: Optional[int] = None
                  ) -> Dict[str, Float[Tensor, "head"]]:
    """Every measure of ``MEASURES`` except the perturbation test, for given q and k (scale default 1/√d), over
    the pairs a causal layer attends (within ``window`` keys back when given)."""
    d = q.shape[-1]
    sums = head_sums(q, k, scale=d ** -0.5 if scale is None else float(scale), softcap=softcap, pattern=pattern,
                     window=window)
    return finish_sums(sums, d)


def _qk_source(model):
    """(q hook, k hook, rotation): the hooks holding the q and k the model multiplies.

    Most rotary bridges of Hugging Face models fire ``hook_rot_q``/``hook_rot_k``. TransformerLens
    native modules declare those hooks but never fire them, so there (``"native"``) the pre-rotary
    q/k are read and rotated with ``rotate_native``; GPT-J's and GPT-NeoX's bridges do not fire them
    either (``"rebuilt"``): q/k are rotated with the layer's ``rotary_spec`` (verified against its
    pattern). ``pattern_err`` checks the result either way.
    """
    return adapter(model, 0).score_inputs()


def _perturbed(tokens: Tensor, n: int, start: int, pool_ids: Tensor, seed: int) -> Tensor:
    """Copies of the first ``n`` rows with every token from ``start`` on replaced by a different one."""
    g = torch.Generator().manual_seed(seed + 1)
    rows = tokens[:n].clone()
    new = pool_ids[torch.randint(0, len(pool_ids), rows[:, start:].shape, generator=g)].to(rows.device)
    same = new == rows[:, start:]
    new[same] = pool_ids[(torch.searchsorted(pool_ids, new[same].cpu()) + 1) % len(pool_ids)].to(rows.device)
    rows[:, start:] = new
    return rows


def _prompt_sets(model, sets: Sequence[str], n_seqs: int, seq_len: int, seg_len: int,
                 seed: int) -> Dict[str, Tensor]:
    out = {}
    for name in sets:
        if name == "text":
            out[name] = text_tokens(model, seq_len=seq_len, n_seqs=n_seqs)
        elif name == "repeated":
            out[name] = repeated_tokens(model, n_seqs=n_seqs, seg_len=seg_len, seed=seed,
                                        length_name="seg_len (--seg-len)")
        else:
            raise QKCircuitsError(f"unknown prompt set {name!r}; choose from 'text', 'repeated'")
    return out


def diagnose(model, *, prompt_sets: Optional[Sequence[str]] = None, n_seqs: int = 8, seq_len: Optional[int] = None,
             seg_len: Optional[int] = None, seed: int = 0, layers: Optional[Iterable[int]] = None,
             thresholds: Optional[Dict[str, Union[int, float]]] = None, n_perturb: int = 2,
             tokens: Optional[Dict[str, Int[Tensor, "batch pos"]]] = None, progress: bool = True) -> HeadDiagnostics:
    """Measure every head's health in one streamed forward pass per prompt set.

    ``prompt_sets`` defaults to natural text (when the model has a tokenizer; rows of ``seq_len``
    tokens, default 128) and repeated random tokens ([BOS] + R + R, ``seg_len`` tokens per copy,
    default 40; both shortened to fit a small context); ``tokens`` may give the sets' token ids
    directly instead. The perturbation test rides in the last set's pass: ``n_perturb`` copies of
    its first rows with every token from the middle on changed are appended to the batch, and
    every position before the change must read the same pattern, z, q, k and v as the original.
    Memory: one layer's q, k, v, z, scores and patterns at a time, plus a few [n_heads, d_head,
    d_head] moment sums per layer; the result is a few dozen [n_layers, n_heads] tensors.
    """
    from .._foundation.progress import progress_bar

    check_seed(seed)
    check_int("n_seqs", n_seqs)
    check_int("n_perturb", n_perturb, least=0)
    thr = check_thresholds(thresholds)
    n_ctx = int(model.cfg.n_ctx)
    pool = token_pool(model)
    # Defaults fit the context: 128 text tokens + BOS, 2 x 40 repeated tokens + BOS (shorter on small
    # models, and no longer than the token pool so a segment never repeats a token: a repeat would
    # split even an exact induction head's attention and blur its entropy).
    seq_len = min(128, n_ctx - 1) if seq_len is None else seq_len
    seg_len = segment_length(model, 2, 40, pool) if seg_len is None else seg_len
    if tokens is None:
        if prompt_sets is None:
            prompt_sets = (["text"] if getattr(model, "tokenizer", None) is not None else []) + ["repeated"]
        tokens = _prompt_sets(model, list(prompt_sets), n_seqs, seq_len, seg_len, seed)
    if not tokens:
        raise QKCircuitsError("no prompt sets given; use 'text' and/or 'repeated'")
    L, H, d_head = model.cfg.n_layers, model.cfg.n_heads, int(adapter(model, 0).d_qk)    # MLA: nope + rope
    layer_list = check_layers(model, layers)
    qn, kn, rope = _qk_source(model)
    scales = {layer: attention_scale(model, layer) for layer in layer_list}
    windows = {layer: adapter(model, layer).window() for layer in layer_list}
    specs = {layer: rotary_spec(model, layer=layer) for layer in layer_list} if rope == "rebuilt" else {}

    per_set: Dict[str, Dict[int, Dict[str, Tensor]]] = {}
    perturb: Dict[int, Tuple[Tensor, Tensor]] = {}
    measured_scale: Dict[int, float] = {}
    scores_real: Dict[int, bool] = {}
    bar = progress_bar(total=len(tokens) * len(layer_list), desc="diagnose", enabled=progress)
    set_names = list(tokens)
    for si, set_name in enumerate(set_names):
        toks = torch.as_tensor(tokens[set_name])
        toks = toks[None] if toks.dim() == 1 else toks
        if toks.dim() != 2 or toks.shape[1] < 2:
            raise QKCircuitsError(f"prompt set {set_name!r} must be [batch, pos] token ids with pos >= 2, "
                                  f"got shape {tuple(toks.shape)}")
        n_clean = toks.shape[0]
        cut = toks.shape[1] // 2
        n_pert = min(n_perturb, n_clean) if si == len(set_names) - 1 and toks.shape[1] >= 4 else 0
        if n_pert:
            toks = torch.cat([toks, _perturbed(toks, n_pert, cut, pool.ids, seed)], 0)
        names = [qn, kn, "scores", "pattern"] + (["v", "z"] if n_pert else [])

        def reducer(layer: int, t: Dict[str, Tensor]) -> Dict[str, Tensor]:
            scale, _, cap = scales[layer]
            q, k, pat, sc = t[qn], t[kn], t["pattern"], t["scores"]
            if rope == "native":
                q, k = rotate_native(native_rotary(model, layer), q, k)
            elif rope == "rebuilt":
                q, k = rotate(specs[layer], q), rotate(specs[layer], k)
            real = not adapter(model, layer).scores_hook_holds_pattern and not torch.equal(sc, pat)
            scores_real[layer] = real
            if real and not cap and layer not in measured_scale:
                # The factor the model really applied: least squares of its scores on raw q·k (the attended pairs:
                # a windowed layer's scores are −inf outside its window)
                raw = torch.einsum("bqhd,bkhd->bhqk", q[:n_clean].double(), k[:n_clean].double())
                causal = attended(raw.shape[-1], windows[layer], raw.device)
                s64 = sc[:n_clean].double()
                measured_scale[layer] = float((raw * s64)[..., causal].sum() / raw[..., causal].square().sum())
            sums = head_sums(q[:n_clean], k[:n_clean], scale=scale, softcap=cap,
                             scores=sc[:n_clean] if real else None, pattern=pat[:n_clean], window=windows[layer])
            # Future weight over every row, the perturbed copies included.
            sums["future_weight"] = torch.maximum(sums["future_weight"], future_weight(pat))
            if n_pert:
                a, b = slice(0, n_pert), slice(n_clean, n_clean + n_pert)
                d_pat = (pat[b, :, :cut] - pat[a, :, :cut]).abs().amax((0, 2, 3))
                d_z = (t["z"][b, :cut] - t["z"][a, :cut]).abs().amax((0, 1, 3))
                d_in = max(float((t[n][b, :cut] - t[n][a, :cut]).abs().max()) for n in (qn, kn, "v"))
                perturb[layer] = (torch.maximum(d_pat, d_z).double(), torch.full((H,), d_in, dtype=torch.float64))
            bar.update(1)
            return sums

        per_set[set_name] = stream(model, toks, reducer, names, layers=layer_list)
        missing = [layer for layer in layer_list if layer not in per_set[set_name]]
        if missing:
            raise QKCircuitsError(f"the hooks {', '.join(names)} did not all fire on layers {missing}: this "
                                  f"model does not expose the q/k it multiplies, so its heads cannot be diagnosed")
    bar.close()

    def grid(values: Dict[int, Dict[str, Tensor]]) -> Dict[str, Tensor]:
        out = {m: torch.full((L, H), float("nan"), dtype=torch.float64) for m in MEASURES}
        for layer, sums in values.items():
            for m, v in finish_sums(sums, d_head).items():
                out[m][layer] = v.cpu()
        return out

    by_set = {s: {m: v for m, v in grid(vals).items() if m not in _PERTURB} for s, vals in per_set.items()}
    pooled: Dict[int, Dict[str, Tensor]] = {}
    for vals in per_set.values():
        for layer, sums in vals.items():
            pooled[layer] = combine_sums(pooled.get(layer), sums)
    measures = grid(pooled)
    for layer, (chg, inp) in perturb.items():
        measures["perturb_change"][layer], measures["perturb_input_change"][layer] = chg.cpu(), inp
    scale = torch.full((L,), float("nan"), dtype=torch.float64)
    sources = {}
    for layer, (s, src, cap) in scales.items():
        if layer in measured_scale and abs(measured_scale[layer] - s) > 1e-3 * abs(s):
            s, src = measured_scale[layer], f"measured from hook_attn_scores (module said {s:g})"
        scale[layer] = s
        sources[src] = sources.get(src, 0) + 1
    caps = sorted({c for _, _, c in scales.values() if c})
    settings = {
        "prompt_sets": {s: {"n_seqs": int(shape[0]), "seq_len": int(shape[-1])}
                        for s, shape in ((s, torch.as_tensor(tokens[s]).shape) for s in set_names)},
        "seed": seed, "seg_len": seg_len, "n_perturb": n_perturb, "thresholds": thr,
        "layers": layer_list,
        "qk_hooks": [qn, kn] + ({"native": ["rotary applied from the native module: hook_rot_q/k never fire there"],
                                 "rebuilt": ["rotary rebuilt from the model's own frequencies (pairing verified "
                                             "against its pattern): this bridge never fires hook_rot_q/k"]
                                 }.get(rope, [])),
        "scale_source": sorted(sources), "softcap": caps[0] if len(caps) == 1 else (caps or None),
        "scores_hook": ("real scores" if all(scores_real.values()) else
                        "carries the pattern on some layers: scores rebuilt from q·k, scale and soft-cap"),
        "scale_measured": {str(k): v for k, v in sorted(measured_scale.items())},
    }                                   # + versions (Result.__post_init__: written in one place)
    return HeadDiagnostics(model=model_name(model), n_layers=L, n_heads=H,
                           d_head=d_head, measures=measures, scale=scale, settings=stamped(settings, model), by_set=by_set)

