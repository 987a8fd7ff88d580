"""Node views, measured many at a time: the metric of each prompt row when only a SET of heads and MLPs keeps its
output and every other one gives its corrupt-run output (``NodeViews``).

>>> task = qk.tasks.induction(model, n=8, seg_len=6)
>>> views = NodeViews(model, task)
>>> m = views.sets([(("0.0", "1.0"), None), (("1.0",), None), ((), None)])     # [3 sets, 8 rows]
>>> m.shape, bool(torch.allclose(m[0], views.clean_rows())), bool(torch.allclose(m[2], views.corrupt_rows()))
(torch.Size([3, 8]), True, True)

A set is ``(heads kept, MLPs kept)`` (``"L.H"`` and ``"mlpL"`` names; MLPs ``None``: every MLP clean). Where a head's
output is z_h W_O[h] (no post-attention norm), a node view is ONE plain forward of the clean rows whose hook_z takes
the corrupt run's z for the left-out heads and whose hook_mlp_out takes the corrupt run's MLP output for the
left-out MLPs (``runs.node_run``, the same metric as the edge-level patched run: tested). Here:

- **stacked**: k sets run as k copies of the rows in one forward (each copy its own mask per layer), up to
  ``STACK_ROWS`` rows a forward;
- **skipped**: a layer whose heads are ALL left out in every copy returns the corrupt run's attention output
  without computing it, and an MLP left out in every copy its corrupt output (``skips.known_attention`` /
  ``known_mlps``): a small set costs a fraction of a forward;
- **per row**: every result is the metric of each row ([k, n]), so a bootstrap over prompts needs no model run;
- **attribution** (``attribute``): one forward and one backward at a set give the metric per row and, for every
  kept node n, a_n = mean over rows of ∂m/∂out_n · (out_n − out_n(corrupt)), the linear estimate of what the
  metric's mean loses when n is left out too (EAP at that set: exact for one node where m is linear in its
  output).

The corrupt record (z, MLP and attention outputs of every layer) is made once per prompt shard and held across
calls when the rows fit one shard (``NODE_BYTES``); the clean rows are run once. Where the model has
post-attention norms (Gemma-2/3: a head's share of the layer output depends on the others), a node view is the
patched run of its edge mask (``patched_run``), stacked the same way, and ``attribute`` is not available (None).
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .graph import Graph, graph
from .patched import patched_run
from .record import Record, _metric_rows, clean_rows, record
from .runs import _check_z, z_patchable
from .skips import known_attention, known_mlps
from .task import Task, with_reference

# the node view's corrupt record holds z, the MLP and the attention outputs ([b, p, H·d_head + 2 d_model] per
# layer): its shards are sized to this, and kept across calls when there is one shard
NODE_BYTES = 2**30
# rows of one stacked forward (k copies × the shard's rows): big enough that the per-forward overhead vanishes,
# small enough that one layer's activations stay in cache-friendly sizes on a CPU
STACK_ROWS = 256
NodeSet = Tuple[Tuple[str, ...], Optional[Tuple[str, ...]]]       # (heads kept, MLPs kept or None: all clean)


def is_head(name: str) -> bool:
    return name[:1].isdigit()


def head_key(h: str) -> Tuple[int, int]:
    L, i = h.split(".")
    return int(L), int(i)


def node_mask_of(g: Graph, heads: Sequence[str], mlps: Optional[Sequence[str]]) -> Tensor:
    """Every edge of the graph except those leaving a head not in ``heads`` or (``mlps`` given) an MLP not in
    ``mlps``: the edge-level form of the node view (the embedding always sends)."""
    keep = set(heads) | (set(mlps) if mlps is not None else {n for n in g.senders if n.startswith("mlp")})
    out = torch.tensor([s == "emb" or s in keep for s in g.senders])
    return g.valid & out[:, None]


def node_rows(model, g: Graph, task: Task) -> int:
    """Rows per shard for the node view's corrupt record (z, MLP and attention outputs of every layer) in
    ``NODE_BYTES``."""
    elt = model.W_E.element_size()
    per_row = task.clean.shape[1] * g.n_layers * (model.cfg.n_heads * model.cfg.d_head + 2 * model.cfg.d_model) * elt
    return max(1, min(task.n, NODE_BYTES // max(per_row, 1)))


def left_out(g: Graph, sets: Sequence[NodeSet]) -> Tuple[Tensor, Tensor]:
    """Per set, which heads [k, layers, heads] and which MLPs [k, layers] give their corrupt output (True)."""
    heads = torch.ones(len(sets), g.n_layers, g.n_heads, dtype=torch.bool)
    mlps = torch.zeros(len(sets), g.n_layers, dtype=torch.bool)
    for i, (kept, kept_mlps) in enumerate(sets):
        for h in kept:
            L, j = head_key(h)
            heads[i, L, j] = False
        if kept_mlps is not None and g.has_mlp:
            mlps[i] = True
            for m in kept_mlps:
                mlps[i, int(m[3:])] = False
    return heads, mlps


class NodeViews:
    """Node views of one model on one task's rows (module docstring): ``sets(sets)`` → the metric per row of each
    set [k, n]; ``attribute(set)`` → (its metric per row [n], {kept node: a_n}); ``clean_rows()`` /
    ``corrupt_rows()`` [n]. ``forwards`` counts the work done in units of one plain forward of the rows (a
    stacked forward of k copies counts k; a backward counts 2). Holds the corrupt record of one shard."""

    def __init__(self, model, task: Task, rows_per_shard: Optional[int] = None):
        from .row_budget import shard_rows

        self.model, self.g = model, graph(model)
        self.task = with_reference(model, task.to(model.W_E.device))
        self.fast = z_patchable(model, self.g)
        self.rows = rows_per_shard or (node_rows(model, self.g, self.task) if self.fast
                                       else shard_rows(model, self.g, self.task, buffers=3))
        self.shards = self.task.shards(self.rows)
        self.keep: Optional[Dict[int, Record]] = {} if len(self.shards) == 1 else None
        self._clean: Optional[Tensor] = None
        self._corrupt: Dict[int, Tensor] = {}         # shard index → m(corrupt) of its rows
        self.sets_measured = 0
        self.forwards = 0.0

    @property
    def n(self) -> int:
        return self.task.n

    # ------------------------------------------------------------------------------------------ records

    def _record(self, j: int, shard: Task) -> Record:
        if self.keep is not None and j in self.keep:
            return self.keep[j]
        rec = self._z_record(shard) if self.fast else record(self.model, self.g, shard, shard.corrupt)
        self.forwards += shard.n / self.n
        self._corrupt.setdefault(j, rec.rows.detach().double().cpu())
        if self.keep is not None:
            self.keep[j] = rec
        return rec

    def _z_record(self, shard: Task) -> Record:
        """z [b, p, H, e], the MLP output and the attention output [b, p, d] of every layer, and the metric per row."""
        keep: Dict[Tuple[str, int], Tensor] = {}
        g = self.g

        def grab(key: Tuple[str, int], check: bool = False):
            def fn(t: Tensor, hook) -> None:
                if check:
                    _check_z(t, g, key[1])
                keep[key] = t.detach()
            return fn

        hooks = [(f"blocks.{L}.attn.hook_z", grab(("z", L), True)) for L in range(g.n_layers)]
        hooks += [(f"blocks.{L}.attn.hook_out", grab(("attn_out", L))) for L in range(g.n_layers)]
        if g.has_mlp:
            hooks += [(f"blocks.{L}.hook_mlp_out", grab(("mlp_out", L))) for L in range(g.n_layers)]
        with torch.no_grad():
            rows = _metric_rows(self.model, shard, shard.corrupt, hooks)
        return Record(torch.empty(0), keep, {}, rows.detach(), heads=False)

    def corrupt_rows(self) -> Tensor:
        """m(corrupt) of each row [n] (float64)."""
        for j, shard in enumerate(self.shards):
            if j not in self._corrupt:
                self._record(j, shard)
        return torch.cat([self._corrupt[j] for j in range(len(self.shards))])

    def clean_rows(self) -> Tensor:
        """m(clean) of each row [n] (float64): one plain forward of the clean rows, once."""
        if self._clean is None:
            self._clean = torch.cat([clean_rows(self.model, s).detach().double().cpu() for s in self.shards])
            self.forwards += 1.0
        return self._clean

    def _records(self):
        for j, shard in enumerate(self.shards):
            yield shard, self._record(j, shard)

    # ------------------------------------------------------------------------------------------ measuring

    def sets(self, sets: Sequence[NodeSet]) -> Tensor:
        """The metric of each row for each set [k, n] (float64): stacked copies, skipped layers (module docstring)."""
        sets = list(sets)
        if not sets:
            return torch.zeros(0, self.n, dtype=torch.float64)
        parts = []
        for shard, rec in self._records():
            per = max(1, STACK_ROWS // shard.n)
            cols = []
            for i in range(0, len(sets), per):
                chunk = sets[i:i + per]
                rows = self._stacked(shard, rec, chunk) if self.fast else self._patched(shard, rec, chunk)
                cols.append(rows.detach().double().cpu())
            parts.append(torch.cat(cols, 0))
        self.sets_measured += len(sets)
        return torch.cat(parts, 1)

    def _stacked(self, shard: Task, rec: Record, chunk: Sequence[NodeSet]) -> Tensor:
        g, k, b = self.g, len(chunk), shard.n
        heads_out, mlps_out = left_out(g, chunk)
        all_attn = heads_out.all(0).all(-1)                 # [layers]: every head of the layer out in every copy
        all_mlp = mlps_out.all(0) if g.has_mlp else torch.zeros(g.n_layers, dtype=torch.bool)

        def stacked(t: Tensor) -> Tensor:
            return t if k == 1 else t.repeat((k,) + (1,) * (t.dim() - 1))

        def patch_z(L: int):
            mask = heads_out[:, L].repeat_interleave(b, 0)[:, None, :, None]       # [k·b, 1, H, 1]

            def fn(z: Tensor, hook) -> Tensor:
                _check_z(z, g, L)
                return torch.where(mask.to(z.device), stacked(rec.hooks[("z", L)]).to(z.dtype), z)
            return fn

        def patch_mlp(L: int):
            mask = mlps_out[:, L].repeat_interleave(b, 0)[:, None, None]          # [k·b, 1, 1]

            def fn(t: Tensor, hook) -> Tensor:
                return torch.where(mask.to(t.device), stacked(rec.hooks[("mlp_out", L)]).to(t.dtype), t)
            return fn

        hooks = [(f"blocks.{L}.attn.hook_z", patch_z(L)) for L in range(g.n_layers)
                 if bool(heads_out[:, L].any()) and not bool(all_attn[L])]
        hooks += [(f"blocks.{L}.hook_mlp_out", patch_mlp(L)) for L in range(g.n_layers) if bool(mlps_out[:, L].any())]
        known_a = {L: (lambda L=L: stacked(rec.hooks[("attn_out", L)]).clone()) for L in range(g.n_layers)
                   if bool(all_attn[L])}
        known_m = {L: (lambda L=L: stacked(rec.hooks[("mlp_out", L)])) for L in range(g.n_layers) if bool(all_mlp[L])}
        # an all-out attention layer replaced: its hook_z never fires, so its heads need no hook; where the
        # replacement does not apply (a model whose attention cannot be swapped) the z hook does the same job
        with torch.no_grad(), known_attention(self.model, known_a) as swapped, known_mlps(self.model, known_m):
            for L in known_a:
                if L not in swapped:
                    hooks.append((f"blocks.{L}.attn.hook_z", patch_z(L)))
            rows = _metric_rows(self.model, shard, shard.clean.repeat(k, 1), hooks, copies=k)
        run = 1.0 - 0.5 * (float(all_attn.float().mean()) + float(all_mlp.float().mean()))
        self.forwards += k * b / self.n * run
        return rows.reshape(k, b)

    def _patched(self, shard: Task, rec: Record, chunk: Sequence[NodeSet]) -> Tensor:
        masks = torch.stack([node_mask_of(self.g, h, m) for h, m in chunk])
        self.forwards += len(chunk) * shard.n / self.n
        return patched_run(self.model, self.g, shard, rec, masks).reshape(len(chunk), shard.n)

    def attribute(self, node_set: NodeSet) -> Optional[Tuple[Tensor, Dict[str, float]]]:
        """(the metric of each row [n] at ``node_set``, {kept node: a_n}) from one forward and one backward, a_n =
        the mean over rows of ∂m/∂out_n · (out_n − out_n(corrupt)) (module docstring); None where node views are
        patched runs (post-attention norms)."""
        if not self.fast:
            return None
        g = self.g
        (heads_out,), (mlps_out,) = (t for t in left_out(g, [node_set]))
        attr: Dict[str, float] = {}
        rows_all = []
        for shard, rec in self._records():
            leaves: Dict[Tuple[str, int], Tensor] = {}
            deltas: Dict[Tuple[str, int], Tensor] = {}

            def patch_z(L: int):
                mask = heads_out[L][None, None, :, None]

                def fn(z: Tensor, hook) -> Tensor:
                    _check_z(z, g, L)
                    corr = rec.hooks[("z", L)].to(z.dtype)
                    deltas[("z", L)] = (z - corr).detach()
                    leaf = torch.zeros_like(z, requires_grad=True)
                    leaves[("z", L)] = leaf
                    return torch.where(mask.to(z.device), corr, z) + leaf
                return fn

            def patch_mlp(L: int):
                def fn(t: Tensor, hook) -> Tensor:
                    corr = rec.hooks[("mlp_out", L)].to(t.dtype)
                    if bool(mlps_out[L]):
                        return corr
                    deltas[("mlp_out", L)] = (t - corr).detach()
                    leaf = torch.zeros_like(t, requires_grad=True)
                    leaves[("mlp_out", L)] = leaf
                    return t + leaf
                return fn

            all_attn = heads_out.all(-1)
            hooks = [(f"blocks.{L}.attn.hook_z", patch_z(L)) for L in range(g.n_layers) if not bool(all_attn[L])]
            if g.has_mlp:
                hooks += [(f"blocks.{L}.hook_mlp_out", patch_mlp(L)) for L in range(g.n_layers)]
            known_a = {L: (lambda L=L: rec.hooks[("attn_out", L)].clone()) for L in range(g.n_layers)
                       if bool(all_attn[L])}
            known_m = {L: rec.hooks[("mlp_out", L)] for L in range(g.n_layers) if g.has_mlp and bool(mlps_out[L])}
            with torch.enable_grad(), known_attention(self.model, known_a) as swapped, known_mlps(self.model, known_m):
                for L in known_a:
                    if L not in swapped:
                        hooks.append((f"blocks.{L}.attn.hook_z", patch_z(L)))
                rows = _metric_rows(self.model, shard, shard.clean, hooks)
                keys = list(leaves)
                grads = torch.autograd.grad(rows.sum(), [leaves[key] for key in keys], allow_unused=True)
            for key, grad in zip(keys, grads):
                if grad is None:
                    continue
                prod = (grad.detach().double() * deltas[key].double())
                if key[0] == "z":
                    per_head = prod.sum((0, 1, 3))                      # [H]
                    for h in range(g.n_heads):
                        if not bool(heads_out[key[1], h]):
                            name = f"{key[1]}.{h}"
                            attr[name] = attr.get(name, 0.0) + float(per_head[h])
                else:
                    name = f"mlp{key[1]}"
                    attr[name] = attr.get(name, 0.0) + float(prod.sum())
            rows_all.append(rows.detach().double().cpu())
            self.forwards += 3.0 * shard.n / self.n
        self.sets_measured += 1
        kept = [f"{L}.{h}" for L in range(g.n_layers) for h in range(g.n_heads) if not bool(heads_out[L, h])]
        kept += [f"mlp{L}" for L in range(g.n_layers) if g.has_mlp and not bool(mlps_out[L])]
        return torch.cat(rows_all), {n: attr.get(n, 0.0) / self.n for n in kept}
