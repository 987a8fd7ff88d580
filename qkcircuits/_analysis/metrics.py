"""Metrics for ablations: a number computed from a forward pass's logits (and the tokens fed in).

>>> m = induction_loss()                       # loss on the repeated half of [BOS] + R + R
>>> m(logits, tokens)                          # doctest: +SKIP  -> scalar tensor, mean over the batch
>>> m = logit_diff(correct=" Paris", wrong=" London", model=model)     # doctest: +SKIP
>>> m = as_metric(lambda logits: logits[:, -1, 42].mean())              # any callable on logits

Every metric returns a scalar tensor that is a *mean over the batch*, so evaluating it on a
slice of the batch (what ``sweep`` does for several ablations stacked along the batch) and on
the whole batch mean the same thing. Effects are ``metric(ablated) - metric(clean)``: for
losses a positive effect means the head helped.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor

from .._foundation.errors import QKCircuitsError

NAMES = ("induction-loss", "text-loss", "logit-diff")
# Logits may cover only the last `kept` positions of the tokens (see Metric.keep_last); kept == pos by default.
Logits = Float[Tensor, "batch kept vocab"]
Tokens = Int[Tensor, "batch pos"]


@dataclass(frozen=True)
class Metric:
    """A named ``fn(logits, tokens) -> scalar`` plus an optional ``check(tokens)`` run before any forward.

    ``keep_last(tokens) -> k`` (optional) says the metric reads only the logits of the last ``k``
    positions: ``sweep`` then asks the model for just those (``logits_to_keep``), which skips most
    of the unembedding, and ``fn`` must accept logits of the last ``k`` (or more) positions.
    """

    name: str
    fn: Callable[[Tensor, Tensor], Tensor]
    check: Optional[Callable[[Tensor], None]] = None
    keep_last: Optional[Callable[[Tensor], int]] = None

    def __call__(self, logits: Logits, tokens: Tokens) -> Float[Tensor, ""]:
        out = torch.as_tensor(self.fn(logits, tokens))
        if out.numel() != 1:
            raise QKCircuitsError(f"metric {self.name!r} must return one number, got shape {tuple(out.shape)}")
        return out.reshape(())


def next_token_losses(logits: Logits, tokens: Tokens) -> Float[Tensor, "batch kept-1"]:
    """Cross-entropy of predicting ``tokens[:, i+1]`` from ``logits[:, i]`` (log-softmax + gather, float32).

    ``logits`` may cover only the last ``k`` positions; the result then covers positions
    ``p-k .. p-2`` (entry ``j`` is position ``p-k+j``).
    """
    k, p = logits.shape[1], tokens.shape[1]
    logp = F.log_softmax(logits[:, :-1].float(), dim=-1)
    return -logp.gather(-1, tokens[:, p - k + 1:, None].to(logits.device)).squeeze(-1)


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
    """
    if half not in ("first", "second"):
        raise QKCircuitsError(f"half must be 'first' or 'second', got {half!r}")

    def fn(logits: Tensor, tokens: Tensor) -> Tensor:
        L = repeat_length(tokens)
        start = tokens.shape[1] - 2 * L              # 1 with BOS, 0 without
        first = start + 1 if half == "first" else start + L + 1   # position of R[1] in that copy
        offset = tokens.shape[1] - logits.shape[1]   # logits may cover only the last positions
        if offset > first - 1:
            raise QKCircuitsError(f"induction-loss needs logits from position {first - 1}, got them from {offset}")
        losses = next_token_losses(logits, tokens)   # losses[:, j] predicts token offset + j + 1
        return losses[:, first - 1 - offset:first - 1 - offset + L - 1].mean()

    if half == "first":
        return Metric("induction-loss-first-half", fn, check=repeat_length)
    # The second copy's predictions come from the last L positions' logits.
    return Metric("induction-loss", fn, check=repeat_length, keep_last=repeat_length)


def text_loss() -> Metric:
    """Mean next-token loss over every position of the given text tokens."""
    return Metric("text-loss", lambda logits, tokens: next_token_losses(logits, tokens).mean())


def logit_diff(correct: Union[int, str, Tensor], wrong: Union[int, str, Tensor], *, position: int = -1,
               model=None) -> Metric:
    """Mean of ``logits[:, position, correct] - logits[:, position, wrong]``.

    ``correct``/``wrong`` are token ids (one, or one per sequence as a [batch] tensor) or strings
    that ``model``'s tokenizer maps to exactly one token each.
    """
    ids = [_one_token(x, model) if isinstance(x, str) else torch.as_tensor(x) for x in (correct, wrong)]

    def fn(logits: Tensor, tokens: Tensor) -> Tensor:
        last = logits[:, position]
        c, w = (i.to(last.device).expand(last.shape[0]) for i in ids)
        rows = torch.arange(last.shape[0], device=last.device)
        return (last[rows, c] - last[rows, w]).mean()

    return Metric("logit-diff", fn, keep_last=(lambda tokens: -position) if position < 0 else None)


def _one_token(text: str, model) -> Tensor:
    tok = getattr(model, "tokenizer", None) if model is not None else None
    if tok is None:
        raise QKCircuitsError(f"answer {text!r} is text but no model with a tokenizer was given; pass token ids "
                              f"or model=")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        raise QKCircuitsError(f"answer {text!r} is {len(ids)} tokens ({ids}); logit-diff needs one token each")
    return torch.tensor(ids[0])


def as_metric(spec: Union[str, Metric, Callable], model=None) -> Metric:
    """A ``Metric`` from a name (``induction-loss``, ``text-loss``), a ``Metric``, or a callable.

    A callable takes ``(logits)`` or ``(logits, tokens)`` and returns a scalar (mean over the
    batch). ``text-loss`` needs a model with a tokenizer (text has to become tokens somehow).
    """
    if isinstance(spec, Metric):
        return spec
    if isinstance(spec, str):
        if spec == "induction-loss":
            return induction_loss()
        if spec == "text-loss":
            if model is not None and getattr(model, "tokenizer", None) is None:
                raise QKCircuitsError("metric 'text-loss' needs a model with a tokenizer, and this one has none; "
                                      "use 'induction-loss' or a callable on logits")
            return text_loss()
        if spec == "logit-diff":
            raise QKCircuitsError("metric 'logit-diff' needs its answer tokens: pass logit_diff(correct, wrong)")
        raise QKCircuitsError(f"unknown metric {spec!r}; use one of {', '.join(NAMES)} or a callable on logits")
    if callable(spec):
        name = getattr(spec, "__name__", "custom")
        if _n_positional(spec) >= 2:
            return Metric(name, spec)
        return Metric(name, lambda logits, tokens: spec(logits))
    raise QKCircuitsError(f"metric must be a name ({', '.join(NAMES)}), a Metric or a callable, not "
                          f"{type(spec).__name__}")


def _n_positional(fn: Callable) -> int:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return 1
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return 2
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty for p in params)


def default_tokens(model, metric: Union[str, Metric], *, n_seqs: int = 8, seq_len: Optional[int] = None,
                   seed: int = 0) -> Tokens:
    """Prompts a named metric is defined on: ``[BOS]+R+R`` with ``|R| = seq_len`` for induction-loss
    (default ``segment_length``: 40 capped by context and vocabulary), rows of ``seq_len`` (default 40)
    tokens of the packaged text for text-loss."""
    from .._foundation.sequences import repeated_tokens, segment_length, text_tokens

    name = metric.name if isinstance(metric, Metric) else metric
    if name.startswith("induction-loss"):
        return repeated_tokens(model, n_seqs=n_seqs, seg_len=seq_len or segment_length(model), seed=seed)
    if name == "text-loss":
        as_metric("text-loss", model)                # raises without a tokenizer
        return text_tokens(model, seq_len=seq_len or 40, n_seqs=n_seqs)
    raise QKCircuitsError(f"no default prompts for metric {name!r}; pass tokens explicitly")
