"""Circuits: the top edges of an edge score, pruned to paths embedding → … → logits (``TaskCircuit``).

>>> task = qk.tasks.induction(model, n=8, seg_len=6)
>>> scores = qk.edge_scores(model, task, method="eap-ig", steps=3, progress=False)
>>> sorted(select(scores, edges=4, by="abs").heads)     # the toy's saturated edges: ±1e-4, signs are noise
['0.0', '1.0']

Selection: edges ranked by the signed score (``by="signed"``, the default: the edges that carry the
behaviour, score in the metric's better direction, i.e. −score for ``"answer-loss"``) or by |score| (``by="abs"``,
as the EAP-IG library's default: an edge whose corruption *helps* the metric joins too). Why signed: a
circuit is asked to carry the behaviour, and the edges that work against it (IOI's negative name movers)
cancel part of it when they are kept clean: on SmolLM2 IOI the |score| ranking needs 20 % of the edges
for f ≥ 0.8, the signed one 2 % (docs/tasks.md). The signed curve overshoots (f > 1: the circuit without
the edges that oppose the behaviour does the task better than the model) and so suits CPR, how much of
the behaviour a circuit can carry; the |score| curve stays near 1 and suits CMD, how closely a circuit
matches the model (MIB evaluates both rankings). Taken either as the top edges of the whole graph
(``how="top"``) or grown from the logits
(``how="greedy"``, EAP-IG's ``apply_greedy``: an edge is a candidate once its receiver's node is in).
Then edges with no path from the embedding through circuit edges, or none on to the logits, are pruned
(they cannot change the metric through the circuit). ``percent`` counts the graph's edges before pruning
and is TRUNCATED to a whole number of edges as MIB's grid does, n = int(pct × |E|) (``edges_for_percent``:
0.1 % of SmolLM2's 70,651 edges is 70, not 71; a percent too small for one edge gives the empty circuit);
``TaskCircuit.n_edges`` says how many are left after pruning. Position-aware scores (``positions.py``) give
position-aware circuits: the edges (sender, receiver input, position group) are ranked and pruned
(``positions.prune_positions``), ``TaskCircuit.position_mask`` [groups, S, R] holds them, and ``mask``/``scores`` are
their plain views (an edge in at some group; the scores summed over the groups), which the roles read; there |E|
counts every (edge, group).
"""

from __future__ import annotations

from numbers import Real

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Set, Tuple

import torch
from torch import Tensor

from .._foundation.result import Result
from .._foundation.errors import QKCircuitsError
from .graph import Graph
from .positions import at, prune_positions, split
from .._foundation.metric_table import direction_of


def _consumers(g: Graph, r: int) -> List[int]:
    """Sender indices of the nodes that read receiver input r (the logits: none, -1)."""
    name, into = g.receivers[r]
    if name == "logits":
        return [-1]
    if into == "in":
        return [g.mlp_sender(int(name[3:]))]
    return [g.head_sender(int(h.split(".")[0]), int(h.split(".")[1])) for h in g.receiver_heads(r)]


def _reads(g: Graph) -> Tensor:
    """[S, R] bool: node s (a head, an MLP) reads receiver input r (a head its q and its KV head's k, v)."""
    reads = torch.zeros(g.n_senders, g.n_receivers, dtype=torch.bool)
    for r in range(g.n_receivers):
        for c in _consumers(g, r):
            if c >= 0:
                reads[c, r] = True
    return reads


def prune(g: Graph, mask: Tensor) -> Tensor:
    """Keep the edges of ``mask`` [S, R] that lie on a path embedding → … → logits inside ``mask``: sender s
    reached from the embedding through ``mask`` edges, and receiver r read by a node from which the logits are
    reached. One sweep up the layers (a layer's heads, then its MLP) and one down, each a few boolean
    reductions per layer."""
    mask = mask.bool().cpu()
    reads = _reads(g)
    S, R = g.n_senders, g.n_receivers
    reach = torch.zeros(S, dtype=torch.bool)
    reach[0] = True
    for L in range(g.n_layers):
        hs = slice(g.head_sender(L), g.head_sender(L) + g.n_heads)
        rs = slice(g.recv_slice(L, "q").start, g.recv_slice(L, "v").stop)
        fed = (mask[:, rs] & reach[:, None]).any(0)                        # each q/k/v input reached
        reach[hs] = (reads[hs, rs] & fed[None]).any(1)
        if g.has_mlp:
            reach[g.mlp_sender(L)] = bool((mask[:, g.recv_slice(L, "mlp").start] & reach).any())
    useful = torch.zeros(S, dtype=torch.bool)
    recv_useful = torch.zeros(R, dtype=torch.bool)
    recv_useful[g.logits_receiver] = True
    for L in range(g.n_layers - 1, -1, -1):
        if g.has_mlp:
            m = g.mlp_sender(L)
            useful[m] = bool((mask[m] & recv_useful).any())
            recv_useful[g.recv_slice(L, "mlp").start] = useful[m]
        hs = slice(g.head_sender(L), g.head_sender(L) + g.n_heads)
        useful[hs] = (mask[hs] & recv_useful[None]).any(1)
        rs = slice(g.recv_slice(L, "q").start, g.recv_slice(L, "v").stop)
        recv_useful[rs] = (reads[hs, rs] & useful[hs, None]).any(0)
    return mask & reach[:, None] & recv_useful[None, :]


@dataclass(frozen=True, repr=False)      # the repr is _text (Result)
class TaskCircuit(Result):
    """A set of edges (``mask`` [S, R]) of ``graph``, chosen from edge scores. Its JSON holds the circuit's
    edges with their scores and the graph's counts (the other edges' scores are not kept: NaN when read)."""

    SCHEMA = "qkcircuits.task_circuit/1"
    WHAT = "a task-circuit JSON (scores.circuit(...).to_json())"
    KEYS = ("edges", "graph")

    graph: Graph
    mask: Tensor
    scores: Tensor
    by: str = "signed"
    percent: Optional[Real] = None
    requested: int = 0
    model: str = ""
    how: str = "top"
    position_mask: Optional[Tensor] = None       # [groups, S, R]: a position-aware circuit's edges
    position_scores: Optional[Tensor] = None     # [groups, S, R]

    @property
    def n_edges(self) -> int:
        return int((self.mask if self.position_mask is None else self.position_mask).sum())

    def edges(self) -> List[Tuple[str, str, str, float]]:
        """(sender, receiver, input, score), largest |score| first; position-aware: names with their group,
        ``("5.6@S2", "20.kv0@S2", "k", score)``."""
        g = self.graph
        if self.position_mask is None:
            s_idx, r_idx = self.mask.nonzero(as_tuple=True)
            vals, grp = self.scores[s_idx, r_idx], None
        else:
            grp, s_idx, r_idx = self.position_mask.nonzero(as_tuple=True)
            vals = self.position_scores[grp, s_idx, r_idx]
        order = torch.argsort(vals.abs(), descending=True, stable=True).tolist()
        out = []
        for i in order:
            sn, (rn, x) = g.senders[int(s_idx[i])], g.receivers[int(r_idx[i])]
            if grp is not None:
                sn, rn = at(sn, g.positions[int(grp[i])]), at(rn, g.positions[int(grp[i])])
            out.append((sn, rn, x, float(vals[i])))
        return out

    @property
    def position_nodes(self) -> List[str]:
        """A position-aware circuit's nodes with their group (``"20.0@END"``, ``"mlp3@S2"``, ``"emb@IO"``): each
        sender at every group where an edge of the circuit leaves it ([] for a plain circuit)."""
        if self.position_mask is None:
            return []
        g = self.graph
        grp, s_idx = self.position_mask.any(2).nonzero(as_tuple=True)
        return [at(g.senders[int(s)], g.positions[int(gi)]) for gi, s in sorted(zip(grp.tolist(), s_idx.tolist()),
                                                                                    key=lambda t: (t[1], t[0]))]

    @property
    def nodes(self) -> Set[str]:
        """Heads ("L.H"), MLPs ("mlpL") the circuit uses: every sender of a circuit edge, every head whose q
        and every MLP whose input is a circuit receiver. An edge into a KV head's k or v (grouped-query
        attention) adds only the query heads of that group already in the circuit: the group's other heads
        read that key/value too, but with no output edge in the circuit they carry nothing on to the logits
        (after pruning every kept head has one). Only when none of the group is in (an unpruned mask) does
        such an edge add its whole group."""
        out: Set[str] = set()
        kv: List[int] = []
        for s, r in self.mask.nonzero().tolist():
            name = self.graph.senders[s]
            if name != "emb":
                out.add(name)
            rname, into = self.graph.receivers[r]
            if into in ("k", "v"):
                kv.append(r)
            elif rname != "logits":
                out.update(self.graph.receiver_heads(r))
        for r in kv:
            group = self.graph.receiver_heads(r)
            if not out.intersection(group):
                out.update(group)
        return out

    @property
    def heads(self) -> List[str]:
        return sorted((n for n in self.nodes if n[0].isdigit()), key=lambda h: tuple(map(int, h.split("."))))

    def to_dict(self) -> Dict[str, object]:
        from .._foundation.io import json_number

        return {"graph": self.graph.to_dict(), "model": self.model,          # what from_json rebuilds the graph from
                "edges": [[s, r, x, json_number(self.scores.new_tensor(v))] for s, r, x, v in self.edges()],   # exact
                "heads": self.heads,
                "mlps": sorted(n for n in self.nodes if n.startswith("mlp")), "n_edges": self.n_edges,
                "requested_edges": self.requested, "percent": self.percent, "by": self.by,
                "how": self.how, **({"position_nodes": self.position_nodes} if self.position_mask is not None else {})}

    @classmethod
    def _from_dict(cls, d: Dict[str, object]) -> "TaskCircuit":
        g = Graph.from_dict(d["graph"], str(d.get("model", "")))
        G = g.n_groups
        mask = torch.zeros(G, g.n_senders, g.n_receivers, dtype=torch.bool)
        scores = torch.full((G, g.n_senders, g.n_receivers), float("nan"))
        s_at = {n: i for i, n in enumerate(g.senders)}
        r_at = {r: i for i, r in enumerate(g.receivers)}
        g_at = {n: i for i, n in enumerate(g.positions)}
        for s, r, x, v in d["edges"]:
            (s, gs), (r, gr) = split(s), split(r)
            gi = g_at.get(gs, -1) if g.positions else (0 if gs is None else -1)
            if s not in s_at or (r, x) not in r_at or not g.valid[s_at[s], r_at[(r, x)]] or gi < 0 or gr != gs:
                raise QKCircuitsError(f"edge {s} -> {r} {x} is not an edge of the graph {g!r}")
            mask[gi, s_at[s], r_at[(r, x)]] = True
            scores[gi, s_at[s], r_at[(r, x)]] = float("nan") if v is None else float(v)
        from dataclasses import fields

        pct = d.get("percent")
        if g.positions:
            d = {**d, "position_mask": mask, "position_scores": scores}
            mask, scores = mask.any(0), torch.nan_to_num(scores, nan=0.0).sum(0).masked_fill_(~mask.any(0), float("nan"))
        else:
            mask, scores = mask[0], scores[0]
        known = {"graph", "mask", "scores", "by", "percent", "requested", "model"}
        other = {f.name: d[f.name] for f in fields(cls) if f.name not in known and f.name in d}   # e.g. later settings
        pct = pct if pct is None or isinstance(pct, int) else float(pct)      # 5 stays 5, 2.5 stays 2.5
        return cls(g, mask, scores, by=str(d.get("by", "abs")), percent=pct,
                   requested=int(d.get("requested_edges", 0)), model=str(d.get("model", "")), **other)

    def top(self, k: int = 10) -> List[Tuple[str, str, str, float]]:
        """The circuit's ``k`` edges of largest |score|: ``(sender, receiver, input, score)``."""
        return self.edges()[:k]

    def to_frame(self):
        import pandas as pd

        return pd.DataFrame(self.edges(), columns=["sender", "receiver", "input", "score"])

    def to_mib(self, path=None, d_model: Optional[int] = None) -> str:
        """This circuit as the MIB circuit track's JSON: every edge of the graph with its score (0 where this
        circuit does not know it), ``in_graph`` = this circuit's edges (``qkcircuits._tasks.mib``)."""
        from .mib import to_mib

        return to_mib(self, path, self.mask, d_model)

    @classmethod
    def from_mib(cls, path, model, gqa: str = "grouped") -> "TaskCircuit":
        """The in_graph edges of a MIB circuit JSON on ``model``'s graph (``gqa`` as in ``qk.graph``; grouped k/v:
        in when any query head's copy is), with the file's scores."""
        from .mib import read_mib

        g, scores, inside, _ = read_mib(path, model, gqa)
        return cls(g, inside, scores, "mib", None, int(inside.sum()), g.model_name, "mib")

    def _text(self) -> str:
        top = "; ".join(f"{s}->{r} {x} {v:+.3g}" for s, r, x, v in self.edges()[:4])
        return (f"TaskCircuit({self.model}: {self.n_edges} edges of {self.graph.n_edges}, heads "
                f"{', '.join(self.heads[:12])}{' …' if len(self.heads) > 12 else ''}; top: {top})")

    def _html(self) -> str:
        import html

        return f"<p>{html.escape(self._text())}</p>"



def _node_inputs(g: Graph) -> Dict[int, List[int]]:
    """Sender index → the receiver inputs of the same node (a head: its q and its KV head's k and v, or its own
    k and v when ungrouped; an MLP: its input). The embedding has none."""
    out: Dict[int, List[int]] = {}
    group = g.n_heads // g.n_kv_in
    for L in range(g.n_layers):
        for h in range(g.n_heads):
            out[g.head_sender(L, h)] = [g.recv_slice(L, x).start + (h if x == "q" else h // group) for x in "qkv"]
        if g.has_mlp:
            out[g.mlp_sender(L)] = [g.recv_slice(L, "mlp").start]
    return out


def greedy_mask(g: Graph, key: Tensor, k: int) -> Tensor:
    """``k`` edges grown from the logits (EAP-IG's ``apply_greedy``, Hanna et al. 2024): the candidates are
    the edges into the logits; repeatedly the candidate with the largest ``key`` joins, and when its sender
    joins for the first time the edges into that node's inputs become candidates. Every chosen edge has a
    path on to the logits by construction. Position-aware (``key`` [groups, S, R]): a sender joins per group;
    an MLP's input is then a candidate at that group, a head's at every group (attention reads all positions)."""
    import heapq

    inputs = _node_inputs(g)
    plain = key.dim() == 2
    kk = (key[None] if plain else key).tolist()
    n_groups = len(kk)
    heap: List[Tuple[float, int, int, int]] = []
    pushed: Set[Tuple[int, int]] = set()
    joined: Set[Tuple[int, int]] = set()

    def add(r: int, gi: int) -> None:
        if (r, gi) not in pushed:
            pushed.add((r, gi))
            for s in range(g.n_below(r)):
                heapq.heappush(heap, (-kk[gi][s][r], gi, s, r))

    for gi in range(n_groups):
        add(g.logits_receiver, gi)
    chosen: List[Tuple[int, int, int]] = []
    while len(chosen) < k and heap:
        _, gi, s, r = heapq.heappop(heap)
        chosen.append((gi, s, r))
        if s != 0 and (s, gi) not in joined:
            joined.add((s, gi))
            head = not g.senders[s].startswith("mlp")
            for r2 in inputs[s]:
                for gj in (range(n_groups) if head else (gi,)):
                    add(r2, gj)
    mask = torch.zeros((n_groups,) + tuple(g.valid.shape), dtype=torch.bool)
    if chosen:
        idx = torch.tensor(chosen)
        mask[idx[:, 0], idx[:, 1], idx[:, 2]] = True
    return mask[0] if plain else mask


SELECTIONS = ("top", "greedy")


def select(scores, edges: Optional[int] = None, percent: Optional[Real] = None, by: str = "signed",
           how: str = "top") -> TaskCircuit:
    """``edges`` (or ``percent`` % of the graph's edges) ranked by ``by`` ("signed": the score in the
    metric's better direction, −score for a lower-is-better metric; "abs": |score|), chosen
    ``how``: "top" (the top edges of the whole graph) or "greedy" (grown from the logits,
    ``greedy_mask``), then pruned."""
    if not (hasattr(scores, "graph") and hasattr(scores, "scores")):
        from .._foundation.args import describe

        raise QKCircuitsError(f"scores must be edge scores (an EdgeScores from qk.edge_scores(model, task) or "
                              f"EdgeScores.from_json / from_mib), got {describe(scores)}")
    g = scores.graph
    if (edges is None) == (percent is None):
        raise QKCircuitsError("give exactly one of edges=N or percent=P")
    if by not in ("abs", "signed"):
        raise QKCircuitsError(f"by must be 'abs' or 'signed', got {by!r}")
    if how not in SELECTIONS:
        raise QKCircuitsError(f"how must be 'top' or 'greedy', got {how!r}")
    if percent is not None:
        if isinstance(percent, bool) or not isinstance(percent, Real) or not 0 <= float(percent) <= 100:
            raise QKCircuitsError(f"percent must be a number in 0-100, got {percent!r}")
        k = edges_for_percent(g.n_edges, percent)
    else:
        if isinstance(edges, bool) or not isinstance(edges, int) or edges < 0:
            raise QKCircuitsError(f"edges must be an integer >= 0, got {edges!r}")
        k = min(edges, g.n_edges)
    by_pos = getattr(scores, "position_scores", None)
    vals = torch.nan_to_num(scores.scores if by_pos is None else by_pos, nan=0.0)
    key = vals.abs() if by == "abs" else vals * behaviour_sign(scores)
    if by_pos is not None:                       # position-aware: (group, sender, receiver) edges
        if how == "greedy":
            mask = greedy_mask(g, key, k)
        else:
            gg, s_idx, r_idx = g.valid[None].expand(g.n_groups, -1, -1).nonzero(as_tuple=True)
            order = torch.argsort(key[gg, s_idx, r_idx], descending=True, stable=True)[:k]
            mask = torch.zeros((g.n_groups,) + tuple(g.valid.shape), dtype=torch.bool)
            mask[gg[order], s_idx[order], r_idx[order]] = True
        pm = prune_positions(g, mask)
        return TaskCircuit(g, pm.any(0), scores.scores, by, None if percent is None else float(percent), k,
                       getattr(scores, "model", ""), how, pm, by_pos)
    if how == "greedy":
        mask = greedy_mask(g, key, k)
    else:
        s_idx, r_idx = g.valid.nonzero(as_tuple=True)
        order = torch.argsort(key[s_idx, r_idx], descending=True, stable=True)[:k]
        mask = torch.zeros_like(g.valid)
        mask[s_idx[order], r_idx[order]] = True
    return TaskCircuit(g, prune(g, mask), scores.scores, by, None if percent is None else float(percent), k,
                   getattr(scores, "model", ""), how)


def edges_for_percent(n_edges: int, percent: Real) -> int:
    """``percent`` % of ``n_edges``, truncated as MIB does (n = int(pct × |E|)); a 1e-9 slack keeps a product
    that is a whole number in exact arithmetic (4 / 29 of 29 edges) from falling one short in floating point.

    >>> edges_for_percent(70651, 0.1), edges_for_percent(70651, 2), edges_for_percent(29, 100 * 4 / 29)
    (70, 1413, 4)
    """
    return int(math.floor(n_edges * float(percent) / 100.0 + 1e-9))


def behaviour_sign(scores) -> float:
    """+1 when a positive score carries the behaviour (a higher-is-better metric), −1 for a lower-is-better
    one (``"answer-loss"``: corrupting a carrying edge raises the loss, so its score m(clean) − m(patched) < 0)."""
    task = getattr(scores, "task", None) or {}
    better = task.get("higher_is_better")
    if better is None:                  # a scores file written before the direction was recorded: the table's
        better = direction_of(task.get("metric"))      # (its old names too: "loss" is a loss either way)
    # a name outside the table in such a file (a callable's): such files were written higher-is-better
    return -1.0 if better is False else 1.0
