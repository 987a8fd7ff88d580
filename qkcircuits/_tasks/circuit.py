"""Circuits (the top edges of a score) and their faithfulness.

>>> task = qk.tasks.induction(model, n=8, seg_len=6)
>>> scores = qk.edge_scores(model, task, method="eap-ig", steps=3, progress=False)
>>> c = scores.circuit(edges=4)
>>> sorted(c.heads)
['0.0', '1.0']
>>> f = qk.faithfulness(model, task, scores, sizes=(10, 50, 100), progress=False)
>>> round(f.curve[100.0], 6)
1.0

Selection: edges ranked by the signed score (``by="signed"``, the default: the edges that carry the
behaviour, score in the metric's better direction, i.e. −score for ``"loss"``) or by |score| (``by="abs"``,
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
(as MIB's grid does); ``Circuit.n_edges`` says how many are left.

Faithfulness of a circuit C: ONE patched forward (runs.py) in which every edge not in C carries its
sender's corrupt-run output and every edge in C the sender's output in this patched run;

    f(C) = (m(C) − m(∅)) / (m(full) − m(∅)),   m(full) = clean run,  m(∅) = corrupt run.

Over a grid of sizes k (fractions of the graph's edges, 0 < k_1 < … < k_n ≤ 1), as MIB (Mueller et al. 2025,
arXiv 2504.13151) defines them, by the trapezoidal rule on the grid:

    CPR = ∫ f(C_k) dk   (higher is better),      CMD = ∫ |1 − f(C_k)| dk   (lower is better).
"""

from __future__ import annotations

from numbers import Real

import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch import Tensor

from .._foundation.result import Result
from .._foundation.errors import QKCircuitsError
from .graph import Graph, graph
from .record import Record, clean_rows, record, reuse
from .runs import node_run, patched_run, z_patchable, z_record
from .task import Task, metric_higher_is_better

SIZES = (0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100)
THRESHOLD = 0.8
SCHEMA = "qkcircuits.faithfulness/1"


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


@dataclass(repr=False)      # the repr is _text (Result)
class Circuit(Result):
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

    @property
    def n_edges(self) -> int:
        return int(self.mask.sum())

    def edges(self) -> List[Tuple[str, str, str, float]]:
        s_idx, r_idx = self.mask.nonzero(as_tuple=True)
        vals = self.scores[s_idx, r_idx]
        order = torch.argsort(vals.abs(), descending=True, stable=True).tolist()
        return [(self.graph.senders[int(s_idx[i])], *self.graph.receivers[int(r_idx[i])], float(vals[i]))
                for i in order]

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
        from .._foundation.io import SCORE_DIGITS, json_number

        return {"graph": self.graph.to_dict(), "model": self.model,          # what from_json rebuilds the graph from
                "edges": [[s, r, x, json_number(v, SCORE_DIGITS)] for s, r, x, v in self.edges()], "heads": self.heads,
                "mlps": sorted(n for n in self.nodes if n.startswith("mlp")), "n_edges": self.n_edges,
                "requested_edges": self.requested, "percent": self.percent, "by": self.by,
                "how": self.how}

    @classmethod
    def _from_dict(cls, d: Dict[str, object]) -> "Circuit":
        gd = d["graph"]
        g = Graph(gd["n_layers"], gd["n_heads"], gd["n_kv_heads"], gd["mlps"], str(d.get("model", "")),
                  bool(gd.get("parallel", False)))
        mask = torch.zeros(g.n_senders, g.n_receivers, dtype=torch.bool)
        scores = torch.full((g.n_senders, g.n_receivers), float("nan"))
        s_at = {n: i for i, n in enumerate(g.senders)}
        r_at = {r: i for i, r in enumerate(g.receivers)}
        for s, r, x, v in d["edges"]:
            if s not in s_at or (r, x) not in r_at or not g.valid[s_at[s], r_at[(r, x)]]:
                raise QKCircuitsError(f"edge {s} -> {r} {x} is not an edge of the graph {g!r}")
            mask[s_at[s], r_at[(r, x)]] = True
            scores[s_at[s], r_at[(r, x)]] = float("nan") if v is None else float(v)
        from dataclasses import fields

        pct = d.get("percent")
        known = {"graph", "mask", "scores", "by", "percent", "requested", "model"}
        other = {f.name: d[f.name] for f in fields(cls) if f.name not in known and f.name in d}   # e.g. later settings
        return cls(g, mask, scores, by=str(d.get("by", "abs")), percent=None if pct is None else float(pct),
                   requested=int(d.get("requested_edges", 0)), model=str(d.get("model", "")), **other)

    def top(self, k: int = 10) -> List[Tuple[str, str, str, float]]:
        """The circuit's ``k`` edges of largest |score|: ``(sender, receiver, input, score)``."""
        return self.edges()[:k]

    def to_frame(self):
        import pandas as pd

        return pd.DataFrame(self.edges(), columns=["sender", "receiver", "input", "score"])

    def roles(self, model, task: Task, **kw):
        """Each head of the circuit with the evidence for its role (see ``qkcircuits._tasks.roles``)."""
        from .roles import roles

        return roles(model, task, self, **kw)

    def _text(self) -> str:
        top = "; ".join(f"{s}->{r} {x} {v:+.3g}" for s, r, x, v in self.edges()[:4])
        return (f"Circuit({self.model}: {self.n_edges} edges of {self.graph.n_edges}, heads "
                f"{', '.join(self.heads[:12])}{' …' if len(self.heads) > 12 else ''}; top: {top})")

    def _html(self) -> str:
        import html

        return f"<p>{html.escape(self._text())}</p>"



def _node_inputs(g: Graph) -> Dict[int, List[int]]:
    """Sender index → the receiver inputs of the same node (a head: its q and its KV head's k and v; an
    MLP: its input). The embedding has none."""
    out: Dict[int, List[int]] = {}
    group = g.n_heads // g.n_kv
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
    path on to the logits by construction."""
    import heapq

    inputs = _node_inputs(g)
    kk = key.tolist()
    heap: List[Tuple[float, int, int]] = []
    pushed: Set[int] = set()
    joined: Set[int] = set()

    def add(r: int) -> None:
        if r not in pushed:
            pushed.add(r)
            for s in range(g.n_below(r)):
                heapq.heappush(heap, (-kk[s][r], s, r))

    add(g.logits_receiver)
    chosen: List[Tuple[int, int]] = []
    while len(chosen) < k and heap:
        _, s, r = heapq.heappop(heap)
        chosen.append((s, r))
        if s != 0 and s not in joined:
            joined.add(s)
            for r2 in inputs[s]:
                add(r2)
    mask = torch.zeros_like(g.valid)
    if chosen:
        idx = torch.tensor(chosen)
        mask[idx[:, 0], idx[:, 1]] = True
    return mask


SELECTIONS = ("top", "greedy")


def select(scores, edges: Optional[int] = None, percent: Optional[Real] = None, by: str = "signed",
           how: str = "top") -> Circuit:
    """``edges`` (or ``percent`` % of the graph's edges) ranked by ``by`` ("signed": the score in the
    metric's better direction, −score for a lower-is-better metric; "abs": |score|), chosen
    ``how``: "top" (the top edges of the whole graph) or "greedy" (grown from the logits,
    ``greedy_mask``), then pruned."""
    g = scores.graph
    if (edges is None) == (percent is None):
        raise QKCircuitsError("give exactly one of edges=N or percent=P")
    if by not in ("abs", "signed"):
        raise QKCircuitsError(f"by must be 'abs' or 'signed', got {by!r}")
    if how not in SELECTIONS:
        raise QKCircuitsError(f"how must be 'top' or 'greedy', got {how!r}")
    if percent is not None:
        if isinstance(percent, bool) or not 0 <= float(percent) <= 100:
            raise QKCircuitsError(f"percent must be a number in 0-100, got {percent!r}")
        k = int(round(g.n_edges * float(percent) / 100.0))
        if float(percent) > 0:
            k = max(k, 1)
    else:
        if isinstance(edges, bool) or not isinstance(edges, int) or edges < 0:
            raise QKCircuitsError(f"edges must be an integer >= 0, got {edges!r}")
        k = min(edges, g.n_edges)
    vals = torch.nan_to_num(scores.scores, nan=0.0)
    key = vals.abs() if by == "abs" else vals * behaviour_sign(scores)
    if how == "greedy":
        mask = greedy_mask(g, key, k)
    else:
        s_idx, r_idx = g.valid.nonzero(as_tuple=True)
        order = torch.argsort(key[s_idx, r_idx], descending=True, stable=True)[:k]
        mask = torch.zeros_like(g.valid)
        mask[s_idx[order], r_idx[order]] = True
    return Circuit(g, prune(g, mask), scores.scores, by, None if percent is None else float(percent), k,
                   getattr(scores, "model", ""), how)


def behaviour_sign(scores) -> float:
    """+1 when a positive score carries the behaviour (a higher-is-better metric), −1 for a lower-is-better
    one (``"loss"``: corrupting a carrying edge raises the loss, so its score m(clean) − m(patched) < 0)."""
    task = getattr(scores, "task", None) or {}
    better = task.get("higher_is_better")
    if better is None:                  # a scores file written before the direction was recorded
        better = metric_higher_is_better(task.get("metric"))
    return 1.0 if better else -1.0


def _area(xs: Sequence[float], ys: Sequence[float]) -> float:
    return float(sum((xs[i + 1] - xs[i]) * (ys[i + 1] + ys[i]) / 2 for i in range(len(xs) - 1)))


@dataclass(repr=False)      # the repr is _text (Result)
class Faithfulness(Result):
    """The faithfulness curve ``curve`` {percent: f}, CPR, CMD, the chosen circuit and its node view."""

    SCHEMA = SCHEMA
    WHAT = "a faithfulness JSON (qk.faithfulness(...).to_json())"
    KEYS = ("curve", "metric_values", "n_edges", "clean", "corrupt", "cpr", "cmd", "chosen_percent", "circuit")

    curve: Dict[Real, Real]
    metric_values: Dict[Real, Real]
    n_edges: Dict[float, int]
    clean: Real
    corrupt: Real
    cpr: Real
    cmd: Real
    chosen_percent: Real
    circuit: Circuit
    node_faithfulness: Real
    node_heads: List[str]
    model: str = ""
    settings: Dict[str, object] = field(default_factory=dict)
    timing: Dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> Dict[str, object]:
        from .._foundation.io import json_number

        return {"schema": SCHEMA, "model": self.model, "clean": json_number(self.clean),
                "corrupt": json_number(self.corrupt), "curve": {str(k): json_number(v) for k, v in self.curve.items()},
                "metric_values": {str(k): json_number(v) for k, v in self.metric_values.items()},
                "n_edges": {str(k): v for k, v in self.n_edges.items()}, "cpr": json_number(self.cpr),
                "cmd": json_number(self.cmd), "chosen_percent": self.chosen_percent,
                "circuit": {**self.circuit.to_dict(), "node_faithfulness": json_number(self.node_faithfulness)},
                "settings": self.settings, "timing": self.timing}

    @classmethod
    def _from_dict(cls, d: Dict[str, object]) -> "Faithfulness":
        def num(v) -> float:
            return float("nan") if v is None else float(v)

        c = Circuit._from_dict({"model": d.get("model", ""), **d["circuit"]})
        return cls({float(k): num(v) for k, v in d["curve"].items()},
                   {float(k): num(v) for k, v in d["metric_values"].items()},
                   {float(k): int(v) for k, v in d["n_edges"].items()}, num(d["clean"]), num(d["corrupt"]),
                   num(d["cpr"]), num(d["cmd"]), float(d["chosen_percent"]), c,
                   num(d["circuit"].get("node_faithfulness")), c.heads, str(d.get("model", "")),
                   dict(d.get("settings", {})), dict(d.get("timing", {})))

    def top(self, k: int = 10) -> List[Tuple[str, str, str, float]]:
        """The chosen circuit's ``k`` edges of largest |score|."""
        return self.circuit.top(k)

    def to_frame(self):
        """One row per grid size: percent, edges kept, the metric, f."""
        import pandas as pd

        return pd.DataFrame([{"percent": p, "n_edges": self.n_edges.get(p), "metric": self.metric_values.get(p),
                              "f": f} for p, f in self.curve.items()])

    def _text(self) -> str:
        pts = ", ".join(f"{k:g}%: {v:.3f}" for k, v in self.curve.items())
        return (f"Faithfulness({self.model}: {pts}; CPR {self.cpr:.3f}, CMD {self.cmd:.3f}; circuit "
                f"{self.chosen_percent:g}% = {self.circuit.n_edges} edges, {len(self.node_heads)} heads, node f "
                f"{self.node_faithfulness:.3f})")

    def _html(self) -> str:
        import html

        return f"<p>{html.escape(self._text())}</p>"



def _heads_left_out(g: Graph, keep: Sequence[str]) -> List[str]:
    """The graph's heads ("L.H") not in ``keep``, in sender order."""
    keep = set(keep)
    return [name for name in g.senders if name[0].isdigit() and name not in keep]


def node_mask(g: Graph, keep: Sequence[str]) -> Tensor:
    """Every edge, except those leaving a head NOT in ``keep`` (their readers read its corrupt output).
    The embedding and the MLPs stay clean: the node view of a circuit is its heads."""
    mask = g.valid.clone()
    for name in _heads_left_out(g, keep):
        mask[g.senders.index(name)] = False
    return mask


def circuit_metric(model, task: Task, masks: Sequence[Tensor], rows_per_shard: int, progress: bool = False,
                   need_clean: bool = True, records: Optional[Dict[int, Record]] = None,
                   known_clean: Optional[float] = None) -> Tuple[List[float], float, float]:
    """The metric mean of each circuit mask (one patched forward per mask and shard), and clean/corrupt
    (the corrupt record per shard; clean from a 100 % mask when one is among ``masks``, else one more run,
    or NaN without ``need_clean``). ``known_clean``: m(clean) already measured on these very rows and
    weights (``faithfulness`` passes the scores' own when their ``task_digest`` matches): the 100 % mask
    takes it and no clean rows are run. ``records``: shard index → corrupt record, read when there and
    filled when given (a caller that runs more circuits on the same shards skips those corrupt forwards;
    it then holds them)."""
    g = graph(model)
    sums = [0.0] * len(masks)
    clean = corrupt = 0.0
    from tqdm.auto import tqdm

    bar = tqdm(total=len(masks) * ((task.n + rows_per_shard - 1) // rows_per_shard), desc="faithfulness",
               disable=not progress, leave=False, file=sys.stderr)
    full = next((i for i, m in enumerate(masks) if torch.equal(m & g.valid, g.valid)), None)
    pool: Dict[str, Tensor] = {}        # one shard's buffers, reused by the next (runs.reuse)
    for j, shard in enumerate(task.shards(rows_per_shard)):
        corr = records[j] if records is not None and j in records else \
            record(model, g, shard, shard.corrupt, pool=None if records is not None else pool)
        if records is not None:
            records[j] = corr
        corrupt += float(corr.rows.sum())
        # one sender-output buffer for all the circuits of the shard
        buf = reuse(pool, "patched", tuple(corr.out.shape), corr.out.dtype, corr.out.device)
        for i, m in enumerate(masks):
            if i == full and known_clean is not None:
                continue
            # the full circuit IS the clean run (runs.py): a plain forward, no sender outputs to record
            sums[i] += float(clean_rows(model, shard).sum() if i == full else
                             patched_run(model, g, shard, corr, m[None], buffer=buf).sum())
            bar.update(1)
        # m(full): a 100 % mask already measured it
        if full is None and need_clean and known_clean is None:
            clean += float(clean_rows(model, shard).sum())
        del corr, buf
    if known_clean is not None:
        clean = float(known_clean) * task.n
        if full is not None:
            sums[full] = clean
    elif full is not None:
        clean = sums[full]
    elif not need_clean:
        clean = float("nan")
    bar.close()
    return [s / task.n for s in sums], clean / task.n, corrupt / task.n


def ratio(m: float, clean: float, corrupt: float) -> float:
    """f = (m − m(corrupt)) / (m(clean) − m(corrupt)); NaN when clean and corrupt are equal. The one formula
    every faithfulness number (curve, node view, CLI, Ray) goes through."""
    return (m - corrupt) / (clean - corrupt) if clean != corrupt else float("nan")


def node_metric(model, task: Task, heads: Sequence[str], rows_per_shard: Optional[int] = None,
                need_clean: bool = True, records: Optional[Dict[int, Record]] = None
                ) -> Tuple[float, float, float]:
    """(m, clean, corrupt) metric means when every head NOT in ``heads`` has its output replaced by its
    corrupt-run output (embedding and MLPs recomputed); without ``need_clean`` clean is NaN (or, where the
    patched run is used and ``heads`` keeps every head, the full mask's value, which is m(clean)). Per
    shard: one corrupt forward unless ``records`` holds that shard's record (``circuit_metric``'s; the
    one-forward path reads it and never fills it, as its own corrupt forward records only z), the node-view
    forward and, with ``need_clean``, one clean forward.
    Without post-attention norms the node-view forward is a plain one with those heads' z from the corrupt
    run (``runs.node_run``; its corrupt forward keeps only z, [b, p, H, e] per layer); with them (Gemma), the
    patched run of ``node_mask``. A Ray shard job runs this on its rows (``ray_tasks.node_metric_job``)."""
    from .scores import shard_rows

    g = graph(model)
    task = task.to(model.W_E.device)
    rows = rows_per_shard or shard_rows(model, g, task, buffers=3)
    if not z_patchable(model, g):
        (m,), full, corrupt = circuit_metric(model, task, [node_mask(g, heads)], rows, need_clean=need_clean,
                                             records=records)
        return m, full, corrupt
    # one plain forward per shard with the left-out heads' z taken from the corrupt run (runs.node_run): the
    # same metric as the patched run of node_mask, without its per-receiver sums
    out = [tuple(map(int, name.split("."))) for name in _heads_left_out(g, heads)]
    m = corrupt = clean = 0.0
    for j, shard in enumerate(task.shards(rows)):
        corr = records[j] if records is not None and j in records else z_record(model, g, shard, shard.corrupt)
        m += float(node_run(model, g, shard, corr, out).sum())
        corrupt += float(corr.rows.sum())
        if need_clean:
            clean += float(clean_rows(model, shard).sum())
        del corr
    return m / task.n, clean / task.n if need_clean else float("nan"), corrupt / task.n


def node_faithfulness(model, task: Task, heads: Sequence[str], rows_per_shard: Optional[int] = None,
                      clean: Optional[Real] = None, records: Optional[Dict[int, Record]] = None) -> float:
    """f of the node view of ``heads`` (``node_metric``): (m − m(corrupt)) / (m(clean) − m(corrupt)). ``clean``:
    m(clean) when the caller has it (the curve's), sparing one clean forward per shard."""
    m, full, corrupt = node_metric(model, task, heads, rows_per_shard, need_clean=clean is None, records=records)
    return ratio(m, full if clean is None else float(clean), corrupt)


def faithfulness(model, task: Task, scores, sizes: Sequence[Real] = SIZES, *, by: str = "signed",
                 how: str = "top", threshold: Real = THRESHOLD, rows_per_shard: Optional[int] = None,
                 progress: bool = True, backend: Any = None) -> Faithfulness:
    """The faithfulness curve over ``sizes`` (percent of edges), CPR/CMD, the chosen circuit (the smallest
    grid size with f ≥ ``threshold``, else the largest) and its node view (module docstring). Cost: one
    patched forward per size and prompt shard, one for the node view, one corrupt forward per shard, and
    one clean forward per shard for m(full) unless the scores measured it on this task and these weights
    (``scores.settings["task_digest"]`` equals ``task.digest(model)``: their m(clean) is taken). Memory: the shard's corrupt record and the patched
    run's sender outputs, ~3 × [S, rows, pos, d_model]. ``backend`` as in ``edge_scores``: on Ray, every m(C)
    is summed over prompt shards and f computed once from the sums (``qkcircuits._scale.ray_tasks``)."""
    from .scores import check_task, shard_rows

    if backend is not None:
        from .._foundation.backends import as_backend

        return as_backend(backend).run("faithfulness", model, local=faithfulness, task=task, scores=scores,
                                       sizes=sizes, by=by, how=how, threshold=threshold, rows_per_shard=rows_per_shard,
                                       progress=progress)

    sizes = sorted({float(s) for s in sizes})
    if not sizes or sizes[0] < 0 or sizes[-1] > 100:
        raise QKCircuitsError(f"sizes must be percents in 0-100, got {sizes!r}")
    check_task(model, task)
    g = graph(model)
    task = task.to(model.W_E.device)
    rows = rows_per_shard or shard_rows(model, g, task, buffers=3)
    t0 = time.perf_counter()
    circuits = [select(scores, percent=p, by=by, how=how) for p in sizes]
    # One shard: its corrupt record (held during the curve anyway) serves the node view too. More shards:
    # each is recorded again there, so that only one shard's record is held at a time.
    records: Optional[Dict[int, Record]] = {} if rows >= task.n else None
    # m(clean) was measured by the scores' own clean run when they were computed on this task and these
    # weights (the digest says so): the 100 % circuit IS that run, so it is not run again
    known = getattr(scores, "clean", None)
    digest = getattr(scores, "settings", {}).get("task_digest")
    known = (float(known) if digest is not None and known is not None and math.isfinite(float(known))
             and digest == task.digest(model) else None)
    values, clean, corrupt = circuit_metric(model, task, [c.mask for c in circuits], rows, progress,
                                            records=records, known_clean=known)
    f = [ratio(v, clean, corrupt) for v in values]
    curve = dict(zip(sizes, f))
    chosen = next((p for p, v in curve.items() if v >= threshold), sizes[-1])
    circuit = circuits[sizes.index(chosen)]
    t1 = time.perf_counter()
    nf = node_faithfulness(model, task, circuit.heads, rows, clean=clean, records=records)
    del records
    xs = [p / 100 for p in sizes]
    out = Faithfulness(curve, dict(zip(sizes, values)), {p: c.n_edges for p, c in zip(sizes, circuits)}, clean,
                       corrupt, _area(xs, f), _area(xs, [abs(1 - v) for v in f]), chosen, circuit, nf, circuit.heads,
                       getattr(scores, "model", ""), {"by": by, "how": how, "threshold": threshold, "rows_per_shard": rows,
                                                       "cpr_cmd": "trapezoid over the grid, x = fraction of edges"},
                       {"curve_s": round(t1 - t0, 3), "node_view_s": round(time.perf_counter() - t1, 3)})
    scores.settings["chosen_percent"] = chosen
    scores.settings["chosen_by"] = by
    scores.settings["chosen_how"] = how
    return out
