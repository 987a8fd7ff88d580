"""Prompts to choose a circuit on and prompts to judge it on: a task's selection part and held-out part, and more
independent draws of the same behaviour (``Source``).

>>> source = Source.of(model, "induction", n=12, seed=0)
>>> sel, held = source.parts(holdout=1 / 3)
>>> sel.n, held.n, bool((sel.clean[:, None, :4] == held.clean[None, :, :4]).all(-1).any())   # no row shared
(8, 4, False)

A circuit, a core or a role chosen on some prompts and judged on the same prompts is judged on what it was fitted
to: the core is dropped to the threshold *on those rows*, and sits below it on about half of other draws. So:

- a **generator** (``ioi``, ``induction``: a seeded draw of ``n`` prompts) gives the selection part as the draw
  of ``n − h`` prompts with the task's seed and the held-out part as a FRESH draw of ``h`` prompts with another
  seed (``held_seed``): independent prompts of the same behaviour, h = round(n × ``holdout``);
- a **file** (a user's JSONL: fixed rows) gives a seeded random ``holdout`` fraction of its rows as the held-out
  part and the rest, in file order, as the selection part;
- ``holdout=0``: no held-out part; everything is chosen and judged on the same rows (as before this module).

``draw(r)`` is the r-th independent selection draw (r = 0 is the selection part itself): a generator draws again
with seed ``seed + r`` and, where it has templates (IOI's sentence frames), leaves template (r − 1) mod T out
(so a resample also says whether the circuit holds on a template it never saw: ``templates_of`` labels the
held-out rows); a file resamples its selection rows with replacement (the bootstrap's draw).
"""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Real
from typing import Any, Callable, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .._foundation.errors import QKCircuitsError
from .task import Task

HOLDOUT = 1 / 3
HELD_SEED = 1_000_003          # the held-out draw's seed is the task's seed + this (never a resample's seed + r)
FRESH, PART = "a fresh draw of the generator", "a seeded random part of the file's rows"     # ``Source.how``


def check_holdout(fraction) -> float:
    """``fraction`` as a float in [0, 1); one line otherwise."""
    if isinstance(fraction, bool) or not isinstance(fraction, Real) or not 0 <= float(fraction) < 1:
        raise QKCircuitsError(f"holdout must be a fraction of the prompts in [0, 1) (0: none; default {HOLDOUT:.3g}), "
                              f"got {fraction!r}")
    return float(fraction)


def held_size(n: int, fraction: float) -> int:
    """Held-out rows of ``n`` at ``fraction``: at least 2 when there is a held-out part, and at least 2 left to
    choose on; one line when ``n`` cannot be split so."""
    if fraction == 0:
        return 0
    h = max(2, int(round(n * fraction)))
    if n - h < 2:
        raise QKCircuitsError(f"{n} prompts cannot be split into a held-out part ({fraction:.3g} of them) and a "
                              f"selection part of at least 2 each; use more prompts or --holdout 0")
    return h


def split_rows(task: Task, fraction: Any, seed: int = 0) -> Tuple[Task, Optional[Task]]:
    """(selection rows in their order, a seeded random ``fraction`` of the rows) of fixed rows (a file)."""
    h = held_size(task.n, check_holdout(fraction))
    if h == 0:
        return task, None
    perm = torch.randperm(task.n, generator=torch.Generator().manual_seed(int(seed)))
    held = perm[:h].sort().values
    keep = torch.ones(task.n, dtype=torch.bool)
    keep[held] = False
    return task.rows(torch.nonzero(keep).flatten()), task.rows(held)


@dataclass
class Source:
    """Where a behaviour's prompts come from: a generator ``build(n, seed, templates) → Task`` (``templates``:
    the template indices to draw from, None = all; ``n_templates`` of them, 0 = none) with the task's ``n`` and
    ``seed``, or a file's fixed rows (``rows``)."""

    n: int
    seed: int
    build: Optional[Callable[[int, int, Optional[Sequence[int]]], Task]] = None
    n_templates: int = 0
    rows: Optional[Task] = None
    template_of: Optional[Callable[[Task], Optional[Tensor]]] = None

    @classmethod
    def of(cls, model, spec: str, n: int, seed: int = 0, prepend_bos=None, metric=None) -> "Source":
        """The source of the CLI's ``--task`` (a built-in generator's name or a .jsonl path)."""
        return task_source(model, spec, n, seed, prepend_bos=prepend_bos, metric=metric)

    @property
    def generated(self) -> bool:
        return self.build is not None

    @property
    def how(self) -> str:
        """Where the held-out part comes from, in words."""
        return FRESH if self.generated else PART

    def parts(self, holdout: Any = HOLDOUT, strict: bool = True) -> Tuple[Task, Optional[Task]]:
        """(selection part, held-out part or None) (module docstring). ``strict=False``: prompts too few to split
        (fewer than 2 in either part) give no held-out part instead of an error (the CLI's default fraction)."""
        fraction = check_holdout(holdout)
        n = self.n if self.generated else self.rows.n
        if not strict and fraction and n - max(2, int(round(n * fraction))) < 2:
            fraction = 0.0
        if not self.generated:
            return split_rows(self.rows, fraction, self.seed)
        h = held_size(self.n, fraction)
        sel = self.build(self.n - h, self.seed, None)
        return sel, (self.build(h, self.seed + HELD_SEED, None) if h else None)

    def left_out(self, r: int) -> Optional[int]:
        """The template draw ``r`` leaves out (None: none; draw 0, the selection part itself, leaves none)."""
        return (r - 1) % self.n_templates if self.generated and self.n_templates > 1 and r > 0 else None

    def draw(self, r: int, sel: Task) -> Task:
        """Independent selection draw ``r`` of ``sel.n`` rows (module docstring); draw 0 is ``sel``."""
        if r == 0:
            return sel
        if self.generated:
            t = self.left_out(r)
            keep = None if t is None else [i for i in range(self.n_templates) if i != t]
            return self.build(sel.n, self.seed + r, keep)
        idx = torch.randint(sel.n, (sel.n,), generator=torch.Generator().manual_seed(int(self.seed) + r))
        return sel.rows(idx)

    def templates(self, task: Task) -> Optional[Tensor]:
        """The template index of each row of a task this source generated with every template (None: unknown)."""
        return self.template_of(task) if self.template_of is not None else None


def task_source(model, spec: str, n: int = 64, seed: int = 0, *, prepend_bos: Optional[bool] = None,
                metric=None) -> "Source":
    """The command line's task as a ``Source``: a registered task is a generator (a fresh draw for the held-out
    part and for each resample; its templates, where it declares them, left out in turn), a .jsonl path fixed
    rows."""
    from .registry import build_task, check_task_arg

    found = check_task_arg(spec)
    if found is None:
        return Source(n, seed, rows=build_task(model, spec, n, seed, prepend_bos=prepend_bos, metric=metric))

    def build(k: int, s: int, templates=None) -> Task:
        extra = {} if templates is None else {"templates": list(templates)}
        return found(model, k, s, prepend_bos=prepend_bos, metric=metric, **extra)

    return Source(n, seed, build, found.n_templates, template_of=found.template_of)
