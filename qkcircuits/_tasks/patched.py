"""The circuit forward: ``patched_run`` (one prompt shard, k circuits stacked), a ``PatchedRun`` whose way of
computing its sums is a ``Strategy`` argument.

``mask[k, S, R]`` (k stacked copies of the shard) says which edges are in the circuit; receiver r of copy c reads

    Σ_{s ∈ C} out_s(this run) + Σ_{s ∉ C} out_s(corrupt run) + biases
      = corrupt_resid_r + Σ_{s∈C} Δ_s = stream_r − Σ_{s∉C} Δ_s,     Δ_s = out_s(this run) − out_s(corrupt)

computed by whichever sum has fewer terms in that layer. A receiver with every edge in C keeps the
model's own value (so the full circuit IS the clean run) and one with none takes the corrupt run's
hook value (so the empty circuit IS the corrupt run): f(100 %) = 1 and f(0 %) = 0 hold exactly.
A position-aware mask [k, Γ, S, R] (``positions.py``) takes the sums per position group: receiver r at
position p reads corrupt_r[p] + Σ_{s: (s, r, γ(p)) ∈ C} Δ_s[p].

The run takes the ungrouped graph too (``ungrouped.py``): its k/v receivers are per query head, and every layer's
hook_k/hook_v then returns one value per query head. Every ``Strategy`` gives the same sums (tests compare them);
the default is the fastest measured (docs/benchmarks.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
from jaxtyping import Bool
from torch import Tensor

from .._foundation.errors import QKCircuitsError
from .._foundation.inputs import InputParts, closed_form, project
from .graph import Graph, logits_input, mlp_input, split_qkv_from_residuals
from .positions import flat_groups, grouped_sum
from .record import Key, Record, _buffer, _hooks, _metric_rows
from .skips import known_attention, known_mlps, skipped
from .ungrouped import expand, per_query_kv

DELTA_ROWS = ("auto", "dense", "gather", "segments")


@dataclass(frozen=True)
class Strategy:
    """How ``patched_run`` computes its sums; every choice gives the same sums (to rounding).

    - ``delta_rows``: how the sums read the senders' Δ rows. ``"auto"`` picks, per receiver group, the cheapest
      of one matmul over every sender below (``"dense"``: reads each Δ row once), a copy of only the rows the sums
      use (``"gather"``: those rows read, written and read again) and one matmul per contiguous run of used rows
      (``"segments"``: those rows read once, the output block read and written once per further run), by the
      rows each moves.
    - ``mlp_with_qkv``: an MLP receiver's sum over the senders below its layer's attention rides in that layer's
      q/k/v matmul (one more column instead of one more read of every sender's Δ: measured −4 s of a 76 s
      SmolLM2 curve). False: each MLP reads Δ itself. Used in float32/64 only: the ride adds and removes a whole
      residual (part − attn_start + start), two more roundings that bf16 would feel (measured: mean error vs
      float32 8.6e-3 → 1.07e-2 on a tiny GPT-2).
    - ``skip_projections``: the model's own q/k/v projection of a group the run replaces is not computed, nor an
      MLP with no edge in (its output is the corrupt run's), nor an attention layer whose q, k and v all take
      the corrupt run's values (``skips.py``, measured on SmolLM2 in docs/benchmarks.md). False: all computed.

    >>> Strategy(delta_rows="gather").delta_rows
    'gather'
    """

    delta_rows: str = "auto"
    mlp_with_qkv: bool = True
    skip_projections: bool = True

    def __post_init__(self) -> None:
        if self.delta_rows not in DELTA_ROWS:
            raise QKCircuitsError(f"delta_rows must be 'auto', 'dense', 'gather' or 'segments', got "
                                  f"{self.delta_rows!r}")


FASTEST = Strategy()


def patched_run(model, g: Graph, task, corrupt: Record, mask: Bool[Tensor, "k *G S R"], force_split: bool = False,
                return_logits: bool = False, buffer: Optional[Tensor] = None,
                positions: Optional[Tensor] = None, strategy: Strategy = FASTEST) -> Tensor:
    """Metric of each row of each copy [k, b] with the circuit edges ``mask`` (see the module docstring),
    or the logits [k·b, pos, vocab] (``return_logits``). A position-aware ``mask`` [k, Γ, S, R] needs
    ``positions``, the group of each of the shard's positions [b, pos] (``positions.group_index``).
    ``force_split`` recomputes every receiver's input
    by the formula (no shortcut for all-in / none-in receivers): the test of the formula itself.
    Runs the shard's clean rows (k stacked copies). Holds the sender outputs of this run
    [S, k·b, p, d] next to the corrupt record's: in ``buffer`` when it has that shape (a caller running
    many circuits reuses one, sparing a fresh allocation's page faults per run; every slot is written
    before it is read)."""
    return PatchedRun(model, g, task, corrupt, mask, force_split=force_split, buffer=buffer, positions=positions,
                      strategy=strategy).run(return_logits)


class PatchedRun:
    """One circuit forward's state: the masks, the sender outputs ``out`` (converted in place to Δ as the
    receivers first read them), the q/k/v sums of the layer being run, the MLP sums riding in them."""

    def __init__(self, model, g: Graph, task, corrupt: Record, mask: Tensor, *, force_split: bool = False,
                 buffer: Optional[Tensor] = None, positions: Optional[Tensor] = None,
                 strategy: Strategy = FASTEST) -> None:
        if not getattr(corrupt, "heads", True):
            raise QKCircuitsError("patched_run needs a corrupt record with the heads' outputs (record(..., "
                                  "heads=True)); this one kept only their z")
        self.model, self.g, self.task, self.corrupt = model, g, task, corrupt
        self.force_split, self.strategy = force_split, strategy
        self.k = k = mask.shape[0]
        self.b = b = task.n
        self.tokens = tokens = task.clean.repeat(k, 1)
        out_shape = (g.n_senders, k * b, tokens.shape[1], model.cfg.d_model)
        self.out = out = buffer if buffer is not None and tuple(buffer.shape) == out_shape else _buffer(model, g, tokens)
        self.stream: Dict[Key, Tensor] = {}
        valid = g.valid
        self.by_group = mask.dim() == 4
        if self.by_group:
            if positions is None or tuple(positions.shape) != (b, tokens.shape[1]) or mask.shape[1] != g.n_groups:
                raise QKCircuitsError(f"a position-aware mask [k, {g.n_groups} groups, S, R] needs the group of "
                                      f"each position [{b}, {tokens.shape[1]}] (positions.group_index)")
            self.m4 = (mask & valid[None, None]).to(out.device)
            self.m, self.m_all = self.m4.any(1), self.m4.all(1)       # an edge in at some group / at every group
            self.flat = flat_groups(positions.to(out.device), g.n_groups)
        else:
            self.m = (mask & valid[None]).to(out.device)
            self.m_all = self.m
        self.corr_out = corrupt.out
        self.converted = 0           # out[:converted] already holds Δ_s = out_s(this run) − out_s(corrupt)
        self.layer_cache: Dict[int, Tuple[Tensor, Tensor, Tensor]] = {}
        self.mlp_part: Dict[int, Tuple[bool, Optional[Tensor]]] = {}   # MLP receiver → (add form, its sum below
        self.parts_of: Dict[Key, Optional[InputParts]] = {}             # the attention)
        self.skips: set = set()

    # ------------------------------------------------------------------------------------------ the forward
    def run(self, return_logits: bool = False) -> Tensor:
        g, model, corrupt, k, skip = self.g, self.model, self.corrupt, self.k, self.strategy.skip_projections
        # every q/k/v group that ``splice`` replaces (all but the all-in ones) skips the model's own projection
        replaced = [(L, x) for L in range(g.n_layers) for x in ("q", "k", "v")
                    if self.shortcut(self._receivers(L, x)) != "all"]
        # an MLP with no edge in reads the corrupt run's input, so it gives the corrupt run's output: not run
        # (k copies: stacked when the MLP is reached, so at most one layer's [k·b, p, d] copy exists at a time)
        known = {L: (self.corr_out[g.mlp_sender(L)] if k == 1
                     else lambda s=g.mlp_sender(L): self.stacked(self.corr_out[s]))
                 for L in range(g.n_layers) if g.has_mlp and skip
                 and self.shortcut(torch.tensor([g.recv_slice(L, "mlp").start])) == "none"}
        # a layer whose q, k and v all take the corrupt run's values gives the corrupt run's attention output, and
        # its heads the corrupt run's outputs (Δ = 0): not run either (the small circuits' many layers with no
        # edge in)
        known_attn = {L: self.attention_known(L) for L in range(g.n_layers) if skip and not self.force_split
                      and ("attn_out", L) in corrupt.hooks
                      and all(self.shortcut(self._receivers(L, x)) == "none" for x in ("q", "k", "v"))}
        with torch.no_grad(), skipped(model, replaced if skip else []) as skips, known_mlps(model, known), \
                known_attention(model, known_attn), per_query_kv(model, g):
            self.skips = skips
            hooks = _hooks(model, g, self.out, self.stream, self.splice, None)
            if return_logits:
                return model.run_with_hooks(self.tokens, fwd_hooks=hooks)
            rows = _metric_rows(model, self.task, self.tokens, hooks, copies=k)
        return rows.view(k, self.b)

    def _receivers(self, L: int, x: str) -> Tensor:
        sl = self.g.recv_slice(L, x)
        return torch.arange(sl.start, sl.stop)

    def stacked(self, t: Tensor) -> Tensor:
        """A corrupt-record tensor for the k stacked copies, READ-only (one copy: the record itself, no copy)."""
        return t if self.k == 1 else t.repeat(self.k, *([1] * (t.dim() - 1)))

    # ------------------------------------------------------------------------------------------ the sums
    def deltas(self, nb: int) -> Tensor:
        """Δ of senders 0 … nb−1 as [nb, k, b·p·d], each sender converted once, in place, when first read
        (every sender below a receiver has been computed by the time the receiver reads)."""
        out, c0 = self.out, self.converted
        if c0 < nb:
            out[c0:nb].view(nb - c0, self.k, self.b, *out.shape[2:]).sub_(self.corr_out[c0:nb].unsqueeze(1))
            self.converted = nb
        return out[:nb].view(nb, self.k, -1)

    def mixed(self, pieces: List[Tuple[Tensor, Tensor]], start: Tensor, sign: float) -> Tensor:
        """start + sign · Σ_pieces Σ_s W[k, s, n] Δ_s as [n, k·x]: the first piece in one addmm from ``start``
        (no separate add pass), each further one added in place."""
        k, res = self.k, None
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

    def gathered(self, W: Tensor, lo: int, hi: int) -> List[Tuple[Tensor, Tensor]]:
        """(W, Δ) pieces over the senders lo … hi−1 that appear in a term (``Strategy.delta_rows``); [] when none
        do. The matmuls are bound by reading Δ ((hi − lo) × k·b·p·d), so small circuits, or circuits that leave
        few edges out, read only the rows their sums use."""
        used = W.any(-1).any(0)                                                  # [hi − lo]
        D = self.deltas(hi)[lo:]                                                 # [hi − lo, k, x]
        idx = used.nonzero().squeeze(1)
        n_used, n_out = len(idx), W.shape[-1]               # the output block is n_out Δ rows
        if not n_used:
            return []
        runs_at = [0] + ((idx[1:] - idx[:-1]) != 1).nonzero().squeeze(1).add(1).tolist() + [n_used]
        segs = [(int(idx[a]), int(idx[b - 1]) + 1) for a, b in zip(runs_at[:-1], runs_at[1:])]
        cost = {"dense": hi - lo, "gather": 3 * n_used, "segments": n_used + 2 * n_out * (len(segs) - 1)}
        how = min(cost, key=cost.get) if self.strategy.delta_rows == "auto" else self.strategy.delta_rows
        if how == "dense":
            return [(W, D)]
        if how == "gather":
            return [(W[:, idx], D[idx])]
        return [(W[:, a:b], D[a:b]) for a, b in segs]

    def resid_for(self, rs: Tensor, base_stream: Tensor, corr_key: Key, mlp: Optional[int] = None
                  ) -> Tuple[Tensor, Tensor, Tensor]:
        """resid [n, k·b, p, d] for receivers ``rs`` (same senders below), and each (copy, receiver)'s
        all-in / none-in flags. One matmul reads the senders' Δ once for all of ``rs``. ``mlp``: the same
        layer's MLP receiver, whose sum over these senders rides in the same matmul (one more column, not
        one more read of Δ) and is kept for it in ``mlp_part``."""
        g, k, b, m, corrupt = self.g, self.k, self.b, self.m, self.corrupt
        nb = g.n_below(int(rs[0]))
        n = len(rs)
        if self.by_group:                        # per position group (no MLP ride: ``_mlp_rides``)
            all_in, none_in = self.m_all[:, :nb][:, :, rs].sum(1) == nb, m[:, :nb][:, :, rs].sum(1) == 0
            start = self.stacked(corrupt.resid[corr_key]).reshape(k, b * base_stream.shape[1], -1)
            D = self.deltas(nb).view(nb, k, b * base_stream.shape[1], -1)
            res = grouped_sum(self.m4[:, :, :nb][..., rs], D, start, self.flat)
            return res.view(n, *base_stream.shape), all_in, none_in
        cols = rs if mlp is None else torch.cat([rs, torch.tensor([mlp])])
        M = m[:, :nb][:, :, cols]                                                # [k, nb, n (+1)]
        n_in = M[..., :n].sum(1)
        all_in, none_in = n_in == nb, n_in == 0
        # Either form gives every receiver's residual: corrupt + Σ_{s in} Δ_s, or this run's − Σ_{s out} Δ_s;
        # the one with fewer terms costs less where Δ rows are gathered
        add = int(M.sum()) <= int((~M).sum())
        start = self.stacked(corrupt.resid[corr_key]) if add else base_stream
        pieces = self.gathered(M if add else ~M, 0, nb)
        if not pieces:                                           # no term: every receiver reads ``start``
            if mlp is not None:
                self.mlp_part[mlp] = (add, None)
            return start.unsqueeze(0).expand(n, *base_stream.shape), all_in, none_in
        res = self.mixed(pieces, start, 1.0 if add else -1.0)                    # [n (+1), k·b·p·d]
        if mlp is not None:
            self.mlp_part[mlp] = (add, res[n])
            res = res[:n]
        return res.view(n, *base_stream.shape), all_in, none_in

    def mlp_resid(self, r: int, L: int, base_stream: Tensor, corr_key: Key) -> Tuple[Tensor, Tensor, Tensor]:
        """MLP receiver ``r``'s resid [1, k·b, p, d] when its layer's q/k/v matmul already summed the senders
        below the attention (``mlp_part``, in that matmul's form and from its start): the start is swapped
        for the MLP's own and only the layer's heads (the senders between) are added here."""
        g, corrupt = self.g, self.corrupt
        add, part = self.mlp_part.pop(r)
        lo, nb = g.n_below(g.recv_slice(L, "q").start), g.n_below(r)
        M = self.m[:, :nb][:, :, [r]]                                            # [k, nb, 1]
        n_in = M.sum(1)
        all_in, none_in = n_in == nb, n_in == 0
        start = self.stacked(corrupt.resid[corr_key]) if add else base_stream
        total = start.reshape(-1)
        if part is not None:
            attn_start = self.stacked(corrupt.resid[("attn", L)]) if add else self.stream[("attn", L)]
            total = part - attn_start.reshape(-1) + total
        pieces = self.gathered((M if add else ~M)[:, lo:], lo, nb)
        if pieces:
            total = self.mixed(pieces, total, 1.0 if add else -1.0)[0]
        return total.view(1, *base_stream.shape), all_in, none_in

    # ------------------------------------------------------------------------------------------ the receivers
    def shortcut(self, rs: Tensor) -> Optional[str]:
        """"all" when every copy has every edge into receivers ``rs`` (they read this run's own value), "none"
        when no copy has any (the corrupt run's value), else None: recomputed. ``force_split``: always None."""
        nb = self.g.n_below(int(rs[0]))
        n_in = self.m[:, :nb][:, :, rs].sum(1)                                    # [k, n]
        if self.force_split:
            return None
        every = n_in if not self.by_group else self.m_all[:, :nb][:, :, rs].sum(1)
        return "all" if bool((every == nb).all()) else "none" if not bool(n_in.any()) else None

    def _mlp_rides(self, L: int) -> Optional[int]:
        """Layer L's MLP receiver when its sum should ride in the q/k/v matmul: it exists and will be
        recomputed."""
        g = self.g
        if (not g.has_mlp or not self.strategy.mlp_with_qkv or self.by_group
                or self.out.dtype not in (torch.float32, torch.float64)):
            return None
        r = g.recv_slice(L, "mlp").start
        return r if self.shortcut(torch.tensor([r])) is None else None

    def splice(self, x: str, L: int, t: Tensor) -> Optional[Tensor]:
        """The hook value of receiver group ``x`` of layer ``L`` (``t``: the model's own)."""
        g, k, b, corrupt, stream = self.g, self.k, self.b, self.corrupt, self.stream
        if x in ("q", "k", "v"):
            sl = g.recv_slice(L, x)
            base, key, corr_key = stream[("attn", L)], (x, L), ("attn", L)
        elif x == "mlp":
            sl, base, key, corr_key = g.recv_slice(L, "mlp"), stream[("mlp", L)], ("mlp", L), ("mlp", L)
        else:
            sl = slice(g.logits_receiver, g.logits_receiver + 1)
            base, key, corr_key = stream[("final", 0)], ("logits", 0), ("final", 0)
        rs = torch.arange(sl.start, sl.stop)
        how = self.shortcut(rs)
        # ungrouped k/v: every layer's attention reads them per query head (``per_query_kv``)
        wide = (lambda v: expand(v, g.group)) if g.ungrouped and x in ("k", "v") else (lambda v: v)
        if x == "mlp" and how is not None:
            self.mlp_part.pop(sl.start, None)
        if how == "all":
            return None if not g.ungrouped or x not in ("k", "v") else wide(t)
        if how == "none":                                # no edge in: the corrupt run's value, no matmul
            return wide(corrupt.hooks[key].repeat(k, *([1] * (corrupt.hooks[key].dim() - 1))))
        if x in ("q", "k", "v"):
            # q, k and v of a layer read the same senders: their inputs come from one matmul, at hook_q
            if L not in self.layer_cache:
                q0, v1 = g.recv_slice(L, "q").start, g.recv_slice(L, "v").stop
                self.layer_cache.clear()
                self.layer_cache[L] = self.resid_for(torch.arange(q0, v1), base, corr_key, mlp=self._mlp_rides(L))
            res_all, a_all, z_all = self.layer_cache[L]
            o0, o1 = sl.start - g.recv_slice(L, "q").start, sl.stop - g.recv_slice(L, "q").start
            resid, all_in, none_in = res_all[o0:o1], a_all[:, o0:o1], z_all[:, o0:o1]
        elif x == "mlp" and sl.start in self.mlp_part:
            resid, all_in, none_in = self.mlp_resid(sl.start, L, base, corr_key)
        else:
            resid, all_in, none_in = self.resid_for(rs, base, corr_key)
        real = (L, x) not in self.skips       # False: ``t`` is the skipped projection's uninitialised output
        if x in ("q", "k", "v"):
            if key not in self.parts_of:       # the closed form is checked on a run where the model computed it
                self.parts_of[key] = (closed_form(self.model, L, x, base, t) if real else
                                      closed_form(self.model, L, x, corrupt.resid[("attn", L)], corrupt.hooks[key]))
            parts = self.parts_of[key]
            heads = g.input_heads(x)
            new = (project(parts, resid, heads) if parts is not None                        # [kb, p, n, e]
                   else split_qkv_from_residuals(self.model, L, x, resid, heads))
        elif x == "mlp":
            new = mlp_input(self.model, L, resid[0]).unsqueeze(2)
        else:
            new = logits_input(self.model, resid[0]).unsqueeze(2)
        if self.force_split:
            return new if x in ("q", "k", "v") else new[:, :, 0]
        # an all-in receiver keeps the model's own value where the model computed it (exact), else the formula's
        own = (wide(t) if real else new) if x in ("q", "k", "v") else t.unsqueeze(2)
        if not bool(all_in.any()) and not bool(none_in.any()):       # every receiver recomputed: no merge
            return new if x in ("q", "k", "v") else new[:, :, 0]
        corr = wide(self.stacked(corrupt.hooks[key]))
        corr = corr if x in ("q", "k", "v") else corr.unsqueeze(2)
        shape = (k, b) + tuple(own.shape[1:])
        new, own, corr = new.view(shape), own.reshape(shape), corr.reshape(shape)
        # [k, n] flags → broadcast over (b, p, ·, e) with the head axis third from the end
        a = all_in.view(k, 1, 1, -1, 1).to(new.device)
        z = none_in.view(k, 1, 1, -1, 1).to(new.device)
        val = torch.where(a, own, torch.where(z, corr, new)).reshape((k * b,) + tuple(own.shape[2:]))
        return val if x in ("q", "k", "v") else val[:, :, 0]

    def attention_known(self, L: int) -> Callable[[], Tensor]:
        """Layer ``L``'s attention output when none of its q/k/v has an edge in: the corrupt run's."""
        def value() -> Tensor:
            g, out, k, b = self.g, self.out, self.k, self.b
            h0 = g.head_sender(L)
            # the heads' slots hold the corrupt outputs, so their Δ is exactly 0 when first read
            out[h0:h0 + g.n_heads].view(g.n_heads, k, b, *out.shape[2:]).copy_(
                self.corr_out[h0:h0 + g.n_heads].unsqueeze(1))
            a = self.corrupt.hooks[("attn_out", L)]
            return a.clone() if k == 1 else self.stacked(a)
        return value
