"""The faithfulness of circuits (the top edges of a score): the curve, CPR, CMD, the node view.

>>> task = qk.tasks.induction(model, n=8, seg_len=6)
>>> scores = qk.edge_scores(model, task, method="exact", progress=False)
>>> c = scores.circuit(edges=4)
>>> sorted(c.heads)
['0.0', '1.0']
>>> f = qk.faithfulness(model, task, scores, sizes=(10, 50, 100), progress=False)
>>> round(f.curve[100.0], 6), f.chosen_percent, sorted(f.circuit.heads)
(1.0, 50.0, ['0.0', '1.0'])

Selection (``EdgeScores.circuit``, ``select``, ``prune``, the ``TaskCircuit`` result): ``selection.py``.

Faithfulness of a circuit C: ONE patched forward (runs.py) in which every edge not in C carries its
sender's corrupt-run output and every edge in C the sender's output in this patched run;

    f(C) = (m(C) − m(∅)) / (m(full) − m(∅)),   m(full) = clean run,  m(∅) = corrupt run.

Over a grid of sizes k (fractions of the graph's edges, 0 < k_1 < … < k_n ≤ 1), as MIB (Mueller et al. 2025,
arXiv 2504.13151) defines them, by the trapezoidal rule on the grid:

    CPR = ∫ f(C_k) dk   (higher is better),      CMD = ∫ |1 − f(C_k)| dk   (lower is better).

The same definition on every graph the scores carry: the ungrouped one (k/v per query head) and the
position-aware one (a circuit's edges are (sender, receiver input, position group); its patched run adds Δ at the
positions of each edge's group only, ``positions.py``). The node view of a circuit is its heads at every position;
``node_metric`` also takes heads at a position group (``"20.0@END"``: every other (head, group) corrupted).
"""
from __future__ import annotations

from numbers import Real

import time
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Optional, Sequence, Tuple

from torch import Tensor

from .._foundation.result import Result
from .._foundation.errors import QKCircuitsError
from .graph import Graph, graph, provenance
from .positions import group_index, position_groups, position_node_mask, split
from .record import Record, clean_rows
from .runs import node_run, z_patchable, z_record
from .selection import TaskCircuit
from .caveats import reached, unreached_message
from .curve import _check_graph_of, circuit_metric  # noqa: F401 (read from here: evaluation, find, tests)
from .task import Task, with_reference

SIZES = (0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100)
THRESHOLD = 0.8
SCHEMA = "qkcircuits.faithfulness/1"


def _area(xs: Sequence[float], ys: Sequence[float]) -> float:
    return float(sum((xs[i + 1] - xs[i]) * (ys[i + 1] + ys[i]) / 2 for i in range(len(xs) - 1)))


@dataclass(frozen=True, repr=False)      # the repr is _text (Result)
class Faithfulness(Result):
    """The faithfulness curve ``curve`` {percent: f}, CPR, CMD, the chosen circuit and its node view. ``reached``:
    whether a grid size below 100 % reaches the threshold (else the chosen circuit is the largest size, most
    often every edge: no circuit of the behaviour, and ``qk.faithfulness`` warns)."""

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
    circuit: TaskCircuit
    node_faithfulness: Real
    node_heads: List[str]
    model: str = ""
    settings: Dict[str, object] = field(default_factory=dict)
    timing: Dict[str, float] = field(default_factory=dict)
    # bootstrap intervals over prompts (``bootstrap.bootstrap_curve``; empty without ``bootstrap=``)
    bootstrap: Dict[str, object] = field(default_factory=dict)
    # the same circuits measured on held-out rows (``faithfulness(holdout=...)``): {n, clean, corrupt, curve,
    # cpr, cmd, node_faithfulness, bootstrap}; empty without one
    holdout: Dict[str, object] = field(default_factory=dict)

    def to_dict(self) -> Dict[str, object]:
        from .._foundation.io import finite_json, json_number

        extra = {"bootstrap": finite_json(self.bootstrap)} if self.bootstrap else {}
        if self.holdout:
            h = dict(self.holdout)
            h["curve"] = {str(k): v for k, v in h.get("curve", {}).items()}
            extra["holdout"] = finite_json(h)
        return {"schema": SCHEMA, "model": self.model, "clean": json_number(self.clean),
                "corrupt": json_number(self.corrupt), "curve": {str(k): json_number(v) for k, v in self.curve.items()},
                "metric_values": {str(k): json_number(v) for k, v in self.metric_values.items()},
                "n_edges": {str(k): v for k, v in self.n_edges.items()}, "cpr": json_number(self.cpr),
                "cmd": json_number(self.cmd), "chosen_percent": self.chosen_percent,
                "circuit": {**self.circuit.to_dict(), "node_faithfulness": json_number(self.node_faithfulness)},
                "settings": self.settings, "timing": self.timing, **extra}

    @classmethod
    def _from_dict(cls, d: Dict[str, object]) -> "Faithfulness":
        from .._foundation.io import read_float as num

        c = TaskCircuit._from_dict({"model": d.get("model", ""), **d["circuit"]})
        return cls({float(k): num(v) for k, v in d["curve"].items()},
                   {float(k): num(v) for k, v in d["metric_values"].items()},
                   {float(k): int(v) for k, v in d["n_edges"].items()}, num(d["clean"]), num(d["corrupt"]),
                   num(d["cpr"]), num(d["cmd"]), float(d["chosen_percent"]), c,
                   num(d["circuit"].get("node_faithfulness")), c.heads, str(d.get("model", "")),
                   dict(d.get("settings", {})), dict(d.get("timing", {})), dict(d.get("bootstrap") or {}),
                   _holdout_from(d.get("holdout")))

    @property
    def reached(self) -> bool:
        return reached(self.curve, float(self.settings.get("threshold", THRESHOLD)))

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
        b = self.bootstrap
        ci = (f" ({100 * b['level']:g} % intervals over {b['n']} resamples of the prompts: CPR "
              f"{b['cpr'][0]:.3f}-{b['cpr'][1]:.3f}, CMD {b['cmd'][0]:.3f}-{b['cmd'][1]:.3f})") if b else ""
        return (f"Faithfulness({self.model}: {pts}; CPR {self.cpr:.3f}, CMD {self.cmd:.3f}{ci}; circuit "
                f"{self.chosen_percent:g}% = {self.circuit.n_edges} edges, {len(self.node_heads)} heads, node f "
                f"{self.node_faithfulness:.3f})")

    def _html(self) -> str:
        import html

        return f"<p>{html.escape(self._text())}</p>"



def _holdout_from(h) -> Dict[str, object]:
    """The ``holdout`` entry read back (percent keys as floats, null numbers as NaN)."""
    from .._foundation.io import read_float as num

    if not h:
        return {}
    out = dict(h)
    out["curve"] = {float(k): num(v) for k, v in dict(h.get("curve") or {}).items()}
    for k in ("clean", "corrupt", "cpr", "cmd", "node_faithfulness"):
        if k in out:
            out[k] = num(out[k])
    return out


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
    patched run of ``node_mask``.
    Heads at a position group (``"20.0@END"``, ``"7.1@other"``; the groups are the task's named positions
    and ``other``): every head at every group NOT in ``heads`` gives its corrupt output at that group's positions
    (a head named without a group is kept at every group)."""
    from .row_budget import shard_rows

    g = graph(model)
    task = with_reference(model, task.to(model.W_E.device))
    rows = rows_per_shard or shard_rows(model, g, task, buffers=3)
    if any(split(h)[1] is not None for h in heads):
        return _position_node_metric(model, task, g, heads, rows, need_clean, records)
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


def _position_node_metric(model, task: Task, g: Graph, heads: Sequence[str], rows: int, need_clean: bool,
                          records: Optional[Dict[int, Record]]) -> Tuple[float, float, float]:
    """``node_metric`` of heads at position groups: one plain forward per shard whose hook_z takes the corrupt
    z of each left-out (head, group) at that group's positions (``runs.node_run(where=)``), or, under a
    post-attention norm, the patched run of ``position_node_mask``."""
    from dataclasses import replace

    g = replace(g, positions=position_groups(task))
    if not z_patchable(model, g):
        (m,), full, corrupt = circuit_metric(model, task, [position_node_mask(g, heads)], rows, need_clean=need_clean,
                                             records=records, g=g)
        return m, full, corrupt
    kept = position_node_mask(g, heads).any(2)             # [groups, S]: the sender's output is kept at the group
    m = corrupt = clean = 0.0
    for j, shard in enumerate(task.shards(rows)):
        corr = records[j] if records is not None and j in records else z_record(model, g, shard, shard.corrupt)
        idx = group_index(shard, g.positions)
        where = {}
        for L in range(g.n_layers):
            for h in range(g.n_heads):
                out_at = ~kept[:, g.head_sender(L, h)]                               # [groups]
                if bool(out_at.any()):
                    where[(L, h)] = out_at.to(idx.device)[idx]                       # [b, pos]
        m += float(node_run(model, g, shard, corr, list(where), where=where).sum())
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
                 progress: bool = True, backend: Any = None, bootstrap: int = 0, seed: int = 0,
                 holdout: Optional[Task] = None) -> Faithfulness:
    """The faithfulness curve over ``sizes`` (percent of edges, truncated to whole edges as MIB does), CPR/CMD,
    the chosen circuit (the smallest grid size with f ≥ ``threshold``, else the largest, with a warning: no size
    below 100 % reaching it means no circuit) and its node view (module docstring). ``scores`` are read, never
    changed (``scores.circuit()`` needs a size; this result's ``circuit`` is the chosen one). Cost: one
    patched forward per size and prompt shard, one for the node view, one corrupt forward per shard, and
    one clean forward per shard for m(full) unless the scores measured it on this task and these weights
    (``scores.settings["task_digest"]`` equals ``task.digest(model)``: their m(clean) is taken). Memory: the shard's corrupt record and the patched
    run's sender outputs, ~3 × [S, rows, pos, d_model]. ``backend`` as in ``edge_scores``: the curve's circuit
    metrics are the shards ``curve.CIRCUIT_METRIC`` (prompt-row blocks, float sums added in order, divided by n;
    f computed once from them) on every backend and graph; the node view is one step (``node_view``).
    ``bootstrap``: that many resamples of the prompt rows (seeded by ``seed``) give 95 % intervals of each f,
    CPR and CMD from the per-row metrics, with no model run per resample (``bootstrap.py``; the clean rows
    are then run even when the scores measured m(clean)). ``holdout``: a Task of other prompts of the same
    behaviour: the grid's circuits (chosen on ``task``) are measured there too, with 95 % intervals over its rows
    (``bootstrap`` resamples, 200 when 0; no model run per resample), in ``Faithfulness.holdout`` — the
    numbers to report, since the circuits were not chosen on those rows."""
    from .._foundation.backends import as_backend
    from .bootstrap import check_bootstrap
    from .curve import CIRCUIT_METRIC

    check_bootstrap(bootstrap)
    sizes = sorted({float(s) for s in sizes})
    if not sizes or sizes[0] < 0 or sizes[-1] > 100:
        raise QKCircuitsError(f"sizes must be percents in 0-100, got {sizes!r}")
    if backend is None:      # this process: a loaded model and a task whose ids fit it, checked before any run
        from .row_budget import check_task

        check_task(model, task)
    request = dict(scores=scores, sizes=sizes, by=by, how=how, progress=progress)
    with as_backend(backend).pool(model) as p:
        t0 = time.perf_counter()
        m = p.map(CIRCUIT_METRIC, task=task, rows_per_shard=rows_per_shard, per_row=bool(bootstrap), use_known=True,
                  **request)
        circuits, rows = m["circuits"], m["rows"]
        values, clean, corrupt = m["values"], m["clean"], m["corrupt"]
        curve, chosen, circuit = choose(sizes, circuits, values, clean, corrupt, threshold)
        t1 = time.perf_counter()
        nf = p.run("node_view", local=node_view, task=task, heads=circuit.heads, rows=rows, clean=clean)
        out = finish(sizes, circuits, values, clean, corrupt, curve, chosen, circuit, nf, getattr(scores, "model", ""),
                     {"by": by, "how": how, "threshold": threshold, "rows_per_shard": rows}, t0, t1, m["per_row"],
                     bootstrap, seed, threshold, task)
        if holdout is not None:
            h = p.map(CIRCUIT_METRIC, task=holdout, rows_per_shard=None, per_row=True, use_known=False, **request)
            hnf = p.run("node_view", local=node_view, task=holdout, heads=circuit.heads, rows=h["rows"],
                        clean=h["clean"])
            out = replace(out, holdout=held_out(h, sizes, hnf, bootstrap or HELD_BOOTSTRAP, seed))
    return out


def node_view(model, *, task: Task, heads: Sequence[str], rows: int, clean: float) -> float:
    """The step ``node_view``: the node faithfulness of ``heads`` on ``task`` (whole, where the model is)."""
    task = with_reference(model, task.to(model.W_E.device))
    return node_faithfulness(model, task, heads, rows, clean=clean)


HELD_BOOTSTRAP = 200


def held_out(m: Dict[str, Any], sizes: List[float], nf: float, bootstrap: int, seed: int) -> Dict[str, object]:
    """The grid's circuits (and the chosen one's node view, ``nf``) measured on held-out rows (``m``: the curve's
    shards combined on them, with each row's metric), with bootstrap intervals."""
    from .bootstrap import bootstrap_curve

    clean, corrupt, per = m["clean"], m["corrupt"], m["per_row"]
    curve = {p: ratio(v, clean, corrupt) for p, v in zip(sizes, m["values"])}
    xs = [p / 100 for p in sizes]
    f = list(curve.values())
    return {"n": m["n"], "clean": clean, "corrupt": corrupt, "curve": curve, "cpr": _area(xs, f),
            "cmd": _area(xs, [abs(1 - v) for v in f]), "node_faithfulness": nf,
            "bootstrap": bootstrap_curve(xs, per["masks"], per["clean"], per["corrupt"], bootstrap, seed)}


def choose(sizes: List[float], circuits: List, values: List[float], clean: float, corrupt: float,
           threshold: Real) -> Tuple[Dict[float, float], float, object]:
    """(curve {percent: f}, the chosen percent: the smallest with f ≥ ``threshold``, else the largest, its circuit)
    from the metric of each grid size's circuit. The local and the Ray faithfulness both choose here."""
    curve = dict(zip(sizes, [ratio(v, clean, corrupt) for v in values]))
    chosen = next((p for p, v in curve.items() if v >= threshold), sizes[-1])
    return curve, chosen, circuits[sizes.index(chosen)]


def finish(sizes, circuits, values, clean, corrupt, curve, chosen, circuit, nf, model: str,
           settings: Dict[str, object], t0: float, t1: float, per_row, bootstrap: int, seed: int,
           threshold: Real, task: Optional[Task] = None) -> "Faithfulness":
    """The ``Faithfulness`` of a measured curve: CPR and CMD (trapezoids over the grid), timings, the bootstrap
    intervals when ``per_row`` holds the per-row metrics, and the one warning when no size reaches
    ``threshold``. The local and the Ray faithfulness both end here."""
    from .bootstrap import bootstrap_curve

    xs = [p / 100 for p in sizes]
    f = list(curve.values())
    timing = {"curve_s": round(t1 - t0, 3), "node_view_s": round(time.perf_counter() - t1, 3)}
    boot = {} if per_row is None else bootstrap_curve(xs, per_row["masks"], per_row["clean"], per_row["corrupt"],
                                                      bootstrap, seed)
    out = Faithfulness(curve, dict(zip(sizes, values)), {p: c.n_edges for p, c in zip(sizes, circuits)}, clean,
                       corrupt, _area(xs, f), _area(xs, [abs(1 - v) for v in f]), chosen, circuit, nf, circuit.heads,
                       model, {**settings, "cpr_cmd": "trapezoid over the grid, x = fraction of edges",
                               **provenance(circuit.graph, task)}, timing, boot)
    if not reached(curve, threshold) and clean != corrupt:
        warnings.warn(unreached_message(curve, threshold), stacklevel=3)
    return out
