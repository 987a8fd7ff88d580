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

Memory: per target layer its heads' query and key maps (``adapter.score_maps``: [d_model, d_qk] float64 each, built
once per call); per prompt shard one ``Writes`` (each earlier layer's z and MLP output); per target layer one source
block's projections [s, b, p, heads, d_qk] at a time (float64); per head the pair table summed over rows
[sources, sources] and the marginals per row [rows, sources]. Never [sources, sources, positions, positions], nor
one residual copy per source.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .._foundation.arch import adapter
from .._foundation.arch.qkmap import ScoreMaps
from .._foundation.errors import QKCircuitsError
from .._foundation.heads import Head, HeadsLike, all_heads, model_heads
from .._foundation.io import check_int
from .._foundation.result import stamped
from .attribution import Attribution, pair_table, summarise
from .rows import Rows, rows_for
from .writes import Writes, capture_writes

READINGS = ("raw", "contrast", "versus")
ERRORS = ("score_error", "pattern_error", "bias_spread", "parts_error")


def attend(model, head, tokens=None, *, task=None, query=None, key=None, versus=None, reading: str = "contrast",
           expand: Optional[str] = None, k: int = 5, labels: Optional[object] = None,
           batch_size: int = 64) -> Attribution:
    """Split ``head``'s score on the chosen rows into (query source, key source) pairs (module docstring).

    Rows (``rows.py``): ``tokens`` (ids or text) with ``query``/``key`` positions or ``key="induction"``, or a
    ``task`` with named positions (``query="END", key="IO", versus="S1"``; ``qk.tasks.induction`` needs none).
    ``reading``: "contrast" (default), "raw" or "versus" (implied by ``versus``). ``expand``: "key" or "query"
    splits the ``k`` largest head sources on that side by the position each read from. ``labels``: names for
    sources ({"16.0": "previous-token"}), shown next to them. ``batch_size``: prompts per forward. With a ``task``,
    ``settings["stability"]`` holds each source's share with a 95 % bootstrap interval over the prompts and how
    often it is among the top 3 (``resample.source_stability``; no model run per resample).
    """
    heads = model_heads(model, [head] if isinstance(head, Head) else head)
    if len(heads) != 1:
        raise QKCircuitsError(f"attend explains one head at a time, got {len(heads)} from {head!r}; name one, e.g. "
                              f"'5.1' (qk.attend_heads explains several in one forward)")
    return attend_heads(model, heads, tokens, task=task, query=query, key=key, versus=versus, reading=reading,
                        expand=expand, k=k, labels=labels, batch_size=batch_size)[str(heads[0])]


def attend_heads(model, heads: Optional[HeadsLike] = None, tokens=None, *, task=None, query=None, key=None, versus=None,
                 reading: str = "contrast", expand: Optional[str] = None, k: int = 5,
                 labels: Optional[object] = None, batch_size: int = 64) -> Dict[str, Attribution]:
    """``attend`` for several heads (default: every head) from one forward per prompt shard (plus block 0 once more,
    to split MLP 0): {head: Attribution}. The same rows for every head (a key outside a head's window is refused for
    that head's layer). Memory: per head its kept pair table [41, 41] and marginals [rows, sources] when one shard
    holds every prompt; the full pair table [sources, sources], summed over shards, otherwise."""
    from .._foundation.args import describe, require_model

    require_model(model)                  # a spec string, None, ...: one line naming qk.load
    # a task is read by what it holds (``_tasks`` is a later layer than this one: no import of its class)
    if task is not None and not all(hasattr(task, a) for a in ("clean", "corrupt", "positions", "answer")):
        raise QKCircuitsError(f"task must be a qk.Task, got {describe(task)}; build one with "
                              f"qk.tasks.build_task(model, NAME) or qk.tasks.from_jsonl(model, path)")
    heads = all_heads(int(model.cfg.n_layers), int(model.cfg.n_heads)) if heads is None else model_heads(model, heads)
    reading = _check(reading, versus, expand)
    if labels is not None and not (isinstance(labels, dict) and all(isinstance(x, str) for kv in labels.items()
                                                                     for x in kv)):
        raise QKCircuitsError(f"labels must be a dict of source names to words ({{'16.0': 'previous-token'}}), got "
                              f"{type(labels).__name__}")
    k, batch_size = check_int("k", k), check_int("batch_size", batch_size)
    by_layer: Dict[int, List[int]] = {}
    for h in heads:
        by_layer.setdefault(h.layer, []).append(h.head)
    layers = sorted(by_layer)
    # what each target layer's score is made of (maps, scale, window, ALiBi, rotary): one adapter call per layer,
    # kept for every shard
    forms = {L: adapter(model, L).score_maps(by_layer[L]) for L in layers}
    rows = {L: rows_for(model, L, tokens, task=task, query=query, key=key, versus=versus,
                        window=forms[L].window) for L in layers}
    n_prompts = next(iter(rows.values())).tokens.shape[0]
    shards = torch.arange(n_prompts).split(batch_size)
    chosen: Optional[Dict[str, List[str]]] = None
    if expand and len(shards) > 1:
        # which heads to expand is decided on every row, not on the first shard: a first pass without expansion
        first = _passes(model, forms, rows, shards, reading, None, k, {})
        chosen = {name: _expand_choice(a, expand, k) for name, a in first.items()}
    acc = _passes(model, forms, rows, shards, reading, expand, k, chosen or {})
    out = {}
    for h in heads:
        a, L = acc[str(h)], h.layer
        form = forms[L]
        cap = form.softcap
        settings = {"scale": form.scale, "scale_source": form.scale_source, "softcap": cap, "rows": rows[L].what,
                    "positions": rows[L].names, "n_rows": len(rows[L]), "dropped_rows": rows[L].dropped,
                    "frozen": list(form.frozen), "labels": dict(labels or {}), "family": form.family,
                    **{e: a[e] for e in ERRORS}}
        if cap:
            settings["caveats"] = [f"the layer soft-caps its scores at {cap:g}: the pre-cap score is decomposed"]
        expanded = _merge_expansions(a["expanded"], len(rows[L])) if expand else {}
        pairs = a["kept"] if "kept" in a else a["P"] / len(rows[L])
        if a["extra"]:
            settings["position_bias"] = "ALiBi: slope_h · key position, a source of its own on both sides"
        _check_exact(model, str(h), {e: a[e] for e in ERRORS})
        out[str(h)] = summarise(model, str(h), reading, rows[L], a["names"], pairs, torch.cat(a["q_vals"]),
                                torch.cat(a["k_vals"]), torch.cat(a["attention"]), extra=a["extra"],
                                exact_error=max(a["score_error"], a["pattern_error"]), settings=stamped(settings, model, task),
                                expanded=expanded, side=expand)
        if task is not None and rows[L].tokens.shape[0] > 1:
            # with a task's prompts: how much each source's share would move with another draw of them
            from .resample import source_stability

            out[str(h)].settings["stability"] = source_stability(out[str(h)])
    return out


def _passes(model, forms: Dict[int, ScoreMaps], rows: Dict[int, Rows], shards, reading: str,
            expand: Optional[str], k: int, chosen: Dict[str, List[str]]) -> Dict[str, Dict]:
    """One forward per prompt shard; every target layer's heads (``forms[L].heads``) from it, accumulated per head."""
    layers = sorted(forms)
    acc: Dict[str, Dict] = {}
    for prompts in shards:
        toks = rows[layers[0]].tokens[prompts].to(model.W_E.device)
        w = capture_writes(model, toks, layers, expand=expand is not None)
        for L in layers:
            for name, part in _layer(w, L, forms[L], rows[L], prompts, reading, expand, k, chosen).items():
                _add(acc, name, part, whole=len(shards) == 1)
    return acc


def _expand_choice(a: Dict, side: str, k: int) -> List[str]:
    """The ``k`` head sources with the largest |mean value| on ``side`` over all rows (at least 5 % of the
    largest one: a tiny value splits into noise). The sentences say only the expansions above ``words.NOISE`` of
    the head's total (``Attribution.expansions``); the data keeps every chosen one."""
    vals = torch.cat(a["k_vals" if side == "key" else "q_vals"]).mean(0).abs()
    heads = [n for n, name in enumerate(a["names"]) if "." in name]
    top = max((float(vals[n]) for n in heads), default=0.0)
    return [a["names"][n] for n in sorted((n for n in heads if float(vals[n]) >= 0.05 * top > 0),
                                          key=lambda n: -float(vals[n]))[:k]]


def _check_exact(model, head: str, errors: Dict[str, float]) -> None:
    """Refuse (one line) an attribution that is not exact: its rebuilt scores miss the model's own attention (the
    architecture does something to the score this decomposition does not know: an unsupported position bias, a
    norm it cannot read), its parts do not add up to the whole query and key, or the residual's remainder ``bias``
    is not one constant (a write some source made is missing). Tolerances: 1e-3 of a probability or of the largest
    score, 1e-4 relative for the parts and the remainder, or 4 × the model's dtype epsilon when that is larger (bf16)."""
    eps = float(torch.finfo(model.W_E.dtype).eps)
    checks = (("rebuilt scores vs the model's own attention", max(errors["score_error"], errors["pattern_error"]),
               max(1e-3, 4 * eps)),
              ("the parts' sum vs the whole query and key", errors["parts_error"], max(1e-4, 4 * eps)),
              ("the residual minus every source's write (the bias) is not one constant", errors["bias_spread"],
               max(1e-4, 4 * eps)))
    for what, error, tol in checks:
        if not error <= tol:
            from .._foundation.arch import architecture

            raise QKCircuitsError(f"head {head}: the attribution is not exact on {architecture(model)} ({what}: "
                                  f"{error:.3g} > {tol:.0e}); qkcircuits cannot decompose this attention yet")


def _check(reading: str, versus, expand) -> str:
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
    return reading


def _add(acc: Dict[str, Dict], name: str, part: Dict, whole: bool) -> None:
    """Accumulate one shard of one head: per-row marginals extend, errors take the max; the parts Q, K are kept
    when this shard holds every row (``whole``: the pair table is then computed for the kept sources only), else
    the full pair table [Sq, Sk] is summed over shards."""
    Q, K = part.pop("Q"), part.pop("K")
    part["q_vals"] = torch.einsum("nad,nd->na", Q, K.sum(1))
    part["k_vals"] = torch.einsum("nd,nbd->nb", Q.sum(1), K)
    if whole:        # every row is here: the kept pair table now, and the parts [rows, sources, d] dropped
        part["kept"] = pair_table(Q, K, part["q_vals"], part["k_vals"])
    else:
        part["P"] = torch.einsum("nad,nbd->ab", Q, K)
    a = acc.get(name)
    if a is None:
        acc[name] = {**part, **{x: [part[x]] for x in ("q_vals", "k_vals", "attention", "expanded")}}
        return
    a["P"] = a["P"] + part["P"]
    for x in ("q_vals", "k_vals", "attention", "expanded"):
        a[x].append(part[x])
    for e in ERRORS:
        a[e] = max(a[e], part[e])


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
        lonely = (ok.sum(1) == 0).nonzero()
        if lonely.numel():
            r = int(idx[int(lonely[0])])
            raise QKCircuitsError(f"row {r}: the query at position {int(i[int(lonely[0])])} may attend no key but "
                                  f"{int(j[int(lonely[0])])}, so there is nothing to contrast with; use reading='raw'")
        w -= ok.double() / ok.sum(1, keepdim=True)
    return w


def _layer(w: Writes, L: int, form: ScoreMaps, rows: Rows, prompts: Tensor, reading: str,
           expand: Optional[str], k: int, chosen: Optional[Dict[str, List[str]]]) -> Dict[str, Dict]:
    """Each of layer ``L``'s heads (``form.heads``) on the rows of ``prompts``: its pair sums, per-row marginals and
    errors."""
    sel = torch.isin(rows.b, prompts).nonzero().flatten()
    if sel.numel() == 0:
        return {}
    heads = form.heads
    dev = w.resid[L].device
    local = {int(b): n for n, b in enumerate(prompts.tolist())}
    rb = torch.tensor([local[int(b)] for b in rows.b[sel]], device=dev)
    ri, rj = rows.i[sel].to(dev), rows.j[sel].to(dev)
    group = form.group
    kv = sorted(form.key)
    qmaps, kmaps = form.query, form.key
    for m in qmaps + list(kmaps.values()):
        m.W, m.c = m.W.to(dev), m.c.to(dev)
    # the parts are computed in float32 (float64 weights: float64) and summed in float64: every part's rounding is
    # ~1e-7 of it, far inside the exactness check, and float32 matmuls are twice as fast on a CPU
    dt = torch.float64 if w.resid[L].dtype == torch.float64 else torch.float32
    fq = [m.frozen(w.resid[L]) for m in qmaps]
    fk = {g: kmaps[g].frozen(w.resid[L]) for g in kv}
    fq_dt, fk_dt = [f.to(dt) for f in fq], {g: f.to(dt) for g, f in fk.items()}
    Wq = torch.stack([m.W for m in qmaps], 1).to(dt)                                   # [d_model, H', d]
    Wk = torch.stack([kmaps[g].W for g in kv], 1).to(dt)                               # [d_model, G', d]
    wr = key_weights(rows, sel, w.tokens.shape[1], reading, form.window).to(dev)       # [n, p]
    wr_dt = wr.to(dt)
    names = w.names(L)
    n, S, d = rb.numel(), len(names), Wq.shape[-1]
    slopes = form.alibi_slopes
    # + bias_q / bias_k; with ALiBi one more source on each side, "position_bias", on a coordinate of its own:
    # its query part is the head's slope, its key part Σ_pos w(pos) · pos, so its pair is the bias's share
    extra = 0 if slopes is None else 1
    Q_all = torch.zeros(len(heads), n, S + 1 + extra, d + extra, dtype=torch.float64, device=dev)
    K_all = {g: torch.zeros(n, S + 1 + extra, d + extra, dtype=torch.float64, device=dev) for g in kv}
    for lo, hi, q_rows, k_all in _chunks(w, L, Wq, Wk, rb, ri):                      # [s, n, H', d], [s, b, p, G', d]
        for t, (m, f) in enumerate(zip(qmaps, fq_dt)):
            Q_all[t, :, lo:hi, :d] = m.finish(q_rows[:, :, t], f, rows=(rb, ri)).transpose(0, 1)
        for u, g in enumerate(kv):
            K_all[g][:, lo:hi, :d] = kmaps[g].contract(k_all[:, :, :, u], fk_dt[g], wr_dt, rb)
    for t, m in enumerate(qmaps):
        Q_all[t, :, S, :d] = m.constant(fq[t], rows=(rb, ri))
    k_total = {}
    for g in kv:
        kc = kmaps[g].constant(fk[g])                                                  # [b, p, d]
        K_all[g][:, S, :d] = torch.einsum("np,npd->nd", wr, kc[rb])
        if slopes is not None:
            K_all[g][:, S + 1, d] = wr @ torch.arange(wr.shape[1], dtype=wr.dtype, device=dev)
        # every key, rebuilt from the whole residual (the parts add up to it by construction: ``bias`` is the rest)
        k_total[g] = kmaps[g].finish(w.resid[L].double() @ kmaps[g].W, fk[g]) + kc
    factor = form.scale
    spread = w.bias_spread(L)
    q_whole = [m.finish((w.resid[L].double() @ m.W)[rb, ri], f, rows=(rb, ri)) + m.constant(f, rows=(rb, ri))
               for m, f in zip(qmaps, fq)]
    out = {}
    for t, h in enumerate(heads):
        g = h // group
        if slopes is not None:
            Q_all[t, :, S + 1, d] = float(slopes[h]) / factor           # × factor below: the slope itself
        Q, K = Q_all[t].mul_(factor), K_all[g]                                         # [n, Sq, d], [n, Sk, d]
        part = {"names": names, "extra": ["position_bias"] if extra else [], "Q": Q.cpu(), "K": K.cpu(),
                "attention": w.pattern[L][rb, h, ri, rj].double().cpu(), "bias_spread": spread,
                **_exactness(form, w, L, h, Q.sum(1)[:, :d] / factor, k_total[g], rb, ri), "expanded": None,
                # the parts must add up to the whole, side by side: the query parts to the query the whole residual
                # makes at each row, the key parts to the reading's sum of the whole keys (an error in one source's
                # write, or in the weights, would otherwise hide in the bias, which is the remainder)
                "parts_error": max(_rel(Q.sum(1)[:, :d] / factor, q_whole[t]),
                                   _rel(K.sum(1)[:, :d], torch.einsum("np,npd->nd", wr, k_total[g][rb])))}
        if expand:
            side_map, side_frozen = (qmaps[t], fq[t]) if expand == "query" else (kmaps[g], fk[g])
            part["expanded"] = _expand(w, L, side_map, side_frozen, names, Q, K, wr, rb, ri, expand, k, sel,
                                       chosen.get(f"{L}.{h}") if chosen else None, factor)
        out[f"{L}.{h}"] = part
    return out


def _chunks(w: Writes, L: int, Wq: Tensor, Wk: Tensor, rb: Tensor, ri: Tensor, size: int = 64):
    """(lo, hi, the query side's x W_q at the rows [s, n, H', d], the key side's x W_k everywhere [s, b, p, G', d])
    for the sources ``lo``…``hi``−1 of layer ``L`` (``w.names(L)`` order: the residual bias last), up to ``size`` at a
    time, every target head of the layer at once. Heads are projected from z (W_O·W fused first: [e, H'·d], not
    d_model). The projections are written into two buffers reused for every chunk (no concatenation), so the
    per-head work after them (norm scales, rotary, the sum over key positions) runs once per chunk."""
    H, G, d = Wq.shape[1], Wk.shape[1], Wq.shape[2]
    Wq2, Wk2 = Wq.reshape(Wq.shape[0], -1), Wk.reshape(Wk.shape[0], -1)
    b, p = w.tokens.shape
    n = rb.numel()
    items = [("dense", w.emb)] + ([("dense", w.pos)] if w.pos is not None else [])
    for l, names in w.head_blocks(L):
        items += [("heads", l, h) for h in range(len(names))] + [("dense", x) for _, x in w.mlp_parts(l)]
    items.append(("dense", w.bias(L)))
    qbuf = torch.empty(min(size, len(items)), n, H * d, dtype=Wq.dtype, device=Wq.device)
    kbuf = torch.empty(min(size, len(items)), b * p, G * d, dtype=Wq.dtype, device=Wq.device)
    fused: Dict[int, Tuple[Tensor, Tensor, Tensor]] = {}
    for lo in range(0, len(items), size):
        chunk = items[lo:lo + size]
        c = 0
        while c < len(chunk):
            item = chunk[c]
            if item[0] == "dense":
                x = item[1].to(Wq.dtype)
                torch.mm(x[rb, ri], Wq2, out=qbuf[c])
                torch.mm(x.reshape(b * p, -1), Wk2, out=kbuf[c])
                c += 1
                continue
            l = item[1]                                   # consecutive heads of one source layer: one bmm each side
            run = 1
            while c + run < len(chunk) and chunk[c + run][0] == "heads" and chunk[c + run][1] == l:
                run += 1
            h0 = item[2]
            if l not in fused:
                M = w.head_out_map(l).to(Wq.dtype)                                     # [Hs, e, d_model]
                zl = w.z[l].to(Wq.dtype)                                               # [b, p, Hs, e]
                # [Hs, e, H'd], [Hs, e, G'd]; z per head at the rows [Hs, n, e] and everywhere [Hs, b·p, e]
                fused = {l: (M @ Wq2, M @ Wk2, zl[rb, ri].transpose(0, 1).contiguous(),
                             zl.permute(2, 0, 1, 3).reshape(zl.shape[2], b * p, -1))}
            Mq, Mk, z_rows, z_all = fused[l]
            hs = slice(h0, h0 + run)
            torch.bmm(z_rows[hs], Mq[hs], out=qbuf[c:c + run])
            torch.bmm(z_all[hs], Mk[hs], out=kbuf[c:c + run])
            post = w.post_scale(l)
            if post is not None:
                post = post.to(Wq.dtype)
                qbuf[c:c + run] *= post[rb, ri].view(1, n, 1)
                kbuf[c:c + run] *= post.view(1, b * p, 1)
            c += run
        m = len(chunk)
        yield lo, lo + m, qbuf[:m].view(m, n, H, d), kbuf[:m].view(m, b, p, G, d)


def _rel(a: Tensor, b: Tensor) -> float:
    """max |a − b| relative to max |b|."""
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _exactness(form: ScoreMaps, w: Writes, L: int, h: int, q_tot: Tensor, k_total: Tensor, rb: Tensor, ri: Tensor
               ) -> Dict[str, float]:
    """Rebuild each row's whole score row from the summed parts and compare with the model's own."""
    factor, cap, slopes = form.scale, form.softcap, form.alibi_slopes
    S = torch.einsum("nd,npd->np", q_tot, k_total[rb]) * factor                    # [n, p]
    if slopes is not None:                                                          # ALiBi: + slope · key position
        S = S + float(slopes[h]) * torch.arange(S.shape[1], dtype=S.dtype, device=S.device)
    if cap:
        S = cap * torch.tanh(S / cap)
    pos = torch.arange(S.shape[1], device=S.device)
    ok = pos[None] <= ri[:, None]
    win = form.window
    if win is not None:
        ok &= (ri[:, None] - pos[None]) < win
    A = S.masked_fill(~ok, float("-inf")).softmax(-1)
    pattern_error = float((A - w.pattern[L][rb, h, ri].double()).abs().max())
    score_error = 0.0
    if w.scores[L] is not None:
        real = w.scores[L][rb, h, ri].double()
        diff = torch.where(ok, (S - real).abs(), torch.zeros_like(S))            # masked entries are -inf or -3e38
        score_error = float(diff.max() / torch.where(ok, real.abs(), torch.zeros_like(S)).max().clamp_min(1e-30))
    return {"pattern_error": pattern_error, "score_error": score_error}


def _expand(w: Writes, L: int, qkmap, frozen, names: List[str], Q: Tensor, K: Tensor, wr: Tensor, rb: Tensor,
            ri: Tensor, side: str, k: int, sel: Tensor, chosen: Optional[List[str]], factor: float) -> Dict[str, Dict]:
    """For the ``k`` head sources with the largest |value| on ``side`` (at least 5 % of the largest; or those
    ``chosen``): value per row and source position m of what that head read at m (pattern · v through OV) and
    wrote where ``side`` reads it. ``Q`` is already × the layer's scale."""
    vals = (Q.sum(1)[:, None] * K).sum(-1) if side == "key" else (Q * K.sum(1)[:, None]).sum(-1)      # [n, s]
    d = qkmap.W.shape[1]
    Q, K = Q[..., :d], K[..., :d]                       # (an ALiBi coordinate, if any, is no head's)
    if chosen is None:                                  # every row is in this shard: choose from them
        chosen = _expand_choice({"names": names, "k_vals": [vals], "q_vals": [vals]}, side, k)
    out = {}
    for name in chosen:
        l, hh = (int(x) for x in name.split("."))
        A = w.patterns[l][:, hh].double()                                              # [b, p, m]
        v = w.values[l]                                                                # [b, m, heads or KV heads, e]
        v = v[:, :, hh // (w.z[l].shape[2] // v.shape[2])].double()
        u = v @ (w.head_out_map(l)[hh] @ qkmap.W)                                      # [b, m, d]
        s = w.post_scale(l)                                                            # [b, p, 1] or None
        if side == "key":
            # the head's write at key position pos is Σ_m A[pos, m] u[m] (× its post-norm scale at pos): the pattern
            # (and the reading's weights) go into per-source weights over positions, u stays position-free
            Apm = A[rb] * (wr[:, :, None] if s is None else wr[:, :, None] * s[rb].double())   # [n, p, m]
            kappa = qkmap.contract_static(u, frozen, Apm.transpose(1, 2), rb)        # [n, m, d]
            val = torch.einsum("nd,nmd->nm", Q.sum(1), kappa)
        else:
            T = A[rb, ri].transpose(0, 1)[..., None] * u[rb].transpose(0, 1)            # [m, n, d]
            if s is not None:
                T = T * s[rb, ri].double()
            T = qkmap.finish(T, frozen, rows=(rb, ri))                                # [m, n, d]
            val = torch.einsum("mnd,nd->nm", T, K.sum(1)) * factor
        out[name] = {"values": val.cpu(), "whole": vals[:, names.index(name)].cpu(), "row_index": sel}
    return out


def _merge_expansions(shards: Sequence[Optional[Dict]], n_rows: int) -> Dict[str, Dict[str, Tensor]]:
    """Per expanded source: values [rows, m] over all shards (every shard expands the first shard's choice)."""
    shards = [s for s in shards if s is not None]
    if not shards:
        return {}
    out = {}
    for name in shards[0]:
        width = max(s[name]["values"].shape[1] for s in shards)
        vals = torch.zeros(n_rows, width, dtype=torch.float64)
        whole = torch.zeros(n_rows, dtype=torch.float64)
        for s in shards:
            v = s[name]["values"]
            vals[s[name]["row_index"], : v.shape[1]] = v
            whole[s[name]["row_index"]] = s[name]["whole"]
        out[name] = {"values": vals, "whole": whole}
    return out
