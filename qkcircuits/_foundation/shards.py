"""An analysis that can be split, declared ONCE: what a shard is, how one runs, how the parts combine.

>>> task = qk.tasks.induction(model, n=4, seg_len=5)
>>> s = qk.edge_scores(model, task, method="eap", rows_per_shard=2, progress=False)   # 2 shards, in this process
>>> r = qk.edge_scores(model, task, method="eap", rows_per_shard=2, backend=qk.Ray(workers=2))  # doctest: +SKIP
>>> torch.equal(s.scores, r.scores)                                                   # doctest: +SKIP (needs Ray)
True

A ``Sharded`` is three functions, written next to the analysis they split (``_tasks/scores``, ``_analysis/sweep``,
``_paths/patching``):

- ``plan(model, **request) -> Plan``: runs where the model is (this process, or ONE Ray worker): checks the request
  on the model, computes what every shard reads (``Plan.shared``: the prompts, the mean/resample references) and
  cuts the work into shards (``Plan.shards``: one dict of arguments each). The plan depends on the request and the
  model only, never on how many workers there are;
- ``run(model, shared, scratch, **shard) -> part``: one shard on a loaded model (``scratch``: a dict that lives for
  one map on one process, for buffers the next shard reuses);
- ``combine(plan, parts, where, **request) -> result``: on the driver (no model), the parts in shard order;
  ``where`` says where they ran (None in this process, else the pool's ``where()``, e.g. Ray's workers).

A backend only maps shards (``BackendPool.map``, written once, here): the plan through the pool's ``run`` (one
step on the model), the shards through its ``each`` (``LocalPool``: in order, in this process; ``RayPool``: on
its workers, ``shared`` sent once), then ``combine``. The same shards combined by the same function in the same
order: every backend's result is the local one, bit for bit. ``check(**request) -> request`` (optional) runs on
the driver first: one-line errors before anything loads or starts, and the request made portable (a metric by
name) for another process.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional


@dataclass
class Plan:
    """What ``Sharded.plan`` returns: ``shared`` (read by every shard; sent once), ``shards`` (each shard's own
    arguments, in the order ``combine`` reads the parts), ``info`` (what ``combine`` needs besides the parts:
    names, the graph, settings) and ``costs`` (relative work per shard, for scheduling; optional)."""

    shared: Any
    shards: List[Dict[str, Any]]
    info: Dict[str, Any] = field(default_factory=dict)
    costs: Optional[List[float]] = None


@dataclass(frozen=True)
class Sharded:
    """An analysis split into shards (module docstring). ``name`` is the step's name on a pool (``"edge_scores"``)."""

    name: str
    plan: Callable[..., Plan]
    run: Callable[..., Any]
    combine: Callable[..., Any]
    check: Optional[Callable[..., Dict[str, Any]]] = None

    def checked(self, request: Dict[str, Any]) -> Dict[str, Any]:
        """The request after ``check`` (the driver's one-line errors), or as it is."""
        return dict(request) if self.check is None else self.check(**request)

    def local(self, model, **request) -> Any:
        """The whole analysis in this process on a loaded ``model``: plan, every shard in order, combine."""
        request = self.checked(request)
        plan = self.plan(model, **request)
        scratch: Dict[str, Any] = {}
        parts = [self.run(model, plan.shared, scratch, **s) for s in plan.shards]
        return self.combine(plan, parts, None, **request)


def row_blocks(n: int, rows: int) -> List[tuple]:
    """Prompt rows ``0..n`` cut into contiguous blocks of ``rows`` (the last one shorter): ``[(a, b), ...]``."""
    rows = max(1, int(rows))
    return [(a, min(a + rows, n)) for a in range(0, n, rows)]
