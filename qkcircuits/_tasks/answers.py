"""A task's answer and wrong tokens: one id per prompt row, or a set of ids per row (ragged sets padded).

>>> answer_ids(7, 3, "answer").tolist()                       # one id for every row
[7, 7, 7]
>>> answer_ids([[4, 5, 6], [5]], 2, "answer").tolist()        # a set per row, padded with PAD (-1)
[[4, 5, 6], [5, -1, -1]]
>>> answer_ids([[4], [5]], 2, "answer").tolist()              # one-element sets ARE one id per row
[4, 5]
>>> set_mask(torch.tensor([[4, 5, 6], [5, -1, -1]])).tolist()
[[True, True, True], [True, False, False]]

Stored as a long tensor [n] (one id per row) or [n, k] (a set per row: its ids first, then ``PAD`` up to the
largest set, ``k`` ≥ 2). The mask of a set tensor is ``ids >= 0`` (``set_mask``). Sets whose every row holds one
id are stored as [n]: a task stated with one-element sets is the one-token task, the same tensors, the same
numbers bit for bit. The task metrics (``_analysis/metrics.py``, the table ``_foundation/metric_table``) read both
forms: ``prob-diff`` = Σ p(answer set) − Σ p(wrong set) (Hanna et al. 2023), ``logit-diff`` = mean logit of the
answer set − mean of the wrong set, ``answer-loss`` = −log Σ p(answer set), ``kl`` reads neither.
"""

from __future__ import annotations

from typing import Any, List, Sequence, Union

import torch
from jaxtyping import Int
from torch import Tensor

from .._foundation.errors import QKCircuitsError

PAD = -1     # the padding of a ragged answer set (never a token id)

AnswerLike = Union[int, Sequence[int], Sequence[Sequence[int]], Int[Tensor, "..."]]


def answer_ids(value: Any, n: int, what: str) -> Int[Tensor, "..."]:
    """``value`` as the stored ids of ``n`` rows: [n] (one id per row) or [n, k] (a set per row, ``PAD``-padded).

    Accepted: one id (every row), one id per row ([n]), a set per row ([n, k] ids, or a list of ``n`` lists of
    ids of any lengths), one set for every row ([1, k]). Each set holds at least one id and no id twice; ``PAD``
    appears only after a row's ids. Errors are one line naming ``what`` and the shape."""
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, (list, tuple)) for v in value):
        width = max(len(v) for v in value)
        value = [list(v) + [PAD] * (width - len(v)) for v in value]
    t = torch.as_tensor(value)
    if t.dtype.is_floating_point or t.dtype == torch.bool or t.is_complex():
        raise QKCircuitsError(f"{what} must hold integer token ids, got {t.dtype}")
    t = t.long()
    if t.numel() == 1:
        return t.reshape(-1).expand(n).clone()
    if t.dim() == 2 and t.shape[0] == 1 and n > 1:
        t = t.expand(n, -1).clone()
    if t.dim() == 1 and t.shape == (n,):
        if int(t.min()) < 0:
            raise QKCircuitsError(f"{what} holds a negative token id {int(t.min())}")
        return t
    if t.dim() != 2 or t.shape[0] != n or t.shape[1] < 1:
        raise QKCircuitsError(f"{what} must hold one token id per prompt row ({n}) or a set of ids per row ([{n}, k] "
                              f"or {n} lists), got shape {tuple(t.shape)}")
    mask = t >= 0
    if bool((t < PAD).any()):
        raise QKCircuitsError(f"{what} holds a negative token id {int(t.min())} (only {PAD} pads a set)")
    if not bool(mask[:, 0].all()):
        row = int((~mask[:, 0]).nonzero()[0])
        raise QKCircuitsError(f"{what} set of row {row} is empty; every row needs at least one token id")
    if bool((mask[:, 1:] & ~mask[:, :-1]).any()):
        raise QKCircuitsError(f"{what} sets hold their ids first, then the padding {PAD}")
    ordered = t.sort(-1).values
    dup = (ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)
    if bool(dup.any()):
        row = int(dup.any(-1).nonzero()[0])
        raise QKCircuitsError(f"{what} set of row {row} holds a token id twice ({t[row][mask[row]].tolist()}); a set "
                              f"counts each token once")
    t = t[:, :int(mask.sum(-1).max())]                           # no all-padding columns
    return t[:, 0].clone() if t.shape[1] == 1 else t.contiguous()


def set_mask(ids: Tensor) -> Tensor:
    """Which entries of stored ids are tokens (not ``PAD``): all True for one id per row."""
    return ids >= 0


def repeat_rows(ids: Tensor, copies: int) -> Tensor:
    """``ids`` ([b] or [b, k]) for ``copies`` stacked copies of the rows ([copies·b] or [copies·b, k])."""
    return ids.repeat(copies) if ids.dim() == 1 else ids.repeat(copies, 1)


def row_ids(ids: Tensor, row: int) -> List[int]:
    """Row ``row``'s ids as a list (one id or its set, padding left out)."""
    r = ids[row]
    return [int(x) for x in r.reshape(-1) if int(x) >= 0]


def check_vocab(ids: Tensor, vocab: int, what: str) -> None:
    """One line when a (non-padding) id is outside ``0 … vocab-1``."""
    real = ids[set_mask(ids)]
    if real.numel() and (int(real.min()) < 0 or int(real.max()) >= vocab):
        raise QKCircuitsError(f"task {what} holds token ids outside the model's vocabulary 0-{vocab - 1}")
