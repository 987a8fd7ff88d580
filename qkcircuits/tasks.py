"""Tasks (clean/corrupt prompt pairs) and what the circuit analyses of a task need below the root's
``qk.Task``, ``qk.graph``, ``qk.edge_scores``, ``qk.node_scores``, ``qk.faithfulness``, ``qk.core_circuit`` and
``qk.evaluate``: the task builders, the graph class, the evaluation result, the node view's faithfulness, where a
behaviour's prompts come from (``Source``: its selection and held-out parts, more draws) and how stable its
circuit is over draws (``stability``).

>>> import qkcircuits as qk
>>> model = qk.load("toy-induction")
>>> task = qk.tasks.induction(model, n=8, seg_len=5, seed=1)
>>> task.n, isinstance(qk.graph(model), qk.tasks.Graph)
(8, True)

The task registry (``_tasks/registry.py``): ``register_task`` (also ``qk.register_task``), ``task_spec``,
``task_names``, ``unregister_task``, ``TaskSpec``, ``Role``, ``IOI_ROLES`` (IOI's roles, declared as any task's), and ``build_task`` (a command's ``--task``: a registered
name or a .jsonl file); installed packages add tasks under the ``qkcircuits.tasks`` entry point.

``Graph``, ``Evaluation`` and ``node_faithfulness`` were root names before 0.2.0 (CHANGELOG.md). The explicit
imports below are the module's one list of names (``__all__`` is read from them).
"""

# ruff: noqa: F401
from ._tasks.builders import FRAMES, NAMES, OBJECTS, PLACES, from_jsonl, induction, ioi, single_tokens
from ._tasks.role_rules import IOI_ROLES
from ._tasks.registry import Role, TaskSpec, build_task, register_task, task_names, task_spec, unregister_task
from ._tasks.evaluation import Evaluation
from ._tasks.faithfulness import node_faithfulness
from ._tasks.graph import Graph
from ._tasks.holdout import Source
from ._tasks.stability import stability

__all__ = sorted(n for n in dir() if not n.startswith("_"))      # the imports above: the one list
