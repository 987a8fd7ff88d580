"""A task: clean and corrupt prompts of the same shape, the answer and the wrong token, a metric.

>>> task = qk.tasks.induction(model, n=4, seg_len=6, seed=0)
>>> task.clean.shape == task.corrupt.shape, task.metric, task.bos
(True, 'logit-diff', True)
>>> sorted(task.positions)
['END']

Every metric is computed per prompt row and *summed* (``row_values``); a mean is the sum over all
rows divided by ``n``. So a prompt shard's sums add up exactly to the whole set's, which is what
edge scores and faithfulness rely on when they split the prompts.

Metrics (logits read at each row's ``END`` position, the last real token; rows shorter than the
longest are right-padded, which a causal model never sees from positions ≤ END):

- ``"logit-diff"`` (default): logit[answer] − logit[wrong];
- ``"prob-diff"``: p(answer) − p(wrong) after a softmax over the vocabulary;
- ``"loss"``: −log p(answer) (lower is better: faithfulness is a ratio, so the sign cancels there; a signed
  circuit ranks edges by −score, the direction that carries the behaviour);
- a callable ``fn(logits [b, pos, vocab], tokens [b, pos]) -> scalar`` (a mean over the batch, the
  ``qk.Metric`` contract): its row sum is taken as ``fn(...) × b``.
"""

from __future__ import annotations

import hashlib
import warnings
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor

from .._foundation.args import check_tokens
from .._foundation.errors import QKCircuitsError

METRICS = ("logit-diff", "prob-diff", "loss")
MetricSpec = Union[str, Callable]


@dataclass
class Task:
    """Clean and corrupt token rows [n, pos] (same shape, checked), per-row ``answer``/``wrong`` token
    ids [n], a ``metric`` (see the module docstring), named positions per row (``positions[name]`` is
    a [n] tensor of indices; ``END`` is where the metric reads and defaults to the last position), a
    ``name``, whether a BOS token was prepended (``bos``) and the prompt texts when built from text."""

    # what __init__ accepts (ids as tensors or nested lists; one answer id for every row, or one per row);
    # __post_init__ stores [n, pos] / [n] long tensors
    clean: Union[Int[Tensor, "n pos"], Sequence[Sequence[int]]]
    corrupt: Union[Int[Tensor, "n_corrupt pos_corrupt"], Sequence[Sequence[int]]]   # == clean's shape: checked below, one line
    answer: Union[int, Sequence[int], Int[Tensor, "..."]]
    wrong: Union[int, Sequence[int], Int[Tensor, "..."]]
    metric: MetricSpec = "logit-diff"
    positions: Dict[str, Tensor] = field(default_factory=dict)
    name: str = "custom"
    bos: bool = False
    prompts: Optional[List[str]] = None

    def __post_init__(self) -> None:
        check_tokens(self.clean, "clean"), check_tokens(self.corrupt, "corrupt")     # ids, not text or floats
        self.clean, self.corrupt = torch.as_tensor(self.clean).long(), torch.as_tensor(self.corrupt).long()
        if self.clean.dim() != 2 or self.clean.shape != self.corrupt.shape:
            raise QKCircuitsError(f"clean and corrupt must be token tensors of the same shape [n, pos]; got "
                                  f"{tuple(self.clean.shape)} and {tuple(self.corrupt.shape)}")
        n = self.clean.shape[0]
        if n < 1:
            raise QKCircuitsError("a task needs at least one prompt row")
        self.answer = torch.as_tensor(self.answer).long().reshape(-1).expand(n).clone() \
            if torch.as_tensor(self.answer).numel() == 1 else torch.as_tensor(self.answer).long()
        self.wrong = torch.as_tensor(self.wrong).long().reshape(-1).expand(n).clone() \
            if torch.as_tensor(self.wrong).numel() == 1 else torch.as_tensor(self.wrong).long()
        for what, ids in (("answer", self.answer), ("wrong", self.wrong)):
            if ids.shape != (n,):
                raise QKCircuitsError(f"{what} must hold one token id per prompt row ({n}), got shape "
                                      f"{tuple(ids.shape)}")
        if isinstance(self.metric, str) and self.metric not in METRICS:
            raise QKCircuitsError(f"unknown task metric {self.metric!r}; use one of {', '.join(METRICS)} or a "
                                  f"callable fn(logits, tokens) -> scalar")
        if not isinstance(self.metric, str) and not callable(self.metric):
            raise QKCircuitsError(f"metric must be a name ({', '.join(METRICS)}) or a callable, not "
                                  f"{type(self.metric).__name__}")
        pos = {k: torch.as_tensor(v).long().reshape(-1) for k, v in self.positions.items()}
        pos.setdefault("END", torch.full((n,), self.clean.shape[1] - 1, dtype=torch.long))
        for k, v in pos.items():
            if v.shape != (n,) or int(v.min()) < 0 or int(v.max()) >= self.clean.shape[1]:
                raise QKCircuitsError(f"position {k!r} must give one index in 0-{self.clean.shape[1] - 1} per row")
        self.positions = pos

    # ---------------------------------------------------------------------------------------- rows

    @property
    def n(self) -> int:
        return int(self.clean.shape[0])

    @property
    def metric_name(self) -> str:
        return self.metric if isinstance(self.metric, str) else getattr(self.metric, "__name__", "custom")

    @property
    def higher_is_better(self) -> bool:
        """See :func:`metric_higher_is_better`."""
        return metric_higher_is_better(self.metric)

    def rows(self, index: Union[slice, Sequence[int], Tensor]) -> "Task":
        """The sub-task of some prompt rows (a shard): its metric sums add up to the whole task's."""
        idx = torch.arange(self.n)[index] if isinstance(index, slice) else torch.as_tensor(index).long()
        return Task(self.clean[idx], self.corrupt[idx], self.answer[idx], self.wrong[idx], self.metric,
                    {k: v[idx] for k, v in self.positions.items()}, self.name, self.bos,
                    [self.prompts[i] for i in idx.tolist()] if self.prompts else None)

    def at_end(self) -> "Task":
        """The same rows with END = 0: for logits already taken at each row's END position ([b, 1, vocab])."""
        t = Task(self.clean[:, :1], self.corrupt[:, :1], self.answer, self.wrong, self.metric, {}, self.name,
                 self.bos)
        return t

    def shards(self, rows_per_shard: int) -> List["Task"]:
        return [self.rows(slice(i, i + rows_per_shard)) for i in range(0, self.n, max(1, rows_per_shard))]

    def to(self, device) -> "Task":
        return Task(self.clean.to(device), self.corrupt.to(device), self.answer.to(device), self.wrong.to(device),
                    self.metric, {k: v.to(device) for k, v in self.positions.items()}, self.name, self.bos,
                    self.prompts)

    # ---------------------------------------------------------------------------------------- metric

    def row_values(self, logits: Float[Tensor, "b pos vocab"], tokens: Optional[Tensor] = None
                   ) -> Float[Tensor, " b"]:
        """The metric of each row (differentiable). ``logits`` may be ``copies`` stacked batches
        (b = copies × n): rows repeat the task's answers. For a callable each row gets the batch mean."""
        b = logits.shape[0]
        copies = b // self.n
        if copies * self.n != b:
            raise QKCircuitsError(f"logits for {b} rows do not stack copies of this task's {self.n} rows")
        if not isinstance(self.metric, str):
            toks = tokens if tokens is not None else self.clean.repeat(copies, 1)
            return torch.as_tensor(self.metric(logits, toks)).reshape(()).expand(b)
        rows = torch.arange(b, device=logits.device)
        end = self.positions["END"].to(logits.device).repeat(copies)
        last = logits[rows, end].float()                                        # [b, vocab]
        a, w = self.answer.to(logits.device).repeat(copies), self.wrong.to(logits.device).repeat(copies)
        if self.metric == "logit-diff":
            return last[rows, a] - last[rows, w]
        logp = F.log_softmax(last, -1)
        if self.metric == "prob-diff":
            return logp[rows, a].exp() - logp[rows, w].exp()
        return -logp[rows, a]

    def metric_sum(self, logits: Tensor, tokens: Optional[Tensor] = None) -> Tensor:
        return self.row_values(logits, tokens).sum()

    def digest(self, model) -> Optional[str]:
        """What the clean metric of this task on ``model`` depends on, as one hex string: the token rows,
        answers, END positions and metric name, the weights (per parameter a bilinear form vᵀ P u with fixed
        pseudo-random u, v > 0: editing a weight changes it, and so does moving values around, e.g. swapping
        two unembedding rows, which keeps every sum), their dtype and device type. None for a callable metric (its code is not
        hashable). ``qk.faithfulness`` reads m(clean) from scores whose digest equals this one instead of
        running the clean rows again."""
        if not isinstance(self.metric, str):
            return None
        h = hashlib.sha1()
        for t in (self.clean, self.corrupt, self.answer, self.wrong, self.positions["END"]):
            h.update(t.detach().cpu().contiguous().numpy().tobytes())
        with torch.no_grad():
            sums = [_fingerprint(p) for p in model.parameters()]
        w = model.W_E
        h.update(repr((self.metric, sums, str(w.dtype), w.device.type)).encode())
        return h.hexdigest()

    def describe(self) -> Dict[str, object]:
        """The JSON-ready description (no tensors)."""
        return {"name": self.name, "n_prompts": self.n, "seq_len": int(self.clean.shape[1]),
                "metric": self.metric_name, "higher_is_better": self.higher_is_better,
                "bos_prepended": bool(self.bos),
                "positions": sorted(self.positions)}


def _probe(n: int, salt: int, like: Tensor) -> Tensor:
    """A fixed pseudo-random vector of ``n`` entries in (0.5, 1.5) (seeded by n and salt), on ``like``'s device."""
    g = torch.Generator().manual_seed(n * 2 + salt)
    return (torch.rand(n, generator=g) + 0.5).to(device=like.device, dtype=like.dtype)


def _fingerprint(p: Tensor) -> float:
    """vᵀ P u of a parameter viewed as [rows, -1] (u, v > 0.5: editing any one weight changes it, and so does
    moving rows or columns around, which a plain sum would not see): one matrix-vector pass over the weights
    (SmolLM2: 0.07 s of CPU for all 135 M, against 0.26 s for a float64 sum)."""
    # in float32 at least: in bf16/fp16 each row's product would be rounded to 8/11 bits, and the probes would
    # take only a few hundred distinct values, so that small edits and swapped rows could leave it unchanged
    x = p.detach() if p.dtype in (torch.float32, torch.float64) else p.detach().float()
    x = x.reshape(x.shape[0], -1) if x.dim() > 1 else x.reshape(1, -1)
    return float(_probe(x.shape[0], 1, x).double() @ (x @ _probe(x.shape[1], 2, x)).double())


def metric_higher_is_better(metric) -> bool:
    """False for ``"loss"``; a callable says so by a ``higher_is_better`` attribute (``qk.Metric`` has one),
    else (another name, a plain callable, ``None``) it is taken as higher-is-better. The one rule: a task and
    a scores file written before ``higher_is_better`` was recorded both go through it."""
    if isinstance(metric, str):
        return metric != "loss"
    return bool(getattr(metric, "higher_is_better", True))


def evaluate(model, task: Task, rows_per_shard: int = 16, warn: bool = True) -> Dict[str, float]:
    """The clean and corrupt metric means (two forwards per shard). Warns, does not fail, when the model
    does not do the task (clean ≤ corrupt for a higher-is-better metric)."""
    sums = {"clean": 0.0, "corrupt": 0.0}
    with torch.no_grad():
        for shard in task.shards(rows_per_shard):
            for which in sums:
                toks = getattr(shard, which)
                sums[which] += float(shard.metric_sum(model(toks), toks))
    out = {k: v / task.n for k, v in sums.items()}
    if warn:
        warn_if_not_done(task, out["clean"], out["corrupt"], stacklevel=3)
    return out


NOT_DONE = "the model does not do task"


def does_the_task(task: Task, clean: float, corrupt: float) -> bool:
    """clean > corrupt for a higher-is-better metric, clean < corrupt for a loss."""
    return clean > corrupt if task.higher_is_better else clean < corrupt


def warn_if_not_done(task: Task, clean: float, corrupt: float, stacklevel: int = 2) -> bool:
    """A ``UserWarning`` (not an error) when the model does not do the task (``does_the_task``); returns whether
    it does. ``evaluate``, ``qk.edge_scores`` and ``qk.node_scores`` call it with the means they measured."""
    done = does_the_task(task, clean, corrupt)
    if not done:
        warnings.warn(f"{NOT_DONE} {task.name!r}: clean {task.metric_name} {clean:.3g} vs corrupt {corrupt:.3g}; "
                      f"circuits and faithfulness will say little", stacklevel=stacklevel + 1)
    return done


# -------------------------------------------------------------------------------------------- text helpers

def tokenizer_of(model):
    tok = getattr(model, "tokenizer", None)
    if tok is None:
        raise QKCircuitsError("this model has no tokenizer; build the Task from token ids (qk.Task(clean, corrupt, "
                              "answer, wrong)) or use qk.tasks.induction")
    return tok


def bos_id(model) -> int:
    tok = getattr(model, "tokenizer", None)
    for cand in (getattr(tok, "bos_token_id", None), getattr(tok, "eos_token_id", None),
                 getattr(model.cfg, "default_prepend_bos_token_id", None)):
        if isinstance(cand, int):
            return cand
    return 0


def encode(model, text: str, prepend_bos: bool) -> List[int]:
    """``text`` as token ids, the tokenizer's own special tokens left out; BOS first when asked."""
    ids = list(tokenizer_of(model)(text, add_special_tokens=False)["input_ids"])
    return ([bos_id(model)] if prepend_bos else []) + ids


def pad_rows(model, rows: Sequence[Sequence[int]]) -> Tensor:
    """Right-pad token rows to one length with the pad (else EOS/BOS) id: a causal model's positions up to
    each row's END never see what follows, so padding changes none of the metric's logits."""
    tok = getattr(model, "tokenizer", None)
    pad = getattr(tok, "pad_token_id", None)
    pad = pad if isinstance(pad, int) else bos_id(model)
    width = max(len(r) for r in rows)
    return torch.tensor([list(r) + [pad] * (width - len(r)) for r in rows], dtype=torch.long)
