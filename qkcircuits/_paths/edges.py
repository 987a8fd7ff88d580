"""Edge attribution: a gradient estimate of every path-patching edge (sender → receiver's q, k or v).

>>> est = qk.edge_attribution(model, "1.0")                # same PathEffects as path_patch, kind "attribution"
>>> est.kind, [str(h) for h, _ in est.top(1, receiver="1.0", into="k")]  # the previous-token head feeds 1.0's keys
('attribution', ['0.0'])

(On toy-induction the estimate itself is tiny, ~1e-5 against path patching's exact 1.0: its attention is
one-hot, so the softmax's gradient is ~0 there; a first-order estimate ranks well only away from saturation.)

For receiver r with metric m and input x ∈ {q, k, v}, let g = ∂m/∂(x-input residual of r), taken on
the clean run with the other two inputs held clean. Each sender's exact change to the residual, Δ
(the same Δ as ``path_patch``: (z' − z) W_O, or post(y + ·) − post(y) under a post-attention norm),
is then scored to first order:

    m(resid + Δ) − m(resid)  ≈  Σ_{batch, pos, d_model}  g · Δ       (divided like the metric)

so effect ≈ −g·Δ for a score (clean − patched). Each sender layer's Δ ([n_heads, batch, pos, d_model])
is computed once and reused by every receiver layer above it (kept up to ``DELTA_CACHE_BYTES``, 1 GiB,
then recomputed).

Cost per receiver layer: ONE forward of that layer's attention (batch as given, not one copy per
sender), one backward through the attention core per receiver metric (q: one for all heads; k and
v: one per member of a KV group, because query heads of a group share their keys and values), and
one small backward through the input norm and projection per (receiver head, input). The gradients of
a block of receiver layers (up to ``GRAD_BLOCK_BYTES``) then meet every sender's Δ in ONE matmul
[n gradients, b·p·d_model] @ [b·p·d_model, sender heads]. ``metric="loss"`` adds one forward from the
lowest receiver layer to the logits and one backward for all receivers (``_loss_grads``). Exact path
patching instead runs the layer's attention once per sender.

Where the linear estimate is weak:
- **Saturated softmax**: a receiver attending ~1.0 to its target has a vanishing gradient there; a
  sender whose removal moves that attention far (the previous-token head of a sharp induction head)
  is *underestimated*, sometimes badly. This is the main failure and why ``path_patch`` is the truth.
- **Norms**: the input norm (ln1, and q/k-norm) rescales the whole residual; the gradient sees the
  rescaling only locally, so large Δ (zero ablation of a big head) bend it. Mean ablation moves less.
- **Metrics read through the final norm** (direct-logit) are linearised through it as well.
Check the ranking against ``path_patch`` on the receivers you care about (``benchmarks/bench_patching.py``).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch
from torch import Tensor

from .._analysis.metrics import Metric
from .._foundation.capture import StopForward, hook_name
from .._foundation.model import model_name
from .._foundation.arch import adapter
from .._foundation.errors import QKCircuitsError
from .._foundation.heads import Head, HeadsLike, model_heads, n_kv_heads
from .path_effects import INPUTS, PathEffects
from .path_core import Scorer, check_resume, grab, is_direct_logit
from .patching import (MetricLike, check_into, check_metric_tokens, check_request, clean_pass, patch_settings,
                       post_norm, replacement_from_cache, resolve_metric)


def _grad_run(cache, layer: int, retry: bool = True):
    """Layer ``layer``'s attention on the clean residual with gradients: returns the residual leaf, each
    input's graph-connected projection (resid → ln1 → W_x, …) and the leaf the attention read instead,
    and the pattern and z computed from those leaves."""
    resid = cache.resid[layer].detach().clone().requires_grad_(True)
    proj: Dict[str, Tensor] = {}
    leaf: Dict[str, Tensor] = {}
    got: Dict[str, Tensor] = {}

    def cut(x: str):
        def fn(t: Tensor, hook) -> Tensor:
            proj[x] = t
            leaf[x] = t.detach().clone().requires_grad_(True)
            return leaf[x]
        return fn

    hooks = [(hook_name(x, layer), cut(x)) for x in INPUTS]
    hooks += [(hook_name("pattern", layer), grab(got, "pattern", False)), (hook_name("z", layer), grab(got, "z", True))]
    with torch.enable_grad():
        try:
            cache.runner.run_resid(layer, resid, hooks)
        except StopForward:
            pass
    if len(proj) < 3 or "z" not in got:
        raise QKCircuitsError(f"layer {layer}'s attention did not fire hook_q/k/v/pattern/z when run from the "
                              f"cached residual; edge attribution cannot run on this bridge")
    # This clean run is the resume check of this layer (clean_pass checked only the lowest): on a mismatch
    # (Gemma-3's sliding/global layers under the sliced runner) pick a mode that reproduces it and rerun.
    eps = torch.finfo(cache.pattern[layer].dtype).eps
    if not torch.allclose(got["pattern"].detach(), cache.pattern[layer], atol=max(1e-5, 4 * eps), rtol=1e-4):
        if not retry:
            raise QKCircuitsError(f"re-running layer {layer} from the cached residual does not reproduce its clean "
                                  f"attention pattern on this bridge; edge attribution needs that")
        check_resume(cache, [layer])
        return _grad_run(cache, layer, retry=False)
    return resid, proj, leaf, got["pattern"], got["z"]


# Δ of every head of a sender layer is reused by every receiver layer above it; keep them up to this budget.
DELTA_CACHE_BYTES = 1024 * 2**20


def _layer_deltas(model, cache, repl, layer: int) -> Tensor:
    """Every head of sender ``layer``'s exact change to the residual: [n_heads, batch, pos, d_model]."""
    b, p = cache.tokens.shape
    z = cache.z[layer]                                                          # [b, p, H, d_head]
    H = z.shape[2]
    new = torch.stack([repl.value(layer, h, b, p).to(z).expand(b, p, z.shape[-1]) for h in range(H)], 2)
    W_O = adapter(model, layer).W_O()                                           # [H, d_v, d_model]
    delta = torch.einsum("bphd,hdm->hbpm", new - z, W_O)
    post = post_norm(model, layer)
    if post is not None:
        y = cache.attn_out[layer]
        delta = torch.stack([post(y + delta[h]) - post(y) for h in range(H)])
    return delta


def _vjp(out: Tensor, inp: Tensor, cots: List[Tensor]) -> List[Tensor]:
    """∂⟨out, cot⟩/∂inp for each cotangent. One backward per cotangent: measured faster on CPU than one
    batched backward (``is_grads_batched`` runs torch's legacy vmap), and needs no batching rules."""
    return [torch.autograd.grad(out, inp, grad_outputs=c, retain_graph=True)[0].detach() for c in cots]


def _logits_grads(cache, layers: Sequence[int], metric: Metric):
    """∂metric/∂z of every layer in ``layers`` (all heads at once) for a logits metric, and its clean value:
    ONE forward from the lowest of them (clean residual, a zero probe added at each hook_z) and ONE backward.
    Later layers respond to a probe as they respond to a patched z in ``path_patch``'s logits metrics, so
    the gradient is the derivative of that metric. Memory: the autograd graph of that forward."""
    probes: Dict[int, Tensor] = {}

    def probe(L: int):
        def fn(t: Tensor, hook) -> Tensor:
            probes[L] = torch.zeros_like(t, requires_grad=True)
            return t + probes[L]
        return fn

    R0 = min(layers)
    # only the logits the metric reads (induction-loss: the repeat's), which skips most of the unembedding
    keep = metric.keep_last(cache.tokens) if metric.keep_last is not None else None
    hooks = [(hook_name("z", L), probe(L)) for L in layers]
    with torch.enable_grad():
        logits = None
        if keep is not None:
            try:
                logits = cache.runner.run_resid(R0, cache.resid[R0], hooks, logits_to_keep=keep)
            except TypeError:                        # a model whose forward takes no logits_to_keep
                logits = None
        if logits is None or logits.shape[1] != (keep or logits.shape[1]):
            logits = cache.runner.run_resid(R0, cache.resid[R0], hooks)
        loss = metric(logits, cache.tokens)
        grads = torch.autograd.grad(loss, [probes[L] for L in layers])
    return {L: g.detach() for L, g in zip(layers, grads)}, float(loss.detach())


# Gradients of several receiver layers are scored against the senders' Δ in ONE matmul (compute-bound
# instead of one thin, memory-bound product per (receiver layer, sender layer)); up to this many bytes of
# gradients (whole receiver layers, at least one) wait for it.
GRAD_BLOCK_BYTES = 256 * 2**20


def edge_attribution(model, receivers: Optional[HeadsLike] = None, into: Sequence[str] = ("q", "k", "v"),
                     senders: Optional[HeadsLike] = None, method: str = "mean", tokens=None,
                     metric: MetricLike = None, *, per_position: bool = True) -> PathEffects:
    """First-order estimate of ``path_patch``'s edges: the same arguments in the same order, the same metrics
    (``resolve_metric``) and the same result type (``kind="attribution"``).

    ``receivers`` default to every head of layers ≥ 1; a named layer-0 receiver is kept with an empty sender
    set (NaN effects, as in ``path_patch``: no head precedes it); only layer-0 receivers fail. ``metric``:
    as ``path_patch`` (None: induction for q/k, direct-logit for v). A logits metric (``induction-loss``,
    alias ``loss``) is differentiated at every receiver layer's z by ONE extra forward and backward in all;
    a receiver callable ``fn(pattern, z, tokens)`` must be differentiable in torch.
    Memory: ``CleanCache`` as in ``path_patch``; per receiver layer one attention forward's autograd
    graph over the batch, 3 × n_receiver_heads residual-sized gradients (waiting in blocks of up to
    ``GRAD_BLOCK_BYTES``, 256 MiB), and the senders' Δ (n_heads × batch × pos × d_model per sender layer,
    one matrix of at most ``DELTA_CACHE_BYTES``, 1 GiB, else recomputed per block). A logits metric:
    plus the autograd graph of one forward from the lowest receiver layer to the logits.

    >>> est = qk.edge_attribution(model, "1.0", "k")
    >>> est.kind, est.top(1, receiver="1.0", into="k")[0][0]
    ('attribution', Head(layer=0, head=0))
    """
    L, H = model.cfg.n_layers, model.cfg.n_heads
    metrics = {x: resolve_metric(metric, x, where="edge_attribution") for x in check_into(into)}
    if receivers is None:
        receivers = [Head(l, h) for l in range(1, L) for h in range(H)]
    recv, snd, into, tokens, _ = check_request(model, receivers, senders, into, method, tokens)
    check_metric_tokens(metrics.values(), tokens)
    cache = clean_pass(model, tokens, [r.layer for r in recv],
                       need_final=any(is_direct_logit(m) for m in metrics.values()),
                       need_logits=any(m.needs == "logits" for m in metrics.values()), check_all=False)
    repl = replacement_from_cache(cache, method, per_position)       # the clean pass's own z: no extra forward
    logits_metrics = {m.name: m for m in metrics.values() if m.needs == "logits"}
    grad_layers = sorted({r.layer for r in recv if r.layer > 0})
    logits_grads = {name: _logits_grads(cache, grad_layers, m)      # one forward + one backward each
                    for name, m in logits_metrics.items()}
    G = H // n_kv_heads(model)
    effects = {x: torch.full((len(recv), L, H), float("nan")) for x in into}
    clean = {x: torch.full((len(recv),), float("nan")) for x in into}
    by_layer: Dict[int, List[int]] = {}
    for i, r in enumerate(recv):
        by_layer.setdefault(r.layer, []).append(i)
    first = by_layer.pop(0, None)                  # layer-0 receivers: no senders (NaN effects), clean value only
    if first is not None:
        for x in into:
            clean[x][first] = _clean_values(model, cache, 0, [recv[i].head for i in first], metrics[x])
    # Senders' Δ, one row per head of each sender layer, flattened over (batch, pos, d_model): kept in one
    # matrix when it fits DELTA_CACHE_BYTES (every receiver layer above reuses it), else recomputed.
    n_flat = tokens.numel() * model.cfg.d_model
    R_top = max(by_layer)
    send_layers = [Ls for Ls in range(R_top) if snd is None or any(s.layer == Ls for s in snd)]
    keep_mask = torch.tensor([[snd is None or Head(Ls, h) in snd for h in range(H)] for Ls in range(L)])
    like = cache.resid[min(by_layer)]
    D = torch.zeros(R_top * H, n_flat, dtype=like.dtype, device=like.device) \
        if R_top * H * n_flat * like.element_size() <= DELTA_CACHE_BYTES else None
    filled = set()                                                               # sender layers in D

    def delta_rows(Ls: int) -> Tensor:
        if D is None:
            return _layer_deltas(model, cache, repl, Ls).reshape(H, -1)
        if Ls not in filled:
            D[Ls * H:(Ls + 1) * H] = _layer_deltas(model, cache, repl, Ls).reshape(H, -1)
            filled.add(Ls)
        return D[Ls * H:(Ls + 1) * H]

    # Gradients go straight into a block buffer [rows, b·p·d_model] (no stack/cat copies); a block holds
    # whole receiver layers, up to GRAD_BLOCK_BYTES (at least one layer).
    per_layer = {R: len(idx) * len(into) for R, idx in by_layer.items()}
    row_bytes = n_flat * like.element_size()
    buf: Optional[Tensor] = None
    used = 0
    pending: List[tuple] = []                       # (receiver layer, rows, first buffer row)

    def flush() -> None:
        """Score every waiting gradient against every sender below its layer, and place the effects."""
        nonlocal used
        if not pending:
            return
        top = max(R for R, _, _ in pending)
        grad_mat = buf[:used]                                                    # [n, b·p·d_model]
        with torch.no_grad():
            if D is not None:
                for Ls in send_layers:
                    if Ls < top:
                        delta_rows(Ls)
                terms = (grad_mat @ D[:top * H].T).float().cpu().view(used, top, H)   # [n, sender layer, head]
            else:
                terms = torch.full((used, top, H), float("nan"))
                for Ls in send_layers:
                    if Ls < top:
                        terms[:, Ls] = (grad_mat @ delta_rows(Ls).T).float().cpu()
        for R, rows, n0 in pending:
            t = torch.where(keep_mask[:R][None], terms[n0:n0 + len(rows), :R], torch.tensor(float("nan")))
            for x in into:
                sel = [k for k, (_, xx) in enumerate(rows) if xx == x]
                if sel:
                    effects[x][torch.tensor([rows[k][0] for k in sel]), :R] = t[sel]
        pending.clear()
        used = 0

    layers_left = sorted(by_layer)
    for R, idx in sorted(by_layer.items()):
        layers_left.remove(R)
        if buf is None or used + per_layer[R] > len(buf):
            flush()
            rows_left = per_layer[R] + sum(per_layer[r] for r in layers_left)
            n_rows = min(rows_left, max(per_layer[R], GRAD_BLOCK_BYTES // row_bytes))
            if buf is None or len(buf) < n_rows:
                buf = torch.empty(n_rows, n_flat, dtype=like.dtype, device=like.device)
        heads = [recv[i].head for i in idx]
        resid, proj, leaf, pattern, z = _grad_run(cache, R)
        rows: List[tuple] = []                    # (receiver index, input) per buffer row
        first = used
        for x in into:
            m = metrics[x]
            if m.needs == "logits":
                # metric ≈ clean + Σ ∂metric/∂z · (z' − z): each head's z against the metric's gradient at its z
                grad_z, clean_value = logits_grads[m.name]
                with torch.enable_grad():
                    values = (z[:, :, heads] * grad_z[R][:, :, heads]).sum((0, 1, 3))
                clean[x][idx] = clean_value
            else:
                scorer = Scorer(model, cache, R, heads, m)
                with torch.enable_grad():
                    values = scorer.sums(pattern, z, 1)[0] / scorer.count()     # [len(heads)] means, in the graph
                clean[x][idx] = values.detach().float().cpu()
            # Query heads of one KV group share k/v: separate their gradients by one backward per member.
            members = [[j for j, h in enumerate(heads) if (h % G if x != "q" else 0) == g]
                       for g in range(G if x != "q" else 1)]
            cots = []
            for js in members:
                if not js:
                    continue
                (g_in,) = torch.autograd.grad(values[js].sum(), leaf[x], retain_graph=True)
                for j in js:
                    h = heads[j]
                    slot = h if x == "q" else h // G
                    cot = torch.zeros_like(g_in)
                    cot[:, :, slot] = g_in[:, :, slot]
                    cots.append(cot)
                    rows.append((idx[j], x))
            for g in _vjp(proj[x], resid, cots):
                torch.mul(g.reshape(-1), -m.sign, out=buf[used])
                used += 1
        del resid, proj, leaf, pattern, z
        pending.append((R, rows, first))
    flush()
    n_edges = sum(int((~effects[into[0]][i].isnan()).sum()) for i in range(len(recv)))
    return PathEffects(model=model_name(model), method=method, receivers=recv, into=into,
                       metrics={x: m.name for x, m in metrics.items()}, effects=effects, clean=clean,
                       kind="attribution", n_layers=L, n_heads=H,
                       settings=patch_settings(model, tokens, per_position, repl.reference, n_edges,
                                               len({r.layer for r in recv})))


def _clean_values(model, cache, layer: int, heads: List[int], metric: Metric) -> Tensor:
    """[len(heads)] the clean metric of receivers that get no gradient run (layer 0: no senders)."""
    with torch.no_grad():
        scorer = Scorer(model, cache, layer, heads, metric)
        return (scorer.clean_sums() / scorer.count()).float().cpu()
