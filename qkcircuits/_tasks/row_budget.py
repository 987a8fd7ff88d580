"""How many prompts a run takes at once, and the checks a task passes before any run.

>>> shard_rows(model, qk.graph(model), qk.tasks.induction(model, n=4, seg_len=5)) >= 1
True

Every edge and node method shards its prompts so the buffers it keeps fit a budget; the budgets are measured
(docs/benchmarks.md). Below ``scores``, ``circuit`` and ``core`` so that each of them can size its shards without
importing another (no import circle).
"""

from __future__ import annotations

from .._foundation.errors import QKCircuitsError
from .graph import Graph
from .answers import check_vocab
from .task import Task

# The faithfulness curve's shards (``shard_rows``' default budget, ``faithfulness.py``: the corrupt record and
# one patched run's sender outputs). Fewer, larger shards: each shard pays a corrupt forward and one
# patched forward per circuit size, plus per-hook Python overhead.
DELTA_BYTES = 3 * 2**30
# Exact patching stacks ``copies`` shards per forward, so its sender outputs are copies × the shard's:
# its shards stay sized for 512 MiB (SmolLM2: 22 rows, 32 copies = one 8.5 GB patched buffer).
EXACT_BYTES = 512 * 2**20
# EAP / EAP-IG shards: measured on SmolLM2 (64 IOI rows, one thread) the gradient runs are ~1.5x slower on
# one 64-row shard than on 22-row shards (a larger autograd graph), so they keep ~1 GiB shards (25 rows).
GRAD_SHARD_BYTES = 2**30


def shard_rows(model, g: Graph, task: Task, buffers: int = 2, budget: int = DELTA_BYTES,
               gradients: bool = False) -> int:
    """Rows per shard so that ``buffers`` sender-output buffers [S, rows, pos, d_model] (and with
    ``gradients`` the float32 receiver-gradient sum [R, rows, pos, d_model]) fit ``budget``."""
    elt = model.W_E.element_size()
    per_pos = g.n_senders * elt * buffers + (g.n_receivers * max(elt, 4) if gradients else 0)
    per_row = per_pos * task.clean.shape[1] * model.cfg.d_model
    return max(1, min(task.n, budget // max(per_row, 1)))


def check_task_type(task: object) -> None:          # any value: it says what it takes
    """``task`` is a ``Task``; else one line saying how to build one (no model needed: a driver's check)."""
    if not isinstance(task, Task):
        from .._foundation.args import describe
        from .registry import task_names

        hint = (f"; build it with qk.tasks.build_task(model, {task!r})" if isinstance(task, str) and task in task_names()
                else "; build one with qk.tasks.build_task(model, NAME) (a registered task: "
                     f"{', '.join(task_names()[:4])}, ...) or qk.tasks.from_jsonl(model, path)")
        raise QKCircuitsError(f"task must be a qk.Task, got {describe(task)}{hint}")


def check_task(model, task: object) -> None:          # any value: it says what it takes
    """``model`` is a loaded model and ``task`` a ``Task`` whose token ids fit it; else one line saying what is
    taken."""
    from .._foundation.args import require_model

    require_model(model)
    check_task_type(task)
    V, n_ctx = model.cfg.d_vocab, model.cfg.n_ctx
    for what, t in (("clean", task.clean), ("corrupt", task.corrupt), ("answer", task.answer), ("wrong", task.wrong)):
        check_vocab(t, V, what)                   # answer / wrong sets: their padding left out
    if task.clean.shape[1] > n_ctx:
        raise QKCircuitsError(f"task rows of {task.clean.shape[1]} tokens exceed the model's context of {n_ctx}")
