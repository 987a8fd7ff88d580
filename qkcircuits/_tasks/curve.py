"""The faithfulness curve's circuit metrics as shards (``CIRCUIT_METRIC``), declared once: every backend maps them.

>>> task = qk.tasks.induction(model, n=8, seg_len=6)
>>> scores = qk.edge_scores(model, task, method="exact", progress=False)
>>> f = qk.faithfulness(model, task, scores, sizes=(10, 100), rows_per_shard=3, progress=False)  # 3 shards here
>>> r = qk.faithfulness(model, task, scores, sizes=(10, 100), rows_per_shard=3,
...                     backend=qk.Ray(workers=2))                  # doctest: +SKIP (needs Ray)
>>> r.curve == f.curve                                              # doctest: +SKIP
True

The metric m(C) of a task is a SUM over its prompt rows, divided by their number n, so the curve splits by rows:

- ``plan`` (where the model is): the task's checks, its reference, rows per shard (``rows_per_shard`` or the
  memory budget's, never the worker count), the circuit of every grid size (``select``), m(clean) when the scores
  measured it on this task and these weights, and one shard per block of rows;
- ``run``: one block, its corrupt record and one patched forward per circuit (``metric_block``):
  each circuit's metric summed over the block's rows (float), the clean and corrupt sums, and with ``per_row``
  each row's metric (the bootstrap's data);
- ``combine``: the sums added in shard order, divided by n (``metric_total``); f = (m(C) − m(∅)) /
  (m(full) − m(∅)) is then computed ONCE from these means (``faithfulness.choose``), never per shard.

``circuit_metric`` (one process, a caller's own shards and corrupt records; also the node view's and
``qk.evaluate``'s) is the same block and total functions. The chosen circuit's node view (the step ``node_view``,
``faithfulness.py``) runs whole where the backend runs steps.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .._foundation.shards import Plan, Sharded, row_blocks
from .._foundation.errors import QKCircuitsError
from .graph import Graph, graph
from .patched import patched_run
from .positions import group_index
from .record import Record, clean_rows, record, reuse
from .selection import select
from .task import Task, with_reference


def circuit_metric(model, task: Task, masks: Sequence[Tensor], rows_per_shard: int, progress: bool = False,
                   need_clean: bool = True, records: Optional[Dict[int, Record]] = None,
                   known_clean: Optional[float] = None, g: Optional[Graph] = None,
                   per_row: Optional[Dict[str, Tensor]] = None) -> Tuple[List[float], float, float]:
    """The metric mean of each circuit mask ([S, R], or [groups, S, R] on a position-aware ``g``; ``g``: the
    graph the masks are of, default ``qk.graph(model)``) (one patched forward per mask and shard), and clean/corrupt
    (the corrupt record per shard; clean from a 100 % mask when one is among ``masks``, else one more run,
    or NaN without ``need_clean``). ``known_clean``: m(clean) already measured on these very rows and
    weights (``faithfulness`` passes the scores' own when their ``task_digest`` matches): the 100 % mask
    takes it and no clean rows are run. ``records``: shard index → corrupt record, read when there and
    filled when given (a caller that runs more circuits on the same shards skips those corrupt forwards;
    it then holds them). ``per_row``: a dict filled with each row's metric, ``"masks"`` [len(masks), n],
    ``"clean"`` and ``"corrupt"`` [n] (what a bootstrap over prompts resamples; ``known_clean`` is then not
    used for the clean rows, which are run). The shards are ``metric_block``'s, added by ``metric_total``: the
    faithfulness curve's shards on any backend (``CIRCUIT_METRIC``) are the same two functions."""
    from .._foundation.progress import progress_bar

    g = g or graph(model)
    task = with_reference(model, task)
    if per_row is not None:
        known_clean = None
        need_clean = True
    bar = progress_bar(total=len(masks) * ((task.n + rows_per_shard - 1) // rows_per_shard), desc="faithfulness",
                       enabled=progress)
    full = full_index(masks, g)
    pool: Dict[str, Tensor] = {}        # one shard's buffers, reused by the next (runs.reuse)
    parts = []
    for j, shard in enumerate(task.shards(rows_per_shard)):
        corr = records[j] if records is not None and j in records else \
            record(model, g, shard, shard.corrupt, pool=None if records is not None else pool)
        if records is not None:
            records[j] = corr
        parts.append(metric_block(model, g, shard, corr, masks, full, known_clean is not None, need_clean,
                                  per_row is not None, pool, bar))
        del corr
    bar.close()
    return metric_total(parts, task.n, len(masks), full, known_clean, need_clean, per_row)


def full_index(masks: Sequence[Tensor], g: Graph) -> Optional[int]:
    """The index of the first mask that keeps every edge of ``g`` (the clean run), or None."""
    return next((i for i, m in enumerate(masks) if bool(((m & g.valid) == g.valid).all())), None)


def metric_block(model, g: Graph, shard: Task, corr: Record, masks: Sequence[Tensor], full: Optional[int],
                 known: bool, need_clean: bool, rows_wanted: bool, pool: Dict[str, Tensor], bar) -> Dict[str, Any]:
    """One block of prompt rows (``shard``, its corrupt record ``corr``): each mask's metric SUMMED over the rows
    (float; the full mask skipped when m(clean) is ``known``), the clean sum (0.0 unless run: no 100 % mask and
    ``need_clean``), the corrupt sum, and with ``rows_wanted`` each row's metric (float64: ``"rows"`` [masks, b],
    ``"clean_rows"``, ``"corrupt_rows"`` [b])."""
    sums = [0.0] * len(masks)
    clean = 0.0
    rows_of: List[Tensor] = []
    # one sender-output buffer for all the circuits of the shard
    buf = reuse(pool, "patched", tuple(corr.out.shape), corr.out.dtype, corr.out.device)
    pos = group_index(shard, g.positions) if g.positions else None
    full_rows = None
    for i, m in enumerate(masks):
        if i == full and known:
            continue
        # the full circuit IS the clean run (runs.py): a plain forward, no sender outputs to record
        rows = (clean_rows(model, shard) if i == full else
                patched_run(model, g, shard, corr, m[None], buffer=buf, positions=pos).reshape(-1))
        sums[i] = float(rows.sum())
        if i == full:
            full_rows = rows
        if rows_wanted:
            rows_of.append(rows.detach().double().cpu())
        bar.update(1)
    # m(full): a 100 % mask already measured it
    if full is None and need_clean and not known:
        full_rows = clean_rows(model, shard)
        clean = float(full_rows.sum())
    out: Dict[str, Any] = {"sums": sums, "clean": clean, "corrupt": float(corr.rows.sum())}
    if rows_wanted:
        b = int(corr.rows.numel())
        out["rows"] = torch.stack(rows_of) if rows_of else torch.zeros(0, b, dtype=torch.float64)
        out["clean_rows"] = full_rows.detach().double().cpu()
        out["corrupt_rows"] = corr.rows.detach().double().cpu()
    return out


def metric_total(parts: Sequence[Dict[str, Any]], n: int, n_masks: int, full: Optional[int],
                 known_clean: Optional[float], need_clean: bool, per_row: Optional[Dict[str, Tensor]]
                 ) -> Tuple[List[float], float, float]:
    """``metric_block``'s parts, in row order: the sums added (float64, in that order), then divided by the ``n``
    rows: (each mask's mean, clean, corrupt); ``per_row`` (when given) filled with the rows concatenated."""
    sums = [0.0] * n_masks
    clean = corrupt = 0.0
    for p in parts:
        for i, v in enumerate(p["sums"]):
            sums[i] += v
        clean += p["clean"]
        corrupt += p["corrupt"]
    if known_clean is not None:
        clean = float(known_clean) * n
        if full is not None:
            sums[full] = clean
    elif full is not None:
        clean = sums[full]
    elif not need_clean:
        clean = float("nan")
    if per_row is not None:
        per_row["masks"] = torch.cat([p["rows"] for p in parts], 1) if n_masks else torch.zeros(0, n)
        per_row["clean"] = torch.cat([p["clean_rows"] for p in parts])
        per_row["corrupt"] = torch.cat([p["corrupt_rows"] for p in parts])
    return [s / n for s in sums], clean / n, corrupt / n


def _check_graph_of(model, task: Task, g: Graph) -> None:
    """The scores' graph is this model's (and, position-aware, this task's positions): one line otherwise."""
    from dataclasses import replace

    own = graph(model, "ungrouped" if g.ungrouped else "grouped")
    if replace(own, model_name="") != replace(g, positions=(), model_name=""):
        raise QKCircuitsError(f"the scores are of another graph ({g!r}) than this model's ({own!r})")
    missing = [p for p in g.positions[:-1] if p not in task.positions]
    if missing:
        raise QKCircuitsError(f"the scores split positions {', '.join(missing)}, which this task does not name")


def _plan_curve(model, *, task: Task, scores, sizes: Sequence[float], by: str, how: str,
                rows_per_shard: Optional[int], progress: bool, per_row: bool, use_known: bool) -> Plan:
    """The plan where the model is: the circuits of every size, the rows per shard, one shard per block of rows."""
    from .row_budget import check_task, shard_rows

    check_task(model, task)
    g = scores.graph if isinstance(getattr(scores, "graph", None), Graph) else graph(model)
    _check_graph_of(model, task, g)
    task = with_reference(model, task.to(model.W_E.device))
    rows = rows_per_shard or shard_rows(model, g, task, buffers=3)
    circuits = [select(scores, percent=p, by=by, how=how) for p in sizes]
    # m(clean) was measured by the scores' own clean run when they were computed on this task and these
    # weights (the digest says so): the 100 % circuit IS that run, so it is not run again (not with per_row:
    # the bootstrap resamples the clean rows)
    known = getattr(scores, "clean", None)
    digest = getattr(scores, "settings", {}).get("task_digest")
    known = (float(known) if use_known and not per_row and digest is not None and known is not None
             and math.isfinite(float(known)) and digest == task.digest(model) else None)
    masks = [c.mask if c.position_mask is None else c.position_mask for c in circuits]
    full = full_index(masks, g)
    blocks = row_blocks(task.n, rows)
    info = {"circuits": circuits, "n": task.n, "rows": rows, "known": known, "full": full, "n_masks": len(masks)}
    shared = {"task": task.to("cpu"), "graph": g, "masks": masks, "full": full, "known": known is not None,
              "per_row": per_row, "progress": progress}
    return Plan(shared, [{"rows": ab} for ab in blocks], info, [float(b - a) for a, b in blocks])


def _curve_shard(model, shared: Dict[str, Any], scratch: Dict[str, Any], *, rows: Tuple[int, int]) -> Dict[str, Any]:
    """One block of prompt rows: every circuit's metric summed over its rows (``metric_block``)."""
    from .._foundation.progress import progress_bar

    g, masks = shared["graph"], shared["masks"]
    shard = shared["task"].rows(slice(*rows)).to(model.W_E.device)
    bar = progress_bar(total=len(masks), desc="faithfulness", enabled=shared["progress"])
    corr = record(model, g, shard, shard.corrupt, pool=scratch)
    out = metric_block(model, g, shard, corr, masks, shared["full"], shared["known"], True, shared["per_row"],
                       scratch, bar)
    bar.close()
    return out


def _combine_curve(plan: Plan, parts: List[Dict[str, Any]], where: Optional[Dict[str, Any]], **_: Any
                   ) -> Dict[str, Any]:
    """The blocks' sums added in shard order, divided by n: each circuit's mean, clean, corrupt (and the rows)."""
    info = plan.info
    per: Optional[Dict[str, Any]] = {} if plan.shared["per_row"] else None
    values, clean, corrupt = metric_total(parts, info["n"], info["n_masks"], info["full"], info["known"], True, per)
    return {"values": values, "clean": clean, "corrupt": corrupt, "per_row": per, "circuits": info["circuits"],
            "rows": info["rows"], "n": info["n"], "where": where, "shards": len(parts)}


# The faithfulness curve's circuit metrics, declared once (``_foundation/shards``): the shards every backend maps
def _check_curve(*, task, **rest: Any) -> Dict[str, Any]:
    """The driver's check of a curve request (one line, before anything loads or starts)."""
    from .row_budget import check_task_type

    check_task_type(task)
    return dict(task=task, **rest)


CIRCUIT_METRIC = Sharded("faithfulness", _plan_curve, _curve_shard, _combine_curve, _check_curve)
