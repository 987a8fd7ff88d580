"""f of any edge set or node set (``qk.evaluate``), on the plain, ungrouped or position-aware graph.

>>> task = qk.tasks.induction(model, n=8, seg_len=6)
>>> round(qk.evaluate(model, task, ["0.0", "1.0"]).f, 4), round(qk.evaluate(model, task, ["1.0"]).f, 4)
(1.0, 0.0)
>>> round(qk.evaluate(model, task, [("emb", "0.0", "v"), ("0.0", "1.0", "k"), ("emb", "1.0", "v"),
...                                  ("1.0", "logits", "in")]).f, 4)
1.0
>>> round(qk.evaluate(model, task, ["0.0@other", "1.0@END"]).f, 4)     # each head only where it acts
1.0

f = (m − m(corrupt)) / (m(clean) − m(corrupt)) (``circuit.ratio``), m from ONE patched forward per shard: an EDGE
set as a circuit of the faithfulness curve (``circuit.circuit_metric``: every edge outside the set carries its
sender's corrupt output; a position-aware edge ``("5.6@S2", "20.kv0@S2", "k")`` only at its group's positions);
a NODE set keeps the named heads and MLPs and gives every other head's and MLP's corrupt output to all its
readers (the embedding stays clean); a node named at a position group (``"20.0@END"``, ``"mlp3@S2"``; groups:
the task's named positions and ``other``) is kept at that group's positions only.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Dict, Optional

import torch
from torch import Tensor

from .._foundation.errors import QKCircuitsError
from .curve import _check_graph_of, circuit_metric
from .faithfulness import node_metric, ratio
from .graph import Graph, graph
from .positions import position_groups, position_node_mask, split
from .row_budget import check_task, shard_rows
from .selection import TaskCircuit
from .task import Task, with_reference


@dataclass(frozen=True)
class Evaluation:
    """f and m of one edge set or node set (``evaluate``): ``f`` = (m − corrupt) / (clean − corrupt), the three
    metric means (per prompt), what was evaluated (``kind`` "edges" | "nodes") and its size (``n``: edges, or
    heads + MLPs kept; a node at a position group counts once per group)."""

    f: float
    m: float
    clean: float
    corrupt: float
    kind: str
    n: int

    def to_dict(self) -> Dict[str, object]:
        from .._foundation.io import json_number

        return {"f": json_number(self.f), "m": json_number(self.m), "clean": json_number(self.clean),
                "corrupt": json_number(self.corrupt), "kind": self.kind, "n": self.n}


def _edge_mask(g: Graph, edges) -> Tensor:
    """Edge tuples (sender, receiver, input[, score]) as a mask [S, R] ([groups, S, R] on a position-aware ``g``,
    whose edges name their group on both ends: ``("5.6@S2", "20.kv0@S2", "k")``); one-line errors for edges not
    in ``g``."""
    mask = torch.zeros((g.n_groups,) + tuple(g.valid.shape), dtype=torch.bool)
    s_at = {n: i for i, n in enumerate(g.senders)}
    r_at = {r: i for i, r in enumerate(g.receivers)}
    g_at = {n: i for i, n in enumerate(g.positions)}
    for e in edges:
        if not isinstance(e, (tuple, list)) or len(e) < 3:
            raise QKCircuitsError(f"an edge is (sender, receiver, input), e.g. ('emb', '1.0', 'v'); got {e!r}")
        (s, gs), (r, gr), x = split(e[0]), split(e[1]), e[2]
        gi = g_at.get(gs, -1) if g.positions else (0 if gs is None else -1)
        if s not in s_at or (r, x) not in r_at or not g.valid[s_at[s], r_at[(r, x)]] or gi < 0 or gr != gs:
            raise QKCircuitsError(f"edge {e[0]} -> {e[1]} {x} is not an edge of {g!r}")
        mask[gi, s_at[s], r_at[(r, x)]] = True
    return mask if g.positions else mask[0]


def _has_group(items) -> bool:
    """Whether any node or edge end names a position group (``"20.0@END"``)."""
    names = [x for item in items for x in ((item,) if isinstance(item, str) else
                                           tuple(item)[:2] if isinstance(item, (tuple, list)) else ())]
    return any(isinstance(n, str) and split(n)[1] is not None for n in names)


def evaluate(model, task: Task, circuit, *, gqa: str = "grouped",
             rows_per_shard: Optional[int] = None) -> Evaluation:
    """f (and m) of ANY edge set or node set on ``task`` (module docstring).

    ``circuit``: a circuit (``scores.circuit(...)``, ``faithfulness(...).circuit``; evaluated on its own graph:
    ungrouped or position-aware as its scores were), a bool mask [senders, receivers] of ``qk.graph(model, gqa)``
    (or [groups, S, R] over the task's named positions and ``other``), edge tuples ``(sender, receiver, input)``
    (e.g. ``("20.0", "23.0", "q")``, or with groups ``("20.0@END", "23.0@END", "q")``; a 4th item, a score, is
    ignored), or node names (``"23.0"``, ``"mlp5"``, ``"20.0@END"``; ``"emb"`` allowed). With every MLP kept at
    every position a node set is the node view of ``qk.faithfulness`` and runs as it does (one plain forward with
    the other heads' corrupt z where the model allows it). The scores and the circuit given are not changed."""
    check_task(model, task)
    if not isinstance(circuit, (TaskCircuit, Tensor, list, tuple, set, frozenset)):
        from .._foundation.args import describe

        raise QKCircuitsError(f"circuit must be a circuit (scores.circuit(...)), a bool mask tensor, a list of edge "
                              f"tuples (sender, receiver, input) or a list of node names, got {describe(circuit)}")
    items = None
    if isinstance(circuit, TaskCircuit):
        g = circuit.graph
        _check_graph_of(model, task, g)
    else:
        g = graph(model, gqa)
        if isinstance(circuit, Tensor) and circuit.dim() == 3:
            g = replace(g, positions=position_groups(task))
        elif not isinstance(circuit, Tensor):
            items = list(circuit)
            if _has_group(items):
                g = replace(g, positions=position_groups(task))
    task = with_reference(model, task.to(model.W_E.device))
    rows = rows_per_shard or shard_rows(model, g, task, buffers=3)
    if isinstance(circuit, TaskCircuit):
        mask = circuit.mask if circuit.position_mask is None else circuit.position_mask
    elif isinstance(circuit, Tensor):
        shape = ((g.n_groups,) if g.positions else ()) + tuple(g.valid.shape)
        if tuple(circuit.shape) != shape or circuit.dtype != torch.bool:
            raise QKCircuitsError(f"a mask must be a bool tensor of shape {shape} [{'groups, ' if g.positions else ''}"
                                  f"senders, receivers], got {circuit.dtype} {tuple(circuit.shape)}")
        mask = circuit
    elif items and all(isinstance(x, str) for x in items):
        return _nodes(model, task, g, items, rows)
    else:
        mask = _edge_mask(g, items)
    mask = mask.to(g.valid.device) & g.valid
    (m,), clean, corrupt = circuit_metric(model, task, [mask], rows, g=g)
    return Evaluation(ratio(m, clean, corrupt), m, clean, corrupt, "edges", int(mask.sum()))


def _nodes(model, task: Task, g: Graph, items, rows: int) -> Evaluation:
    """``evaluate`` of node names (position-aware ``g`` when a name has a group)."""
    bad = [x for x in items if split(x)[0] not in g.senders or (split(x)[1] is not None
                                                                 and split(x)[1] not in g.positions)]
    if bad:
        where = f" at a group of {', '.join(g.positions)}" if g.positions else ""
        raise QKCircuitsError(f"node(s) {', '.join(map(repr, bad[:5]))} are not nodes of {g!r}; name heads 'L.H', "
                              f"MLPs 'mlpL' or 'emb'{where}")
    keep = set(items)
    kept_at: Dict[str, set] = {}
    for name in keep:
        base, grp = split(name)
        kept_at.setdefault(base, set()).update((set(g.positions) or {None}) if grp is None else {grp})
    n_kept = sum(len(v) for n, v in kept_at.items() if n != "emb")
    every = set(g.positions) if g.positions else {None}
    mlps_all_in = all(kept_at.get(n, set()) >= every for n in g.senders if n.startswith("mlp"))
    heads = [n for n in keep if n[0].isdigit()]
    if mlps_all_in:                 # every MLP kept everywhere: the node view's own (faster) run
        m, clean, corrupt = node_metric(model, task, heads, rows)
    else:
        if g.positions:
            mask = position_node_mask(g, [n for n in keep if split(n)[0] != "emb"], kinds=("head", "mlp"))
        else:
            mask = g.valid.clone()
            for name in g.senders:
                if name != "emb" and name not in keep:
                    mask[g.senders.index(name)] = False
        (m,), clean, corrupt = circuit_metric(model, task, [mask], rows, g=g)
    return Evaluation(ratio(m, clean, corrupt), m, clean, corrupt, "nodes", n_kept)
