"""``Metric``: the one metric type of every analysis, a named function with its direction and its inputs.

>>> m = qk.Metric("top-logit", lambda logits, tokens: logits[:, -1].max(-1).values.mean(), higher_is_better=True)
>>> m.needs, m.prompts, m.effect(clean=2.0, changed=0.5)
('logits', 'any', 1.5)

What ``fn`` reads (``needs``) and is defined on (``prompts``; the table: ``_foundation/metric_table``):

- ``needs="logits"``, ``prompts`` "any" / "repeated": ``fn(logits [batch, pos, vocab], tokens [batch, pos]) ->
  scalar``, a mean over the batch (a slice of the batch and the whole batch mean the same thing); ``m(logits,
  tokens)``.
- ``needs="logits"``, ``prompts="task"``: one value per prompt row, from the logits at each row's END and the
  task's answer and wrong tokens: ``fn(end_logits [b, vocab] float32, answer, wrong, reference) -> [b]``, answer
  and wrong ids [b] (one per row) or [b, k] (a set per row, padded with -1; ``_tasks/answers.py``)
  (``reference``: the clean run's log-probabilities at END [b, vocab], or None; only ``kl`` reads it);
  ``m.rows(end_logits, answer, wrong, reference)``. A ``qk.Task`` evaluates it.
- ``needs="pattern"`` / ``"z"``: a receiver metric of path patching, ``fn(pattern [batch, q, k], z [batch, pos,
  d_head], tokens) -> scalar`` for one receiver head; ``m(pattern, z, tokens)``.

The direction is never guessed: ``higher_is_better`` must be given (True: larger = the behaviour is present, a
score; False: a loss), because it sets the sign of every effect::

    effect = sign · (metric(clean) − metric(ablated or patched)),   sign = +1 if higher_is_better else −1

so positive = the component matters, for a loss (ablated − clean) and a score (clean − ablated) alike.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass
from typing import Callable, Optional

import torch
from jaxtyping import Float
from torch import Tensor

from .._foundation.errors import QKCircuitsError
from .._foundation.metric_table import NEEDS, PROMPTS


@dataclass(frozen=True)
class Metric:
    """A named ``fn`` plus what it reads (``needs``), what prompts it is defined on (``prompts``) and which way
    is "behaviour present" (``higher_is_better``, required; see the module docstring).

    ``check(tokens)`` (optional) runs before any forward; ``keep_last(tokens) -> k`` (optional) says the
    metric reads only the logits of the last ``k`` positions, so ``sweep`` asks the model for just those
    (``logits_to_keep``) and ``fn`` must accept logits of the last ``k`` (or more) positions.
    """

    name: str
    fn: Callable[..., Tensor]
    check: Optional[Callable[[Tensor], object]] = None
    keep_last: Optional[Callable[[Tensor], int]] = None
    _: KW_ONLY
    needs: str = "logits"
    higher_is_better: Optional[bool] = None     # required: None is refused (the direction is never guessed)
    prompts: str = "any"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise QKCircuitsError(f"a metric's name must be a non-empty string, got {self.name!r}")
        if not callable(self.fn):
            raise QKCircuitsError(f"metric {self.name!r}: fn must be callable, got {type(self.fn).__name__}")
        if self.needs not in NEEDS:
            raise QKCircuitsError(f"metric {self.name!r}: needs must be one of {', '.join(NEEDS)}, got {self.needs!r}")
        if self.prompts not in PROMPTS:
            raise QKCircuitsError(f"metric {self.name!r}: prompts must be one of {', '.join(PROMPTS)}, got "
                                  f"{self.prompts!r}")
        if self.prompts == "task" and self.needs != "logits":
            raise QKCircuitsError(f"metric {self.name!r}: a task metric reads the logits at END (needs='logits'), "
                                  f"got needs={self.needs!r}")
        if self.higher_is_better is None:
            raise QKCircuitsError(undeclared(self.name))
        if not isinstance(self.higher_is_better, bool):
            raise QKCircuitsError(f"metric {self.name!r}: higher_is_better must be True or False, got "
                                  f"{self.higher_is_better!r}")

    def __str__(self) -> str:
        """The name (``f"{task.metric}"`` prints ``logit-diff``, as when a task held the name itself)."""
        return self.name

    @property
    def sign(self) -> float:
        """+1 when larger = behaviour present, −1 for a loss: ``effect = sign · (clean − changed)``."""
        return 1.0 if self.higher_is_better else -1.0

    def effect(self, clean, changed):
        """``sign · (clean − changed)``: positive = the ablated/patched component matters (floats or tensors)."""
        return self.sign * (clean - changed)

    def __call__(self, *inputs: Optional[Tensor]) -> Float[Tensor, ""]:
        """Logits metrics: ``m(logits, tokens)``; receiver metrics: ``m(pattern, z, tokens)`` (task metrics:
        ``rows``)."""
        if self.prompts == "task":
            raise QKCircuitsError(f"metric {self.name!r} reads a task's answer and wrong tokens: evaluate it per row "
                                  f"with .rows(end_logits, answer, wrong) or through a qk.Task")
        want = 2 if self.needs == "logits" else 3
        if len(inputs) != want:
            what = "(logits, tokens)" if want == 2 else "(pattern, z, tokens)"
            raise QKCircuitsError(f"metric {self.name!r} (needs {self.needs}) is called as {what}, got "
                                  f"{len(inputs)} inputs")
        out = torch.as_tensor(self.fn(*inputs))
        if out.numel() != 1:
            raise QKCircuitsError(f"metric {self.name!r} must return one number, got shape {tuple(out.shape)}")
        return out.reshape(())

    def rows(self, end_logits: Float[Tensor, "b vocab"], answer: Tensor, wrong: Tensor,
             reference: Optional[Tensor] = None) -> Float[Tensor, " b"]:
        """A task metric's value per row (differentiable): the logits at each row's END, its answer and wrong ids."""
        if self.prompts != "task":
            raise QKCircuitsError(f"metric {self.name!r} is not a task metric (prompts={self.prompts!r}); call it as "
                                  f"m(logits, tokens)")
        out = torch.as_tensor(self.fn(end_logits, answer, wrong, reference))
        if out.shape != (end_logits.shape[0],):
            raise QKCircuitsError(f"task metric {self.name!r} must return one value per row "
                                  f"[{end_logits.shape[0]}], got shape {tuple(out.shape)}")
        return out


def undeclared(name: str) -> str:
    """The one-line refusal of a metric without a direction (a plain callable, or a Metric built without it)."""
    return (f"metric {name!r} does not say which way is better, and that sets the sign of every effect: declare it, "
            f"qk.as_metric(fn, higher_is_better=False) for a loss or True for a score (or qk.Metric(name, fn, "
            f"higher_is_better=...))")
