"""The built-in metrics and ``as_metric``, the one resolver every analysis and command calls.

>>> m = qk.induction_loss()                     # loss on the repeated half of [BOS] + R + R
>>> m.name, m.needs, m.prompts, m.higher_is_better
('induction-loss', 'logits', 'repeated', False)
>>> float(m(model(tokens).detach(), tokens)) >= 0
True
>>> qk.as_metric(m.name) == m                   # a name round-trips (JSON holds the name)
True
>>> qk.as_metric(lambda logits: logits[:, -1, 3].mean(), higher_is_better=True).needs   # the signature decides
'logits'
>>> qk.as_metric(lambda pattern, z, tokens: pattern[:, -1, 0].mean(), higher_is_better=True).needs
'z'

One table of names (``_foundation/metric_table.TABLE``, docs/architecture.md "Metrics"): each name has one
meaning, one direction, what it reads and what prompts it is defined on:

- given token rows: ``induction-loss``, ``induction-loss-first-half``, ``text-loss``, ``logit-diff:C,W`` (token
  ids; ``@P`` for a position other than -1), and for path patching the receiver metrics ``induction`` (pattern)
  and ``direct-logit`` (z);
- a task's rows (``qk.Task``; answer and wrong token, or token set, per row, read at END): ``logit-diff``,
  ``prob-diff``, ``answer-loss``, ``kl`` (and the any-rows names above, as a batch mean).

A name used where it cannot apply (``logit-diff`` given tokens
alone: no answer tokens) is refused in one line naming what is accepted there. A callable is wrapped once, its
positional parameters deciding what it reads (1 or 2 → logits, 3 → a receiver metric), and only with its
direction declared: ``qk.as_metric(fn, higher_is_better=False)`` for a loss (the direction is never guessed:
it sets the sign of every effect, ``metric.Metric``).
"""

from __future__ import annotations

import inspect
import re
import sys
from typing import Any, Callable, Dict, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor

from .._foundation.errors import QKCircuitsError
from .._foundation.metric_table import NEEDS, TASK, TOKENS, names, row
from .._foundation.sequences import repeated_tokens, segment_length, text_tokens
from .detectors import induction_mask
from .metric import Metric, undeclared

__all__ = ["Metric", "NEEDS", "TASK", "TOKENS", "as_metric", "builtin", "default_tokens", "induction_loss",
           "logit_diff", "text_loss"]

# Logits may cover only the last `kept` positions of the tokens (see Metric.keep_last); kept == pos by default.
Logits = Float[Tensor, "batch kept vocab"]
Tokens = Int[Tensor, "batch pos"]


def _from_table(name: str, fn: Callable, **kwargs) -> Metric:
    """The built-in ``Metric`` of a table row: its direction, needs and prompts come from the table."""
    r = row(name)
    return Metric(name, fn, needs=r.needs, higher_is_better=r.higher_is_better, prompts=r.prompts, **kwargs)


# ------------------------------------------------------------------------------------------ logits metrics

# next_token_losses' working set: at 2 × 1,281 tokens SmolLM2's full log-softmax copy would be 0.5 GB
LOSS_CHUNK_BYTES = 64 * 2**20


def next_token_losses(logits: Float[Tensor, "batch kept vocab"], tokens: Tokens) -> Float[Tensor, "batch kept_minus_1"]:
    """Cross-entropy of predicting ``tokens[:, i+1]`` from ``logits[:, i]`` (log-softmax + gather, float32).

    ``logits`` may cover only the last ``k`` positions; the result then covers positions
    ``p-k .. p-2`` (entry ``j`` is position ``p-k+j``).
    """
    k, p = logits.shape[1], tokens.shape[1]
    x, target = logits[:, :-1], tokens[:, p - k + 1:, None].to(logits.device)
    # in slices of positions (each ~LOSS_CHUNK_BYTES of float32 log-probabilities), not one [b, k, vocab] copy:
    # every position's log-softmax is its own, so the values are the same
    step = max(1, LOSS_CHUNK_BYTES // max(1, 4 * x.shape[0] * x.shape[-1]))
    parts = [-F.log_softmax(x[:, a:a + step].float(), dim=-1).gather(-1, target[:, a:a + step]).squeeze(-1)
             for a in range(0, x.shape[1], step)]
    if not parts:                       # one kept position: nothing to predict
        return logits.new_zeros(logits.shape[0], 0, dtype=torch.float32)
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def repeat_length(tokens: Tokens) -> int:
    """``L`` for tokens laid out as ``[BOS] + R + R`` (or ``R + R``) with ``|R| = L``; else a QKCircuitsError."""
    t = torch.as_tensor(tokens)
    p = t.shape[-1]
    for bos in (1, 0):
        L = (p - bos) // 2
        if L >= 2 and bos + 2 * L == p and torch.equal(t[:, bos:bos + L], t[:, bos + L:]):
            return L
    raise QKCircuitsError(f"induction-loss needs tokens laid out as [BOS] + R + R (see qk.repeated_tokens); got "
                          f"{p} positions whose halves differ")


def induction_loss(half: str = "second") -> Metric:
    """Mean loss on the repeated half of ``[BOS] + R + R`` (``half="first"``: the same positions of the first R).

    Counts the ``L-1`` predictions an induction head can make: the tokens ``R[1:]`` of the second
    copy (``R[0]`` follows the end of the first copy, which nothing before predicts). The first
    half's counterpart predicts ``R[1:]`` of the first copy, which only guessing can do: a model
    that copies perfectly has second-half loss 0 and first-half loss ``ln(V-1)`` on uniform R.
    A loss: ``higher_is_better=False``.
    """
    if half not in ("first", "second"):
        raise QKCircuitsError(f"half must be 'first' or 'second', got {half!r}")
    return _INDUCTION_LOSS[half]


def _induction_loss_fn(half: str):
    def fn(logits: Tensor, tokens: Tensor) -> Tensor:
        L = repeat_length(tokens)
        start = tokens.shape[1] - 2 * L              # 1 with BOS, 0 without
        first = start + 1 if half == "first" else start + L + 1   # position of R[1] in that copy
        offset = tokens.shape[1] - logits.shape[1]   # logits may cover only the last positions
        if offset > first - 1:
            raise QKCircuitsError(f"induction-loss needs logits from position {first - 1}, got them from {offset}")
        losses = next_token_losses(logits, tokens)   # losses[:, j] predicts token offset + j + 1
        return losses[:, first - 1 - offset:first - 1 - offset + L - 1].mean()
    return fn


def _text_loss_fn(logits: Tensor, tokens: Tensor) -> Tensor:
    return next_token_losses(logits, tokens).mean()


# Built once, so that as_metric(name) returns an equal (the same) object: names round-trip.
_INDUCTION_LOSS = {
    # The second copy's predictions come from the last L positions' logits.
    "second": _from_table("induction-loss", _induction_loss_fn("second"), check=repeat_length,
                          keep_last=repeat_length),
    "first": _from_table("induction-loss-first-half", _induction_loss_fn("first"), check=repeat_length),
}
_TEXT_LOSS = _from_table("text-loss", _text_loss_fn)


def text_loss() -> Metric:
    """Mean next-token loss over every position of the given text tokens (a loss: ``higher_is_better=False``)."""
    return _TEXT_LOSS


def logit_diff(correct: Union[int, str, Tensor], wrong: Union[int, str, Tensor], *, position: int = -1,
               model=None) -> Metric:
    """Mean of ``logits[:, position, correct] - logits[:, position, wrong]`` (larger = behaviour present).

    ``correct``/``wrong`` are token ids (one, or one per sequence as a [batch] tensor) or strings
    that ``model``'s tokenizer maps to exactly one token each. With one id each the name carries them
    (``logit-diff:C,W``, ``@P`` for another position) and round-trips through ``as_metric``.

    >>> m = qk.logit_diff(3, 7)
    >>> m.name, qk.as_metric(m.name).name
    ('logit-diff:3,7', 'logit-diff:3,7')
    """
    ids = [_one_token(x, model) if isinstance(x, str) else torch.as_tensor(x) for x in (correct, wrong)]
    if not isinstance(position, int) or isinstance(position, bool):
        raise QKCircuitsError(f"position must be an integer, got {position!r}")

    def fn(logits: Tensor, tokens: Tensor) -> Tensor:
        last = logits[:, position]
        c, w = (i.to(last.device).expand(last.shape[0]) for i in ids)
        rows = torch.arange(last.shape[0], device=last.device)
        return (last[rows, c] - last[rows, w]).mean()

    name = "logit-diff"
    if all(i.numel() == 1 for i in ids):
        name += f":{int(ids[0])},{int(ids[1])}" + (f"@{position}" if position != -1 else "")
    return Metric(name, fn, keep_last=(lambda tokens: -position) if position < 0 else None,
                  higher_is_better=row("logit-diff:C,W").higher_is_better)


def _one_token(text: str, model) -> Tensor:
    tok = getattr(model, "tokenizer", None) if model is not None else None
    if tok is None:
        raise QKCircuitsError(f"answer {text!r} is text but no model with a tokenizer was given; pass token ids "
                              f"or model=")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        raise QKCircuitsError(f"answer {text!r} is {len(ids)} tokens ({ids}); logit-diff needs one token each")
    return torch.tensor(ids[0])


# ------------------------------------------------------------------------------------------ task metrics
# One value per row from the logits at each row's END ([b, vocab], float32) and the row's answer / wrong ids
# (Metric.rows; a qk.Task evaluates them): [b] (one id per row: the operations Task.row_values has always run, so
# a one-token task's numbers are unchanged) or [b, k] (a set per row, padded with -1: _tasks/answers.py).

def _rows(last: Tensor) -> Tensor:
    return torch.arange(last.shape[0], device=last.device)


def _at(values: Tensor, ids: Tensor, fill: float) -> Tuple[Tensor, Tensor]:
    """``values`` [b, vocab] at a set per row ``ids`` [b, k] (``fill`` at the padding) and the set's mask."""
    mask = ids >= 0
    got = values.gather(1, ids.clamp(min=0))
    return torch.where(mask, got, torch.full_like(got, fill)), mask


def _mean_logit(last: Tensor, ids: Tensor) -> Tensor:
    if ids.dim() == 1:
        return last[_rows(last), ids]
    got, mask = _at(last, ids, 0.0)
    return got.sum(-1) / mask.sum(-1)


def _total_prob(logp: Tensor, ids: Tensor) -> Tensor:
    if ids.dim() == 1:
        return logp[_rows(logp), ids].exp()
    return _at(logp, ids, float("-inf"))[0].exp().sum(-1)


def _logit_diff_rows(last: Tensor, answer: Tensor, wrong: Tensor, reference: Optional[Tensor]) -> Tensor:
    return _mean_logit(last, answer) - _mean_logit(last, wrong)


def _prob_diff_rows(last: Tensor, answer: Tensor, wrong: Tensor, reference: Optional[Tensor]) -> Tensor:
    logp = F.log_softmax(last, -1)
    return _total_prob(logp, answer) - _total_prob(logp, wrong)


def _answer_loss_rows(last: Tensor, answer: Tensor, wrong: Tensor, reference: Optional[Tensor]) -> Tensor:
    logp = F.log_softmax(last, -1)
    if answer.dim() == 1:
        return -logp[_rows(last), answer]
    return -torch.logsumexp(_at(logp, answer, float("-inf"))[0], -1)


def _kl_rows(last: Tensor, answer: Tensor, wrong: Tensor, reference: Optional[Tensor]) -> Tensor:
    if reference is None:
        raise QKCircuitsError("metric 'kl' needs the clean run's next-token distribution: pass the task through "
                              "qk.edge_scores / qk.faithfulness / qk.evaluate (they fill it), or task = "
                              "qkcircuits._tasks.task.with_reference(model, task)")
    logp = F.log_softmax(last, -1)
    return (reference.exp() * (reference - logp)).sum(-1)


TASK_METRICS = {m.name: m for m in (_from_table("logit-diff", _logit_diff_rows),
                                    _from_table("prob-diff", _prob_diff_rows),
                                    _from_table("answer-loss", _answer_loss_rows),
                                    _from_table("kl", _kl_rows))}


def reads_reference(metric: Metric) -> bool:
    """Whether a task metric reads the clean run's distribution at END (``kl``: ``Task.with_reference`` fills it)."""
    return metric.fn is _kl_rows


# ------------------------------------------------------------------------------------------ receiver metrics

def induction_attention(pattern: Float[Tensor, "batch q k"], z: Optional[Tensor], tokens: Tokens) -> Tensor:
    """A receiver head's attention on its induction targets, mean over the query positions that have one.

    Path patching computes the same number as sums and counts (``path_core.Scorer``), so shards add up.
    """
    mask = induction_mask(tokens, repeat_length(tokens)).to(pattern.device)
    has = mask.any(-1)
    return (pattern * mask.to(pattern.dtype)).sum(-1)[has].mean()


def direct_logit(pattern: Optional[Tensor], z: Tensor, tokens: Tokens) -> Tensor:
    """Placeholder ``fn`` of the ``direct-logit`` receiver metric: it reads the model's unembedding and the
    clean final residual, so only path patching (``path_core.Scorer``) evaluates it."""
    raise QKCircuitsError("metric 'direct-logit' (a receiver head's direct contribution to the correct next "
                          "token's logit) is evaluated inside path_patch / edge_attribution only")


INDUCTION = _from_table("induction", induction_attention, check=repeat_length)
DIRECT_LOGIT = _from_table("direct-logit", direct_logit, check=repeat_length)


# ------------------------------------------------------------------------------------------ the resolver

_LOGIT_DIFF = re.compile(r"^logit-diff:(-?\d+),(-?\d+)(?:@(-?\d+))?$")
_FIXED: Dict[str, Metric] = {"induction-loss": _INDUCTION_LOSS["second"],
                             "induction-loss-first-half": _INDUCTION_LOSS["first"], "text-loss": _TEXT_LOSS,
                             "induction": INDUCTION, "direct-logit": DIRECT_LOGIT, **TASK_METRICS}


def builtin(name: str) -> Optional[Metric]:
    """The built-in ``Metric`` of a current name of the table (``logit-diff:C,W`` built from its ids), whatever
    the context; None for any other string. ``as_metric`` adds the checks of where a name applies."""
    m = _LOGIT_DIFF.match(name)
    if m:
        return logit_diff(int(m[1]), int(m[2]), position=int(m[3]) if m[3] else -1)
    return _FIXED.get(name)


def is_builtin(metric: Metric) -> bool:
    """``metric`` is the table's own (the same function as ``builtin(metric.name)``: a name describes it fully)."""
    again = builtin(metric.name)
    return again is not None and again.fn is metric.fn


def portable(metric: "Union[str, Metric, Callable, None]") -> "Union[str, Metric, Callable, None]":
    """What to send to another process (Ray workers): the metric's name where the name alone rebuilds it
    (the built-ins), else the metric itself. A name always pickles; a built-in's closure may not (under a
    runtime type checker its functions are wrapped in objects that hold weak references)."""
    if not isinstance(metric, Metric):
        return metric
    again = builtin(metric.name)
    same = again is not None and (again.needs, again.higher_is_better, again.prompts) == (
        metric.needs, metric.higher_is_better, metric.prompts)
    return metric.name if same else metric


def as_metric(spec: Any, model=None, *, accept: Sequence[str] = NEEDS, prompts: Sequence[str] = TOKENS,
              where: str = "this analysis", higher_is_better: Optional[bool] = None) -> Metric:
    """The one resolver: a ``Metric`` from a name (the table), a ``Metric`` or a callable, checked for where it
    is used: ``accept`` (the ``needs`` the caller evaluates) and ``prompts`` (``TOKENS``: analyses given token
    rows, the default; ``TASK``: a ``qk.Task``); ``where`` names the caller in the one-line errors.

    A callable needs ``higher_is_better`` (the direction is never guessed); it is wrapped once: ``fn(logits)`` or
    ``fn(logits, tokens)`` → a logits metric, ``fn(pattern, z, tokens)`` → a receiver metric (``needs="z"``),
    named after ``fn.__name__``. ``text-loss`` needs a model with a tokenizer when one is given.

    >>> try:
    ...     qk.as_metric("logit-diff", where="sweep")
    ... except qk.QKCircuitsError as e:
    ...     print(str(e)[:64])
    sweep cannot evaluate metric 'logit-diff': it needs a task's ans
    """
    if isinstance(spec, Metric):
        if higher_is_better is not None and higher_is_better != spec.higher_is_better:
            raise QKCircuitsError(f"metric {spec.name!r} is declared higher_is_better={spec.higher_is_better}; "
                                  f"higher_is_better= declares a plain callable's direction")
        metric = spec
    elif isinstance(spec, str):
        metric = _named(spec.strip(), model, accept, prompts, where)
    elif callable(spec):
        name = getattr(spec, "__name__", None) or type(spec).__name__
        name = "custom" if name == "<lambda>" else name
        if higher_is_better is None:
            raise QKCircuitsError(f"{where}: " + undeclared(name))
        n = _n_positional(spec)
        fn = spec if n >= 2 else (lambda logits, tokens: spec(logits))
        metric = Metric(name, fn, needs="z" if n >= 3 else "logits", higher_is_better=higher_is_better)
    else:
        raise QKCircuitsError(f"metric must be a name ({', '.join(names(accept, prompts))}), a qk.Metric or a "
                              f"callable, not {type(spec).__name__} {spec!r}"[:300])
    if metric.needs not in accept:
        raise QKCircuitsError(f"{where} needs a metric on {' or '.join(accept)}; got {metric.name!r} (needs "
                              f"{metric.needs}). Accepted: {accepted_names(accept, prompts)}")
    if metric.prompts not in prompts:
        raise QKCircuitsError(_misplaced(metric, accept, prompts, where))
    return metric


def _named(name: str, model, accept: Sequence[str], prompts: Sequence[str], where: str) -> Metric:
    metric = builtin(name)
    if metric is None:
        hint = (" (answer and wrong token ids: 'logit-diff:C,W')" if name.startswith("logit-diff")
                and "any" in prompts else "")
        raise QKCircuitsError(f"unknown metric {name!r}{hint}; use one of {accepted_names(accept, prompts)}")
    if name == "text-loss" and model is not None and getattr(model, "tokenizer", None) is None:
        raise QKCircuitsError("metric 'text-loss' needs a model with a tokenizer, and this one has none; "
                              "use 'induction-loss' or a callable on logits")
    return metric


def _misplaced(metric: Metric, accept: Sequence[str], prompts: Sequence[str], where: str) -> str:
    """One line: why ``metric`` cannot apply here, and what would."""
    if metric.prompts == "task":
        why = ("it needs a task's answer and wrong tokens (a qk.Task: qk.evaluate, qk.edge_scores, qk.faithfulness, "
               "qkcircuits circuit)")
        if metric.name == "logit-diff":
            why += "; with tokens alone name the two tokens: qk.logit_diff(correct, wrong) or 'logit-diff:C,W' (ids)"
    else:
        why = f"it is defined on {metric.prompts} prompts ([BOS] + R + R), not a task's clean and corrupt rows"
    return f"{where} cannot evaluate metric {metric.name!r}: {why}. Accepted: {accepted_names(accept, prompts)}"


def accepted_names(accept: Sequence[str] = NEEDS, prompts: Sequence[str] = TOKENS) -> str:
    """The names and forms of metric an analysis that evaluates ``accept`` on ``prompts`` takes (for errors)."""
    forms = []
    if "logits" in accept:
        forms.append("fn(logits[, tokens])")
    if "pattern" in accept or "z" in accept:
        forms.append("fn(pattern, z, tokens)")
    return (", ".join(names(accept, prompts)) + ", a qk.Metric, or a callable " + " or ".join(forms)
            + " with higher_is_better declared")


def _n_positional(fn: Callable) -> int:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return 1
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return 2
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty for p in params)


def default_tokens(model, metric: Union[str, Metric], *, n_seqs: int = 8, seg_len: Optional[int] = None,
                   seq_len: Optional[int] = None, seed: int = 0) -> Tokens:
    """Prompts a named metric is defined on: ``[BOS]+R+R`` with ``|R| = seg_len`` for induction-loss
    (default ``segment_length``: 40 capped by context and vocabulary), rows of ``seq_len`` (default 40)
    tokens of the packaged text for text-loss.

    ``seq_len=`` for induction-loss is refused (``seg_len=`` is the length of R), and ``seg_len=`` for text-loss
    (text rows have no repeated segment).
    """
    name = metric.name if isinstance(metric, Metric) else as_metric(metric, model).name
    if name.startswith("induction"):
        if seq_len is not None:
            raise QKCircuitsError(f"seq_len={seq_len!r} is the length of text-loss rows; induction prompts take "
                                  f"seg_len= (the length of R)")
        return repeated_tokens(model, n_seqs=n_seqs, seg_len=seg_len or segment_length(model), seed=seed)
    if name == "text-loss":
        if seg_len is not None:
            raise QKCircuitsError(f"seg_len={seg_len!r} is the repeated segment of induction prompts; text-loss "
                                  f"rows take seq_len= (tokens per row)")
        as_metric("text-loss", model)                # raises without a tokenizer
        return text_tokens(model, seq_len=seq_len or 40, n_seqs=n_seqs)
    raise QKCircuitsError(f"no default prompts for metric {name!r}; pass tokens explicitly")
