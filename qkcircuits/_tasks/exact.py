"""Exact patching over the whole graph: one patched run per edge or per node (``copies`` stacked per forward).

>>> acc = torch.zeros(g.n_groups, g.n_senders, g.n_receivers, dtype=torch.float64)   # doctest: +SKIP (needs a corrupt record and a shard)
>>> clean_sum = exact_edges(model, g, shard, corrupt_record, acc, copies=32, bar=bar)  # doctest: +SKIP (needs a corrupt record and a shard)

- edge (s, r) [position-aware: (γ, s, r)]: m(clean) − m(clean with only r reading out_s(corrupt)) [at the
  positions of group γ only];
- node s [at γ]: m(clean) − m(clean with every reader of s reading out_s(corrupt)) [at the positions of γ].

Each is one ``runs.patched_run`` of the full mask with that edge (or that sender's row) taken out; the sums over
the shard's rows are added into ``acc`` (divide by the prompt count for per-prompt units).
"""

from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

from .graph import Graph
from .positions import group_index
from .record import record
from .patched import patched_run
from .task import Task


def exact_edges(model, g: Graph, shard: Task, corr, acc: Tensor, copies: int, bar) -> float:
    """One patched run per edge (``copies`` edges stacked per forward): acc[γ, s, r] += m(clean) − m(edge off)
    (position-aware: the edge off at the positions of group γ only)."""
    clean_sum = float(patched_run(model, g, shard, corr, g.valid[None]).sum())
    full = g.valid[None].expand(g.n_groups, -1, -1)
    gg, s_idx, r_idx = full.nonzero(as_tuple=True)
    pos = group_index(shard, g.positions) if g.positions else None
    for start in range(0, len(s_idx), copies):
        ga, ss, rr = gg[start:start + copies], s_idx[start:start + copies], r_idx[start:start + copies]
        mask = full[None].repeat(len(ss), 1, 1, 1)
        mask[torch.arange(len(ss)), ga, ss, rr] = False
        vals = patched_run(model, g, shard, corr, mask if g.positions else mask[:, 0], positions=pos)
        acc[ga, ss, rr] += clean_sum - vals.sum(1).double().cpu()      # [copies]
        bar.update(len(ss))
    return clean_sum


def exact_nodes(model, g: Graph, task: Task, rows: int, copies: int) -> Tuple[Tensor, float, float]:
    """acc [groups, S] (m(clean) − m(node off) summed over rows; one group when not position-aware), and the clean
    and corrupt metric means."""
    acc = torch.zeros(g.n_groups, g.n_senders, dtype=torch.float64)
    clean = corrupt = 0.0
    for shard in task.shards(rows):
        a, c, z = exact_node_sums(model, g, shard, copies)
        acc += a
        clean += c
        corrupt += z
    return acc, clean / task.n, corrupt / task.n


def exact_node_sums(model, g: Graph, shard: Task, copies: int) -> Tuple[Tensor, float, float]:
    """One shard of ``exact_nodes``: acc [groups, S] summed over its rows, its clean and corrupt metric sums."""
    acc = torch.zeros(g.n_groups, g.n_senders, dtype=torch.float64)
    full = g.valid[None].expand(g.n_groups, -1, -1)
    nodes = [(gi, s) for gi in range(g.n_groups) for s in range(g.n_senders)]
    corr = record(model, g, shard, shard.corrupt)
    pos = group_index(shard, g.positions) if g.positions else None
    clean_sum = float(patched_run(model, g, shard, corr, g.valid[None]).sum())
    for start in range(0, len(nodes), copies):
        gs, ss = (torch.tensor(c) for c in zip(*nodes[start:start + copies]))
        mask = full[None].repeat(len(ss), 1, 1, 1)
        mask[torch.arange(len(ss)), gs, ss] = False
        vals = patched_run(model, g, shard, corr, mask if g.positions else mask[:, 0], positions=pos)
        acc[gs, ss] += clean_sum - vals.sum(1).double().cpu()
    return acc, clean_sum, float(corr.rows.sum())
