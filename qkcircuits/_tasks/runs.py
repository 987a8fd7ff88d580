"""The two instrumented forwards built on ``record.py``'s plain one (one prompt shard each).

- ``grad_run``: a forward with gradients in which each receiver reads its OWN copy of the residual, then
  ONE backward of the metric sum; each copy's gradient ∂m/∂(receiver input) [n, b, p, d] is handed to
  ``on_grad`` as the backward reaches it and then dropped (only one layer's gradients exist at a time).
  The q/k/v copies are virtual where the input has a closed form (``inputs.py``: the model's own hook_q/k/v
  gradient through the closed-form VJP), else expanded copies through ``split_qkv_from_residuals``; the
  MLP and the logits read a clone (ln2 / the final norm).
- ``patched_run``: the circuit forward. ``mask[k, S, R]`` (k stacked copies of the shard) says which
  edges are in the circuit; receiver r of copy c reads

      Σ_{s ∈ C} out_s(this run) + Σ_{s ∉ C} out_s(corrupt run) + biases
        = corrupt_resid_r + Σ_{s∈C} Δ_s = stream_r − Σ_{s∉C} Δ_s,     Δ_s = out_s(this run) − out_s(corrupt)

  computed by whichever sum has fewer terms in that layer. A receiver with every edge in C keeps the
  model's own value (so the full circuit IS the clean run) and one with none takes the corrupt run's
  hook value (so the empty circuit IS the corrupt run): f(100 %) = 1 and f(0 %) = 0 hold exactly.
  A position-aware mask [k, Γ, S, R] (``positions.py``) takes the sums per position group: receiver r at
  position p reads corrupt_r[p] + Σ_{s: (s, r, γ(p)) ∈ C} Δ_s[p].

Both runs take the ungrouped graph (``ungrouped.py``): its k/v receivers are per query head, and every layer's
hook_k/hook_v then returns one value per query head.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from jaxtyping import Bool
from torch import Tensor

from .._foundation.errors import QKCircuitsError
from .graph import INPUT_HOOKS, Graph, logits_input, mlp_input, post_norm, split_qkv_from_residuals
from .inputs import InputParts, closed_form, input_vjp, project
# re-exported for the tests and tools that reach every run through this module
from .record import Key, Record, _buffer, _hooks, _metric_rows, check_graph, clean_rows, record, reuse  # noqa: F401
from .positions import flat_groups, grouped_sum
from .skips import known_attention, known_mlps, skipped
from .ungrouped import expand, per_query_kv

# How patched_run's sums read the senders' Δ rows: "auto" picks, per receiver group, the cheapest of one
# matmul over every sender below ("dense": reads each Δ row once), a copy of only the rows the sums use
# ("gather": those rows read, written and read again) and one matmul per contiguous run of used rows
# ("segments": those rows read once, the output block read and written once per further run), by the rows
# each moves. The others are for tests: every choice gives the same sums.
DELTA_ROWS = "auto"
# An MLP receiver's sum over the senders below its layer's attention rides in that layer's q/k/v matmul (one
# more column instead of one more read of every sender's Δ: measured −4 s of a 76 s SmolLM2 curve). False:
# each MLP reads Δ itself (the same sums in exact arithmetic; tests compare the two). Used in float32/64 only:
# the ride adds and removes a whole residual (part − attn_start + start), two more roundings that bf16 would
# feel (measured: mean error vs float32 8.6e-3 → 1.07e-2 on a tiny GPT-2).
MLP_WITH_QKV = True
# The model's own q/k/v projection of a group that patched_run replaces is not computed, nor an MLP with no edge
# in (its output is the corrupt run's): ``skips.py``, measured on SmolLM2 in docs/benchmarks.md. False: both
# computed (the same values; tests compare the two).
SKIP_PROJECTIONS = True


def grad_run(model, g: Graph, task, tokens: Tensor, on_grad: Callable[[slice, Tensor], None],
             emb_override: Optional[Tensor] = None, out: Optional[Tensor] = None,
             dest: Optional[Callable[[slice], Optional[Tensor]]] = None,
             z_minus: Optional[Dict[Key, Tensor]] = None, extra_hooks: Sequence = (),
             cut_layers: Sequence[int] = ()) -> float:
    """Forward with every receiver reading its own residual copy, one backward of the metric SUM over
    the rows; ``on_grad(receiver slice, grad [n, b, p, d])`` per receiver group. Fills ``out`` (sender
    outputs, detached) when given; without it records none. Returns the metric sum. ``dest(slice)``: where
    the closed-form VJP may write a group's gradient (a caller summing into one buffer spares a copy; the
    tensor handed to ``on_grad`` is then that one), or None. ``z_minus``: another run's hook_z per layer
    (``record``'s): the heads' slots of ``out`` then hold their Δ against that run, (z − z') W_O, not their
    outputs (no post-attention norms).

    Every copy of a layer's residual equals the layer's one residual in this run, so where the q/k/v
    input has a closed form (``inputs.py``: RMSNorm or LayerNorm, checked on the run) the copies are never
    made: the model computes its own hook_q/k/v, the backward hands their gradient [b, p, n, e], and the
    closed-form VJP turns it into each head's ∂m/∂(own copy). Elsewhere (bf16, latent attention, other
    norms) each head reads an expanded copy through ``split_qkv_from_residuals`` and autograd does it.
    The MLP and the logits read a clone of their residual. Holds one forward's autograd graph (no copies
    in it on the closed-form path; [H + 2 G, b, p, d] normed copies per layer otherwise); it grows with
    the shard's tokens and has no cap of its own (docs/benchmarks.md: EAP +10.69 GB for SmolLM2 at 2 × 1,281
    tokens on the closed-form path, +11.8 GB with the copies): mostly the model's own attention scores and
    patterns, kept for the backward.

    ``extra_hooks``: more (hook name, fn) pairs for this forward (EAP-IG on activations replaces one node's
    output by a constant); ``cut_layers``: the layers whose attention output such a hook replaces, so that no
    gradient reaches their q/k/v (their receivers get none, which is then not an error)."""
    stream: Dict[Key, Tensor] = {}
    hooked: List[str] = []              # every closed-form gradient hook registered, and those that fired
    fired: set = set()

    def from_hook_grad(sl: slice, parts: InputParts, xb: Tensor, heads: List[int], name: str):
        def fn(grad: Tensor) -> None:
            fired.add(name)
            on_grad(sl, input_vjp(parts, xb, grad, heads, out=dest(sl) if dest is not None else None))
        return fn

    def splice(x: str, L: int, t: Tensor) -> Optional[Tensor]:
        if x in ("q", "k", "v"):
            heads = g.input_heads(x)             # ungrouped k/v: one receiver per query head, W of its KV head
            n = len(heads)
            wide = g.ungrouped and x != "q"
            base = stream[("attn", L)]
            sl = g.recv_slice(L, x)
            parts = closed_form(model, L, x, base, t) if t.requires_grad else None
            if parts is not None:
                xb = base.detach()
                # a NEW view carries the hook: the bridge reads an unedited hook value (the same object back)
                # from its own pre-hook tensor, so a gradient hook on ``t`` itself would never fire. Ungrouped:
                # the value per query head, whose gradient arrives per query head
                mine = expand(t, g.group) if wide else t.view(t.shape)
                mine.register_hook(from_hook_grad(sl, parts, xb, heads, f"blocks.{L}.{INPUT_HOOKS[x]}"))
                hooked.append(f"blocks.{L}.{INPUT_HOOKS[x]}")
                return mine
            copies = base.unsqueeze(0).expand(n, *base.shape)
            copies.register_hook(lambda grad, sl=sl: on_grad(sl, grad))
            return split_qkv_from_residuals(model, L, x, copies, heads)
        base = stream[("mlp", L)] if x == "mlp" else stream[("final", 0)]
        own = base.clone()
        sl = g.recv_slice(L, "mlp") if x == "mlp" else slice(g.logits_receiver, g.logits_receiver + 1)
        own.register_hook(lambda grad, sl=sl: on_grad(sl, grad.unsqueeze(0)))
        return mlp_input(model, L, own) if x == "mlp" else logits_input(model, own)

    with torch.enable_grad(), per_query_kv(model, g):
        rows = _metric_rows(model, task, tokens, _hooks(model, g, out, stream, splice, None, emb_override, True,
                                                        z_minus=z_minus) + list(extra_hooks))
        total = rows.sum()
        # Gradients of the activations only (the receiver copies' hooks fire on the way to the embedding
        # leaf): ``total.backward()`` would also compute and KEEP a weights-sized ``.grad`` on every
        # parameter, accumulating over calls.
        torch.autograd.grad(total, stream[("attn", 0)])
    # every q/k/v value is on the way to the metric: a hook the backward never reached means the attention did
    # not read the value the hook returned, and those receivers' edges would silently score 0
    cut = {f"blocks.{L}.{INPUT_HOOKS[x]}" for L in cut_layers for x in ("q", "k", "v")}
    missed = [h for h in hooked if h not in fired and h not in cut]
    if missed:
        raise QKCircuitsError(f"the backward never reached this model's {', '.join(missed[:3])}"
                              f"{' …' if len(missed) > 3 else ''} (its attention does not read the value the hook "
                              f"returns); its edge scores cannot be computed this way")
    return float(total.detach())


def plain_run(model, g: Graph, task, tokens: Tensor, out: Tensor, z_minus: Optional[Dict[Key, Tensor]] = None,
              keep: Optional[Dict[Key, Tensor]] = None) -> float:
    """A forward (no grad) of ``tokens`` that fills ``out`` with the sender outputs (with ``z_minus``, the heads'
    slots with their Δ against that run, as ``grad_run``) and ``keep`` with the hook values ``record`` keeps
    (each layer's attention output among them); returns the metric sum. The gradient methods whose points do
    not include the clean run itself (EAP-IG's left and midpoint rules, on activations) take Δ and m(clean)
    from it."""
    stream: Dict[Key, Tensor] = {}
    with torch.no_grad():
        rows = _metric_rows(model, task, tokens, _hooks(model, g, out, stream, None, keep, z_minus=z_minus))
    return float(rows.sum())


def patched_run(model, g: Graph, task, corrupt: Record, mask: Bool[Tensor, "k *G S R"], force_split: bool = False,
                return_logits: bool = False, buffer: Optional[Tensor] = None,
                positions: Optional[Tensor] = None) -> Tensor:
    """Metric of each row of each copy [k, b] with the circuit edges ``mask`` (see the module docstring),
    or the logits [k·b, pos, vocab] (``return_logits``). A position-aware ``mask`` [k, Γ, S, R] needs
    ``positions``, the group of each of the shard's positions [b, pos] (``positions.group_index``).
    ``force_split`` recomputes every receiver's input
    by the formula (no shortcut for all-in / none-in receivers): the test of the formula itself.
    Runs the shard's clean rows (k stacked copies). Holds the sender outputs of this run
    [S, k·b, p, d] next to the corrupt record's: in ``buffer`` when it has that shape (a caller running
    many circuits reuses one, sparing a fresh allocation's page faults per run; every slot is written
    before it is read)."""
    if DELTA_ROWS not in ("auto", "dense", "gather", "segments"):
        raise QKCircuitsError(f"runs.DELTA_ROWS must be 'auto', 'dense', 'gather' or 'segments', got {DELTA_ROWS!r}")
    if not getattr(corrupt, "heads", True):
        raise QKCircuitsError("patched_run needs a corrupt record with the heads' outputs (record(..., heads=True)); "
                              "this one kept only their z")
    k = mask.shape[0]
    b = task.n
    tokens = task.clean.repeat(k, 1)
    out_shape = (g.n_senders, k * b, tokens.shape[1], model.cfg.d_model)
    out = buffer if buffer is not None and tuple(buffer.shape) == out_shape else _buffer(model, g, tokens)
    stream: Dict[Key, Tensor] = {}
    valid = g.valid
    by_group = mask.dim() == 4
    if by_group:
        if positions is None or tuple(positions.shape) != (b, tokens.shape[1]) or mask.shape[1] != g.n_groups:
            raise QKCircuitsError(f"a position-aware mask [k, {g.n_groups} groups, S, R] needs the group of each "
                                  f"position [{b}, {tokens.shape[1]}] (positions.group_index)")
        m4 = (mask & valid[None, None]).to(out.device)
        m, m_all = m4.any(1), m4.all(1)          # an edge in at some group / at every group
        flat = flat_groups(positions.to(out.device), g.n_groups)
    else:
        m = (mask & valid[None]).to(out.device)
        m_all = m
    corr_out = corrupt.out

    converted = [0]                 # out[:converted] already holds Δ_s = out_s(this run) − out_s(corrupt)

    def stacked(t: Tensor) -> Tensor:
        """A corrupt-record tensor for the k stacked copies, READ-only (one copy: the record itself, no copy)."""
        return t if k == 1 else t.repeat(k, *([1] * (t.dim() - 1)))

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
        if by_group:                             # per position group (no MLP ride: ``_mlp_rides``)
            all_in, none_in = m_all[:, :nb][:, :, rs].sum(1) == nb, m[:, :nb][:, :, rs].sum(1) == 0
            start = stacked(corrupt.resid[corr_key]).reshape(k, b * base_stream.shape[1], -1)
            D = deltas(nb).view(nb, k, b * base_stream.shape[1], -1)
            res = grouped_sum(m4[:, :, :nb][..., rs], D, start, flat)
            return res.view(n, *base_stream.shape), all_in, none_in
        cols = rs if mlp is None else torch.cat([rs, torch.tensor([mlp])])
        M = m[:, :nb][:, :, cols]                                                # [k, nb, n (+1)]
        n_in = M[..., :n].sum(1)
        all_in, none_in = n_in == nb, n_in == 0
        # Either form gives every receiver's residual: corrupt + Σ_{s in} Δ_s, or this run's − Σ_{s out} Δ_s;
        # the one with fewer terms costs less where Δ rows are gathered
        add = int(M.sum()) <= int((~M).sum())
        start = stacked(corrupt.resid[corr_key]) if add else base_stream
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
        start = stacked(corrupt.resid[corr_key]) if add else base_stream
        total = start.reshape(-1)
        if part is not None:
            attn_start = stacked(corrupt.resid[("attn", L)]) if add else stream[("attn", L)]
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
        every = n_in if not by_group else m_all[:, :nb][:, :, rs].sum(1)
        return "all" if bool((every == nb).all()) else "none" if not bool(n_in.any()) else None

    def _mlp_rides(L: int) -> Optional[int]:
        """Layer L's MLP receiver when its sum should ride in the q/k/v matmul: it exists and will be
        recomputed."""
        if not g.has_mlp or not MLP_WITH_QKV or by_group or out.dtype not in (torch.float32, torch.float64):
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
        # ungrouped k/v: every layer's attention reads them per query head (``per_query_kv``)
        wide = (lambda v: expand(v, g.group)) if g.ungrouped and x in ("k", "v") else (lambda v: v)
        if x == "mlp" and how is not None:
            mlp_part.pop(sl.start, None)
        if how == "all":
            return None if not g.ungrouped or x not in ("k", "v") else wide(t)
        if how == "none":                                # no edge in: the corrupt run's value, no matmul
            return wide(corrupt.hooks[key].repeat(k, *([1] * (corrupt.hooks[key].dim() - 1))))
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
        real = (L, x) not in skips            # False: ``t`` is the skipped projection's uninitialised output
        if x in ("q", "k", "v"):
            if key not in parts_of:            # the closed form is checked on a run where the model computed it
                parts_of[key] = (closed_form(model, L, x, base, t) if real else
                                 closed_form(model, L, x, corrupt.resid[("attn", L)], corrupt.hooks[key]))
            parts = parts_of[key]
            heads = g.input_heads(x)
            new = (project(parts, resid, heads) if parts is not None                        # [kb, p, n, e]
                   else split_qkv_from_residuals(model, L, x, resid, heads))
        elif x == "mlp":
            new = mlp_input(model, L, resid[0]).unsqueeze(2)
        else:
            new = logits_input(model, resid[0]).unsqueeze(2)
        if force_split:
            return new if x in ("q", "k", "v") else new[:, :, 0]
        # an all-in receiver keeps the model's own value where the model computed it (exact), else the formula's
        own = (wide(t) if real else new) if x in ("q", "k", "v") else t.unsqueeze(2)
        if not bool(all_in.any()) and not bool(none_in.any()):       # every receiver recomputed: no merge
            return new if x in ("q", "k", "v") else new[:, :, 0]
        corr = wide(stacked(corrupt.hooks[key]))
        corr = corr if x in ("q", "k", "v") else corr.unsqueeze(2)
        shape = (k, b) + tuple(own.shape[1:])
        new, own, corr = new.view(shape), own.reshape(shape), corr.reshape(shape)
        # [k, n] flags → broadcast over (b, p, ·, e) with the head axis third from the end
        a = all_in.view(k, 1, 1, -1, 1).to(new.device)
        z = none_in.view(k, 1, 1, -1, 1).to(new.device)
        val = torch.where(a, own, torch.where(z, corr, new)).reshape((k * b,) + tuple(own.shape[2:]))
        return val if x in ("q", "k", "v") else val[:, :, 0]

    def attention_known(L: int) -> Callable[[], Tensor]:
        def value() -> Tensor:
            h0 = g.head_sender(L)
            # the heads' slots hold the corrupt outputs, so their Δ is exactly 0 when first read
            out[h0:h0 + g.n_heads].view(g.n_heads, k, b, *out.shape[2:]).copy_(
                corr_out[h0:h0 + g.n_heads].unsqueeze(1))
            a = corrupt.hooks[("attn_out", L)]
            return a.clone() if k == 1 else stacked(a)
        return value

    # every q/k/v group that ``splice`` replaces (all but the all-in ones) skips the model's own projection
    replaced = [(L, x) for L in range(g.n_layers) for x in ("q", "k", "v")
                if shortcut(torch.arange(g.recv_slice(L, x).start, g.recv_slice(L, x).stop)) != "all"]
    # an MLP with no edge in reads the corrupt run's input, so it gives the corrupt run's output: not run
    # (k copies: stacked when the MLP is reached, so at most one layer's [k·b, p, d] copy exists at a time)
    known = {L: (corr_out[g.mlp_sender(L)] if k == 1 else lambda s=g.mlp_sender(L): stacked(corr_out[s]))
             for L in range(g.n_layers) if g.has_mlp and SKIP_PROJECTIONS
             and shortcut(torch.tensor([g.recv_slice(L, "mlp").start])) == "none"}
    # a layer whose q, k and v all take the corrupt run's values gives the corrupt run's attention output, and its
    # heads the corrupt run's outputs (Δ = 0): not run either (the small circuits' many layers with no edge in)
    known_attn = {L: attention_known(L) for L in range(g.n_layers) if SKIP_PROJECTIONS and not force_split
                  and ("attn_out", L) in corrupt.hooks
                  and all(shortcut(torch.arange(g.recv_slice(L, x).start, g.recv_slice(L, x).stop)) == "none"
                          for x in ("q", "k", "v"))}
    with torch.no_grad(), skipped(model, replaced if SKIP_PROJECTIONS else []) as skips, known_mlps(model, known), \
            known_attention(model, known_attn), per_query_kv(model, g):
        hooks = _hooks(model, g, out, stream, splice, None)
        if return_logits:
            return model.run_with_hooks(tokens, fwd_hooks=hooks)
        rows = _metric_rows(model, task, tokens, hooks, copies=k)
    return rows.view(k, b)


def _check_z(z: Tensor, g: Graph, layer: int) -> None:
    """node_run patches z[:, :, heads]: the hook value must be [b, p, H, e] (a flat or head-major layout would
    patch features or positions instead, silently)."""
    if z.dim() != 4 or z.shape[2] != g.n_heads:
        raise QKCircuitsError(f"blocks.{layer}.attn.hook_z is {tuple(z.shape)}, not [batch, pos, {g.n_heads} heads, "
                              f"d_head]: the node view cannot patch heads of this model this way")


def z_patchable(model, g: Graph) -> bool:
    """Whether ``node_run`` applies: every head's output is z_h W_O[h], a function of its own z (no block has a
    post-attention norm, whose rms mixes the layer's heads)."""
    return all(post_norm(model, L) is None for L in range(g.n_layers))


def node_run(model, g: Graph, task, corrupt: Record, heads_out: Sequence[Tuple[int, int]],
             where: Optional[Dict[Tuple[int, int], Tensor]] = None) -> Optional[Tensor]:
    """The metric per row [b] when every head in ``heads_out`` ((layer, head) pairs) gives its corrupt-run
    output to every reader and everything else is this run's: ``patched_run`` with ``circuit.node_mask``'s
    mask, as ONE plain forward of the clean rows whose hook_z takes the corrupt record's z for those heads.
    ``where[(layer, head)]``: a bool [b, pos] of the positions at which that head gives its corrupt output
    (a position-aware node view: its output elsewhere stays this run's); absent: every position.

    The same thing, not an estimate: a head's output is z_h W_O[h] (graph.py), a function of its z alone, so
    with z_h patched every reader reads its corrupt output; every receiver reads the same residual
    (no per-receiver sums, no per-head projections). Holds no sender outputs. Returns None where the graph's
    head output is NOT a function of z alone (Gemma's post-attention norm divides by the rms of the whole
    layer's output, so a head's share depends on the others): the caller uses ``patched_run`` there."""
    if not z_patchable(model, g):
        return None
    if any(("z", L) not in corrupt.hooks for L in range(g.n_layers)):
        raise QKCircuitsError("the corrupt record holds no hook_z values; record it with runs.record")
    by_layer: Dict[int, List[int]] = {}
    for L, h in heads_out:
        by_layer.setdefault(int(L), []).append(int(h))

    def patch(L: int, heads: List[int]):
        idx = torch.tensor(sorted(set(heads)))

        def fn(z: Tensor, hook) -> Tensor:
            _check_z(z, g, L)
            z = z.clone()
            corr = corrupt.hooks[("z", L)].to(z.dtype)
            if where is None:
                z[:, :, idx] = corr[:, :, idx]
                return z
            for h in idx.tolist():
                at = where.get((L, h))
                z[:, :, h] = corr[:, :, h] if at is None else torch.where(at.to(z.device)[..., None], corr[:, :, h],
                                                                          z[:, :, h])
            return z
        return fn

    hooks = [(f"blocks.{L}.attn.hook_z", patch(L, hs)) for L, hs in by_layer.items()]
    with torch.no_grad():
        return _metric_rows(model, task, task.clean, hooks)


def z_record(model, g: Graph, task, tokens: Tensor) -> Record:
    """What ``node_run`` reads of a corrupt run, alone: each layer's hook_z [b, p, H, e] and the metric per row
    (a plain forward; no sender outputs, so none of ``record``'s [S, b, p, d] buffer)."""
    keep: Dict[Key, Tensor] = {}

    def grab(L: int):
        def fn(z: Tensor, hook) -> None:
            _check_z(z, g, L)
            keep[("z", L)] = z.detach()
        return fn

    with torch.no_grad():
        rows = _metric_rows(model, task, tokens, [(f"blocks.{L}.attn.hook_z", grab(L)) for L in range(g.n_layers)])
    return Record(torch.empty(0), keep, {}, rows.detach())
