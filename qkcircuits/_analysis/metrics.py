"""One ``Metric`` for every analysis: a named number computed from a forward pass.

>>> m = qk.induction_loss()                     # loss on the repeated half of [BOS] + R + R
>>> m.name, m.needs, m.higher_is_better
('induction-loss', 'logits', False)
>>> float(m(model(tokens).detach(), tokens)) >= 0
True
>>> qk.as_metric(m.name) == m                   # a name round-trips (JSON holds the name)
True
>>> qk.as_metric("loss").name                   # alias, labelled by its real name
'induction-loss'
>>> qk.as_metric(lambda logits: logits[:, -1, 3].mean()).needs     # the signature decides
'logits'
>>> qk.as_metric(lambda pattern, z, tokens: pattern[:, -1, 0].mean()).needs
'z'

What a metric reads (``needs``):

- ``"logits"``: ``fn(logits [batch, pos, vocab], tokens [batch, pos]) -> scalar``, a mean over the batch
  (so a slice of the batch and the whole batch mean the same thing). Every analysis accepts these:
  ``ablate``/``group_effect``/``sweep``/``attribution``, ``path_patch``/``edge_attribution`` (the receiver's
  patched z is run through the layers above to the logits) and the task circuits.
- ``"pattern"`` / ``"z"``: a *receiver* metric of path patching, ``fn(pattern [batch, q, k], z [batch, pos,
  d_head], tokens) -> scalar`` for one receiver head (``needs="pattern"``: z may be None). Only
  ``path_patch``/``edge_attribution``/``trace`` accept these; elsewhere they fail with one line.

Sign convention: ``higher_is_better`` says whether a larger value means the behaviour is present (a score,
a logit difference: True, the default) or absent (a loss: False). Metrics keep their natural values
(``baseline``, ``clean``: a loss stays a loss) but every *effect* is reported so that **positive = the
component matters**::

    effect = sign · (metric(clean) − metric(ablated or patched)),   sign = +1 if higher_is_better else −1

so a loss gives ``ablated − clean`` and a score ``clean − ablated`` (``Metric.effect``).

Names (``NAMES``; ``as_metric(name)`` builds each): ``induction-loss``, ``induction-loss-first-half``,
``text-loss``, ``logit-diff:C,W`` (token ids; ``@P`` for a position other than -1), ``induction`` (pattern),
``direct-logit`` (z); alias ``loss`` = ``induction-loss``. Any callable is wrapped once by ``as_metric``
(its positional parameters decide: 1 or 2 → logits, 3 → a receiver metric), or built explicitly with
``qk.Metric(name, fn, needs=..., higher_is_better=...)``.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import KW_ONLY, dataclass
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor

from .._foundation.errors import QKCircuitsError
from .._foundation.sequences import repeated_tokens, segment_length, text_tokens
from .detectors import induction_mask

NEEDS = ("logits", "pattern", "z")
NAMES = ("induction-loss", "induction-loss-first-half", "text-loss", "logit-diff:C,W", "induction", "direct-logit")
ALIASES = {"loss": "induction-loss"}
# Logits may cover only the last `kept` positions of the tokens (see Metric.keep_last); kept == pos by default.
Logits = Float[Tensor, "batch kept vocab"]
Tokens = Int[Tensor, "batch pos"]


@dataclass(frozen=True)
class Metric:
    """A named ``fn`` plus what it reads and which way is "behaviour present" (see the module docstring).

    ``Metric(name, fn)`` (positional, as before): a logits metric, larger = behaviour present.
    ``check(tokens)`` (optional) runs before any forward; ``keep_last(tokens) -> k`` (optional) says the
    metric reads only the logits of the last ``k`` positions, so ``sweep`` asks the model for just those
    (``logits_to_keep``) and ``fn`` must accept logits of the last ``k`` (or more) positions.

    >>> m = qk.Metric("top-logit", lambda logits, tokens: logits[:, -1].max(-1).values.mean())
    >>> m.needs, m.higher_is_better, m.effect(clean=2.0, changed=0.5)
    ('logits', True, 1.5)
    """

    name: str
    fn: Callable[..., Tensor]
    check: Optional[Callable[[Tensor], object]] = None
    keep_last: Optional[Callable[[Tensor], int]] = None
    _: KW_ONLY
    needs: str = "logits"
    higher_is_better: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise QKCircuitsError(f"a metric's name must be a non-empty string, got {self.name!r}")
        if not callable(self.fn):
            raise QKCircuitsError(f"metric {self.name!r}: fn must be callable, got {type(self.fn).__name__}")
        if self.needs not in NEEDS:
            raise QKCircuitsError(f"metric {self.name!r}: needs must be one of {', '.join(NEEDS)}, got {self.needs!r}")
        if not isinstance(self.higher_is_better, bool):
            raise QKCircuitsError(f"metric {self.name!r}: higher_is_better must be True or False, got "
                                  f"{self.higher_is_better!r}")

    @property
    def sign(self) -> float:
        """+1 when larger = behaviour present, −1 for a loss: ``effect = sign · (clean − changed)``."""
        return 1.0 if self.higher_is_better else -1.0

    def effect(self, clean, changed):
        """``sign · (clean − changed)``: positive = the ablated/patched component matters (floats or tensors)."""
        return self.sign * (clean - changed)

    def __call__(self, *inputs: Optional[Tensor]) -> Float[Tensor, ""]:
        """Logits metrics: ``m(logits, tokens)``; receiver metrics: ``m(pattern, z, tokens)``."""
        want = 2 if self.needs == "logits" else 3
        if len(inputs) != want:
            what = "(logits, tokens)" if want == 2 else "(pattern, z, tokens)"
            raise QKCircuitsError(f"metric {self.name!r} (needs {self.needs}) is called as {what}, got "
                                  f"{len(inputs)} inputs")
        out = torch.as_tensor(self.fn(*inputs))
        if out.numel() != 1:
            raise QKCircuitsError(f"metric {self.name!r} must return one number, got shape {tuple(out.shape)}")
        return out.reshape(())


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
    "second": Metric("induction-loss", _induction_loss_fn("second"), check=repeat_length, keep_last=repeat_length,
                     higher_is_better=False),
    "first": Metric("induction-loss-first-half", _induction_loss_fn("first"), check=repeat_length,
                    higher_is_better=False),
}
_TEXT_LOSS = Metric("text-loss", _text_loss_fn, higher_is_better=False)


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
    return Metric(name, fn, keep_last=(lambda tokens: -position) if position < 0 else None)


def _one_token(text: str, model) -> Tensor:
    tok = getattr(model, "tokenizer", None) if model is not None else None
    if tok is None:
        raise QKCircuitsError(f"answer {text!r} is text but no model with a tokenizer was given; pass token ids "
                              f"or model=")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        raise QKCircuitsError(f"answer {text!r} is {len(ids)} tokens ({ids}); logit-diff needs one token each")
    return torch.tensor(ids[0])


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


INDUCTION = Metric("induction", induction_attention, needs="pattern")
DIRECT_LOGIT = Metric("direct-logit", direct_logit, needs="z")


# ------------------------------------------------------------------------------------------ the resolver

_LOGIT_DIFF = re.compile(r"^logit-diff:(-?\d+),(-?\d+)(?:@(-?\d+))?$")


def _named(name: str, model) -> Metric:
    name = ALIASES.get(name, name)
    if name == "induction-loss":
        return induction_loss()
    if name == "induction-loss-first-half":
        return induction_loss("first")
    if name == "text-loss":
        if model is not None and getattr(model, "tokenizer", None) is None:
            raise QKCircuitsError("metric 'text-loss' needs a model with a tokenizer, and this one has none; "
                                  "use 'induction-loss' or a callable on logits")
        return text_loss()
    if name == "induction":
        return INDUCTION
    if name == "direct-logit":
        return DIRECT_LOGIT
    m = _LOGIT_DIFF.match(name)
    if m:
        return logit_diff(int(m[1]), int(m[2]), position=int(m[3]) if m[3] else -1)
    if name == "logit-diff":
        raise QKCircuitsError("metric 'logit-diff' needs its answer tokens: pass qk.logit_diff(correct, wrong) or "
                              "the name 'logit-diff:C,W' with token ids")
    raise QKCircuitsError(f"unknown metric {name!r}; use one of {', '.join(NAMES)} (alias: loss), a qk.Metric or a "
                          f"callable")


def portable(metric: "Union[str, Metric, Callable, None]") -> "Union[str, Metric, Callable, None]":
    """What to send to another process (Ray workers): the metric's name where the name alone rebuilds it
    (``as_metric(name)``: the built-ins), else the metric itself. A name always pickles; a built-in's closure
    may not (under a runtime type checker its functions are wrapped in objects that hold weak references)."""
    name = metric if isinstance(metric, str) or metric is None else getattr(metric, "name", None)
    if not isinstance(name, str) or isinstance(metric, str) or metric is None:
        return metric
    try:
        again = as_metric(name)
    except QKCircuitsError:
        return metric
    same = (again.name == metric.name and again.needs == metric.needs
            and again.higher_is_better == metric.higher_is_better)
    return name if same else metric


def as_metric(spec: Any, model=None, *, accept: Sequence[str] = NEEDS,
              where: str = "this analysis") -> Metric:
    """The one resolver: a ``Metric`` from a name (``NAMES``, alias ``loss``), a ``Metric`` or a callable.

    A callable is wrapped once: ``fn(logits)`` or ``fn(logits, tokens)`` → a logits metric, ``fn(pattern, z,
    tokens)`` → a receiver metric (``needs="z"``); named after ``fn.__name__``, larger = behaviour present
    (build ``qk.Metric(name, fn, needs=..., higher_is_better=False)`` for a loss). ``accept``: the
    ``needs`` the caller can evaluate (``where`` names the caller in the error). ``text-loss`` needs a
    model with a tokenizer (text has to become tokens somehow).

    >>> try:
    ...     qk.as_metric("induction", accept=("logits",), where="sweep")
    ... except qk.QKCircuitsError as e:
    ...     print(str(e)[:58])
    sweep needs a metric on logits; got 'induction' (needs pat
    """
    if isinstance(spec, Metric):
        metric = spec
    elif isinstance(spec, str):
        metric = _named(spec.strip(), model)
    elif callable(spec):
        name = getattr(spec, "__name__", None) or type(spec).__name__
        name = "custom" if name == "<lambda>" else name
        n = _n_positional(spec)
        if n >= 3:
            metric = Metric(name, spec, needs="z")
        elif n == 2:
            metric = Metric(name, spec)
        else:
            metric = Metric(name, lambda logits, tokens: spec(logits))
    else:
        raise QKCircuitsError(f"metric must be a name ({', '.join(NAMES)}), a qk.Metric or a callable, not "
                              f"{type(spec).__name__} {spec!r}"[:300])
    if metric.needs not in accept:
        raise QKCircuitsError(f"{where} needs a metric on {' or '.join(accept)}; got {metric.name!r} (needs "
                              f"{metric.needs}). Accepted: {accepted_names(accept)}")
    return metric


def accepted_names(accept: Sequence[str]) -> str:
    """The names and forms of metric an analysis that evaluates ``accept`` takes (for error messages)."""
    names = [n for n in NAMES if _NEEDS_OF[n] in accept]
    forms = []
    if "logits" in accept:
        forms.append("fn(logits[, tokens])")
    if "pattern" in accept or "z" in accept:
        forms.append("fn(pattern, z, tokens)")
    return ", ".join(names) + ", a qk.Metric or a callable " + " or ".join(forms)


_NEEDS_OF = {"induction-loss": "logits", "induction-loss-first-half": "logits", "text-loss": "logits",
             "logit-diff:C,W": "logits", "induction": "pattern", "direct-logit": "z"}


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

    ``seq_len=`` for induction-loss is the old spelling of ``seg_len=`` (one release, DeprecationWarning);
    ``seg_len=`` for text-loss is refused (text rows have no repeated segment).
    """
    import warnings

    name = metric.name if isinstance(metric, Metric) else ALIASES.get(metric, metric)
    if name.startswith("induction"):
        if seq_len is not None:
            if seg_len is not None:
                raise QKCircuitsError("default_tokens: give seg_len= (the length of R), not also seq_len= (its old "
                                      "name for induction prompts)")
            warnings.warn("default_tokens(seq_len=...) for induction prompts is deprecated; use seg_len=... (the "
                          "length of R; the old name goes in the next release)", DeprecationWarning, stacklevel=2)
            seg_len = seq_len
        return repeated_tokens(model, n_seqs=n_seqs, seg_len=seg_len or segment_length(model), seed=seed)
    if name == "text-loss":
        if seg_len is not None:
            raise QKCircuitsError(f"seg_len={seg_len!r} is the repeated segment of induction prompts; text-loss "
                                  f"rows take seq_len= (tokens per row)")
        as_metric("text-loss", model)                # raises without a tokenizer
        return text_tokens(model, seq_len=seq_len or 40, n_seqs=n_seqs)
    raise QKCircuitsError(f"no default prompts for metric {name!r}; pass tokens explicitly")
