"""Tasks from the literature as generators (registered by name in ``registry.py``).

>>> task = greater_than(gpt2, n=4, seed=0)           # doctest: +SKIP (a tokenizer with digits)
>>> sorted(task.positions)                                # doctest: +SKIP
['END', 'NOUN', 'XX', 'YY']

**greater-than** (Hanna, Liu & Variengien 2023): "The war lasted from the year 1732 to the year 17" → a year after
1732. The metric is ``prob-diff`` over answer sets: Σ p(years after the start) − Σ p(years up to it). Two forms,
chosen by how the model's tokenizer writes a year:

- **digits** (SmolLM2, Gemma, Llama 3: " 1732" → " ", "1", "7", "3", "2"): the prompt ends on the century's last
  digit, so the next token is the tens digit; answer set = the digits above the start year's tens digit d, wrong
  set = the digits below it (d itself says nothing without the units). d is drawn from 2-8 so both sets hold at
  least two digits.
- **two-digit tokens** (GPT-2: " 1732" → " 17", "32"): the next token is the two-digit year YY'; answer set = the
  two-digit tokens above YY, wrong set = those up to YY (Hanna et al.'s), YY drawn from 02-98.

Corrupt: the start year's last two digits set to "01" (Hanna et al.'s "0-1" baseline: the digits form sets the
tens digit to 0 and keeps the units, the same token count). Named positions: ``NOUN`` (the event noun's last
token), ``XX`` (the
start year's century: its last token), ``YY`` (the start year's tens digit, or its two-digit token), ``END``.
Every prompt is checked token by token (the pieces tokenize to the same ids in place); a tokenizer with neither
form is refused in one line naming its tokenization of " 1732".
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .._foundation.errors import QKCircuitsError
from .task import Task, bos_prefix, encode, pad_rows, tokenizer_of

# Hanna et al.'s templates (the event noun, the start year XXYY, the end year's century XX)
TEMPLATES = ("The {noun} lasted from the year {start} to the year {century}",
             "The {noun} started in the year {start} and ended in the year {century}",
             "The {noun} began in the year {start} and it ended in the year {century}")
NOUNS = ("war", "reign", "journey", "expedition", "project", "voyage", "campaign", "trial", "strike", "siege",
         "occupation", "conflict", "drought", "famine", "crisis", "dynasty", "construction", "migration")
CENTURIES = tuple(range(11, 18))


def year_form(model) -> str:
    """"digits" or "two-digit" (module docstring): how this model's tokenizer writes " 1732"."""
    tok = tokenizer_of(model)
    pieces = [tok.decode([i]) for i in tok(" 1732", add_special_tokens=False)["input_ids"]]
    if pieces[-4:] == ["1", "7", "3", "2"]:
        return "digits"
    if [p.strip() for p in pieces[-2:]] == ["17", "32"]:
        return "two-digit"
    raise QKCircuitsError(f"greater-than needs a tokenizer that writes a year as digits or two-digit tokens; this one "
                          f"writes ' 1732' as {pieces}")


def greater_than(model, n: int = 64, seed: int = 0, *, prepend_bos: Optional[bool] = None, metric="prob-diff",
                 templates: Sequence[str] = TEMPLATES, nouns: Sequence[str] = NOUNS) -> Task:
    """``n`` greater-than prompts (module docstring), templates in turn, nouns and years seeded (``NOUN`` is the
    noun's last token). ``prepend_bos``: None = what the tokenizer does on its own."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise QKCircuitsError(f"n must be an integer >= 1, got {n!r}")
    tok = tokenizer_of(model)
    form = year_form(model)
    prefix, mode = bos_prefix(model, prepend_bos)
    pool = list(nouns)
    if not pool:
        raise QKCircuitsError("greater-than: nouns= must name at least one event noun")
    digit = {d: _one(tok, str(d)) for d in range(10)} if form == "digits" else {}
    pairs = {y: _one(tok, f"{y:02d}") for y in range(100)} if form == "two-digit" else {}
    g = torch.Generator().manual_seed(seed)
    clean_rows, corrupt_rows, answers, wrongs, prompts = [], [], [], [], []
    pos: Dict[str, List[int]] = {k: [] for k in ("NOUN", "XX", "YY", "END")}
    for i in range(n):
        frame = templates[i % len(templates)]
        noun = pool[int(torch.randint(len(pool), (1,), generator=g))]
        century = CENTURIES[int(torch.randint(len(CENTURIES), (1,), generator=g))]
        if form == "digits":
            tens, units = 2 + int(torch.randint(7, (1,), generator=g)), int(torch.randint(10, (1,), generator=g))
            yy, bad_yy = 10 * tens + units, units
            answer = [digit[d] for d in range(tens + 1, 10)]
            wrong = [digit[d] for d in range(tens)]
        else:
            yy, bad_yy = 2 + int(torch.randint(97, (1,), generator=g)), 1
            answer = [pairs[y] for y in range(yy + 1, 100) if pairs[y] is not None]
            wrong = [pairs[y] for y in range(yy + 1) if pairs[y] is not None]
        text = frame.format(noun=noun, start=f"{century}{yy:02d}", century=century)
        bad = frame.format(noun=noun, start=f"{century}{bad_yy:02d}", century=century)
        row, crow = encode(model, text, prefix), encode(model, bad, prefix)
        if len(row) != len(crow):
            raise QKCircuitsError(f"greater-than prompt {text!r} and its corruption tokenize to {len(row)} and "
                                  f"{len(crow)} tokens")
        at = _positions(model, prefix, frame, noun, century, yy, form)
        if at is None or not answer or not wrong:
            raise QKCircuitsError(f"greater-than prompt {text!r}: its year does not tokenize piece by piece in place")
        for k, v in at.items():
            pos[k].append(v)
        pos["END"].append(len(row) - 1)
        clean_rows.append(row)
        corrupt_rows.append(crow)
        answers.append(answer)
        wrongs.append(wrong)
        prompts.append(text)
    return Task(pad_rows(model, clean_rows), pad_rows(model, corrupt_rows), answers, wrongs, metric,
                {k: torch.tensor(v) for k, v in pos.items()}, "greater-than", bool(prefix), prompts, mode)


def _one(tok, text: str) -> Optional[int]:
    ids = tok(text, add_special_tokens=False)["input_ids"]
    return ids[0] if len(ids) == 1 else None


def _positions(model, prefix: List[int], frame: str, noun: str, century: int, yy: int,
               form: str) -> Optional[Dict[str, int]]:
    """Where NOUN, XX and YY sit: the last token of each prefix of the prompt ending on them, each prefix's ids
    checked to be the start of the whole prompt's (None when a piece merges with its neighbour)."""
    head, _, _ = frame.partition("{start}")
    full = encode(model, frame.format(noun=noun, start=f"{century}{yy:02d}", century=century), prefix)
    ends = {"NOUN": head.split("{noun}")[0] + noun, "XX": head.format(noun=noun) + f"{century}",
            "YY": head.format(noun=noun) + f"{century}{yy:02d}"[:3 if form == "digits" else 4]}
    out = {}
    for name, text in ends.items():
        ids = encode(model, text, prefix)
        if full[:len(ids)] != ids:
            return None
        out[name] = len(ids) - 1
    return out


__all__ = ["CENTURIES", "NOUNS", "TEMPLATES", "greater_than", "year_form"]
