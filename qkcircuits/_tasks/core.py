"""The core circuit: the fewest heads (and MLPs) whose node view carries the behaviour (``CoreCircuit``).

>>> task = qk.tasks.induction(model, n=8, seg_len=6)
>>> scores = qk.edge_scores(model, task, method="exact", progress=False)
>>> core = scores.core(model, task, progress=False)
>>> core.heads, round(core.node_faithfulness, 3)
(['0.0', '1.0'], 1.0)

The node view of a set of nodes N (heads ``"L.H"`` and MLPs ``"mlpL"``): the clean rows run with every head
and MLP NOT in N giving its corrupt-run output to every reader (the embedding stays clean: it is the input),
and f(N) = (m(N) − m(corrupt)) / (m(clean) − m(corrupt)). Where a head's output is z_h W_O[h] (no post-attention
norm) that is ONE plain forward whose hook_z takes the corrupt run's z for the left-out heads and whose
hook_mlp_out takes the corrupt run's MLP output for the left-out MLPs (``runs.node_run``): the same metric as
the edge-level patched run of the mask without those senders' edges (tested); elsewhere that patched run.
With every node in, it IS the clean run (f = 1 exactly).

How the core is chosen (``core_circuit``), from node scores alone (no new attribution):

1. **rank** every head and MLP by its node score, the sum of its outgoing edge scores (the EAP / EAP-IG
   estimate of what corrupting its output costs; signed in the metric's better direction by default, or
   |score| with ``by="abs"``); ``mlps=False`` keeps every MLP clean and ranks heads only;
2. **grow**: the prefix of the ranking that holds k heads (and every MLP ranked before the (k+1)-th head) is
   measured on a grid of k (0-8, then ×1.5 up to every head): the ``curve`` {k: f}; the smallest k whose
   f ≥ ``threshold`` (0.8), narrowed by bisection between it and the grid point below it (f need not be
   monotone in k: bisection finds a k whose prefix reaches the threshold and whose k − 1 does not);
3. **prune**: nodes of that prefix are dropped one at a time, weakest first, whenever f stays ≥ ``threshold``
   without them; passes repeat (over the nodes whose set changed after they were tried) until none can go.
   Every node left is then needed: dropping any one of them alone takes f below the threshold (each such
   set was measured).

Scores of the ungrouped graph give the same core as the grouped one would from the same node scores (a node
is a head or an MLP in both; its score sums its outgoing edges either way). Position-aware scores are refused in
one line: their nodes are (head, position group) pairs, and the node view here corrupts a head at every position.

When no prefix reaches the threshold (a model that does not do the task) the core is every node (its f,
1 up to rounding) and ``how`` says so. Cost: one forward per measured set (the grid: 17 points on 270 heads;
~5 bisection steps; the grown set's size plus the retries when pruning), plus one corrupt forward per prompt
shard (held across the search when it fits one shard) and one clean forward unless the scores measured
m(clean) on this task.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from numbers import Real
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .._foundation.errors import QKCircuitsError
from .._foundation.result import Result
from .faithfulness import ratio
from .graph import Graph, graph
from .record import Record, clean_rows, record
from .patched import patched_run
from .runs import node_run, z_patchable, z_record
from .task import Task

THRESHOLD = 0.8
SCHEMA = "qkcircuits.core_circuit/1"
# the node view's corrupt record holds only z and the MLP outputs ([b, p, H·d_head + d_model] per layer):
# its shards are sized to this, and kept across the whole search when there is one shard
NODE_BYTES = 2**30
NodeSet = Tuple[Tuple[str, ...], Tuple[str, ...]]           # (heads kept, MLPs kept)


def _is_head(name: str) -> bool:
    return name[:1].isdigit()


def _head_key(h: str) -> Tuple[int, int]:
    L, i = h.split(".")
    return int(L), int(i)


@dataclass(repr=False)      # the repr is _text (Result)
class CoreCircuit(Result):
    """The core circuit: ``heads`` and ``mlps`` kept, their node view's f (``node_faithfulness``), the grow
    ``curve`` {heads in the ranked prefix: f}, ``how`` (one sentence), the ``ranking`` it grew from
    ((node, node score), best first), the nodes ``pruned`` after growing, m(clean) / m(corrupt)."""

    SCHEMA = SCHEMA
    WHAT = "a core-circuit JSON (qk.core_circuit(...).to_json())"
    KEYS = ("heads", "mlps", "node_faithfulness", "curve", "how")

    heads: List[str]
    mlps: List[str]
    node_faithfulness: Real
    curve: Dict[int, Real]
    how: str
    ranking: List[Tuple[str, float]]
    pruned: List[str]
    clean: Real
    corrupt: Real
    threshold: Real = THRESHOLD
    model: str = ""
    settings: Dict[str, object] = field(default_factory=dict)
    timing: Dict[str, float] = field(default_factory=dict)

    @property
    def nodes(self) -> List[str]:
        return list(self.heads) + list(self.mlps)

    def to_dict(self) -> Dict[str, object]:
        from .._foundation.io import json_number

        return {"schema": SCHEMA, "model": self.model, "heads": list(self.heads), "mlps": list(self.mlps),
                "node_faithfulness": json_number(self.node_faithfulness),
                "curve": {str(k): json_number(v) for k, v in self.curve.items()}, "how": self.how,
                "threshold": self.threshold, "pruned": list(self.pruned),
                "ranking": [[n, json_number(v)] for n, v in self.ranking], "clean": json_number(self.clean),
                "corrupt": json_number(self.corrupt), "settings": self.settings, "timing": self.timing}

    @classmethod
    def _from_dict(cls, d: Dict[str, Any]) -> "CoreCircuit":
        def num(v) -> float:
            return float("nan") if v is None else float(v)

        return cls([str(h) for h in d["heads"]], [str(m) for m in d["mlps"]], num(d["node_faithfulness"]),
                   {int(k): num(v) for k, v in d["curve"].items()}, str(d["how"]),
                   [(str(n), num(v)) for n, v in d.get("ranking", [])], [str(n) for n in d.get("pruned", [])],
                   num(d.get("clean")), num(d.get("corrupt")), float(d.get("threshold", THRESHOLD)),
                   str(d.get("model", "")), dict(d.get("settings", {})), dict(d.get("timing", {})))

    def top(self, k: int = 10) -> List[Tuple[str, float]]:
        """The core's ``k`` nodes of largest ranking score: ``(node, node score)``."""
        keep = set(self.nodes)
        return [(n, v) for n, v in self.ranking if n in keep][:k]

    def to_frame(self):
        """One row per grid point of the grow curve: heads in the prefix, f."""
        import pandas as pd

        return pd.DataFrame([{"heads": k, "f": v} for k, v in self.curve.items()])

    def circuit(self, scores):
        """The core as an edge circuit of ``scores``' graph: every edge between its nodes (the embedding and the
        logits included), so that ``TaskCircuit.roles`` and the edge-level views read it. ``TaskCircuit.nodes`` then
        holds its heads and MLPs."""
        from .selection import TaskCircuit

        g = scores.graph
        keep = {"emb", *self.heads, *self.mlps}
        send = torch.tensor([s in keep for s in g.senders])
        recv = torch.tensor([_reads(g, r, keep) for r in range(g.n_receivers)])
        mask = g.valid & send[:, None] & recv[None, :]
        return TaskCircuit(g, mask, scores.scores, "core", None, int(mask.sum()), getattr(scores, "model", ""), "core")

    def outside(self, scores, share: Optional[Real] = None) -> List[str]:
        """Heads not in the core whose direct or node effect reaches ``share`` (default ``roles.ALSO_SHARE``,
        5 %) of m(clean) − m(corrupt) in size, either sign (``roles.significant_heads``)."""
        from .roles import ALSO_SHARE, significant_heads

        keep = set(self.heads)
        return [h for h in significant_heads(scores, scores.clean, scores.corrupt,
                                             ALSO_SHARE if share is None else share) if h not in keep]

    def roles(self, model, task: Task, scores, share: Optional[Real] = None, **kw):
        """The roles of the core's heads, plus those of ``outside(scores, share)`` (so a negative name mover the
        core leaves out is named); each entry says ``in_circuit``. ``kw``: ``roles.roles``' own (``clean``,
        ``corrupt``, ``thresholds``); see ``qkcircuits._tasks.roles``."""
        from .roles import roles

        kw.setdefault("clean", scores.clean)
        kw.setdefault("corrupt", scores.corrupt)
        return roles(model, task, self.circuit(scores), also=self.outside(scores, share), **kw)

    def _text(self) -> str:
        shown = ", ".join(self.heads[:16]) + (" …" if len(self.heads) > 16 else "")
        mlps = f" + {len(self.mlps)} MLPs" if self.mlps else ""
        return (f"CoreCircuit({self.model}: {len(self.heads)} heads{mlps}, node f {self.node_faithfulness:.3f}; "
                f"heads {shown})")

    def _html(self) -> str:
        import html

        return f"<p>{html.escape(self._text())}</p><p>{html.escape(self.how)}</p>"


def _reads(g: Graph, r: int, keep) -> bool:
    """Receiver input r belongs to a kept node: the logits, a kept MLP's input, a kept head's q, or the k/v
    of a KV head one of whose query heads is kept."""
    name, into = g.receivers[r]
    if name == "logits":
        return True
    if into == "in":
        return name in keep
    return any(h in keep for h in g.receiver_heads(r))


# ----------------------------------------------------------------------------------------------- measuring


def node_mask_of(g: Graph, heads: Sequence[str], mlps: Optional[Sequence[str]]) -> Tensor:
    """Every edge of the graph except those leaving a head not in ``heads`` or (``mlps`` given) an MLP not in
    ``mlps``: the edge-level form of the node view (the embedding always sends)."""
    keep = set(heads) | (set(mlps) if mlps is not None else {n for n in g.senders if n.startswith("mlp")})
    out = torch.tensor([s == "emb" or s in keep for s in g.senders])
    return g.valid & out[:, None]


def node_rows(model, g: Graph, task: Task) -> int:
    """Rows per shard for the node view's corrupt record (z and MLP outputs of every layer) in ``NODE_BYTES``."""
    elt = model.W_E.element_size()
    per_row = task.clean.shape[1] * g.n_layers * (model.cfg.n_heads * model.cfg.d_head + model.cfg.d_model) * elt
    return max(1, min(task.n, NODE_BYTES // max(per_row, 1)))


class NodeViews:
    """Measures node views on one model and task: ``metrics(sets)`` → the metric mean of each (heads, MLPs)
    set (MLPs None: all clean). The corrupt records are held across calls when the task is one shard."""

    def __init__(self, model, task: Task, rows_per_shard: Optional[int] = None, clean: Optional[float] = None):
        from .shards import shard_rows

        self.model, self.g = model, graph(model)
        self.task = task.to(model.W_E.device)
        self.fast = z_patchable(model, self.g)
        self.rows = rows_per_shard or (node_rows(model, self.g, self.task) if self.fast
                                       else shard_rows(model, self.g, self.task, buffers=3))
        self.shards = self.task.shards(self.rows)
        self.keep: Optional[Dict[int, Record]] = {} if len(self.shards) == 1 else None
        self.clean = clean
        self.corrupt: Optional[float] = None
        self.calls = 0

    def _record(self, j: int, shard: Task) -> Record:
        if self.keep is not None and j in self.keep:
            return self.keep[j]
        rec = (z_record(self.model, self.g, shard, shard.corrupt, mlps=True) if self.fast
               else record(self.model, self.g, shard, shard.corrupt))
        if self.keep is not None:
            self.keep[j] = rec
        return rec

    def metrics(self, sets: Sequence[NodeSet]) -> List[float]:
        g = self.g
        sums = [0.0] * len(sets)
        clean = corrupt = 0.0
        for j, shard in enumerate(self.shards):
            rec = self._record(j, shard)
            corrupt += float(rec.rows.sum())
            if self.clean is None:
                clean += float(clean_rows(self.model, shard).sum())
            for i, (heads, mlps) in enumerate(sets):
                if self.fast:
                    keep = set(heads)
                    out = [_head_key(n) for n in g.senders if _is_head(n) and n not in keep]
                    mlp_out = [] if mlps is None else [L for L in range(g.n_layers) if g.has_mlp
                                                       and f"mlp{L}" not in set(mlps)]
                    sums[i] += float(node_run(self.model, g, shard, rec, out, mlp_out).sum())
                else:
                    sums[i] += float(patched_run(self.model, g, shard, rec, node_mask_of(g, heads, mlps)[None]).sum())
            self.calls += len(sets)
        n = self.task.n
        if self.clean is None:
            self.clean = clean / n
        self.corrupt = corrupt / n
        return [s / n for s in sums]


# ----------------------------------------------------------------------------------------------- the search


def grid(n: int) -> List[int]:
    """Head counts the grow curve measures: 1 … 8, then ×1.5 (rounded) up to ``n`` (always included)."""
    out = list(range(1, min(n, 8) + 1))
    k = out[-1] if out else 0
    while k < n:
        k = min(n, max(k + 1, int(round(k * 1.5))))
        out.append(k)
    return out


def rank(node_scores: Dict[str, float], sign: float, by: str, mlps: bool) -> List[Tuple[str, float]]:
    """Heads (and with ``mlps`` MLPs) best first by ``sign`` × score (``by="signed"``) or |score| (``"abs"``);
    ties keep the graph's order."""
    if by not in ("signed", "abs"):
        raise QKCircuitsError(f"by must be 'signed' or 'abs', got {by!r}")
    items = [(n, float(v)) for n, v in node_scores.items() if _is_head(n) or (mlps and n.startswith("mlp"))]
    key = (lambda t: -abs(t[1])) if by == "abs" else (lambda t: -sign * t[1])
    return sorted(items, key=lambda t: (key(t) if math.isfinite(t[1]) else math.inf))


def prefix(order: Sequence[str], k: int) -> List[str]:
    """The longest prefix of ``order`` holding ``k`` heads: up to (not including) the (k+1)-th head."""
    seen = 0
    for i, n in enumerate(order):
        if _is_head(n):
            if seen == k:
                return list(order[:i])
            seen += 1
    return list(order)


def search(order: Sequence[str], all_mlps: Sequence[str], f_of: Callable[[Sequence[Sequence[str]]], List[float]],
           threshold: float, prune: bool = True) -> Tuple[List[str], float, Dict[int, float], List[str], str]:
    """Grow then prune over ``order`` (the ranked candidates) with ``f_of(node lists) → f each``. MLPs not in
    ``order`` are always kept (``mlps=False``: ``all_mlps`` is then every MLP). Returns (nodes, f, curve,
    pruned, what happened in words)."""
    fixed = [m for m in all_mlps if m not in set(order)]
    n_heads = sum(_is_head(n) for n in order)
    ks = [0] + grid(n_heads)
    fs = f_of([prefix(order, k) + fixed for k in ks])
    curve = dict(zip(ks, fs))
    hit = next((i for i, v in enumerate(fs) if v >= threshold), None)
    if hit is None:
        return list(order) + fixed, float(curve[n_heads]), curve, [], "no prefix reaches"
    lo, hi, f_hi = (ks[hit - 1] if hit else -1), ks[hit], fs[hit]
    while hi - lo > 1:                   # bisection: a k whose prefix reaches the threshold and whose k − 1 does not
        mid = (lo + hi) // 2
        (f_mid,) = f_of([prefix(order, mid) + fixed])
        if f_mid >= threshold:
            hi, f_hi = mid, f_mid
        else:
            lo = mid
    nodes, f, grown, dropped = prefix(order, hi), f_hi, hi, []
    # Weakest first. A node that stayed was tried against the set as it was then; only a removal after that
    # try changes its set, so the next pass retries only the nodes tried before the pass's last removal.
    todo = list(reversed(nodes)) if prune else []
    while todo:
        last, failed = -1, []
        for i, n in enumerate(todo):
            trial = [m for m in nodes if m != n]
            (ft,) = f_of([trial + fixed])
            if ft >= threshold:
                nodes, f, last = trial, ft, i
                dropped.append(n)
            else:
                failed.append((i, n))
        todo = [n for i, n in failed if i < last]
    return nodes + fixed, float(f), curve, dropped, f"grown to {grown} heads"


def core_circuit(model, task: Task, scores, *, threshold: Real = THRESHOLD, by: str = "signed", mlps: bool = True,
                 prune: bool = True, rows_per_shard: Optional[int] = None, progress: bool = True,
                 backend: Any = None) -> CoreCircuit:
    """The fewest heads (and MLPs) whose node view reaches f ≥ ``threshold``, grown from ``scores``' node
    scores and pruned (module docstring). ``scores``: ``qk.edge_scores`` (node score = the sum of a node's
    outgoing edge scores) or ``qk.node_scores``. ``mlps=False``: every MLP stays clean and only heads are
    searched. ``backend`` as in ``edge_scores`` (on Ray, every measured set is summed over prompt shards)."""
    from .shards import check_task

    check_plain(scores)
    if backend is not None:
        from .._foundation.backends import as_backend

        return as_backend(backend).run("core_circuit", model, local=core_circuit, task=task, scores=scores,
                                       threshold=threshold, by=by, mlps=mlps, prune=prune,
                                       rows_per_shard=rows_per_shard, progress=progress)
    check_task(model, task)
    views = NodeViews(model, task, rows_per_shard, clean=known_clean(model, task, scores))
    return build_core(views.g, task, scores, lambda sets: views.metrics(sets), lambda: (views.clean, views.corrupt),
                      threshold=threshold, by=by, mlps=mlps, prune=prune, progress=progress,
                      settings={"rows_per_shard": views.rows, "node_run": "z" if views.fast else "patched"})


def known_clean(model, task: Task, scores) -> Optional[float]:
    """m(clean) from ``scores`` when they were measured on this very task and these weights (their
    ``task_digest`` matches), else None (``faithfulness`` does the same)."""
    digest = getattr(scores, "settings", {}).get("task_digest")
    clean = getattr(scores, "clean", None)
    if digest is None or clean is None or not math.isfinite(float(clean)) or digest != task.digest(model):
        return None
    return float(clean)


def check_plain(scores) -> None:
    """One line for position-aware scores (module docstring): the core's nodes are heads and MLPs at every position."""
    g = getattr(scores, "graph", None)
    names = getattr(scores, "scores", None)
    if (isinstance(g, Graph) and g.positions) or (isinstance(names, dict) and any("@" in str(n) for n in names)):
        raise QKCircuitsError("core_circuit: the scores are position-aware (nodes like 20.0@END); the core's node view "
                              "corrupts a head at every position: score the plain graph (positions=False)")


def node_scores_of(scores) -> Dict[str, float]:
    """{node: score} of an ``EdgeScores`` (sums of outgoing edge scores) or a ``NodeScores``."""
    check_plain(scores)
    if callable(getattr(scores, "node_scores", None)):
        return scores.node_scores()
    if isinstance(getattr(scores, "scores", None), dict):
        return dict(scores.scores)
    raise QKCircuitsError(f"scores must be qk.edge_scores(...) or qk.node_scores(...), got {type(scores).__name__}")


def build_core(g: Graph, task: Task, scores, metrics: Callable[[Sequence[NodeSet]], List[float]],
               ends: Callable[[], Tuple[float, float]], *, threshold: Real, by: str, mlps: bool, prune: bool,
               progress: bool, settings: Dict[str, object]) -> CoreCircuit:
    """The search of ``core_circuit`` on any way of measuring: ``metrics(sets)`` gives the metric means of
    (heads, MLPs) sets, ``ends()`` then (m(clean), m(corrupt)). Local: ``NodeViews``; Ray: ``ray_tasks``."""
    from tqdm.auto import tqdm

    if isinstance(threshold, bool) or not isinstance(threshold, Real) or not 0 < float(threshold) <= 1:
        raise QKCircuitsError(f"threshold must be a number in (0, 1], got {threshold!r}")
    t0 = time.perf_counter()
    sign = 1.0 if task.higher_is_better else -1.0
    ranking = rank(node_scores_of(scores), sign, by, mlps and g.has_mlp)
    all_mlps = [f"mlp{L}" for L in range(g.n_layers)] if g.has_mlp else []
    bar = tqdm(desc="core circuit", unit="set", disable=not progress, leave=False, file=sys.stderr)
    measured = [0]

    def f_of(node_lists: Sequence[Sequence[str]]) -> List[float]:
        sets = [(tuple(n for n in ns if _is_head(n)), tuple(n for n in ns if n.startswith("mlp"))) for ns in node_lists]
        values = metrics(sets)
        clean, corrupt = ends()
        bar.update(len(sets))
        measured[0] += len(sets)
        return [ratio(v, clean, corrupt) for v in values]

    try:
        nodes, f, curve, dropped, what = search([n for n, _ in ranking], all_mlps, f_of, float(threshold), prune)
    finally:
        bar.close()
    clean, corrupt = ends()
    heads = sorted((n for n in nodes if _is_head(n)), key=_head_key)
    kept_mlps = sorted((n for n in nodes if n.startswith("mlp")), key=lambda m: int(m[3:]))
    how = _how(scores, by, mlps and g.has_mlp, g.has_mlp, threshold, what, heads, kept_mlps, dropped, prune)
    return CoreCircuit(heads, kept_mlps, f, curve, how, ranking, dropped, clean, corrupt, float(threshold),
                       getattr(scores, "model", ""),
                       {"by": by, "mlps": "searched" if mlps and g.has_mlp else "clean", "prune": prune,
                        "method": getattr(scores, "method", ""), "sets_measured": measured[0], **settings},
                       {"core_s": round(time.perf_counter() - t0, 3)})


def _how(scores, by: str, mlps: bool, has_mlp: bool, threshold: Real, what: str, heads: List[str],
         kept_mlps: List[str], dropped: List[str], prune: bool) -> str:
    method = str(getattr(scores, "method", "") or "").upper()
    ranked = f"heads{' and MLPs' if mlps else ''} ranked by {by} {method + ' ' if method else ''}node score"
    clean_mlps = " (every MLP kept clean)" if has_mlp and not mlps else ""
    if what == "no prefix reaches":
        return f"{ranked}; no prefix reaches node f >= {threshold:g}, so the core is every node{clean_mlps}"
    pruned = (f", then {len(dropped)} node{'s' if len(dropped) != 1 else ''} dropped while f stayed >= {threshold:g}"
              if prune else "")
    mlp_part = f" + {len(kept_mlps)} MLPs" if mlps else clean_mlps
    return (f"{ranked} (sum of outgoing edge scores); grown along the ranking until node f >= {threshold:g} "
            f"({what}){pruned}: {len(heads)} heads{mlp_part}")
