"""Edge and node scores over the whole graph: EAP, EAP-IG (inputs, activations), clean-corrupted and exact
edge patching.

>>> task = qk.tasks.induction(model, n=8, seg_len=6)
>>> s = qk.edge_scores(model, task, method="eap-ig", steps=3, progress=False)
>>> [e[:3] for e in s.top(2)]
[('1.0', 'logits', 'in'), ('emb', '1.0', 'v')]

For an edge s → r (sender s, receiver input r) with Δ_s = out_s(clean) − out_s(corrupt) [b, p, d]:

- exact:   score = m(clean) − m(clean with r reading out_s(corrupt) instead of out_s(clean))
- EAP:     score ≈ Σ_{b,p,d} Δ_s · ∂m/∂x_r  at the clean run          (Syed et al. 2023)
- EAP-IG:  score ≈ Σ_{b,p,d} Δ_s · (1/k) Σ_j ∂m/∂x_r |_(e_corrupt + α_j (e_clean − e_corrupt))
  (Hanna et al. 2024, arXiv 2403.17806, "inputs" variant: the *input embeddings* e are interpolated;
  ``rule="left"``, the default and the authors' code: α_j = j/k, j = 0..k−1; "right": j = 1..k, so k = 1 is
  EAP; "midpoint": (j + ½)/k). As k grows it tends to the integrated gradient along the joint corrupt → clean
  path, not to exact (the integral along the edge's own segment); agreement with exact on tiny models is
  measured in docs/tasks.md. EAP-IG on activations and clean-corrupted: ``gradients.py``.

where x_r is the receiver's own copy of the residual (graph.py) and m the task metric SUMMED over rows;
``positions=True`` splits every edge by position group γ (``positions.py``: the sums above over the positions
of γ only; exact patches r at those positions only), ``gqa="ungrouped"`` gives each query head its own k/v input
(``ungrouped.py``);
scores are divided by the number of prompts, so they are in metric units per prompt. A positive score:
the edge carries the behaviour (corrupting it lowers m). Node scores (a sender's output corrupted for
every reader) are the same three ways; for EAP / EAP-IG a node's score is the sum of its outgoing edges'.

Cost (per prompt shard): EAP one corrupt forward + one clean forward with gradients + one backward;
EAP-IG one corrupt forward + ``steps`` forward/backward pairs + one clean forward without gradients (the right
rule's last step IS the clean run, so it spares that forward); exact one
patched forward per edge (stacked ``copies`` at a time). Memory (EAP / EAP-IG): the shard's sender outputs
of the clean and the corrupt run, 2 × [S, b, p, d] (S senders), every receiver's gradient summed over the
steps, [R, b, p, d] in float32 (R receiver inputs), and one forward's autograd graph; shards are sized so
those buffers fit ``GRAD_SHARD_BYTES`` (1 GiB: SmolLM2's 64 IOI prompts × 17 tokens run as 25 + 25 + 14).
The three buffers are allocated for the first shard and reused by the others (``record.reuse``). Where a
layer's q/k/v input has a closed form (``inputs.py``: RMSNorm / LayerNorm, float32/64) the gradient run
holds no per-head residual copies: the receiver gradients come from the model's own hook_q/k/v gradients
through the closed-form VJP; elsewhere each head reads an expanded copy and autograd keeps its normed
input ([H + 2 G, b, p, d] per layer) in the graph. The summed gradients meet Δ once, in blocked matmuls
(``gradients.GRAD_BLOCK_BYTES`` of receivers each), and are reduced to [senders, receivers] scores.
"""

from __future__ import annotations

from numbers import Real

import time
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from .._foundation.result import Result, stamped
from .._foundation.arch.model_facts import folded
from .._foundation.errors import QKCircuitsError
from .._foundation.shards import Plan, Sharded, row_blocks
from .gradients import gradient_scores, n_runs, points, resolve_rule
from .graph import Graph, graph, provenance
from .exact import exact_edges, exact_node_sums
from .positions import at, position_groups
from .record import check_graph, record
from .runs import z_patchable
from .row_budget import DELTA_BYTES, EXACT_BYTES, GRAD_SHARD_BYTES, check_task, shard_rows  # noqa: F401 (re-exported)
from .task import Task, warn_if_not_done, with_reference
from .ungrouped import check as check_ungrouped

METHODS = ("eap", "eap-ig", "exact", "eap-ig-activations", "clean-corrupted")
SCHEMA = "qkcircuits.edge_scores/1"


def _bar(total: int, desc: str, progress: bool):
    from .._foundation.progress import progress_bar

    return progress_bar(total=total, desc=desc, enabled=progress)


@dataclass(frozen=True, repr=False)      # the repr is _text (Result)
class EdgeScores(Result):
    """A score per edge (``scores[s, r]``, NaN where s does not feed r), the method and its settings. A
    position-aware graph's scores per group are ``position_scores[γ, s, r]``; ``scores`` is then their sum over
    the groups (for EAP / EAP-IG the plain scores themselves).

    >>> s = qk.edge_scores(model, qk.tasks.induction(model, n=4, seg_len=5), method="eap")
    >>> s.to_frame().columns.tolist()
    ['sender', 'receiver', 'input', 'score']
    """

    SCHEMA = SCHEMA
    WHAT = "an edge-scores JSON (qk.edge_scores(...).to_json())"
    KEYS = ("method", "steps", "clean", "corrupt", "task", "graph", "scores")

    graph: Graph
    scores: Tensor
    method: str
    steps: int
    clean: Real
    corrupt: Real
    task: Dict[str, object]
    model: str = ""
    settings: Dict[str, object] = field(default_factory=dict)
    timing: Dict[str, float] = field(default_factory=dict)
    position_scores: Optional[Tensor] = None     # [groups, S, R] on a position-aware graph

    def edge_list(self, by: str = "abs") -> List[Tuple[str, str, str, float]]:
        """Every edge (sender, receiver, input, score), best first by |score| (``by="abs"``) or score. On a
        position-aware graph the names carry the group: ``("5.6@S2", "20.kv0@S2", "k", score)``."""
        g = self.graph
        if self.position_scores is None:
            s_idx, r_idx = g.valid.nonzero(as_tuple=True)
            vals, grp = self.scores[s_idx, r_idx], None
        else:
            grp, s_idx, r_idx = g.valid[None].expand(g.n_groups, -1, -1).nonzero(as_tuple=True)
            vals = self.position_scores[grp, s_idx, r_idx]
        order = torch.argsort(vals.abs() if by == "abs" else vals, descending=True, stable=True)
        out = []
        for i in order.tolist():
            rn, x = g.receivers[int(r_idx[i])]
            sn = g.senders[int(s_idx[i])]
            if grp is not None:
                sn, rn = at(sn, g.positions[int(grp[i])]), at(rn, g.positions[int(grp[i])])
            out.append((sn, rn, x, float(vals[i])))
        return out

    def top(self, k: int = 10, by: str = "abs") -> List[Tuple[str, str, str, float]]:
        return self.edge_list(by)[:k]

    def to_frame(self):
        import pandas as pd

        return pd.DataFrame(self.edge_list(), columns=["sender", "receiver", "input", "score"])

    def node_scores(self) -> Dict[str, float]:
        """Per sender (heads, MLPs, embedding): the sum of its outgoing edges' scores (exact for the linear
        estimates EAP / EAP-IG: a node's Δ meets every reader's gradient). Position-aware: per sender and group,
        ``{"20.0@END": ..., "mlp3@S2": ..., "emb@IO": ...}`` (its output at that group's positions)."""
        if self.position_scores is not None:
            s = torch.nan_to_num(self.position_scores, nan=0.0).sum(2)                 # [groups, S]
            return {at(name, grp): float(s[gi, i]) for gi, grp in enumerate(self.graph.positions)
                    for i, name in enumerate(self.graph.senders)}
        s = torch.nan_to_num(self.scores, nan=0.0).sum(1)
        return {name: float(v) for name, v in zip(self.graph.senders, s)}

    @property
    def rule(self) -> Optional[str]:
        """EAP-IG's interpolation rule ("left", "right", "midpoint"; None for the other methods). A file written
        before the rule was recorded holds EAP-IG scores of the right rule, the one used then."""
        known = self.settings.get("rule")
        if known is not None or self.method not in ("eap-ig", "eap-ig-activations"):
            return known
        return "right"

    def circuit(self, edges: Optional[int] = None, percent: Optional[Real] = None, by: str = "signed",
                how: str = "top"):
        """The top ``edges`` (or ``percent`` % of the graph's edges, truncated as MIB does), ranked ``by``,
        chosen ``how`` (``qkcircuits._tasks.selection.select``). A size is required: the circuit of the smallest
        grid size with f ≥ 0.8 is ``qk.faithfulness(model, task, scores).circuit`` (the scores are never
        changed by a call, so this answer depends on nothing but its arguments)."""
        from .selection import select

        if edges is None and percent is None:
            raise QKCircuitsError("give edges=N or percent=P; the circuit of the smallest grid size with f >= 0.8 is "
                                  "qk.faithfulness(model, task, scores).circuit")
        return select(self, edges=edges, percent=percent, by=by, how=how)

    def to_mib(self, path=None, circuit=None, d_model: Optional[int] = None) -> str:
        """These scores as the MIB circuit track's JSON (an importance-score submission file; with ``circuit``,
        its edges are ``in_graph``), written to ``path`` when given; returns the text (``qkcircuits._tasks.mib``:
        names, grouped k/v split evenly over the group's query heads)."""
        from .mib import to_mib

        return to_mib(self, path, None if circuit is None else circuit.mask, d_model)

    @classmethod
    def from_mib(cls, path, model, gqa: str = "grouped") -> "EdgeScores":
        """Scores from a MIB circuit JSON (the EAP-IG library's ``Graph.to_json``) on ``model``'s graph (a loaded
        model, with ``gqa`` as in ``qk.graph``, or a graph); per-query-head k/v scores are summed into their KV
        head on the grouped graph, read one to one on the ungrouped one."""
        from .._foundation.model import model_name
        from .mib import read_mib

        g, scores, _, cfg = read_mib(path, model, gqa)     # method "mib"; clean / corrupt unknown (NaN)
        name = g.model_name if isinstance(model, Graph) else model_name(model)
        return cls(g, scores, "mib", 0, float("nan"), float("nan"),
                   {"metric": "logit-diff", "higher_is_better": True, "source": "mib"}, name,
                   {"source": str(path), "format": "mib", "d_model": cfg.get("d_model"), **provenance(g)})

    # ---------------------------------------------------------------------------------------- data
    def to_dict(self) -> Dict[str, object]:
        from .._foundation.io import json_floats, json_number

        # exact numbers (the order of the scores decides a circuit; labels and circuits must survive a round trip)
        return {"schema": SCHEMA, "model": self.model, "method": self.method, "steps": self.steps,
                "clean": json_number(self.clean), "corrupt": json_number(self.corrupt),
                "task": self.task,
                "graph": self.graph.to_dict(), "senders": list(self.graph.senders),
                "receivers": [list(r) for r in self.graph.receivers],
                "scores": json_floats(self.scores),
                "settings": self.settings, "timing": self.timing,
                **({} if self.position_scores is None else {"position_scores": json_floats(self.position_scores)})}

    @classmethod
    def _from_dict(cls, d: Dict[str, object]) -> "EdgeScores":
        from .._foundation.io import read_float, read_floats

        g = Graph.from_dict(d["graph"], d.get("model", ""))
        sc = read_floats(d["scores"])
        if tuple(sc.shape) != (g.n_senders, g.n_receivers):
            raise QKCircuitsError(f"scores are {tuple(sc.shape)}, but the graph has {g.n_senders} senders x "
                                  f"{g.n_receivers} receiver inputs")
        ps = None
        if g.positions:
            ps = read_floats(d.get("position_scores") or [])
            if tuple(ps.shape) != (g.n_groups, g.n_senders, g.n_receivers):
                raise QKCircuitsError(f"position_scores are {tuple(ps.shape)}, but the graph has {g.n_groups} position "
                                      f"groups x {g.n_senders} senders x {g.n_receivers} receiver inputs")
        return cls(g, sc, d["method"], d["steps"], read_float(d["clean"]), read_float(d["corrupt"]), d["task"],
                   d.get("model", ""), d.get("settings", {}), d.get("timing", {}), ps)

    def _text(self) -> str:
        top = "; ".join(f"{s}->{r} {x} {v:+.3g}" for s, r, x, v in self.top(3))
        return (f"EdgeScores({self.method}, {self.model}: {self.graph.n_edges} edges, clean {self.clean:.3g}, "
                f"corrupt {self.corrupt:.3g}; top: {top})")

    def _html(self) -> str:
        import html

        rows = "".join(f"<tr><td>{html.escape(s)}</td><td>{html.escape(r)}</td><td>{x}</td><td>{v:+.4g}</td></tr>"
                       for s, r, x, v in self.top(15))
        return (f"<p>{html.escape(self._text())}</p><table><tr><th>sender</th><th>receiver</th><th>input</th>"
                f"<th>score</th></tr>{rows}</table>")



def _settings(model, task: Task, rows: int, extra: Dict[str, object]) -> Dict[str, object]:
    """The run's settings; the library versions are ``Result``'s (``result.versions``, written in one place)."""
    return stamped({"rows_per_shard": rows, "bos_prepended": bool(task.bos), "dtype": str(model.W_E.dtype),
                    "d_model": int(model.cfg.d_model),
                    "fold_ln": folded(model), "task_digest": task.digest(model), **extra}, model, task)


def task_graph(model, task: Task, gqa: str = "grouped", positions: Any = False) -> Graph:
    """``qk.graph(model, gqa)``, split by ``task``'s position groups when ``positions`` is True (every named
    position) or a sequence of the task's position names (the others pooled in ``other``)."""
    g = graph(model, gqa)
    if positions is False or positions is None:
        return g
    return replace(g, positions=position_groups(positions, task))


def edge_scores(model, task: Task, method: str = "eap-ig", steps: int = 5, *, rule: Optional[str] = None,
                rows_per_shard: Optional[int] = None, copies: int = 32, progress: bool = True, check: bool = True,
                backend: Any = None, gqa: str = "grouped", positions: Any = False) -> EdgeScores:
    """Score every edge of ``qk.graph(model)`` for ``task`` (see the module docstring for formulas and cost).

    ``method``: "eap-ig" (default), "eap", "exact", "eap-ig-activations" or "clean-corrupted" (``gradients.py``).
    ``rule`` (EAP-IG's interpolation points): "left" (α = k/steps, k = 0 … steps−1: the authors' code and MIB,
    the default for "eap-ig"), "right" (k = 1 … steps: one clean forward fewer; the default of
    "eap-ig-activations", as the authors' code runs it) or "midpoint". ``gqa="ungrouped"``: k/v inputs per query
    head (the EAP-IG authors' and MIB's graph); ``positions=True`` (or a sequence of the task's position names):
    every edge split by position group (``position_scores``). ``rows_per_shard``: prompt rows per shard (default:
    as many as fit the memory budget). ``backend``: None (this process), ``qk.Local()``, ``qk.Ray(...)`` or a
    string as ``qk.as_backend``: the shards (``EDGE_SCORES``: prompt-row blocks, float64 sums added in order, then
    divided) run where the backend runs them, every graph option on every backend, the result the local one."""
    request = dict(task=task, method=method, steps=steps, rule=rule, rows_per_shard=rows_per_shard, copies=copies,
                   progress=progress, check=check, gqa=gqa, positions=positions)
    if backend is not None:
        from .._foundation.backends import as_backend

        return as_backend(backend).map(EDGE_SCORES, model, **request)
    return EDGE_SCORES.local(model, **request)


def _check_edges(*, task, method: str, steps, rule: Optional[str], **rest: Any) -> Dict[str, Any]:
    """The driver's checks of an edge-scores request (one line each, before anything loads or starts)."""
    check_method(method, steps)
    if not isinstance(task, Task):
        raise QKCircuitsError(f"task must be a qk.Task (qk.tasks.ioi / induction / from_jsonl), got "
                              f"{type(task).__name__}")
    return dict(task=task, method=method, steps=steps, rule=resolve_rule(method, rule), **rest)


class _Words:
    """What a not-done warning reads of the model (its tokenizer), without the model: the driver has none."""

    def __init__(self, model):
        self.tokenizer = getattr(model, "tokenizer", None)


def _plan_edges(model, *, task: Task, method: str, steps: int, rule: Optional[str], rows_per_shard: Optional[int],
                copies: int, progress: bool, check: bool, gqa: str, positions: Any) -> Plan:
    """The plan where the model is: the graph, the task with its reference, rows per shard (``rows_per_shard`` or
    the memory budget's: the same on every backend), one shard per block of rows."""
    from .._foundation.model import model_name

    check_task(model, task)
    g = task_graph(model, task, gqa, positions)
    task = with_reference(model, task.to(model.W_E.device))
    rows = rows_per_shard or (shard_rows(model, g, task, budget=EXACT_BYTES) if method == "exact"
                              else shard_rows(model, g, task, budget=GRAD_SHARD_BYTES, gradients=True))
    blocks = row_blocks(task.n, rows)
    extra = {"n_edges": g.n_edges, "copies": copies if method == "exact" else None, "rule": rule,
             "alphas": None if method == "exact" else points(method, steps, rule),
             "gradient_runs": None if method == "exact" else n_runs(g, method, steps, rule)}
    info = {"graph": g, "n": task.n, "task": task.describe(), "model": model_name(model), "words": _Words(model),
            "settings": _settings(model, task, rows, extra), "not_done": task.rows(slice(0, 1)).to("cpu")}
    how = {"method": method, "steps": steps, "rule": rule, "copies": copies, "progress": progress}
    return Plan({"task": task.to("cpu"), "graph": g, "how": how},
                [{"rows": ab, "check": check and i == 0} for i, ab in enumerate(blocks)], info,
                [float(b - a) for a, b in blocks])


def _edge_shard(model, shared: Dict[str, Any], scratch: Dict[str, Any], *, rows: Tuple[int, int],
                check: bool) -> Dict[str, Any]:
    """One block of prompt rows: its scores summed over its rows ([groups, S, R] float64), its clean and corrupt
    metric sums. ``scratch``: the gradient buffers, reused by the next shard on this process (``record.reuse``)."""
    g, how = shared["graph"], shared["how"]
    method, steps, rule, copies, progress = (how[k] for k in ("method", "steps", "rule", "copies", "progress"))
    shard = shared["task"].rows(slice(*rows)).to(model.W_E.device)
    acc = torch.zeros(g.n_groups, g.n_senders, g.n_receivers, dtype=torch.float64)
    t0 = time.perf_counter()
    bar = _bar(g.n_edges if method == "exact" else 1, f"edge scores ({method})", progress)
    # the gradient methods need only the heads' Δ = (z_clean − z_corrupt) W_O: the corrupt record keeps z, not the
    # heads' outputs (one head-output pass and a [heads, b, p, d] subtraction fewer), where outputs are linear in z;
    # on activations the record keeps each layer's attention output (which it records with the heads' outputs)
    deltas_from_z = method not in ("exact", "eap-ig-activations") and z_patchable(model, g)
    corr = record(model, g, shard, shard.corrupt, pool=None if method == "exact" else scratch, heads=not deltas_from_z)
    if check:
        check_graph(model, g, corr, shard.corrupt)
        check_ungrouped(model, g, shard.corrupt)
    corrupt = float(corr.rows.sum())
    if method == "exact":
        clean = exact_edges(model, g, shard, corr, acc, copies, bar)
    else:
        clean = gradient_scores(model, g, shard, corr, acc, method, steps, rule, scratch)
        bar.update(1)
    bar.close()
    return {"acc": acc, "clean": clean, "corrupt": corrupt, "s": time.perf_counter() - t0}


def _combine_edges(plan: Plan, parts: List[Dict[str, Any]], where: Optional[Dict[str, Any]], *, method: str,
                   steps: int, **_: Any) -> EdgeScores:
    """The shards' sums added in shard order (float64), divided by the number of prompts."""
    info, g = plan.info, plan.info["graph"]
    n = info["n"]
    acc = torch.zeros(g.n_groups, g.n_senders, g.n_receivers, dtype=torch.float64)
    clean = corrupt = 0.0
    for p in parts:
        acc += p["acc"]
        clean += p["clean"]
        corrupt += p["corrupt"]
    scores = (acc / n).float()
    scores[:, ~g.valid] = float("nan")
    warn_if_not_done(info["not_done"], clean / n, corrupt / n, stacklevel=4, model=info["words"])
    # position-aware: ``scores`` is the sum over the groups (for the gradient methods the plain scores: the Δ·∇
    # sums split by position), summed in float64
    plain = scores[0] if not g.positions else (acc.sum(0) / n).float().masked_fill_(~g.valid, float("nan"))
    settings = dict(info["settings"], **({"backend": {**where, "shards": len(parts)}} if where else {}))
    return EdgeScores(g, plain, method, steps if method in STEPPED else 0, clean / n, corrupt / n, info["task"],
                      info["model"], settings, {"edge_scores_s": round(sum(p["s"] for p in parts), 3)},
                      scores if g.positions else None)


# Edge scores, declared once: the shards every backend maps (``_foundation/shards``)
EDGE_SCORES = Sharded("edge_scores", _plan_edges, _edge_shard, _combine_edges, _check_edges)


STEPPED = ("eap-ig", "eap-ig-activations")


def check_method(method: str, steps) -> None:
    """One-line errors for an unknown method or bad ``steps`` (the stepped methods)."""
    if method not in METHODS:
        raise QKCircuitsError(f"unknown edge-score method {method!r}; use one of {', '.join(METHODS)}")
    if method in STEPPED and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise QKCircuitsError(f"steps must be an integer >= 1, got {steps!r}")


@dataclass(frozen=True, repr=False)      # the repr is _text (Result)
class NodeScores(Result):
    """A score per sender node (embedding, heads ``"L.H"``, MLPs ``"mlpL"``): m(clean) − m(node corrupted)."""

    SCHEMA = "qkcircuits.node_scores/1"
    WHAT = "a node-scores JSON (qk.node_scores(...).to_json())"
    KEYS = ("method", "scores")

    scores: Dict[str, float]
    method: str
    model: str = ""
    settings: Dict[str, object] = field(default_factory=dict)

    def top(self, k: int = 10, by: str = "abs", heads_only: bool = False) -> List[Tuple[str, float]]:
        items = [(n, v) for n, v in self.scores.items() if not heads_only or (n[0].isdigit())]
        items.sort(key=lambda t: -abs(t[1]) if by == "abs" else -t[1])
        return items[:k]

    def to_frame(self):
        import pandas as pd

        return pd.DataFrame(list(self.scores.items()), columns=["node", "score"])

    def to_dict(self) -> Dict[str, object]:
        from .._foundation.io import json_number

        return {"schema": self.SCHEMA, "model": self.model, "method": self.method,
                "scores": {n: json_number(v) for n, v in self.scores.items()}, "settings": self.settings}

    @classmethod
    def _from_dict(cls, d: Dict[str, object]) -> "NodeScores":
        from .._foundation.io import read_float

        return cls({str(n): read_float(v) for n, v in d["scores"].items()},
                   str(d["method"]), str(d.get("model", "")), dict(d.get("settings", {})))

    def _text(self) -> str:
        return f"NodeScores({self.method}, {self.model}: top {', '.join(f'{n} {v:+.3g}' for n, v in self.top(5))})"

    def _html(self) -> str:
        import html

        return f"<p>{html.escape(self._text())}</p>"



def node_scores(model, task: Task, method: str = "eap-ig", steps: int = 5, *, rule: Optional[str] = None,
                progress: bool = True, rows_per_shard: Optional[int] = None, copies: int = 32,
                backend: Any = None, gqa: str = "grouped", positions: Any = False) -> NodeScores:
    """Heads, MLPs and the embedding scored by a gradient method (sums of the edge scores; ``rule`` as in
    ``edge_scores``) or exactly (one patched run per node, every reader of the node reading its corrupt
    output). ``positions=True`` (or the task's position names): one node per sender and position group,
    ``"20.0@END"``, its output corrupted at that group's positions only. ``backend``, ``gqa`` as in
    ``edge_scores`` (exact: ``NODE_SCORES``' shards, prompt-row blocks)."""
    if method != "exact":
        es = edge_scores(model, task, method, steps, rule=rule, progress=progress, rows_per_shard=rows_per_shard,
                         gqa=gqa, positions=positions, backend=backend)
        return NodeScores(es.node_scores(), method, es.model, {**es.settings, "clean": es.clean, "corrupt": es.corrupt})
    request = dict(task=task, method=method, steps=steps, rule=rule, rows_per_shard=rows_per_shard, copies=copies,
                   progress=progress, check=False, gqa=gqa, positions=positions)
    if backend is not None:
        from .._foundation.backends import as_backend

        return as_backend(backend).map(NODE_SCORES, model, **request)
    return NODE_SCORES.local(model, **request)


def _plan_nodes(model, *, task: Task, method: str, steps: int, rule: Optional[str], rows_per_shard: Optional[int],
                copies: int, progress: bool, check: bool, gqa: str, positions: Any) -> Plan:
    """Exact node scores' plan: as edge scores' (a node's score does not depend on how k/v are counted)."""
    from .._foundation.model import model_name

    check_task(model, task)
    g = task_graph(model, task, gqa, positions)
    task = with_reference(model, task.to(model.W_E.device))
    rows = rows_per_shard or shard_rows(model, g, task, budget=EXACT_BYTES)
    blocks = row_blocks(task.n, rows)
    info = {"graph": g, "n": task.n, "model": model_name(model), "words": _Words(model),
            "settings": _settings(model, task, rows, {}), "not_done": task.rows(slice(0, 1)).to("cpu")}
    return Plan({"task": task.to("cpu"), "graph": g, "copies": copies}, [{"rows": ab} for ab in blocks], info,
                [float(b - a) for a, b in blocks])


def _node_shard(model, shared: Dict[str, Any], scratch: Dict[str, Any], *, rows: Tuple[int, int]
                ) -> Tuple[Tensor, float, float]:
    """One block of prompt rows: m(clean) − m(node off) summed over its rows per node, clean and corrupt sums."""
    shard = shared["task"].rows(slice(*rows)).to(model.W_E.device)
    return exact_node_sums(model, shared["graph"], shard, shared["copies"])


def _combine_nodes(plan: Plan, parts: List[Tuple[Tensor, float, float]], where: Optional[Dict[str, Any]],
                   **_: Any) -> NodeScores:
    info, g = plan.info, plan.info["graph"]
    n = info["n"]
    acc = torch.zeros(g.n_groups, g.n_senders, dtype=torch.float64)
    clean = corrupt = 0.0
    for a, c, z in parts:
        acc += a
        clean += c
        corrupt += z
    clean, corrupt = clean / n, corrupt / n
    vals = (acc / n).tolist()
    warn_if_not_done(info["not_done"], clean, corrupt, stacklevel=4, model=info["words"])
    names = (list(g.senders) if not g.positions else
             [at(name, grp) for grp in g.positions for name in g.senders])
    settings = dict(info["settings"], clean=clean, corrupt=corrupt,
                    **({"backend": {**where, "shards": len(parts)}} if where else {}))
    return NodeScores(dict(zip(names, [v for row in vals for v in row])), "exact", info["model"], settings)


# Exact node scores, declared once (``_foundation/shards``)
NODE_SCORES = Sharded("node_scores", _plan_nodes, _node_shard, _combine_nodes, _check_edges)
