"""The task registry: every task a command names (``--task NAME``) is a ``TaskSpec`` here, the built-ins too.

>>> spec = task_spec("induction")
>>> spec.name, spec.metric, spec.always_bos
('induction', 'logit-diff', True)
>>> task = spec(model, n=4, seed=0)               # spec.build with the options it takes
>>> task.name, task.n
('induction', 4)
>>> task_names()[:3]
('ioi', 'induction', 'greater-than')

A task is registered with ``qk.register_task(name, build, *, metric=, positions=, roles=)``: ``build(model, *, n,
seed, prepend_bos, metric) -> qk.Task`` (it may take fewer of these: only those it takes are passed; a BOS choice
other than auto to one that takes none is refused), ``metric`` its default metric, ``positions`` the named positions
every task it builds holds (checked), ``roles`` its own roles (``Role``: a rule over a head's evidence, tried
before the built-in classes: ``_tasks/role_rules.py``; IOI's own are such a declaration). Installed packages declare tasks under the entry point
``qkcircuits.tasks`` (a ``TaskSpec``, a list of them, or a function returning either), loaded as detector plugins
are (``_analysis/detectors.load_plugins``): on the registry's first use, under a lock, each plugin whole or not at
all (one warning naming it), never taking a name another holds. ``build_task`` resolves a command's ``--task``:
a registered name, else a .jsonl file (``from_jsonl``). No other module matches a task by its name
(tests/test_task_registry.py counts).
"""

from __future__ import annotations

import inspect
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

from .._foundation.errors import QKCircuitsError
from . import builders, literature
from .role_rules import IOI_ROLES, Role
from .task import Task

ENTRY_POINT_GROUP = "qkcircuits.tasks"
OPTIONS = ("n", "seed", "prepend_bos", "metric", "templates")       # what build may take


@dataclass(frozen=True)
class TaskSpec:
    """A registered task (module docstring). Calling it builds the task for a model."""

    name: str
    build: Callable[..., Task]
    metric: str = "logit-diff"
    positions: Tuple[str, ...] = ()
    roles: Tuple[Role, ...] = ()
    description: str = ""
    always_bos: bool = False
    pattern: Optional[str] = None       # its rows are read by this pattern, not named positions (Task.pattern)
    takes: Tuple[str, ...] = field(default=(), compare=False)      # the OPTIONS build takes (filled in)
    # templates (sentence frames): how many the generator has (build then takes ``templates``, the indices to draw
    # from) and the template of each row of a task drawn with all of them; a draw that leaves one out says whether
    # a circuit holds on a frame it never saw (``holdout.Source``)
    n_templates: int = 0
    template_of: Optional[Callable[[Task], object]] = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or self.name != self.name.strip() or " " in self.name \
                or self.name.endswith(".jsonl"):
            raise QKCircuitsError(f"a task name is a non-empty word without spaces (not a .jsonl path), got "
                                  f"{self.name!r}")
        if not callable(self.build):
            raise QKCircuitsError(f"task {self.name!r}: build must be callable (model, *, n, seed, prepend_bos, "
                                  f"metric) -> qk.Task, got {type(self.build).__name__}")
        roles = tuple(self.roles)
        bad = [r for r in roles if not isinstance(r, Role)]
        if bad:
            raise QKCircuitsError(f"task {self.name!r}: roles must be qk.tasks.Role(name, rule), got "
                                  f"{type(bad[0]).__name__}")
        object.__setattr__(self, "roles", roles)
        object.__setattr__(self, "positions", tuple(self.positions))
        object.__setattr__(self, "takes", _takes(self.build))

    def __call__(self, model, n: int = 64, seed: int = 0, *, prepend_bos: Optional[bool] = None,
                 metric=None, templates: Optional[Sequence[int]] = None) -> Task:
        if self.always_bos and prepend_bos is False:
            raise QKCircuitsError(f"--bos no: the {self.name} task's prompts always start with BOS; use --bos auto "
                                  f"or yes")
        if prepend_bos is not None and "prepend_bos" not in self.takes and not self.always_bos:
            raise QKCircuitsError(f"task {self.name!r} builds its prompts as they are (it takes no BOS choice); use "
                                  f"--bos auto / prepend_bos=None")
        if templates is not None and not self.n_templates:
            raise QKCircuitsError(f"task {self.name!r} declares no templates to choose from")
        given = {"n": n, "seed": seed, "prepend_bos": prepend_bos, "metric": metric or self.metric}
        if templates is not None:           # indices into the n_templates the spec declares
            given["templates"] = list(templates)
        task = self.build(model, **{k: v for k, v in given.items() if k in self.takes})
        if not isinstance(task, Task):
            raise QKCircuitsError(f"task {self.name!r}: build returned {type(task).__name__}, not a qk.Task")
        missing = [p for p in self.positions if p not in task.positions]
        if missing:
            raise QKCircuitsError(f"task {self.name!r} declares position(s) {', '.join(missing)} that its build "
                                  f"did not give (it gave {', '.join(sorted(task.positions))})")
        if "metric" not in self.takes and (metric or self.metric) != task.metric.name:
            task.metric = metric or self.metric
        task.name = self.name
        if self.pattern is not None:
            task.pattern = self.pattern
        return task


def _takes(build: Callable) -> Tuple[str, ...]:
    try:
        params = inspect.signature(build).parameters.values()
    except (TypeError, ValueError):
        return OPTIONS
    if any(p.kind == p.VAR_KEYWORD for p in params):
        return OPTIONS
    return tuple(p.name for p in params if p.name in OPTIONS)


_REGISTRY: Dict[str, TaskSpec] = {}
_plugins: Dict[str, object] = {"loaded": False, "by_entry": {}}      # entry point "name = value" -> its names
_plugins_lock = threading.RLock()


def _registry() -> Dict[str, TaskSpec]:
    """The registry, with the installed packages' tasks added on first use (under a re-entrant lock)."""
    if not _plugins["loaded"]:
        with _plugins_lock:
            if not _plugins["loaded"]:
                _plugins["loaded"] = True
                load_plugins()
    return _REGISTRY


def load_plugins(entry_points=None) -> List[str]:
    """Register the tasks installed packages declare under the ``qkcircuits.tasks`` entry point, e.g. in a
    package's ``pyproject.toml``::

        [project.entry-points."qkcircuits.tasks"]
        my-task = "my_package.tasks:spec"

    Runs once per process, on the registry's first use; returns the names registered. A plugin is all or nothing:
    one that fails to load, gives anything but ``TaskSpec``s, or any of whose names is already registered, is
    skipped whole with one warning naming it; loading the same entry point again replaces its own tasks."""
    if entry_points is None:
        from importlib.metadata import entry_points as installed

        entry_points = installed(group=ENTRY_POINT_GROUP)
    from .._foundation.plugins import load_entry_points

    with _plugins_lock:
        return load_entry_points(entry_points, TaskSpec, "qk.tasks.TaskSpec", "task", _REGISTRY, _plugins["by_entry"],
                                 lambda s: _REGISTRY.__setitem__(s.name, s))


def register_task(name: Union[str, TaskSpec], build: Optional[Callable[..., Task]] = None, *,
                  metric: str = "logit-diff", positions: Sequence[str] = (), roles: Sequence[Role] = (),
                  description: str = "", always_bos: bool = False, replace: bool = False) -> TaskSpec:
    """Register a task under ``name`` (module docstring), or a ready ``TaskSpec``; ``replace=True`` to redefine
    one. Returns the spec; ``--task NAME`` then builds it in ``circuit``, ``attend`` and ``zoo``.

    >>> spec = qk.register_task("first-token", lambda model, n, seed: qk.tasks.induction(model, n=n, seed=seed))
    >>> qk.tasks.build_task(model, "first-token", n=2).name
    'first-token'
    >>> qk.tasks.unregister_task("first-token")
    """
    spec = name if isinstance(name, TaskSpec) else TaskSpec(name, build, metric, tuple(positions), tuple(roles),
                                                            description, always_bos)
    if isinstance(name, TaskSpec) and build is not None:
        raise QKCircuitsError("register_task: give a TaskSpec alone, or a name and its build")
    with _plugins_lock:
        if spec.name in _registry() and not replace:
            raise QKCircuitsError(f"a task named {spec.name!r} exists; pass replace=True to redefine it")
        _REGISTRY[spec.name] = spec
    return spec


def unregister_task(name: str) -> None:
    """Remove a task (built-ins included; register it again to restore)."""
    task_spec(name)
    del _REGISTRY[name]


def task_names() -> Tuple[str, ...]:
    """Every registered task's name, in registration order (the built-ins first)."""
    return tuple(_registry())


def task_spec(name: str) -> TaskSpec:
    """The registered task ``name``; one line naming the registered ones when there is none."""
    try:
        return _registry()[name]
    except (KeyError, TypeError):
        raise QKCircuitsError(f"unknown task {name!r}; registered: {', '.join(_REGISTRY)} (or a .jsonl file)") from None


def spec_of(task: Task) -> Optional[TaskSpec]:
    """The registered spec a built task came from (by its name), or None (a task from a file, or built by hand)."""
    return _registry().get(getattr(task, "name", None))


def check_task_arg(text: str, flag: str = "--task", bos: str = "auto") -> Optional[TaskSpec]:
    """Before anything loads: ``text`` is a registered task (its spec is returned) or an existing .jsonl file
    (None); ``bos`` (``--bos``) "no" is refused for a task whose prompts always start with BOS. One line otherwise."""
    spec = _registry().get(text)
    if spec is None and not Path(text).is_file():
        raise QKCircuitsError(f"{flag} {text!r}: expected a registered task ({', '.join(_REGISTRY)}) or an existing "
                              f".jsonl file")
    if spec is not None and spec.always_bos and bos == "no":
        raise QKCircuitsError(f"--bos no: the {spec.name} task's prompts always start with BOS; use --bos auto or yes")
    return spec


def build_task(model, spec: str, n: int = 64, seed: int = 0, *, prepend_bos: Optional[bool] = None,
               metric=None) -> Task:
    """The command line's task: a registered name (``n``/``seed`` for its generator), else a .jsonl path."""
    if spec in _registry():
        return _registry()[spec](model, n, seed, prepend_bos=prepend_bos, metric=metric)
    check_task_arg(spec)
    return builders.from_jsonl(model, spec, prepend_bos=prepend_bos, metric=metric or "logit-diff")


# ------------------------------------------------------------------------------------------------ the built-ins

def _ioi(model, *, n, seed, prepend_bos, metric, templates=None):
    frames = builders.FRAMES if templates is None else [builders.FRAMES[i] for i in templates]
    return builders.ioi(model, n=n, seed=seed, prepend_bos=prepend_bos, metric=metric, frames=frames)


def _ioi_frame(task: Task):
    """IOI's row i uses frame (i // 2) mod T (``builders.ioi``)."""
    import torch

    return (torch.arange(task.n) // 2) % len(builders.FRAMES)


def _induction(model, *, n, seed, metric):
    return builders.induction(model, n=n, seed=seed, metric=metric)


for _spec in (
        TaskSpec("ioi", _ioi, positions=("IO", "S1", "S1+1", "S2", "END"), roles=IOI_ROLES,
                 description="indirect-object identification (Wang et al. 2022), ABC-corrupted",
                 n_templates=len(builders.FRAMES), template_of=_ioi_frame),
        TaskSpec("induction", _induction, always_bos=True, pattern="induction",
                 description="[BOS] + R + R[:-1] -> R[-1]; corrupt: another first segment"),
        TaskSpec("greater-than", literature.greater_than, metric="prob-diff", positions=("NOUN", "XX", "YY", "END"),
                 roles=(Role("year reader", lambda e: e["attn_from_END"].get("YY", 0.0) >= 0.3
                             and abs(e["node_share"]) >= 0.05,
                             why="attends from END to the start year's tens digit (YY) and carries at least 5 % of "
                                 "the behaviour"),),
                 description="Hanna et al. 2023: 'from the year 1732 to the year 17' -> a later year; answer sets"),
        TaskSpec("successor", literature.successor, metric="prob-diff", positions=("FIRST", "LAST", "END"),
                 description="Gould et al. 2023: 'March, April, May,' -> ' June' against the other items"),
        TaskSpec("gendered-pronoun", literature.gendered_pronoun, positions=("NAME", "END"),
                 description="Mathwin et al. 2023: 'So Mary is a really great friend, isn't' -> ' she'"),
        TaskSpec("capital-country", literature.capital_country, positions=("CITY", "END"),
                 description="factual recall: 'The city of Paris is the capital of' -> ' France'"),
        TaskSpec("docstring", literature.docstring, positions=("DEF_C", "DOC_A", "DOC_B", "END"),
                 description="Heimersheim & Janiak 2023: ':param' -> the next undocumented argument's name")):
    _REGISTRY[_spec.name] = _spec
del _spec

__all__ = ["ENTRY_POINT_GROUP", "Role", "TaskSpec", "build_task", "check_task_arg", "load_plugins", "register_task",
           "spec_of", "task_names", "task_spec", "unregister_task"]
