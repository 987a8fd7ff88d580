"""The three instrumented forwards every method is built from (one prompt shard each).

- ``record``: a plain forward (no grad) that keeps every sender's output [S, b, p, d], every receiver's
  hook value (hook_q/k/v, mlp.hook_in, unembed.hook_in) and the metric per row.
- ``grad_run``: a forward with gradients in which each receiver reads its OWN copy of the residual
  (``split_qkv_from_residuals`` on per-head copies, ln2 / the final norm on a clone), then ONE backward
  of the metric sum; each copy's gradient ∂m/∂(receiver input) [n, b, p, d] is handed to ``on_grad`` as
  the backward reaches it and then dropped (only one layer's gradients exist at a time).
- ``patched_run``: the circuit forward. ``mask[k, S, R]`` (k stacked copies of the shard) says which
  edges are in the circuit; receiver r of copy c reads

      Σ_{s ∈ C} out_s(this run) + Σ_{s ∉ C} out_s(corrupt run) + biases
        = corrupt_resid_r + Σ_{s∈C} Δ_s = stream_r − Σ_{s∉C} Δ_s,     Δ_s = out_s(this run) − out_s(corrupt)

  computed by whichever sum has fewer terms in that layer. A receiver with every edge in C keeps the
  model's own value (so the full circuit IS the clean run) and one with none takes the corrupt run's
  hook value (so the empty circuit IS the corrupt run): f(100 %) = 1 and f(0 %) = 0 hold exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch
from jaxtyping import Bool
from torch import Tensor

from .._foundation.capture import _Stop
from .._foundation.errors import QKCircuitsError
from .graph import (INPUT_HOOKS, Graph, head_outputs, logits_input, mlp_input, post_norm,
                    split_qkv_from_residuals)
from .inputs import InputParts, closed_form, input_vjp, project

Key = Tuple[str, int]
# How patched_run's sums read the senders' Δ rows: "auto" picks, per receiver group, the cheapest of one
# matmul over every sender below ("dense": reads each Δ row once), a copy of only the rows the sums use
# ("gather": those rows read, written and read again) and one matmul per contiguous run of used rows
# ("segments": those rows read once, the output block read and written once per further run), by the rows
# each moves. The others are for tests: every choice gives the same sums.
DELTA_ROWS = "auto"
# An MLP receiver's sum over the senders below its layer's attention rides in that layer's q/k/v matmul (one
# more column instead of one more read of every sender's Δ: measured −4 s of a 76 s SmolLM2 curve). False:
# each MLP reads Δ itself (the same sums; tests compare the two).
MLP_WITH_QKV = True


@dataclass
class Record:
    """One run's sender outputs ``out`` [S, b, p, d], receiver hook values ``hooks[(x, L)]`` (x in q, k,
    v, mlp; ``("logits", 0)`` = unembed.hook_in), the residuals receivers read ``resid[(x, L)]`` (x in
    attn, mlp, final) and the metric of each row ``rows`` [b]."""

    out: Tensor
    hooks: Dict[Key, Tensor] = field(default_factory=dict)
    resid: Dict[Key, Tensor] = field(default_factory=dict)
    rows: Optional[Tensor] = None


def _hooks(model, g: Graph, out: Optional[Tensor], stream: Dict[Key, Tensor], splice: Optional[Callable],
           keep: Optional[Dict[Key, Tensor]], emb_override: Optional[Tensor] = None, grad: bool = False):
    """The hook list shared by the three runs: capture stream/outputs (``out`` None: no sender outputs,
    and no head-output einsums), optionally splice receiver inputs."""
    z_of: Dict[int, Tensor] = {}
    hooks = []

    def resid_pre(L: int):
        def fn(t: Tensor, hook):
            if L == 0 and emb_override is not None:
                t = emb_override.to(t.dtype)
            if L == 0 and grad:           # frozen weights: the embedding is where the gradient graph starts
                t = t.detach().requires_grad_(True)
            stream[("attn", L)] = t
            if L == 0 and out is not None:
                out[0] = t.detach()
            return t
        return fn

    def z_hook(L: int):
        def fn(t: Tensor, hook) -> None:
            z_of[L] = t.detach()
            if post_norm(model, L) is None:
                with torch.no_grad():
                    head_outputs(model, L, z_of[L], out=out[g.head_sender(L):g.head_sender(L) + g.n_heads])
        return fn

    def y_hook(L: int):
        def fn(t: Tensor, hook) -> None:
            with torch.no_grad():
                head_outputs(model, L, z_of[L], t.detach(), out=out[g.head_sender(L):g.head_sender(L) + g.n_heads])
        return fn

    def keep_stream(key: Key):
        def fn(t: Tensor, hook) -> None:
            stream[key] = t
        return fn

    def mlp_out(L: int):
        def fn(t: Tensor, hook) -> None:
            out[g.mlp_sender(L)] = t.detach()
        return fn

    def receiver(x: str, L: int):
        def fn(t: Tensor, hook):
            if keep is not None:
                keep[(x, L)] = t.detach()
            if splice is None:
                return None
            new = splice(x, L, t)
            return None if new is None else new.to(t.dtype)
        return fn

    for L in range(g.n_layers):
        hooks.append((f"blocks.{L}.hook_resid_pre", resid_pre(L)))
        if out is not None:
            hooks.append((f"blocks.{L}.attn.hook_z", z_hook(L)))
            if post_norm(model, L) is not None:
                hooks.append((f"blocks.{L}.attn.hook_out", y_hook(L)))
        hooks += [(f"blocks.{L}.{INPUT_HOOKS[x]}", receiver(x, L)) for x in ("q", "k", "v")]
        if g.has_mlp:
            hooks.append((f"blocks.{L}.hook_resid_mid", keep_stream(("mlp", L))))
            hooks.append((f"blocks.{L}.{INPUT_HOOKS['mlp']}", receiver("mlp", L)))
            if out is not None:
                hooks.append((f"blocks.{L}.hook_mlp_out", mlp_out(L)))
    hooks.append(("ln_final.hook_in", keep_stream(("final", 0))))
    hooks.append(("unembed.hook_in", receiver("logits", 0)))
    return hooks


def clean_rows(model, task) -> Tensor:
    """The metric per row of a plain forward of ``task``'s clean rows (no hooks, no sender outputs): what a
    circuit holding every edge measures (``patched_run`` with the full mask reproduces this run exactly)."""
    with torch.no_grad():
        return _metric_rows(model, task, task.clean, [])


def _metric_rows(model, task, tokens: Tensor, hooks, copies: int = 1) -> Tensor:
    """Run with ``hooks`` and return the metric per row. A named metric reads one position per row, so the
    forward stops at the unembedding's input and only those b rows are unembedded (not b × pos)."""
    if not isinstance(task.metric, str):
        return task.row_values(model.run_with_hooks(tokens, fwd_hooks=hooks), tokens)
    got: Dict[str, Tensor] = {}

    def stop(t: Tensor, hook):
        got["x"] = t
        raise _Stop

    try:
        model.run_with_hooks(tokens, fwd_hooks=list(hooks) + [("unembed.hook_in", stop)])
    except _Stop:
        pass
    if "x" not in got:
        raise QKCircuitsError("this model never fired unembed.hook_in; the circuit graph needs it")
    x = got["x"]
    rows = torch.arange(x.shape[0], device=x.device)
    end = task.positions["END"].to(x.device).repeat(copies)
    logits = model.unembed(x[rows, end].unsqueeze(1))                                   # [b, 1, vocab]
    return task.at_end().row_values(logits)


def reuse(pool: Optional[Dict[str, Tensor]], name: str, shape: Tuple[int, ...], dtype, device) -> Tensor:
    """An uninitialised tensor of ``shape``: a view of ``pool[name]``'s first elements when that flat buffer
    is large enough (a caller running many prompt shards allocates the first shard's buffers once, sparing
    every later shard a fresh allocation's page faults), else a new buffer kept there."""
    n = 1
    for s in shape:
        n *= int(s)
    flat = None if pool is None else pool.get(name)
    if flat is None or flat.numel() < n or flat.dtype != dtype or flat.device != torch.device(device):
        flat = torch.empty(n, dtype=dtype, device=device)
        if pool is not None:
            pool[name] = flat
    return flat[:n].view(shape)


def _buffer(model, g: Graph, tokens: Tensor, pool: Optional[Dict[str, Tensor]] = None, name: str = "out") -> Tensor:
    b, p = tokens.shape
    # uninitialised, not zeros: every run writes each sender's slot before anything reads it
    return reuse(pool, name, (g.n_senders, b, p, model.cfg.d_model), model.W_E.dtype, model.W_E.device)


def record(model, g: Graph, task, tokens: Tensor, pool: Optional[Dict[str, Tensor]] = None) -> Record:
    """A plain forward of ``tokens`` (a shard's clean or corrupt rows) keeping what ``Record`` lists; its
    sender outputs in ``pool["record"]`` when given (``reuse``)."""
    out = _buffer(model, g, tokens, pool, "record")
    stream: Dict[Key, Tensor] = {}
    keep: Dict[Key, Tensor] = {}
    with torch.no_grad():
        rows = _metric_rows(model, task, tokens, _hooks(model, g, out, stream, None, keep)).detach()
    missing = [k for k in [("q", 0), ("logits", 0)] if k not in keep]
    if missing or ("final", 0) not in stream:
        raise QKCircuitsError("this model never fired hook_q / ln_final.hook_in / unembed.hook_in; the circuit "
                              "graph needs a TransformerLens bridge (or native model) with those hook points")
    return Record(out, keep, {k: v.detach() for k, v in stream.items()}, rows)


def check_graph(model, g: Graph, rec: Record, tokens: Tensor, atol: float = 1e-4, rows: int = 2) -> None:
    """The residual semantics hold on this model: per-head recomputed inputs equal the model's own, and the
    final residual is the sum of every sender's output plus a constant (the biases). Raises otherwise.
    Tolerances are at least the residual dtype's epsilon (bf16: 0.0078), so rounding alone never fails it.
    Checks the record's first ``rows`` prompts: every identity is per prompt (the attention mixing is
    inside the recorded values), so more rows would repeat the same check at the cost of a forward."""
    rec = Record(rec.out[:, :rows], {k: v[:rows] for k, v in rec.hooks.items()},
                 {k: v[:rows] for k, v in rec.resid.items()})
    eps = float(torch.finfo(rec.resid[("final", 0)].dtype).eps)
    atol, rtol = max(atol, eps), max(1e-3, eps)
    with torch.no_grad():
        for L in range(g.n_layers):
            x = rec.resid[("attn", L)]
            for into, n in (("q", g.n_heads), ("k", g.n_kv), ("v", g.n_kv)):
                mine = split_qkv_from_residuals(model, L, into, x.unsqueeze(0).expand(n, *x.shape), range(n))
                if not torch.allclose(mine, rec.hooks[(into, L)], atol=atol, rtol=rtol):
                    raise QKCircuitsError(f"recomputing layer {L}'s hook_{into} from the residual (ln1, W_{into.upper()})"
                                          f" does not reproduce the model's (max diff "
                                          f"{float((mine - rec.hooks[(into, L)]).abs().max()):.3g}); the circuit "
                                          f"graph does not support this architecture yet")
            if g.has_mlp:
                mine = mlp_input(model, L, rec.resid[("mlp", L)])
                if not torch.allclose(mine, rec.hooks[("mlp", L)], atol=atol, rtol=rtol):
                    raise QKCircuitsError(f"layer {L}'s MLP input is not ln2 of the residual; unsupported architecture")
        mine = logits_input(model, rec.resid[("final", 0)])
        if not torch.allclose(mine, rec.hooks[("logits", 0)], atol=atol, rtol=rtol):
            raise QKCircuitsError("the unembedding's input is not the final norm of the last residual; unsupported")
        total = rec.out.sum(0)
        rest = rec.resid[("final", 0)] - total              # the biases: must not depend on the prompt
        scale = float(rec.resid[("final", 0)].abs().max()) + 1.0
        if float((rest - rest[:1, :1]).abs().max()) > atol * scale * 10:
            raise QKCircuitsError(f"the final residual is not the sum of the embedding, the heads' and the MLPs' "
                                  f"outputs plus a constant (max deviation {float((rest - rest[:1, :1]).abs().max()):.3g}"
                                  f"); the circuit graph does not support this architecture yet")


def grad_run(model, g: Graph, task, tokens: Tensor, on_grad: Callable[[slice, Tensor], None],
             emb_override: Optional[Tensor] = None, out: Optional[Tensor] = None,
             dest: Optional[Callable[[slice], Optional[Tensor]]] = None) -> float:
    """Forward with every receiver reading its own residual copy, one backward of the metric SUM over
    the rows; ``on_grad(receiver slice, grad [n, b, p, d])`` per receiver group. Fills ``out`` (sender
    outputs, detached) when given; without it records none. Returns the metric sum. ``dest(slice)``: where
    the closed-form VJP may write a group's gradient (a caller summing into one buffer spares a copy; the
    tensor handed to ``on_grad`` is then that one), or None.

    Every copy of a layer's residual equals the layer's one residual in this run, so where the q/k/v
    input has a closed form (``inputs.py``: RMSNorm or LayerNorm, checked on the run) the copies are never
    made: the model computes its own hook_q/k/v, the backward hands their gradient [b, p, n, e], and the
    closed-form VJP turns it into each head's ∂m/∂(own copy). Elsewhere (bf16, latent attention, other
    norms) each head reads an expanded copy through ``split_qkv_from_residuals`` and autograd does it.
    The MLP and the logits read a clone of their residual. Holds one forward's autograd graph (no copies
    in it on the closed-form path; [H + 2 G, b, p, d] normed copies per layer otherwise); it grows with
    the shard's tokens and has no cap of its own (docs/benchmarks.md: EAP +10.69 GB for SmolLM2 at 2 × 1,281
    tokens on the closed-form path, +11.8 GB with the copies): mostly the model's own attention scores and
    patterns, kept for the backward."""
    stream: Dict[Key, Tensor] = {}
    fired = {"hooked": 0, "fired": 0}

    def from_hook_grad(sl: slice, parts: InputParts, xb: Tensor, n: int):
        def fn(grad: Tensor) -> None:
            fired["fired"] += 1
            on_grad(sl, input_vjp(parts, xb, grad, range(n), out=dest(sl) if dest is not None else None))
        return fn

    def splice(x: str, L: int, t: Tensor) -> Optional[Tensor]:
        if x in ("q", "k", "v"):
            n = g.n_heads if x == "q" else g.n_kv
            base = stream[("attn", L)]
            sl = g.recv_slice(L, x)
            parts = closed_form(model, L, x, base, t) if t.requires_grad else None
            if parts is not None:
                xb = base.detach()
                # a NEW view carries the hook: the bridge reads an unedited hook value (the same object back)
                # from its own pre-hook tensor, so a gradient hook on ``t`` itself would never fire
                mine = t.view(t.shape)
                mine.register_hook(from_hook_grad(sl, parts, xb, n))
                fired["hooked"] += 1
                return mine
            copies = base.unsqueeze(0).expand(n, *base.shape)
            copies.register_hook(lambda grad, sl=sl: on_grad(sl, grad))
            return split_qkv_from_residuals(model, L, x, copies, range(n))
        base = stream[("mlp", L)] if x == "mlp" else stream[("final", 0)]
        own = base.clone()
        sl = g.recv_slice(L, "mlp") if x == "mlp" else slice(g.logits_receiver, g.logits_receiver + 1)
        own.register_hook(lambda grad, sl=sl: on_grad(sl, grad.unsqueeze(0)))
        return mlp_input(model, L, own) if x == "mlp" else logits_input(model, own)

    with torch.enable_grad():
        rows = _metric_rows(model, task, tokens, _hooks(model, g, out, stream, splice, None, emb_override, True))
        total = rows.sum()
        # Gradients of the activations only (the receiver copies' hooks fire on the way to the embedding
        # leaf): ``total.backward()`` would also compute and KEEP a weights-sized ``.grad`` on every
        # parameter, accumulating over calls.
        torch.autograd.grad(total, stream[("attn", 0)])
    if fired["hooked"] and not fired["fired"]:
        raise QKCircuitsError("the backward never reached this model's hook_q/k/v values (its attention does not "
                              "read the value the hook returns); its edge scores cannot be computed this way")
    return float(total.detach())


def patched_run(model, g: Graph, task, corrupt: Record, mask: Bool[Tensor, "k S R"], force_split: bool = False,
                return_logits: bool = False, buffer: Optional[Tensor] = None) -> Tensor:
    """Metric of each row of each copy [k, b] with the circuit edges ``mask`` (see the module docstring),
    or the logits [k·b, pos, vocab] (``return_logits``). ``force_split`` recomputes every receiver's input
    by the formula (no shortcut for all-in / none-in receivers): the test of the formula itself.
    Runs the shard's clean rows (k stacked copies). Holds the sender outputs of this run
    [S, k·b, p, d] next to the corrupt record's: in ``buffer`` when it has that shape (a caller running
    many circuits reuses one, sparing a fresh allocation's page faults per run; every slot is written
    before it is read)."""
    k = mask.shape[0]
    b = task.n
    tokens = task.clean.repeat(k, 1)
    out_shape = (g.n_senders, k * b, tokens.shape[1], model.cfg.d_model)
    out = buffer if buffer is not None and tuple(buffer.shape) == out_shape else _buffer(model, g, tokens)
    stream: Dict[Key, Tensor] = {}
    valid = g.valid
    m = (mask & valid[None]).to(out.device)
    corr_out = corrupt.out

    converted = [0]                 # out[:converted] already holds Δ_s = out_s(this run) − out_s(corrupt)

    def deltas(nb: int) -> Tensor:
        """Δ of senders 0 … nb−1 as [nb, k, b·p·d], each sender converted once, in place, when first read
        (every sender below a receiver has been computed by the time the receiver reads)."""
        c0 = converted[0]
        if c0 < nb:
            out[c0:nb].view(nb - c0, k, b, *out.shape[2:]).sub_(corr_out[c0:nb].unsqueeze(1))
            converted[0] = nb
        return out[:nb].view(nb, k, -1)

    def mixed(pieces: List[Tuple[Tensor, Tensor]], start: Tensor, sign: float) -> Tensor:
        """start + sign · Σ_pieces Σ_s W[k, s, n] Δ_s as [n, k·x]: the first piece in one addmm from ``start``
        (no separate add pass), each further one added in place."""
        res = None
        for W, D in pieces:
            n, x = W.shape[-1], D.shape[-1]
            W = W.to(D.dtype)
            if k == 1:
                if res is None:
                    res = torch.addmm(start.reshape(1, x).expand(n, x), W[0].T, D[:, 0], alpha=sign)
                else:
                    res.addmm_(W[0].T, D[:, 0], alpha=sign)
                continue
            term = torch.einsum("ksn,skx->nkx", W, D).reshape(n, k * x)
            res = (term.mul_(sign).add_(start.reshape(1, k * x)) if res is None
                   else res.add_(term, alpha=sign))
        return res

    def gathered(W: Tensor, lo: int, hi: int) -> List[Tuple[Tensor, Tensor]]:
        """(W, Δ) pieces over the senders lo … hi−1 that appear in a term (``DELTA_ROWS``); [] when none do.
        The matmuls are bound by reading Δ ((hi − lo) × k·b·p·d), so small circuits, or circuits that leave
        few edges out, read only the rows their sums use."""
        used = W.any(-1).any(0)                                                  # [hi − lo]
        D = deltas(hi)[lo:]                                                      # [hi − lo, k, x]
        idx = used.nonzero().squeeze(1)
        n_used, n_out = len(idx), W.shape[-1]               # the output block is n_out Δ rows
        if not n_used:
            return []
        runs_at = [0] + ((idx[1:] - idx[:-1]) != 1).nonzero().squeeze(1).add(1).tolist() + [n_used]
        segs = [(int(idx[a]), int(idx[b - 1]) + 1) for a, b in zip(runs_at[:-1], runs_at[1:])]
        cost = {"dense": hi - lo, "gather": 3 * n_used, "segments": n_used + 2 * n_out * (len(segs) - 1)}
        how = min(cost, key=cost.get) if DELTA_ROWS == "auto" else DELTA_ROWS
        if how not in cost:
            raise QKCircuitsError(f"runs.DELTA_ROWS must be 'auto', 'dense', 'gather' or 'segments', got {DELTA_ROWS!r}")
        if how == "dense":
            return [(W, D)]
        if how == "gather":
            return [(W[:, idx], D[idx])]
        return [(W[:, a:b], D[a:b]) for a, b in segs]

    def resid_for(rs: Tensor, base_stream: Tensor, corr_key: Key, mlp: Optional[int] = None
                  ) -> Tuple[Tensor, Tensor, Tensor]:
        """resid [n, k·b, p, d] for receivers ``rs`` (same senders below), and each (copy, receiver)'s
        all-in / none-in flags. One matmul reads the senders' Δ once for all of ``rs``. ``mlp``: the same
        layer's MLP receiver, whose sum over these senders rides in the same matmul (one more column, not
        one more read of Δ) and is kept for it in ``mlp_part``."""
        nb = g.n_below(int(rs[0]))
        n = len(rs)
        cols = rs if mlp is None else torch.cat([rs, torch.tensor([mlp])])
        M = m[:, :nb][:, :, cols]                                                # [k, nb, n (+1)]
        n_in = M[..., :n].sum(1)
        all_in, none_in = n_in == nb, n_in == 0
        # Either form gives every receiver's residual: corrupt + Σ_{s in} Δ_s, or this run's − Σ_{s out} Δ_s;
        # the one with fewer terms costs less where Δ rows are gathered
        add = int(M.sum()) <= int((~M).sum())
        start = corrupt.resid[corr_key].repeat(k, 1, 1) if add else base_stream
        pieces = gathered(M if add else ~M, 0, nb)
        if not pieces:                                           # no term: every receiver reads ``start``
            if mlp is not None:
                mlp_part[mlp] = (add, None)
            return start.unsqueeze(0).expand(n, *base_stream.shape), all_in, none_in
        res = mixed(pieces, start, 1.0 if add else -1.0)                         # [n (+1), k·b·p·d]
        if mlp is not None:
            mlp_part[mlp] = (add, res[n])
            res = res[:n]
        return res.view(n, *base_stream.shape), all_in, none_in

    def mlp_resid(r: int, L: int, base_stream: Tensor, corr_key: Key) -> Tuple[Tensor, Tensor, Tensor]:
        """MLP receiver ``r``'s resid [1, k·b, p, d] when its layer's q/k/v matmul already summed the senders
        below the attention (``mlp_part``, in that matmul's form and from its start): the start is swapped
        for the MLP's own and only the layer's heads (the senders between) are added here."""
        add, part = mlp_part.pop(r)
        lo, nb = g.n_below(g.recv_slice(L, "q").start), g.n_below(r)
        M = m[:, :nb][:, :, [r]]                                                 # [k, nb, 1]
        n_in = M.sum(1)
        all_in, none_in = n_in == nb, n_in == 0
        start = corrupt.resid[corr_key].repeat(k, 1, 1) if add else base_stream
        total = start.reshape(-1)
        if part is not None:
            attn_start = corrupt.resid[("attn", L)].repeat(k, 1, 1) if add else stream[("attn", L)]
            total = part - attn_start.reshape(-1) + total
        pieces = gathered((M if add else ~M)[:, lo:], lo, nb)
        if pieces:
            total = mixed(pieces, total, 1.0 if add else -1.0)[0]
        return total.view(1, *base_stream.shape), all_in, none_in

    layer_cache: Dict[int, Tuple[Tensor, Tensor, Tensor]] = {}
    mlp_part: Dict[int, Tuple[bool, Optional[Tensor]]] = {}   # MLP receiver → (add form, its sum below the attention)
    parts_of: Dict[Key, Optional[InputParts]] = {}

    def shortcut(rs: Tensor) -> Optional[str]:
        """"all" when every copy has every edge into receivers ``rs`` (they read this run's own value), "none"
        when no copy has any (the corrupt run's value), else None: recomputed. ``force_split``: always None."""
        nb = g.n_below(int(rs[0]))
        n_in = m[:, :nb][:, :, rs].sum(1)                                         # [k, n]
        if force_split:
            return None
        return "all" if bool((n_in == nb).all()) else "none" if not bool(n_in.any()) else None

    def _mlp_rides(L: int) -> Optional[int]:
        """Layer L's MLP receiver when its sum should ride in the q/k/v matmul: it exists and will be
        recomputed."""
        if not g.has_mlp or not MLP_WITH_QKV:
            return None
        r = g.recv_slice(L, "mlp").start
        return r if shortcut(torch.tensor([r])) is None else None

    def splice(x: str, L: int, t: Tensor) -> Optional[Tensor]:
        if x in ("q", "k", "v"):
            sl = g.recv_slice(L, x)
            base, key, corr_key = stream[("attn", L)], (x, L), ("attn", L)
        elif x == "mlp":
            sl, base, key, corr_key = g.recv_slice(L, "mlp"), stream[("mlp", L)], ("mlp", L), ("mlp", L)
        else:
            sl = slice(g.logits_receiver, g.logits_receiver + 1)
            base, key, corr_key = stream[("final", 0)], ("logits", 0), ("final", 0)
        rs = torch.arange(sl.start, sl.stop)
        how = shortcut(rs)
        if x == "mlp" and how is not None:
            mlp_part.pop(sl.start, None)
        if how == "all":
            return None
        if how == "none":                                # no edge in: the corrupt run's value, no matmul
            return corrupt.hooks[key].repeat(k, *([1] * (corrupt.hooks[key].dim() - 1)))
        if x in ("q", "k", "v"):
            # q, k and v of a layer read the same senders: their inputs come from one matmul, at hook_q
            if L not in layer_cache:
                q0, v1 = g.recv_slice(L, "q").start, g.recv_slice(L, "v").stop
                layer_cache.clear()
                layer_cache[L] = resid_for(torch.arange(q0, v1), base, corr_key, mlp=_mlp_rides(L))
            res_all, a_all, z_all = layer_cache[L]
            o0, o1 = sl.start - g.recv_slice(L, "q").start, sl.stop - g.recv_slice(L, "q").start
            resid, all_in, none_in = res_all[o0:o1], a_all[:, o0:o1], z_all[:, o0:o1]
        elif x == "mlp" and sl.start in mlp_part:
            resid, all_in, none_in = mlp_resid(sl.start, L, base, corr_key)
        else:
            resid, all_in, none_in = resid_for(rs, base, corr_key)
        if x in ("q", "k", "v"):
            if key not in parts_of:
                parts_of[key] = closed_form(model, L, x, base, t)
            parts = parts_of[key]
            new = (project(parts, resid, range(len(rs))) if parts is not None             # [kb, p, n, e]
                   else split_qkv_from_residuals(model, L, x, resid, range(len(rs))))
        elif x == "mlp":
            new = mlp_input(model, L, resid[0]).unsqueeze(2)
        else:
            new = logits_input(model, resid[0]).unsqueeze(2)
        if force_split:
            return new if x in ("q", "k", "v") else new[:, :, 0]
        own = t if x in ("q", "k", "v") else t.unsqueeze(2)
        corr = corrupt.hooks[key].repeat(k, *([1] * (corrupt.hooks[key].dim() - 1)))
        corr = corr if x in ("q", "k", "v") else corr.unsqueeze(2)
        shape = (k, b) + tuple(own.shape[1:])
        new, own, corr = new.view(shape), own.reshape(shape), corr.reshape(shape)
        # [k, n] flags → broadcast over (b, p, ·, e) with the head axis third from the end
        a = all_in.view(k, 1, 1, -1, 1).to(new.device)
        z = none_in.view(k, 1, 1, -1, 1).to(new.device)
        val = torch.where(a, own, torch.where(z, corr, new)).reshape((k * b,) + tuple(own.shape[2:]))
        return val if x in ("q", "k", "v") else val[:, :, 0]

    with torch.no_grad():
        hooks = _hooks(model, g, out, stream, splice, None)
        if return_logits:
            return model.run_with_hooks(tokens, fwd_hooks=hooks)
        rows = _metric_rows(model, task, tokens, hooks, copies=k)
    return rows.view(k, b)
