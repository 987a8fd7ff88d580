"""Why a head attends where it does: its attention score split exactly into pairs (query-side source, key-side
source) of upstream components, on real prompts.

>>> r = qk.attend(model, "1.0", torch.tensor([[0, 5, 6, 7, 5, 6, 7]]), key="induction", reading="raw")
>>> [(n, round(v, 2), round(s, 2)) for n, v, s in r.key_sources(1)]     # keys: from the previous-token head
[('0.0', 30.0, 1.0)]
>>> [(n, round(v, 2), round(s, 2)) for n, v, s in r.query_sources(1)]   # queries: from the token embedding
[('emb', 30.0, 1.0)]

The score of query position i and key position j is bilinear in the residual stream. Hold every norm's
per-position scale at its value in the run (the input norm's 1/σ, a QK-norm's, the latent norms' of multi-head
latent attention); the residual at a position is the sum of the sources' writes x_a (``writes.py``), and the
query and key maps are then linear in them (``_foundation/arch/qkmap``):

    score(i, j) = scale · ⟨q_i, k_j⟩ = scale · Σ_a Σ_b ⟨Q_a(i), K_b(j)⟩,
    Q_a(i) = finish_q,i(x_a[i] W_q),  K_b(j) = finish_k,j(x_b[j] W_k),  plus the constants bias_q / bias_k

where finish applies the frozen scales, the QK-norm's weight and the rotary at that position. Readings:
``raw`` (score(i, j)); ``contrast`` (default: score(i, j) − the mean of score(i, k) over the other keys k the
head may attend from i — its causal and sliding-window mask respected — what makes j win); ``versus``
(score(i, j) − score(i, v)). Each is Σ_pos w(pos)·score(i, pos) for a weight w over key positions, so every
reading splits the same way with K_b replaced by Σ_pos w(pos) K_b(pos). A soft-capped score (Gemma-2) is
decomposed before its cap.

``exact_error``: the largest of |softmax of the rebuilt score rows − the model's own pattern| and, where the
bridge exposes real scores, |rebuilt − captured| / max |captured|.

Memory: per prompt shard one ``Writes`` (each earlier layer's z and MLP output), one source block's [n, b, p, d_qk]
at a time on the key side; kept for all rows: Q [rows, sources, d_qk] and the reading's K [rows, sources, d_qk].
Never [sources, sources, positions, positions], nor one residual copy per source.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .._foundation.arch import adapter
from .._foundation.errors import QKCircuitsError
from .._foundation.heads import Head, model_heads
from .._foundation.io import check_int
from .._foundation.result import stamped
from .attribution import Attribution, summarise
from .rows import Rows, rows_for
from .writes import Writes, capture_writes

READINGS = ("raw", "contrast", "versus")


def attend(model, head, tokens=None, *, task=None, query=None, key=None, versus=None, reading: str = "contrast",
           expand: Optional[str] = None, k: int = 5, labels: Optional[Dict[str, str]] = None,
           batch_size: int = 32) -> Attribution:
    """Split ``head``'s score on the chosen rows into (query source, key source) pairs (module docstring).

    Rows (``rows.py``): ``tokens`` (ids or text) with ``query``/``key`` positions or ``key="induction"``, or a
    ``task`` with named positions (``query="END", key="IO", versus="S1"``; ``qk.tasks.induction`` needs none).
    ``reading``: "contrast" (default), "raw" or "versus" (implied by ``versus``). ``expand``: "key" or "query"
    splits the ``k`` largest head sources on that side by the position each read from. ``labels``: names for
    sources ({"16.0": "previous-token"}), shown next to them. ``batch_size``: prompts per forward.
    """
    h = _one_head(model, head)
    if versus is not None:
        if reading not in ("contrast", "versus"):
            raise QKCircuitsError(f"versus= compares two keys; it has no reading {reading!r} (leave reading out)")
        reading = "versus"
    if reading not in READINGS:
        raise QKCircuitsError(f"unknown reading {reading!r}; choose one of {', '.join(READINGS)}")
    if reading == "versus" and versus is None:
        raise QKCircuitsError("reading 'versus' needs versus= (the key position to compare with)")
    if expand not in (None, "key", "query"):
        raise QKCircuitsError(f"expand must be 'key', 'query' or None, got {expand!r}")
    k = check_int("k", k)
    batch_size = check_int("batch_size", batch_size)
    att = adapter(model, h.layer)
    rows = rows_for(model, h.layer, tokens, task=task, query=query, key=key, versus=versus, window=att.window())
    parts, chosen = [], None
    for idx in torch.arange(rows.tokens.shape[0]).split(batch_size):
        part = _shard(model, att, h, rows, idx, reading, expand, k, chosen)
        if part is not None:
            parts.append(part)
            chosen = chosen or (list(part["expanded"]) if expand else None)
    names_q, names_k = parts[0]["names_q"], parts[0]["names_k"]
    cat = {key_: torch.cat([p[key_] for p in parts]) for key_ in ("Q", "K", "attention", "row_index")}
    order = torch.argsort(cat["row_index"])
    Q, K = cat["Q"][order], cat["K"][order]
    factor, source, cap = att.scale()
    settings = {"scale": factor, "scale_source": source, "softcap": cap,
                "rows": rows.what, "positions": rows.names, "n_rows": len(rows), "dropped_rows": rows.dropped,
                "frozen": _frozen_note(att), "labels": dict(labels or {}),
                "score_error": max(p["score_error"] for p in parts), "pattern_error": max(p["pattern_error"] for p in parts),
                "bias_spread": max(p["bias_spread"] for p in parts), "family": att.family}
    if cap:
        settings["caveats"] = [f"the layer soft-caps its scores at {cap:g}: the pre-cap score is decomposed"]
    expanded = _merge_expansions([p["expanded"] for p in parts], len(rows)) if expand else {}
    return summarise(model, str(h), reading, rows, names_q, names_k, Q * factor, K, cat["attention"][order],
                     max(settings["score_error"], settings["pattern_error"]), stamped(settings), expanded, expand)


def _one_head(model, head) -> Head:
    heads = model_heads(model, [head] if isinstance(head, Head) else head)
    if len(heads) != 1:
        raise QKCircuitsError(f"attend explains one head at a time, got {len(heads)} from {head!r}; name one, e.g. '5.1'")
    return heads[0]


def _frozen_note(att) -> List[str]:
    out = ["the input norm's 1/σ at each position"] if att.input_norm().kind else []
    if att.family == "latent":
        out.append("the query and KV latents' RMS scales (the shared rotary key is not normalised)")
    elif any(n is not None for n in att.qk_norms()):
        out.append("the QK-norm's 1/σ of each head's query and key")
    return out


def key_weights(rows: Rows, idx: Tensor, p: int, reading: str, window: Optional[int]) -> Tensor:
    """[n, p] weights over key positions whose sum with the score row is the reading (module docstring)."""
    n = int(idx.numel())
    i, j = rows.i[idx], rows.j[idx]
    w = torch.zeros(n, p, dtype=torch.float64)
    w[torch.arange(n), j] = 1.0
    if reading == "versus":
        w[torch.arange(n), rows.v[idx]] -= 1.0
    elif reading == "contrast":
        pos = torch.arange(p)
        ok = (pos[None] <= i[:, None]) & (pos[None] != j[:, None])
        if window is not None:
            ok &= (i[:, None] - pos[None]) < window
        count = ok.sum(1, keepdim=True).clamp_min(1)
        w -= ok.double() / count
    return w


def _shard(model, att, h: Head, rows: Rows, prompts: Tensor, reading: str, expand: Optional[str], k: int,
           chosen: Optional[List[str]] = None):
    """Q and the reading's K per row for the rows whose prompt is in ``prompts`` (one forward); ``chosen``: the
    head sources to expand (the first shard picks them)."""
    sel = torch.isin(rows.b, prompts).nonzero().flatten()
    if sel.numel() == 0:
        return None
    local = {int(b): n for n, b in enumerate(prompts.tolist())}
    tokens = rows.tokens[prompts].to(model.W_E.device)
    w = capture_writes(model, tokens, h.layer, expand=expand is not None)
    dev = w.resid.device
    rb = torch.tensor([local[int(b)] for b in rows.b[sel]], device=dev)
    ri, rj = rows.i[sel].to(dev), rows.j[sel].to(dev)
    p = tokens.shape[1]
    qm, km = att.query_map(h.head), att.key_map(h.head // (att.n_heads // att.n_kv_heads))
    qm.W, qm.c, km.W, km.c = (t.to(dev) for t in (qm.W, qm.c, km.W, km.c))
    fq, fk = qm.frozen(w.resid), km.frozen(w.resid)
    wr = key_weights(rows, sel, p, reading, att.window()).to(dev)                     # [n, p]
    names, Qs, Ks = [], [], []
    k_total = torch.zeros(*tokens.shape, km.W.shape[1], dtype=torch.float64, device=dev)
    for name, q_rows, k_all in _blocks(w, qm, km, rb, ri):
        Qs.append(qm.finish(q_rows, fq, rows=(rb, ri)).transpose(0, 1))             # [n, s, d]
        k_fin = km.finish(k_all, fk)                                                 # [s, b, p, d]
        k_total += k_fin.sum(0)
        Ks.append(torch.einsum("np,snpd->nsd", wr, k_fin[:, rb]))
        names += name
    Qc = qm.constant(fq, rows=(rb, ri))[:, None]                                     # [n, 1, d]
    kc = km.constant(fk)                                                             # [b, p, d]
    k_total += kc
    Q = torch.cat(Qs + [Qc], 1)
    K = torch.cat(Ks + [torch.einsum("np,npd->nd", wr, kc[rb])[:, None]], 1)
    errs = _exactness(att, w, h, Q.sum(1), k_total, rb, ri)
    out = {"names_q": names + ["bias_q"], "names_k": names + ["bias_k"], "Q": Q.cpu(), "K": K.cpu(),
           "attention": w.pattern[rb, h.head, ri, rj].double().cpu(), "row_index": sel,
           "bias_spread": w.bias_spread(), **errs, "expanded": None}
    if expand:
        out["expanded"] = _expand(att, w, h, qm if expand == "query" else km, fq if expand == "query" else fk,
                                  names, Q, K, wr, rb, ri, expand, k, sel, chosen)
    return out


def _blocks(w: Writes, qm, km, rb: Tensor, ri: Tensor):
    """(names, the query-side x W_q at the rows [s, n, d], the key-side x W_k everywhere [s, b, p, d]) per source
    block, in ``w.names()`` order (the residual bias last); heads are projected from z (W_O·W fused first)."""
    def dense(x: Tensor):
        x = x.double()
        return (x[rb, ri] @ qm.W)[None], (x @ km.W)[None]

    yield ["emb"], *dense(w.emb)
    if w.pos is not None:
        yield ["pos"], *dense(w.pos)
    for l, heads in w.head_blocks():
        M = w.head_out_map(l)                                                        # [H, e, d_model]
        z = w.z[l].double()
        q_rows = torch.einsum("nhe,hed->hnd", z[rb, ri], M @ qm.W)
        k_all = torch.einsum("bphe,hed->hbpd", z, M @ km.W)
        s = w.post_scale(l)
        if s is not None:
            q_rows, k_all = q_rows * s[rb, ri], k_all * s
        yield heads, q_rows, k_all
        for name, x in w.mlp_parts(l):
            yield [name], *dense(x)
    yield ["bias"], *dense(w.bias())


def _exactness(att, w: Writes, h: Head, q_tot: Tensor, k_total: Tensor, rb: Tensor, ri: Tensor) -> Dict[str, float]:
    """Rebuild each row's whole score row from the summed parts and compare with the model's own."""
    factor, _, cap = att.scale()
    S = torch.einsum("nd,npd->np", q_tot, k_total[rb]) * factor                    # [n, p]
    if cap:
        S = cap * torch.tanh(S / cap)
    p = S.shape[1]
    pos = torch.arange(p, device=S.device)
    ok = pos[None] <= ri[:, None]
    win = att.window()
    if win is not None:
        ok &= (ri[:, None] - pos[None]) < win
    A = S.masked_fill(~ok, float("-inf")).softmax(-1)
    pattern_error = float((A - w.pattern[rb, h.head, ri].double()).abs().max())
    score_error = 0.0
    if w.scores is not None:
        real = w.scores[rb, h.head, ri].double()
        diff = torch.where(ok, (S - real).abs(), torch.zeros_like(S))            # masked entries are -inf or -3e38
        score_error = float(diff.max() / torch.where(ok, real.abs(), torch.zeros_like(S)).max().clamp_min(1e-30))
    return {"pattern_error": pattern_error, "score_error": score_error}


def _expand(att, w: Writes, h: Head, qkmap, frozen, names: List[str], Q: Tensor, K: Tensor, wr: Tensor,
            rb: Tensor, ri: Tensor, side: str, k: int, sel: Tensor, chosen: Optional[List[str]]) -> Dict[str, Dict]:
    """For the ``k`` head sources with the largest |value| on ``side`` (at least 5 % of the largest; or those
    ``chosen``): value per row and source
    position m of what that head read at m (pattern · v through OV) and wrote where ``side`` reads it."""
    factor = att.scale()[0]
    if side == "key":
        vals = (Q.sum(1)[:, None] * K).sum(-1) * factor                               # [n, s]
    else:
        vals = (Q * K.sum(1)[:, None]).sum(-1) * factor
    # the largest head sources, leaving out those under 5 % of the largest one (a tiny value splits into noise)
    mass = vals.abs().sum(0)
    head_idx = [n for n, name in enumerate(names) if "." in name]
    top = max((float(mass[n]) for n in head_idx), default=0.0)
    ranked = sorted((n for n in head_idx if float(mass[n]) >= 0.05 * top > 0), key=lambda n: -float(mass[n]))[:k] \
        if chosen is None else [names.index(c) for c in chosen]
    out = {}
    for n in ranked:
        l, hh = (int(x) for x in names[n].split("."))
        A = w.patterns[l][:, hh].double()                                              # [b, p, m]
        v = w.values[l]                                                                # [b, m, heads or KV heads, e]
        v = v[:, :, hh // (w.z[l].shape[2] // v.shape[2])].double()
        u = v @ (w.head_out_map(l)[hh] @ qkmap.W)                                      # [b, m, d]
        T = A.permute(2, 0, 1)[..., None] * u.permute(1, 0, 2)[:, :, None]             # [m, b, p, d]
        s = w.post_scale(l)
        if s is not None:
            T = T * s
        if side == "key":
            T = qkmap.finish(T, frozen)                                               # [m, b, p, d]
            per = torch.einsum("np,mnpd->nmd", wr, T[:, rb])                           # [n, m, d]
            val = torch.einsum("nd,nmd->nm", Q.sum(1), per) * factor
        else:
            T = qkmap.finish(T[:, rb, ri], frozen, rows=(rb, ri))                     # [m, n, d]
            val = torch.einsum("mnd,nd->nm", T, K.sum(1)) * factor
        out[names[n]] = {"values": val.cpu(), "whole": vals[:, n].cpu(), "row_index": sel}
    return out


def _merge_expansions(shards: Sequence[Optional[Dict]], n_rows: int) -> Dict[str, Dict[str, Tensor]]:
    """Per expanded source: values [rows, m] over all shards (every shard expands the first shard's choice)."""
    shards = [s for s in shards if s is not None]
    if not shards:
        return {}
    out = {}
    for name in shards[0]:
        width = max(s[name]["values"].shape[1] for s in shards)
        vals = torch.full((n_rows, width), 0.0, dtype=torch.float64)
        whole = torch.zeros(n_rows, dtype=torch.float64)
        for s in shards:
            v = s[name]["values"]
            vals[s[name]["row_index"], : v.shape[1]] = v
            whole[s[name]["row_index"]] = s[name]["whole"]
        out[name] = {"values": vals, "whole": whole}
    return out
