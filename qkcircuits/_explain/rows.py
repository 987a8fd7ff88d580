"""Which (prompt, query position, key position) rows a QK attribution explains.

>>> r = rows_for(model, 1, tokens=torch.tensor([[0, 5, 6, 7, 5, 6, 7]]), key="induction")
>>> r.i.tolist(), r.j.tolist()                 # each repeated token -> the token after its earlier copy
([4, 5, 6], [2, 3, 4])

Three ways to name rows:

- a task (``qk.tasks.ioi(model)``, ``from_jsonl``): ``query``/``key``/``versus`` name the task's positions
  (``query="END", key="IO", versus="S1"``), one row per prompt; ``qk.tasks.induction(model)`` with no names gives
  the induction rows below;
- tokens (ids [b, p], a text or a list of texts, tokenized as the model's tokenizer does on its own) with
  integer positions (``query=7, key=3``, lists of equal length for several rows per prompt, negative = from the
  end of that prompt) applied to every prompt;
- tokens with ``key="induction"``: every query position whose token occurred exactly once before (not just
  before it), keyed to the position after that earlier copy; ``key="duplicate"``: the same query positions, keyed
  to the earlier copy itself; ``key="previous"``: every position after the first, keyed to the one before it.

Rows whose key the head cannot attend (after the query, or outside a sliding window) are refused in one line, or
(for induction rows) dropped and counted in ``dropped``.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import torch
from torch import Tensor

from .._foundation.errors import QKCircuitsError
from .._foundation.own_tokenizer import own_affixes

Pos = Any          # int, str, a list of ints or None: checked here, with one-line errors
PATTERNS = ("induction", "duplicate", "previous")     # keys that pick their own rows from the tokens


@dataclass
class Rows:
    """``tokens`` [b, p] and per row: prompt ``b``, query ``i``, key ``j``, ``v`` (versus) or None; ``what`` says
    in words what the rows are, ``names`` the task position names (or None), ``dropped`` rows left out."""

    tokens: Tensor
    b: Tensor
    i: Tensor
    j: Tensor
    v: Optional[Tensor]
    what: str
    names: dict
    dropped: int = 0
    named: Optional[dict] = None      # a task's named positions per prompt {name: [b]}: where an expansion read from

    def __len__(self) -> int:
        return int(self.b.numel())


def tokenize(model, tokens) -> Tuple[Tensor, Tensor]:
    """Token ids [b, p]: ids as given (checked), or text tokenized as the checkpoint's tokenizer does on its own
    (its prefix: a BOS where it adds one; ``_foundation/own_tokenizer``), several texts right-padded with the pad
    (else EOS) id; and each prompt's length before padding [b]."""
    if isinstance(tokens, (list, tuple)) and tokens:
        kinds = {type(t).__name__ for t in tokens}
        if any(isinstance(t, str) for t in tokens) and not all(isinstance(t, str) for t in tokens):
            raise QKCircuitsError(f"tokens must be text, a list of texts, or token ids [batch, pos]; got a list mixing "
                                  f"{', '.join(sorted(kinds))}")
        if all(isinstance(t, (list, tuple)) for t in tokens) and len({len(t) for t in tokens}) > 1:
            raise QKCircuitsError(f"tokens must be a [batch, pos] grid of ids; got rows of lengths "
                                  f"{sorted({len(t) for t in tokens})} (give texts to have them padded)")
    if isinstance(tokens, str) or (isinstance(tokens, (list, tuple)) and tokens and isinstance(tokens[0], str)):
        tok = getattr(model, "tokenizer", None)
        if tok is None:
            raise QKCircuitsError("this model has no tokenizer; pass token ids as a [batch, pos] tensor")
        texts = [tokens] if isinstance(tokens, str) else list(tokens)
        # the checkpoint's tokenizer's own prefix (a BOS where it adds one; TransformerLens' add_bos_token is no guide)
        prefix = [int(t) for t in own_affixes(model)["prefix"]]
        ids = [prefix + list(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]
        if not all(ids):
            raise QKCircuitsError("a prompt tokenizes to no tokens; give text with at least one token")
        pad = next((x for x in (getattr(tok, "pad_token_id", None), getattr(tok, "eos_token_id", None)) if isinstance(x, int)), 0)
        width = max(len(r) for r in ids)
        t = torch.tensor([r + [pad] * (width - len(r)) for r in ids], dtype=torch.long)
        lengths = torch.tensor([len(r) for r in ids])
    else:
        try:
            t = torch.as_tensor(tokens)
        except (TypeError, ValueError, RuntimeError):
            raise QKCircuitsError(f"tokens must be text, a list of texts, or token ids [batch, pos]; got "
                                  f"{type(tokens).__name__}") from None
        if t.dtype.is_floating_point or t.dtype == torch.bool:
            raise QKCircuitsError(f"tokens must be integer token ids or text, got {t.dtype}")
        t = t.long()[None] if t.dim() == 1 else t.long()
        lengths = torch.full((t.shape[0],), t.shape[-1])
    if t.dim() != 2 or t.numel() == 0:
        raise QKCircuitsError(f"tokens must be a non-empty [batch, pos] tensor of ids, got shape {tuple(t.shape)}")
    if t.shape[1] > int(model.cfg.n_ctx):
        raise QKCircuitsError(f"a prompt of {t.shape[1]} tokens exceeds the model's context of {model.cfg.n_ctx}")
    bad = t[(t < 0) | (t >= int(model.cfg.d_vocab))]
    if bad.numel():
        raise QKCircuitsError(f"token id {int(bad[0])} is outside the vocabulary 0-{int(model.cfg.d_vocab) - 1}")
    return t, lengths


def rows_for(model, layer: int, tokens=None, *, task=None, query: Pos = None, key: Pos = None, versus: Pos = None,
             window: Optional[int] = None) -> Rows:
    """The rows (module docstring) for a head of ``layer``; ``window``: its sliding window, if any."""
    if task is not None and tokens is not None:
        raise QKCircuitsError("give tokens or a task, not both")
    if task is not None:
        t = task.clean.long()
        if query is None and key is None and versus is None and getattr(task, "pattern", None) == "induction":
            return _induction(t, torch.full((t.shape[0],), t.shape[1]), window, "the induction task's prompts")
        return _named(task, t, query, key, versus, window)
    if tokens is None:
        raise QKCircuitsError("give tokens (ids or text) with query/key positions, or a task (qk.tasks.ioi(model), "
                              "qk.tasks.induction(model))")
    t, lengths = tokenize(model, tokens)
    if key in PATTERNS or (query is None and key is None):
        key = key or "induction"
        if query is not None or versus is not None:
            raise QKCircuitsError(f"key={key!r} picks its own query positions: give no query or versus")
        if key == "previous":
            return _previous(t, lengths, window)
        return _induction(t, lengths, window, "the given prompts", shift=int(key == "induction"))
    return _explicit(t, lengths, query, key, versus, window)


def _previous(t: Tensor, lengths: Tensor, window: Optional[int]) -> Rows:
    bs = [b for b in range(t.shape[0]) for _ in range(1, int(lengths[b]))]
    is_ = [i for b in range(t.shape[0]) for i in range(1, int(lengths[b]))]
    if not bs:
        raise QKCircuitsError("key='previous' needs prompts of at least two tokens")
    i = torch.tensor(is_)
    return Rows(t, torch.tensor(bs), i, i - 1, None, "from each token to the one before it", {"key": "previous"})


def _induction(t: Tensor, lengths: Tensor, window: Optional[int], where: str, shift: int = 1) -> Rows:
    """Each query whose token occurred exactly once before, keyed to that copy + ``shift`` (1: the induction target,
    0: the earlier copy itself, a duplicate-token head's target)."""
    bs, is_, js = [], [], []
    dropped = 0
    for b in range(t.shape[0]):
        row = t[b, : int(lengths[b])].tolist()
        for i in range(len(row)):
            earlier = [m for m in range(i) if row[m] == row[i]]
            if len(earlier) != 1 or earlier[0] + shift >= i:
                continue
            j = earlier[0] + shift
            if window is not None and i - j >= window:
                dropped += 1
                continue
            bs.append(b), is_.append(i), js.append(j)
    if not bs:
        extra = f" ({dropped} outside the layer's window of {window})" if dropped else ""
        raise QKCircuitsError(f"{where} have no induction rows{extra}: no token occurs exactly once earlier with a "
                              f"token after it; repeat a segment (e.g. qk.tasks.induction(model)) or give query/key")
    what = "the token after its earlier copy" if shift else "its earlier copy"
    return Rows(t, torch.tensor(bs), torch.tensor(is_), torch.tensor(js), None, f"from each repeated token to {what}",
                {"key": "induction" if shift else "duplicate"}, dropped)


def _named(task, t: Tensor, query, key, versus, window) -> Rows:
    known = sorted(task.positions)
    names = {"query": query if query is not None else "END", "key": key, "versus": versus}
    if key is None:
        raise QKCircuitsError(f"name the key position of task {getattr(task, 'name', '')!r}: one of {', '.join(known)}")
    got = {}
    for role, name in names.items():
        if name is None:
            continue
        if not isinstance(name, str) or name not in task.positions:
            raise QKCircuitsError(f"{role} {name!r} is not a position of task {getattr(task, 'name', '')!r}; it has "
                                  f"{', '.join(known)}")
        got[role] = task.positions[name].long()
    n = t.shape[0]
    rows = Rows(t, torch.arange(n), got["query"], got["key"], got.get("versus"),
                f"from {names['query']} to {names['key']}" + (f" (versus {versus})" if versus else ""),
                {k: v for k, v in names.items() if v is not None},
                named={k: v.long() for k, v in task.positions.items()})
    _check_attendable(rows, window)
    return rows


def _explicit(t: Tensor, lengths: Tensor, query, key, versus, window) -> Rows:
    def as_list(x, role) -> Optional[List[int]]:
        if x is None:
            return None
        if isinstance(x, Tensor):
            x = x.tolist()
        xs = [x] if not isinstance(x, (list, tuple)) else list(x)
        out = []
        for v in xs:
            try:
                if isinstance(v, bool):
                    raise TypeError
                out.append(operator.index(v))           # ints, numpy and 0-d tensor integers
            except TypeError:
                raise QKCircuitsError(f"{role} must be a position (an integer, negative from the end) or a list of "
                                      f"them, got {x!r}") from None
        if not out:
            raise QKCircuitsError(f"{role} must name at least one position, got {x!r}")
        xs = out
        return xs

    q, k, v = as_list(query, "query"), as_list(key, "key"), as_list(versus, "versus")
    if q is None or k is None:
        raise QKCircuitsError("give both query and key positions (e.g. query=7, key=3), or key='induction'")
    if len(q) != len(k) or (v is not None and len(v) != len(q)):
        raise QKCircuitsError(f"query, key (and versus) must list the same number of positions, got {len(q)}, "
                              f"{len(k)}{'' if v is None else f', {len(v)}'}")
    bs, is_, js, vs = [], [], [], []
    for b in range(t.shape[0]):
        n = int(lengths[b])
        for r in range(len(q)):
            idx = [x + n if x < 0 else x for x in (q[r], k[r], *(() if v is None else (v[r],)))]
            if any(not 0 <= x < n for x in idx):
                raise QKCircuitsError(f"position {q[r]}/{k[r]}{'' if v is None else f'/{v[r]}'} is outside prompt {b} "
                                      f"of {n} tokens")
            bs.append(b), is_.append(idx[0]), js.append(idx[1])
            if v is not None:
                vs.append(idx[2])
    rows = Rows(t, torch.tensor(bs), torch.tensor(is_), torch.tensor(js), torch.tensor(vs) if v is not None else None,
                "from position " + ", ".join(f"{a} to {b}" for a, b in zip(q, k)) +
                ("" if v is None else " (versus " + ", ".join(str(x) for x in v) + ")"), {})
    _check_attendable(rows, window)
    return rows


def _check_attendable(rows: Rows, window: Optional[int]) -> None:
    for name, pos in (("key", rows.j), ("versus", rows.v)):
        if pos is None:
            continue
        late = (pos > rows.i).nonzero()
        if late.numel():
            r = int(late[0])
            raise QKCircuitsError(f"row {r}: the {name} position {int(pos[r])} comes after the query position "
                                  f"{int(rows.i[r])}; a causal head attends only to earlier positions")
        if window is not None:
            far = ((rows.i - pos) >= window).nonzero()
            if far.numel():
                r = int(far[0])
                raise QKCircuitsError(f"row {r}: the {name} position {int(pos[r])} is {int(rows.i[r] - pos[r])} "
                                      f"positions before the query, outside this layer's sliding window of {window}")
