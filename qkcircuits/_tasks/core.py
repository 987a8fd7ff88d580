"""The core circuit: the fewest heads (and MLPs) whose node view carries the behaviour, with a margin, and its
f on prompts it was not chosen on (``CoreCircuit``).

>>> task = qk.tasks.induction(model, n=8, seg_len=6)
>>> scores = qk.edge_scores(model, task, method="exact", progress=False)
>>> core = qk.core_circuit(model, task, scores, progress=False)
>>> core.heads, round(core.node_faithfulness, 3)
(['0.0', '1.0'], 1.0)

The node view of a set of nodes N (heads ``"L.H"`` and MLPs ``"mlpL"``): the clean rows run with every head
and MLP NOT in N giving its corrupt-run output to every reader (the embedding stays clean: it is the input),
and f(N) = (m(N) − m(corrupt)) / (m(clean) − m(corrupt)) (``nodeviews.py`` measures it: many sets per forward,
the layers nobody keeps skipped, the metric per prompt row). With every node in, it IS the clean run (f = 1).

**The criterion, with a margin.** A set is *enough* when the lower end of the 95 % bootstrap interval of its f over
the prompt rows it was chosen on is ≥ ``threshold`` (0.8; ``margin="interval"``, the default: a set that sits
just at 0.8 on these rows would fall below it on about half of other draws), or its f itself (``margin="none"``).
The bootstrap resamples the per-row metrics (no model run per resample; the same resampled rows for every set).

**The search** (``search``): backward elimination with re-linearisation, from every node down.

1. every head (and MLP, ``mlps=True``) starts in; its *cost* is the estimated loss of m when it is left out, in the
   metric's better direction: first the scores' node score (the sum of its outgoing edge scores: EAP / EAP-IG
   from the clean run), then, at every accepted smaller set, a_n from one forward and one backward AT that set
   (``NodeViews.attribute``: what the node adds given the nodes still in, which the clean-run estimate cannot
   see — a name mover matters only while the heads that point it at the name are in);
2. drop the cheapest nodes, as many as their summed cost fits in the set's room above the threshold (at least
   one; never more than twice the last accepted step), and measure the smaller set: enough → accepted, costs
   re-estimated there; not enough → the step is halved; a single node that misses is kept (in a set of more
   than ``BATCH`` = 48 nodes; in a smaller one the search moves on to 3);
3. ``prune=True``: then every node left is dropped alone and measured, in one stacked batch; the nodes that can
   go alone are tried together (else the one whose set keeps the highest lower end goes), and the batch is
   measured again, until none can go. Every node of the core is then needed: without any one of them the set
   is not enough (``needed`` holds f without each, measured).

The **ranking** is the order of elimination reversed (the core's nodes first, by their last cost), so every
accepted set is a prefix of it; the **curve** {heads in the prefix: f} holds those sets and the small prefixes of
the core (1 … 8 heads, then ×1.5), measured after the search: f rises along it to the core.

``holdout`` (a Task: other prompts of the same behaviour) measures the chosen core there: ``holdout["f"]`` with
its 95 % interval, the number to report (the core was not chosen on those rows).

Where a node view is a patched run (post-attention norms: Gemma-2/3) no backward is taken: the costs stay the
scores' node scores. Scores of the ungrouped graph give the same core as the grouped one (a node's score sums
its outgoing edges on either graph). Position-aware scores are refused in one line: their nodes are (head,
position group) pairs, and the node view here corrupts a head at every position. f of the clean run is 1 in every
resample, so every node is always enough, except where m(clean) = m(corrupt) (f undefined): the core is then every
node and ``how`` says so. The costs' direction is the one f rises in (the sign of m(clean) − m(corrupt) on these
rows). A metric on token rows (a batch mean per shard, no per-row values) has no interval: its margin is f itself.

Cost (``settings["forwards"]``, in plain forwards of the rows): one clean and one corrupt forward, per accepted
set one node view (a fraction of a forward: skipped layers) and one forward + backward (~3), per rejected set
one node view, the final leave-one-out batch and the curve's small sets (cheap: most layers skipped).
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from numbers import Real
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .._foundation.errors import QKCircuitsError
from .._foundation.result import Result
from .bootstrap import ratio_intervals
from .graph import Graph, provenance
from .nodeviews import NodeSet, NodeViews, head_key as _head_key, is_head as _is_head
from .nodeviews import node_mask_of, node_rows  # noqa: F401  (their home before nodeviews.py; tests import them here)
from .task import Task

THRESHOLD = 0.8
SCHEMA = "qkcircuits.core_circuit/1"
MARGINS = ("interval", "none")
BOOTSTRAP = 200          # resamples of the rows behind every lower end (the search's and the reported intervals)
BATCH = 48               # a set this small has its single nodes measured in one stacked batch, not one by one



# heads outside a circuit judged beside it (qk.roles' also=, CoreCircuit.outside): at least this share of the effect
ALSO_SHARE = 0.05


def significant_heads(scores, clean: Real, corrupt: Real, share: Real = ALSO_SHARE) -> List[str]:
    """Heads of ``scores``' graph whose direct effect (head → logits edge score) or node effect (the sum of its
    outgoing edge scores) is at least ``share`` × |m(clean) − m(corrupt)| in size, either sign; in graph order."""
    g = scores.graph
    denom = abs(float(clean) - float(corrupt))
    if not denom == denom or denom == 0:
        return []
    sc = torch.nan_to_num(scores.scores.float(), nan=0.0)
    out = []
    for L in range(g.n_layers):
        for h in range(g.n_heads):
            s = g.head_sender(L, h)
            if max(abs(float(sc[s, g.logits_receiver])), abs(float(sc[s].sum()))) >= float(share) * denom:
                out.append(f"{L}.{h}")
    return out

@dataclass(frozen=True, repr=False)      # the repr is _text (Result)
class CoreCircuit(Result):
    """The core circuit: ``heads`` and ``mlps`` kept, their node view's f on the rows they were chosen on
    (``node_faithfulness``) with its 95 % bootstrap ``interval``, the same on held-out rows (``holdout``: {n, f,
    interval, clean, corrupt}; empty when none were given), the ``curve`` {heads in the ranked prefix: f},
    ``how`` (one sentence), the ``ranking`` ((node, cost), the core first), the nodes ``pruned`` (in the order
    they were dropped), ``needed`` {core node: f without it}, the ``path`` of accepted sets [[heads, MLPs, f,
    lower end], ...], m(clean) / m(corrupt) of the selection rows and the ``margin`` rule."""

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
    interval: List[float] = field(default_factory=list)
    holdout: Dict[str, object] = field(default_factory=dict)
    margin: str = "interval"
    needed: Dict[str, float] = field(default_factory=dict)
    path: List[List[Real]] = field(default_factory=list)

    @property
    def nodes(self) -> List[str]:
        return list(self.heads) + list(self.mlps)

    @property
    def holdout_f(self) -> float:
        """f of the core on the held-out rows (NaN when none were given)."""
        return float(self.holdout.get("f", float("nan"))) if self.holdout else float("nan")

    def to_dict(self) -> Dict[str, object]:
        from .._foundation.io import json_number

        def nums(xs):
            return [json_number(x) for x in xs]

        hold = {k: (nums(v) if isinstance(v, list) else json_number(v) if isinstance(v, float) else v)
                for k, v in self.holdout.items()}
        return {"schema": SCHEMA, "model": self.model, "heads": list(self.heads), "mlps": list(self.mlps),
                "node_faithfulness": json_number(self.node_faithfulness), "interval": nums(self.interval),
                "holdout": hold, "margin": self.margin,
                "curve": {str(k): json_number(v) for k, v in self.curve.items()}, "how": self.how,
                "threshold": self.threshold, "pruned": list(self.pruned),
                "needed": {k: json_number(v) for k, v in self.needed.items()},
                "path": [[int(p[0]), int(p[1]), json_number(p[2]), json_number(p[3])] for p in self.path],
                "ranking": [[n, json_number(v)] for n, v in self.ranking], "clean": json_number(self.clean),
                "corrupt": json_number(self.corrupt), "settings": self.settings, "timing": self.timing}

    @classmethod
    def _from_dict(cls, d: Dict[str, Any]) -> "CoreCircuit":
        def num(v) -> float:
            return float("nan") if v is None else float(v)

        hold = {k: ([num(x) for x in v] if isinstance(v, list) else num(v) if k in ("f", "clean", "corrupt") else v)
                for k, v in dict(d.get("holdout") or {}).items()}
        return cls([str(h) for h in d["heads"]], [str(m) for m in d["mlps"]], num(d["node_faithfulness"]),
                   {int(k): num(v) for k, v in d["curve"].items()}, str(d["how"]),
                   [(str(n), num(v)) for n, v in d.get("ranking", [])], [str(n) for n in d.get("pruned", [])],
                   num(d.get("clean")), num(d.get("corrupt")), float(d.get("threshold", THRESHOLD)),
                   str(d.get("model", "")), dict(d.get("settings", {})), dict(d.get("timing", {})),
                   [num(x) for x in d.get("interval", [])], hold, str(d.get("margin", "none")),
                   {str(k): num(v) for k, v in dict(d.get("needed") or {}).items()},
                   [[int(p[0]), int(p[1]), num(p[2]), num(p[3])] for p in d.get("path", [])])

    def top(self, k: int = 10) -> List[Tuple[str, float]]:
        """The core's ``k`` nodes first in the ranking: ``(node, cost)``."""
        keep = set(self.nodes)
        return [(n, v) for n, v in self.ranking if n in keep][:k]

    def to_frame(self):
        """One row per measured prefix of the ranking: heads in the prefix, f."""
        import pandas as pd

        return pd.DataFrame([{"heads": k, "f": v} for k, v in sorted(self.curve.items())])

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
        """Heads not in the core whose direct or node effect reaches ``share`` (default ``ALSO_SHARE``,
        5 %) of m(clean) − m(corrupt) in size, either sign (``significant_heads``)."""
        keep = set(self.heads)
        return [h for h in significant_heads(scores, scores.clean, scores.corrupt,
                                             ALSO_SHARE if share is None else share) if h not in keep]

    def f_text(self) -> str:
        """"node f 0.912 [0.871-0.948] on the 43 selection rows; held-out 0.884 [0.80-0.95] on 21 rows"."""
        ci = f" [{self.interval[0]:.3f}-{self.interval[1]:.3f}]" if len(self.interval) == 2 else ""
        n = self.settings.get("rows")
        out = f"node f {self.node_faithfulness:.3f}{ci} on the {n} selection rows" if n else \
            f"node f {self.node_faithfulness:.3f}{ci}"
        if self.holdout:
            lo, hi = (list(self.holdout.get("interval") or []) + [float("nan")] * 2)[:2]
            out += f"; held-out {self.holdout_f:.3f} [{lo:.3f}-{hi:.3f}] on {self.holdout.get('n')} rows"
        return out

    def _text(self) -> str:
        shown = ", ".join(self.heads[:16]) + (" …" if len(self.heads) > 16 else "")
        mlps = f" + {len(self.mlps)} MLPs" if self.mlps else ""
        return f"CoreCircuit({self.model}: {len(self.heads)} heads{mlps}, {self.f_text()}; heads {shown})"

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


class Judge:
    """f and the lower end of its 95 % interval of per-row metrics [k, n] against the rows' clean and corrupt
    metrics, and whether a set is enough (``margin``: "interval" → lower end ≥ threshold, "none" → f ≥ it)."""

    def __init__(self, clean: Tensor, corrupt: Tensor, threshold: float, margin: str, n_boot: int = BOOTSTRAP,
                 seed: int = 0):
        self.clean, self.corrupt, self.threshold, self.margin = clean, corrupt, threshold, margin
        self.n_boot, self.seed = n_boot, seed
        self.c, self.z = float(clean.mean()), float(corrupt.mean())

    def __call__(self, rows: Tensor) -> Tuple[List[float], List[float], List[float]]:
        """(f, lower end, upper end) of each set."""
        m = rows.double().mean(1)
        f = [(float(v) - self.z) / (self.c - self.z) if self.c != self.z else float("nan") for v in m]
        lo, hi = ratio_intervals(rows, self.clean, self.corrupt, self.n_boot, self.seed)
        return f, lo.tolist(), hi.tolist()

    def enough(self, f: float, lo: float) -> bool:
        v = lo if self.margin == "interval" else f
        return math.isfinite(v) and v >= self.threshold

    def room(self, f: float, lo: float) -> float:
        """How much m may fall (metric units, better direction) before the set stops being enough (≥ 0)."""
        v = lo if self.margin == "interval" else f
        return max(0.0, (v - self.threshold) * abs(self.c - self.z)) if math.isfinite(v) else 0.0


def search(candidates: Sequence[str], fixed: Sequence[str], costs: Dict[str, float], measure, judge: Judge,
           sign: float, prune: bool = True, bar=None, by: str = "signed") -> Dict[str, Any]:
    """Backward elimination with re-linearisation (module docstring) over ``candidates`` (MLPs in ``fixed`` are
    always kept). ``measure``: ``sets(list of NodeSet) → [k, n]`` per-row metrics, ``clean_rows()``, and
    ``attribute(NodeSet) → (rows, {node: a_n}) | None``. Returns {nodes, f, lo, hi, path, chunks, needed, costs,
    what}."""

    def as_set(nodes: Sequence[str]) -> NodeSet:
        mlps = tuple(n for n in list(nodes) + list(fixed) if n.startswith("mlp"))
        return tuple(n for n in nodes if _is_head(n)), mlps

    def tick(k: int) -> None:
        if bar is not None:
            bar.update(k)

    K = list(candidates)
    f_K, lo_K, hi_K = (v[0] for v in judge(measure.clean_rows()[None]))
    tick(1)
    if not judge.enough(f_K, lo_K):
        return {"nodes": K, "f": f_K, "lo": lo_K, "hi": hi_K, "path": [(K, f_K, lo_K)], "chunks": [], "needed": {},
                "costs": dict(costs), "what": "not enough"}
    costs = dict(costs)
    path, chunks, step, kept = [(list(K), f_K, lo_K)], [], None, set()
    while K:                                # coarse: chunks of the cheapest nodes, the step halved on a miss
        order = sorted((n for n in K if n not in kept), key=lambda n: costs.get(n, 0.0))
        if not order:
            break
        room, total, c = judge.room(f_K, lo_K), 0.0, 0
        for n in order:                     # the cheapest nodes whose summed cost fits in the room (at least one)
            total += costs.get(n, 0.0)
            if c >= 1 and total > room:
                break
            c += 1
        c = max(1, min(c, step) if step is not None else c)
        drop = set(order[:c])
        trial = [n for n in K if n not in drop]
        (f2,), (lo2,), (hi2,) = judge(measure.sets([as_set(trial)]))
        tick(1)
        if judge.enough(f2, lo2):
            K, f_K, lo_K, hi_K = trial, f2, lo2, hi2
            # from ``order`` (a list), not the set: equal costs keep the ranking's order in every process (a set of
            # strings iterates in the order of their hashes, which Python seeds per process)
            chunks.append(sorted(order[:c], key=lambda n: -costs.get(n, 0.0)))
            path.append((list(K), f_K, lo_K))
            step = 2 * c
            # re-estimated where the set now stands: stale estimates near the threshold make many small misses
            got = measure.attribute(as_set(K)) if K else None
            if got is not None:
                costs.update({n: abs(v) if by == "abs" else sign * v for n, v in got[1].items()})
                tick(1)
        elif c == 1 and len(K) <= BATCH and prune:
            break                           # single nodes of a small set: measured all at once below
        elif c == 1:
            kept.add(order[0])              # this node cannot go now (measured); the next cheapest are tried
            step = None
        else:
            step = max(1, c // 2)
    without: Dict[str, float] = {}
    while prune and K:                      # every node left, dropped alone, measured (one stacked batch)
        trials = [[m for m in K if m != n] for n in K]
        fs, los, his = judge(measure.sets([as_set(t) for t in trials]))
        tick(len(trials))
        ok = sorted((i for i in range(len(K)) if judge.enough(fs[i], los[i])), key=lambda i: (-los[i], -fs[i]))
        if not ok:
            without = {n: fs[i] for i, n in enumerate(K)}
            break
        # every node that can go alone, tried together first; else the one whose set keeps the highest lower end
        best = ok[:1]
        if len(ok) > 1:
            both = [n for j, n in enumerate(K) if j not in set(ok)]
            (f2,), (lo2,), (hi2,) = judge(measure.sets([as_set(both)]))
            tick(1)
            if judge.enough(f2, lo2):
                best = ok
        gone = [K[i] for i in best]
        chunks.append(gone)
        if len(best) == 1:
            K, f_K, lo_K, hi_K = trials[best[0]], fs[best[0]], los[best[0]], his[best[0]]
        else:
            K, f_K, lo_K, hi_K = both, f2, lo2, hi2
        path.append((list(K), f_K, lo_K))
    return {"nodes": K, "f": f_K, "lo": lo_K, "hi": hi_K, "path": path, "chunks": chunks, "needed": without,
            "costs": costs, "what": "eliminated"}


def core_circuit(model, task: Task, scores, *, threshold: Real = THRESHOLD, by: str = "signed", mlps: bool = True,
                 prune: bool = True, margin: str = "interval", holdout: Any = None, seed: int = 0,
                 rows_per_shard: Optional[int] = None, progress: bool = True, backend: Any = None) -> CoreCircuit:
    """The fewest heads (and MLPs) whose node view is enough (f's lower 95 % end ≥ ``threshold`` on ``task``'s rows;
    ``margin="none"``: f itself), found by backward elimination from ``scores``' node scores, re-estimated at each
    accepted set (module docstring). ``scores``: ``qk.edge_scores`` or ``qk.node_scores`` of ``task``.
    ``mlps=False``: every MLP stays clean and only heads are searched. ``holdout``: a Task of other prompts of the
    same behaviour: the core's f is measured there too (``CoreCircuit.holdout``). ``seed``: the bootstrap's.
    ``backend`` as in ``edge_scores``: the search is one step where the backend runs steps (on Ray: one worker)."""
    from .row_budget import check_task

    check_plain(scores)
    _check_margin(margin)
    if backend is not None:
        from .._foundation.backends import as_backend

        return as_backend(backend).run("core_circuit", model, local=core_circuit, task=task, scores=scores,
                                       threshold=threshold, by=by, mlps=mlps, prune=prune, margin=margin,
                                       holdout=holdout, seed=seed, rows_per_shard=rows_per_shard, progress=progress)
    check_task(model, task)
    views = NodeViews(model, task, rows_per_shard)
    if holdout is not None and not isinstance(holdout, NodeViews):
        check_task(model, holdout)
    # a NodeViews of held-out rows is shared by callers judging several cores there (its corrupt and clean
    # runs made once): ``stability``
    held = holdout if isinstance(holdout, NodeViews) or holdout is None else NodeViews(model, holdout)
    return build_core(views.g, task, scores, views, held, threshold=threshold, by=by, mlps=mlps, prune=prune,
                      margin=margin, seed=seed, progress=progress,
                      settings={"rows_per_shard": views.rows, "node_run": "z" if views.fast else "patched"})


def _check_margin(margin: str) -> None:
    if margin not in MARGINS:
        raise QKCircuitsError(f"margin must be one of {', '.join(MARGINS)} (interval: the lower end of f's 95 % "
                              f"interval must reach the threshold; none: f itself), got {margin!r}")


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


def build_core(g: Graph, task: Task, scores, measure, held=None, *, threshold: Real, by: str, mlps: bool,
               prune: bool, margin: str = "interval", seed: int = 0, progress: bool = True,
               settings: Optional[Dict[str, object]] = None) -> CoreCircuit:
    """The search of ``core_circuit`` on any way of measuring node views (``measure``: ``NodeViews``;
    ``held``: the same on held-out rows, or None)."""
    from tqdm.auto import tqdm

    if isinstance(threshold, bool) or not isinstance(threshold, Real) or not 0 < float(threshold) <= 1:
        raise QKCircuitsError(f"threshold must be a number in (0, 1], got {threshold!r}")
    _check_margin(margin)
    t0 = time.perf_counter()
    # the metric's better direction here is the one f rises in: clean − corrupt's sign on these rows (the declared
    # direction when the model does the task; a task it does backwards, forced through, is searched as it runs)
    clean_rows, corrupt_rows = measure.clean_rows(), measure.corrupt_rows()
    gap = float(clean_rows.mean() - corrupt_rows.mean())
    sign = (1.0 if gap > 0 else -1.0) if gap != 0 else (1.0 if task.higher_is_better else -1.0)
    searched = mlps and g.has_mlp
    ranking0 = rank(node_scores_of(scores), sign, by, searched)
    all_mlps = [f"mlp{L}" for L in range(g.n_layers)] if g.has_mlp else []
    candidates = [n for n, _ in ranking0]
    fixed = [m for m in all_mlps if m not in set(candidates)]
    costs = {n: (abs(v) if by == "abs" else sign * v) if math.isfinite(v) else math.inf for n, v in ranking0}
    if margin == "interval" and task.metric.prompts != "task":
        # a metric on token rows is a batch mean per shard: every row holds the same value, so there is no
        # per-row interval to take a lower end of
        margin = "none"
        settings = {**(settings or {}), "margin_note": f"metric {task.metric_name} is a batch mean (no per-row "
                                                       f"values): f itself is held to the threshold"}
    judge = Judge(clean_rows, corrupt_rows, float(threshold), margin, BOOTSTRAP, seed)
    bar = tqdm(desc="core circuit", unit="set", disable=not progress, leave=False, file=sys.stderr)
    try:
        found = search(candidates, fixed, costs, measure, judge, sign, prune, bar, by)
        nodes = found["nodes"]
        # the ranking: the core by its last cost, then the dropped chunks, last dropped first
        final = found["costs"]
        order = sorted(nodes, key=lambda n: -final.get(n, 0.0))
        for chunk in reversed(found["chunks"]):
            order += chunk
        order += [n for n in candidates if n not in set(order)]
        ranking = [(n, float(final.get(n, costs.get(n, 0.0)))) for n in order]
        # the curve: the accepted sets (prefixes of the ranking) and the small prefixes of the core
        n_core = sum(_is_head(n) for n in nodes)
        small = [k for k in [0] + grid(n_core) if k < n_core]
        sets = [prefix(order, k) for k in small]
        fs, _, _ = judge(measure.sets([(tuple(n for n in p if _is_head(n)),
                                        tuple(n for n in list(p) + fixed if n.startswith("mlp"))) for p in sets]))
        bar.update(len(sets))
    finally:
        bar.close()
    curve = {k: f for k, f in zip(small, fs)}
    for ns, f, _ in reversed(found["path"]):
        curve[sum(_is_head(n) for n in ns)] = f
    curve = dict(sorted(curve.items()))
    heads = sorted((n for n in nodes if _is_head(n)), key=_head_key)
    kept_mlps = sorted(set(n for n in nodes if n.startswith("mlp")) | set(fixed), key=lambda m: int(m[3:]))
    hold: Dict[str, object] = {}
    held_before = float(getattr(held, "forwards", 0.0) or 0.0)
    if held is not None:
        hc, hz = held.clean_rows(), held.corrupt_rows()
        rows = held.sets([(tuple(heads), tuple(kept_mlps) if g.has_mlp else None)])
        hj = Judge(hc, hz, float(threshold), margin, BOOTSTRAP, seed)
        (hf,), (hlo,), (hhi,) = hj(rows)
        hold = {"n": int(hc.shape[0]), "f": hf, "interval": [hlo, hhi], "clean": hj.c, "corrupt": hj.z,
                "enough": bool(hj.enough(hf, hlo))}
    dropped = [n for chunk in found["chunks"] for n in chunk]
    how = _how(scores, by, searched, g.has_mlp, float(threshold), margin, found["what"], heads, kept_mlps, dropped,
               prune, measure.attribute is not None and getattr(measure, "fast", True))
    forwards = float(getattr(measure, "forwards", float("nan"))) + float(getattr(held, "forwards", 0.0) or 0.0) \
        - held_before       # a held-out NodeViews shared by several cores (stability): this core's part
    return CoreCircuit(heads, kept_mlps, found["f"], curve, how, ranking, dropped, judge.c, judge.z, float(threshold),
                       getattr(scores, "model", ""),
                       {"by": by, "mlps": "searched" if searched else "clean", "prune": prune,
                        "method": getattr(scores, "method", ""), "rows": int(judge.clean.shape[0]),
                        "sets_measured": int(getattr(measure, "sets_measured", 0)), "forwards": round(forwards, 2),
                        "bootstrap": BOOTSTRAP, "seed": seed, **(settings or {}), **provenance(g, task)},
                       {"core_s": round(time.perf_counter() - t0, 3)}, [found["lo"], found["hi"]], hold, margin,
                       {n: float(v) for n, v in found["needed"].items()},
                       [[sum(_is_head(n) for n in ns), sum(n.startswith("mlp") for n in ns), f, lo]
                        for ns, f, lo in found["path"]])


def _how(scores, by: str, mlps: bool, has_mlp: bool, threshold: float, margin: str, what: str, heads: List[str],
         kept_mlps: List[str], dropped: List[str], prune: bool, relinearised: bool) -> str:
    method = str(getattr(scores, "method", "") or "").upper()
    crit = (f"the lower end of f's 95 % interval on these rows >= {threshold:g}" if margin == "interval"
            else f"f >= {threshold:g}")
    clean_mlps = " (every MLP kept clean)" if has_mlp and not mlps else ""
    if what == "not enough":
        return (f"f is undefined (m(clean) = m(corrupt) on these rows), so the core is every node{clean_mlps}")
    start = f"heads{' and MLPs' if mlps else ''} ranked by {by} {method + ' ' if method else ''}node score"
    again = ", re-estimated at each accepted set by one forward and backward there" if relinearised else ""
    mlp_part = f" + {len(kept_mlps)} MLPs" if mlps else clean_mlps
    need = "; every node left is needed (each dropped alone, measured)" if prune else ""
    return (f"{start}{again}; {len(dropped)} nodes dropped, cheapest first, while {crit}: "
            f"{len(heads)} heads{mlp_part}{need}")
