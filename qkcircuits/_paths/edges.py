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
the input norm and projection's VJP per (receiver head, input): closed form, all heads of a layer in one
matmul, for RMSNorm and LayerNorm input norms (``_foundation/inputs.py``); a small backward each otherwise. For receiver
metrics (induction, custom pattern/z metrics) that forward IS the clean forward's own attention of
that layer: the layer is scored inside the clean pass (``clean_pass(first_hooks=...)``: gradients on
from hook_resid_pre to hook_z of each receiver layer only), so no layer is run twice; direct-logit
(needs the final residual) and logits metrics get a second run of each receiver layer from the cached
residual. Where the hook value is ``RMSNorm(resid) W_x + b`` or ``ln1(resid) W_x + b`` (checked on the
run), the projection's part is done for the receiver head's slot only (``_input_vjps``). The gradients of
a block of receiver layers (up to ``GRAD_BLOCK_BYTES``) then meet every sender's Δ in ONE matmul
[n gradients, b·p·d_model] @ [b·p·d_model, sender heads]. ``metric="induction-loss"`` adds one forward from the
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
from .._foundation.inputs import closed_form, input_vjp
from .._foundation.heads import Head, HeadsLike, model_heads, n_kv_heads
from .path_effects import INPUTS, PathEffects
from .path_core import Scorer, check_resume, grab, is_direct_logit
from .patching import (MetricLike, check_into, check_metric_tokens, check_request, clean_pass, patch_settings,
                       post_norm, replacement_from_cache, resolve_metric)


def _cut(x: str, proj: Dict[str, Tensor], leaf: Dict[str, Tensor]):
    """A hook that keeps input ``x``'s graph-connected value in ``proj`` and hands the attention a fresh leaf
    (kept in ``leaf``) instead, so the gradient with respect to that input can be read off the leaf."""
    def fn(t: Tensor, hook) -> Tensor:
        proj[x] = t
        leaf[x] = t.detach().clone().requires_grad_(True)
        return leaf[x]
    return fn


def _grad_run(cache, layer: int, retry: bool = True):
    """Layer ``layer``'s attention on the clean residual with gradients: returns the residual leaf, each
    input's graph-connected projection (resid → ln1 → W_x, …) and the leaf the attention read instead,
    and the pattern and z computed from those leaves."""
    resid = cache.resid[layer].detach().clone().requires_grad_(True)
    proj: Dict[str, Tensor] = {}
    leaf: Dict[str, Tensor] = {}
    got: Dict[str, Tensor] = {}

    hooks = [(hook_name(x, layer), _cut(x, proj, leaf)) for x in INPUTS]
    both = ("pattern", "z")
    hooks += [(hook_name("pattern", layer), grab(got, "pattern", both)), (hook_name("z", layer), grab(got, "z", both))]
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


def _layer_deltas(model, cache, repl, layer: int, out: Optional[Tensor] = None) -> Tensor:
    """Every head of sender ``layer``'s exact change to the residual, as [n_heads, batch·pos·d_model] rows
    (written into ``out`` when given: no intermediate of that size is allocated on the pre-norm path)."""
    b, p = cache.tokens.shape
    z = cache.z[layer]                                                          # [b, p, H, d_head]
    H = z.shape[2]
    new = torch.stack([repl.value(layer, h, b, p).to(z).expand(b, p, z.shape[-1]) for h in range(H)], 2)
    W_O = adapter(model, layer).W_O()                                           # [H, d_v, d_model]
    d_model = W_O.shape[-1]
    dz = (new - z).permute(2, 0, 1, 3).reshape(H, b * p, -1)                    # [H, b·p, d_v], small
    post = post_norm(model, layer)
    if post is None:
        # one batched matmul per head straight into the caller's rows of D (was an einsum, a permuted
        # [H, b, p, d_model] result and two copies of it: most of delta_rows' time)
        rows = out if out is not None else torch.empty(H, b * p * d_model, dtype=z.dtype, device=z.device)
        torch.bmm(dz, W_O.to(z.dtype), out=rows.view(H, b * p, d_model))
        return rows
    delta = torch.bmm(dz, W_O.to(z.dtype)).view(H, b, p, d_model)
    y = cache.attn_out[layer]
    delta = torch.stack([post(y + delta[h]) - post(y) for h in range(H)]).reshape(H, -1)
    if out is not None:
        out.copy_(delta)
        return out
    return delta


def _vjp(out: Tensor, inp: Tensor, cots: List[Tensor]) -> List[Tensor]:
    """∂⟨out, cot⟩/∂inp for each cotangent. One backward per cotangent: measured faster on CPU than one
    batched backward (``is_grads_batched`` runs torch's legacy vmap), and needs no batching rules."""
    return [torch.autograd.grad(out, inp, grad_outputs=c, retain_graph=True)[0].detach() for c in cots]


def _input_vjps(model, layer: int, x: str, resid: Tensor, proj: Tensor, slots: List[int],
                cots: List[Tensor], out: Tensor) -> None:
    """``out[i]`` ← ∂⟨proj[:, :, slots[i]], cots[i]⟩/∂resid, flattened: the gradient at the residual of one
    head's input, written straight into the caller's rows (``out``: [len(slots), b·p·d_model]).

    Where the hook value is norm(resid) · W_x + b for an RMSNorm or LayerNorm the adapter reads (the closed form
    of ``_foundation/inputs.py``, checked on this very run to rounding: the same implementation the task
    circuits' runs use) the VJP is closed-form and batched over the cotangents, written into ``out`` (no
    autograd: the 9 norm backwards per layer this replaces were ~12 % of the time); else one backward of the
    whole hook per cotangent (``_vjp``)."""
    n, (bsz, pos, d_model) = len(slots), resid.shape
    parts = closed_form(model, layer, x, resid, proj)
    if parts is not None:
        grad = torch.stack([c.detach() for c in cots], 2)                                 # [b, p, n, d_head]
        rows = out.view(n, bsz, pos, d_model)
        got = input_vjp(parts, resid, grad, slots, out=rows)
        if got.data_ptr() != rows.data_ptr():
            rows.copy_(got)
        return
    full = []
    for slot, c in zip(slots, cots):
        cot = torch.zeros_like(proj)
        cot[:, :, slot] = c
        full.append(cot)
    for i, g in enumerate(_vjp(proj, resid, full)):
        out[i].copy_(g.reshape(-1))


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
GRAD_BLOCK_BYTES = 64 * 2**20


def edge_attribution(model, receivers: Optional[HeadsLike] = None, into: Sequence[str] = ("q", "k", "v"),
                     senders: Optional[HeadsLike] = None, method: str = "mean", tokens=None,
                     metric: MetricLike = None, *, per_position: bool = True) -> PathEffects:
    """First-order estimate of ``path_patch``'s edges: the same arguments in the same order, the same metrics
    (``resolve_metric``) and the same result type (``kind="attribution"``).

    ``receivers`` default to every head of layers ≥ 1; a named layer-0 receiver is kept with an empty sender
    set (NaN effects, as in ``path_patch``: no head precedes it); only layer-0 receivers fail. ``metric``:
    as ``path_patch`` (None: induction for q/k, direct-logit for v). A logits metric (``induction-loss``,
    ``qk.induction_loss()``) is differentiated at every receiver layer's z by ONE extra forward and backward in all;
    a receiver callable ``fn(pattern, z, tokens)`` must be differentiable in torch.
    Memory: ``CleanCache`` as in ``path_patch``; per receiver layer one attention forward's autograd
    graph over the batch, 3 × n_receiver_heads residual-sized gradients (waiting in blocks of up to
    ``GRAD_BLOCK_BYTES``, 64 MiB), and the senders' Δ (n_heads × batch × pos × d_model per sender layer,
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
    # Inputs whose metric reads only the receiver's own pattern / z (induction, custom receiver metrics) are
    # scored INSIDE the clean forward: each receiver layer's attention runs once, with gradients, as part of
    # it (no second run from the cached residual). Direct-logit needs the final residual and logits metrics
    # the layers above: those inputs get a gradient run per receiver layer after the clean pass.
    stream_xs = [x for x in into if metrics[x].needs != "logits" and not is_direct_logit(metrics[x])]
    later_xs = [x for x in into if x not in stream_xs]
    G = H // n_kv_heads(model)
    effects = {x: torch.full((len(recv), L, H), float("nan")) for x in into}
    clean = {x: torch.full((len(recv),), float("nan")) for x in into}
    by_layer: Dict[int, List[int]] = {}
    for i, r in enumerate(recv):
        by_layer.setdefault(r.layer, []).append(i)
    first = by_layer.pop(0, None)                  # layer-0 receivers: no senders (NaN effects), clean value only
    R_top = max(by_layer)
    send_layers = [Ls for Ls in range(R_top) if snd is None or any(s.layer == Ls for s in snd)]
    keep_mask = torch.tensor([[snd is None or Head(Ls, h) in snd for h in range(H)] for Ls in range(L)])
    n_flat = tokens.numel() * model.cfg.d_model
    dtype, device = model.W_E.dtype, model.W_E.device
    item = torch.empty((), dtype=dtype).element_size()
    # Senders' Δ, one row per head of each sender layer, flattened over (batch, pos, d_model): kept in one
    # matrix when it fits DELTA_CACHE_BYTES (every receiver layer above reuses it), else recomputed.
    D = torch.empty(R_top * H, n_flat, dtype=dtype, device=device) \
        if R_top * H * n_flat * item <= DELTA_CACHE_BYTES else None
    if D is not None:
        for Ls in range(R_top):
            if Ls not in send_layers:
                D[Ls * H:(Ls + 1) * H].zero_()                  # never a sender: zero rows (masked to NaN)
    filled = set()                                                               # sender layers in D
    st: Dict[str, object] = {"cache": None, "repl": None, "used": 0, "buf": None,
                             "rows_left": sum(len(idx) for idx in by_layer.values()) * len(into)}

    def delta_rows(Ls: int) -> Tensor:
        cache, repl = st["cache"], st["repl"]
        if D is None:
            return _layer_deltas(model, cache, repl, Ls)
        if Ls not in filled:
            _layer_deltas(model, cache, repl, Ls, out=D[Ls * H:(Ls + 1) * H])
            filled.add(Ls)
        return D[Ls * H:(Ls + 1) * H]

    pending: List[tuple] = []                       # (receiver layer, rows, first buffer row)

    def flush() -> None:
        """Score every waiting gradient against every sender below its layer, and place the effects."""
        used = st["used"]
        if not pending:
            return
        top = max(R for R, _, _ in pending)
        # the replacement z of the senders (means of the clean z so far: flushes may come mid-forward, when
        # every sender layer below ``top`` has run)
        st["repl"] = replacement_from_cache(st["cache"], method, per_position)
        grad_mat = st["buf"][:used]                                              # [n, b·p·d_model]
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
            t = t * torch.tensor([-metrics[x].sign for _, x in rows])[:, None, None]       # effect = −sign·g·Δ
            for x in into:
                sel = [k for k, (_, xx) in enumerate(rows) if xx == x]
                if sel:
                    effects[x][torch.tensor([rows[k][0] for k in sel]), :R] = t[sel]
        pending.clear()
        st["used"] = 0

    row_bytes = n_flat * item

    def layer_rows(R: int, run, xs: Sequence[str]) -> None:
        """Receiver layer R's gradients for inputs ``xs`` from one run with gradients (``_grad_run``'s
        tuple) into the block buffer; a full buffer is scored first."""
        idx = by_layer[R]
        n_new = len(idx) * len(xs)
        buf = st["buf"]
        if buf is None or st["used"] + n_new > len(buf):
            flush()
            n_rows = min(st["rows_left"], max(n_new, GRAD_BLOCK_BYTES // row_bytes))
            if buf is None or len(buf) < n_rows:
                st["buf"] = buf = torch.empty(n_rows, n_flat, dtype=dtype, device=device)
        st["rows_left"] -= n_new
        heads = [recv[i].head for i in idx]
        resid, proj, leaf, pattern, z = run
        rows: List[tuple] = []                    # (receiver index, input) per buffer row
        first_row = st["used"]
        for x in xs:
            m = metrics[x]
            if m.needs == "logits":
                # metric ≈ clean + Σ ∂metric/∂z · (z' − z): each head's z against the metric's gradient at its z
                grad_z, clean_value = logits_grads[m.name]
                with torch.enable_grad():
                    values = (z[:, :, heads] * grad_z[R][:, :, heads]).sum((0, 1, 3))
                clean[x][idx] = clean_value
            else:
                scorer = Scorer(model, st["cache"], R, heads, m)
                with torch.enable_grad():
                    values = scorer.sums(pattern, z, 1)[0] / scorer.count()     # [len(heads)] means, in the graph
                clean[x][idx] = values.detach().float().cpu()
            # Query heads of one KV group share k/v: separate their gradients by one backward per member.
            members = [[j for j, h in enumerate(heads) if (h % G if x != "q" else 0) == g]
                       for g in range(G if x != "q" else 1)]
            slots, cots = [], []                  # per receiver head: its slot of the input and ∂value/∂slot
            for js in members:
                if not js:
                    continue
                # a pattern metric does not read v: its gradient there is exactly 0 (not "unused")
                (g_in,) = torch.autograd.grad(values[js].sum(), leaf[x], retain_graph=True, allow_unused=True)
                if g_in is None:
                    g_in = torch.zeros_like(leaf[x])
                for j in js:
                    h = heads[j]
                    slots.append(h if x == "q" else h // G)
                    cots.append(g_in[:, :, slots[-1]])
                    rows.append((idx[j], x))
            u = st["used"]
            _input_vjps(model, R, x, resid, proj[x], slots, cots, st["buf"][u:u + len(slots)])
            st["used"] = u + len(slots)
        pending.append((R, rows, first_row))

    def stream(R: int) -> list:
        """Hooks that run receiver layer R's attention with gradients inside the clean forward and score it."""
        got: Dict[str, Tensor] = {}
        proj: Dict[str, Tensor] = {}
        leaf: Dict[str, Tensor] = {}

        def pre(t: Tensor, hook) -> Tensor:
            torch.set_grad_enabled(True)        # this layer's attention only: finish() turns it off again
            got["resid"] = t.detach().clone().requires_grad_(True)
            return got["resid"]

        def finish() -> None:
            try:
                if len(proj) < 3 or "resid" not in got:
                    raise QKCircuitsError(f"layer {R}'s attention did not fire hook_q/k/v after hook_resid_pre; "
                                          f"edge attribution cannot run on this bridge")
                layer_rows(R, (got["resid"], proj, leaf, got["pattern"], got["z"]), stream_xs)
                finished.add(R)
            finally:
                torch.set_grad_enabled(False)
                got.clear(), proj.clear(), leaf.clear()

        # the layer is scored once both its pattern and z are in, whichever hook fires last (GPT-J's bridge
        # fires hook_z first and reads hook_pattern off the attention's outputs); z goes on detached
        def at_pattern(t: Tensor, hook) -> None:
            got["pattern"] = t
            if "z" in got:
                finish()

        def at_z(t: Tensor, hook) -> Tensor:
            got["z"] = t
            if "pattern" in got:
                finish()
            return t.detach()

        return ([(f"blocks.{R}.hook_resid_pre", pre)] + [(hook_name(x, R), _cut(x, proj, leaf)) for x in INPUTS]
                + [(hook_name("pattern", R), at_pattern), (hook_name("z", R), at_z)])

    finished: set = set()

    first_hooks = [hk for R in sorted(by_layer) for hk in stream(R)] if stream_xs else []
    def started(c) -> None:                          # the hooks above read the cache as it fills
        st["cache"] = c

    st["cache"] = cache = clean_pass(model, tokens, [r.layer for r in recv],
                                     need_final=any(is_direct_logit(m) for m in metrics.values()),
                                     need_logits=any(m.needs == "logits" for m in metrics.values()),
                                     check_all=False if later_xs else None, first_hooks=first_hooks,
                                     on_start=started)
    unscored = [str(R) for R in sorted(by_layer) if stream_xs and R not in finished]
    if unscored:
        raise QKCircuitsError(f"layers {', '.join(unscored)}: the attention did not fire both hook_pattern and "
                              f"hook_z in the clean forward; edge attribution cannot run on this bridge")
    if first is not None:
        for x in into:
            clean[x][first] = _clean_values(model, cache, 0, [recv[i].head for i in first], metrics[x])
    logits_metrics = {m.name: m for x, m in metrics.items() if x in later_xs and m.needs == "logits"}
    grad_layers = sorted(by_layer)
    logits_grads = {name: _logits_grads(cache, grad_layers, m)      # one forward + one backward each
                    for name, m in logits_metrics.items()}
    st["repl"] = replacement_from_cache(cache, method, per_position)
    if later_xs:
        for R in sorted(by_layer):
            run = _grad_run(cache, R)
            layer_rows(R, run, later_xs)
            del run
    flush()
    n_edges = sum(int((~effects[into[0]][i].isnan()).sum()) for i in range(len(recv)))
    return PathEffects(model=model_name(model), method=method, receivers=recv, into=into,
                       metrics={x: m.name for x, m in metrics.items()}, effects=effects, clean=clean,
                       kind="attribution", n_layers=L, n_heads=H,
                       settings=patch_settings(model, tokens, per_position, st["repl"].reference, n_edges,
                                               len({r.layer for r in recv})))


def _clean_values(model, cache, layer: int, heads: List[int], metric: Metric) -> Tensor:
    """[len(heads)] the clean metric of receivers that get no gradient run (layer 0: no senders)."""
    with torch.no_grad():
        scorer = Scorer(model, cache, layer, heads, metric)
        return (scorer.clean_sums() / scorer.count()).float().cpu()
