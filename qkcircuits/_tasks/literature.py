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

**gendered-pronoun** (Mathwin et al. 2023): "So Mary is a really great friend, isn't" → " she" (wrong " he");
corrupt: a name of the other gender (its answer the other pronoun). Positions ``NAME``, ``END``.

**capital-country** (factual recall): "The city of Paris is the capital of" → " France"; corrupt: another
capital, whose country is the wrong token. Positions ``CITY``, ``END``.

**successor** (successor heads, Gould et al. 2023): "March, April, May," → " June"; the answer is the successor
of the last item, the wrong set every other item of its sequence (months, weekdays, number words: each one token
with its leading space for this tokenizer); corrupt: the three items before another item of the same sequence.
Positions ``FIRST``, ``LAST`` (the items), ``END``.

**docstring** (Heimersheim & Janiak 2023): a ``def`` with five arguments after ``self``, a docstring documenting
the first two, then ``:param`` → the third argument's name; the wrong set is the other four. Corrupt: the
``def``'s arguments replaced by five other words (the docstring unchanged). Positions ``DEF_C`` (the answer in the
``def``), ``DOC_A``, ``DOC_B`` (the documented names), ``END``.

Words that are not ONE token with their leading space for this model's tokenizer are left out of every list; a
list left too short is refused in one line.
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


# ----------------------------------------------------------------------------------- word-list tasks

FEMALE = ("Mary", "Anna", "Emma", "Sarah", "Lisa", "Kate", "Laura", "Rachel", "Linda", "Susan", "Grace", "Jane",
          "Amy", "Helen", "Lucy", "Rose", "Karen", "Alice")
MALE = ("John", "Tom", "James", "David", "Michael", "Paul", "Mark", "Peter", "Jack", "Daniel", "Steve", "George",
        "Henry", "Adam", "Ryan", "Kevin", "Brian", "Eric", "Frank", "Bob")
PRONOUN_FRAMES = ("So {name} is a really great friend, isn't", "Well, {name} is such a kind person, isn't",
                  "I think {name} is very tired today, isn't")
CAPITALS = (("Paris", "France"), ("Berlin", "Germany"), ("Rome", "Italy"), ("Madrid", "Spain"), ("Tokyo", "Japan"),
            ("London", "England"), ("Moscow", "Russia"), ("Cairo", "Egypt"), ("Athens", "Greece"),
            ("Vienna", "Austria"), ("Lisbon", "Portugal"), ("Dublin", "Ireland"), ("Warsaw", "Poland"),
            ("Ottawa", "Canada"), ("Beijing", "China"), ("Stockholm", "Sweden"), ("Oslo", "Norway"),
            ("Helsinki", "Finland"), ("Budapest", "Hungary"), ("Delhi", "India"))
CAPITAL_FRAMES = ("The city of {city} is the capital of", "Everyone knows that {city} is the capital of",
                  "The capital of which country is {city}? It is the capital of")
SEQUENCES = {"months": ("January", "February", "March", "April", "May", "June", "July", "August", "September",
                        "October", "November", "December"),
             "weekdays": ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"),
             "numbers": ("one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")}


def _word(tok, word: str) -> Optional[int]:
    ids = tok(" " + word, add_special_tokens=False)["input_ids"]
    return ids[0] if len(ids) == 1 else None


def _check_n(n) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise QKCircuitsError(f"n must be an integer >= 1, got {n!r}")


def _position(model, prefix, text: str, upto: str, where: str) -> int:
    """The index of the last token of ``text[:text.index(upto) + len(upto)]`` in ``text``'s ids (checked in place)."""
    full, head = encode(model, text, prefix), encode(model, text[:text.index(upto) + len(upto)], prefix)
    if full[:len(head)] != head:
        raise QKCircuitsError(f"{where} prompt {text!r}: {upto!r} does not tokenize in place")
    return len(head) - 1


def _assemble(model, prefix, mode, rows, name: str, metric) -> Task:
    """rows: (clean text, corrupt text, answer ids, wrong ids, {position: index}) per prompt."""
    clean = [encode(model, r[0], prefix) for r in rows]
    corrupt = [encode(model, r[1], prefix) for r in rows]
    for (text, bad, *_), a, b in zip(rows, clean, corrupt):
        if len(a) != len(b):
            raise QKCircuitsError(f"{name} prompt {text!r} and its corruption {bad!r} tokenize to {len(a)} and "
                                  f"{len(b)} tokens")
    pos = {k: torch.tensor([r[4][k] for r in rows]) for k in rows[0][4]}
    pos["END"] = torch.tensor([len(r) - 1 for r in clean])
    return Task(pad_rows(model, clean), pad_rows(model, corrupt), [r[2] for r in rows], [r[3] for r in rows], metric,
                pos, name, bool(prefix), [r[0] for r in rows], mode)


def gendered_pronoun(model, n: int = 64, seed: int = 0, *, prepend_bos: Optional[bool] = None,
                     metric="logit-diff", frames: Sequence[str] = PRONOUN_FRAMES) -> Task:
    """``n`` gendered-pronoun prompts (module docstring), half with a female name, frames in turn; seeded."""
    _check_n(n)
    tok = tokenizer_of(model)
    prefix, mode = bos_prefix(model, prepend_bos)
    names = {g: [w for w in ws if _word(tok, w) is not None] for g, ws in (("she", FEMALE), ("he", MALE))}
    pron = {g: _word(tok, g) for g in names}
    if min(len(v) for v in names.values()) < 2 or None in pron.values():
        raise QKCircuitsError("gendered-pronoun: this tokenizer has too few single-token names (need 2 of each "
                              "gender) or no single-token ' he' / ' she'")
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        frame = frames[(i // 2) % len(frames)]
        this, other = ("she", "he") if i % 2 == 0 else ("he", "she")
        name = names[this][int(torch.randint(len(names[this]), (1,), generator=g))]
        alt = names[other][int(torch.randint(len(names[other]), (1,), generator=g))]
        text = frame.format(name=name)
        rows.append((text, frame.format(name=alt), pron[this], pron[other],
                     {"NAME": _position(model, prefix, text, name, "gendered-pronoun")}))
    return _assemble(model, prefix, mode, rows, "gendered-pronoun", metric)


def capital_country(model, n: int = 64, seed: int = 0, *, prepend_bos: Optional[bool] = None,
                    metric="logit-diff", frames: Sequence[str] = CAPITAL_FRAMES) -> Task:
    """``n`` capital → country prompts (module docstring), frames in turn; seeded."""
    _check_n(n)
    tok = tokenizer_of(model)
    prefix, mode = bos_prefix(model, prepend_bos)
    pairs = [(c, k) for c, k in CAPITALS if _word(tok, c) is not None and _word(tok, k) is not None]
    if len(pairs) < 2:
        raise QKCircuitsError(f"capital-country: this tokenizer has {len(pairs)} capital/country pairs that are one "
                              f"token each with a leading space (need >= 2)")
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        frame = frames[i % len(frames)]
        a, b = (pairs[j] for j in torch.randperm(len(pairs), generator=g)[:2].tolist())
        text = frame.format(city=a[0])
        rows.append((text, frame.format(city=b[0]), _word(tok, a[1]), _word(tok, b[1]),
                     {"CITY": _position(model, prefix, text, a[0], "capital-country")}))
    return _assemble(model, prefix, mode, rows, "capital-country", metric)


def successor(model, n: int = 64, seed: int = 0, *, prepend_bos: Optional[bool] = None,
              metric="prob-diff") -> Task:
    """``n`` successor prompts (module docstring): the sequences in turn, start items seeded."""
    _check_n(n)
    tok = tokenizer_of(model)
    prefix, mode = bos_prefix(model, prepend_bos)
    usable = {k: v for k, v in SEQUENCES.items() if all(_word(tok, w) is not None for w in v)}
    if not usable:
        raise QKCircuitsError("successor: no sequence (months, weekdays, number words) whose every item is one token "
                              "with its leading space for this tokenizer")
    kinds = sorted(usable)
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        items = usable[kinds[i % len(kinds)]]
        ids = [_word(tok, w) for w in items]
        perm = torch.randperm(len(items) - 3, generator=g).tolist()      # starts whose successor exists
        start, other = perm[0], perm[1 % len(perm)]
        text = ", ".join(items[start:start + 3]) + ","
        bad = ", ".join(items[other:other + 3]) + ","
        nxt = start + 3
        rows.append((text, bad, ids[nxt], [x for j, x in enumerate(ids) if j != nxt],
                     {"FIRST": _position(model, prefix, text, items[start], "successor"),
                      "LAST": _position(model, prefix, text, items[start + 2], "successor")}))
    return _assemble(model, prefix, mode, rows, "successor", metric)


ARGUMENTS = ("load", "size", "files", "last", "port", "shape", "token", "value", "name", "data", "count", "index",
             "path", "mode", "key", "item", "node", "text", "user", "page", "line", "time", "code", "type", "word",
             "file", "state", "field", "group", "order")
DESCRIPTIONS = ("crime population", "unit dark", "river rain", "boat metal", "glass song", "tree dinner",
                "window paper", "horse light")
DOCSTRING = 'def {fn}(self, {args}):\n    """{desc}\n\n    :param {a}: {d1}\n    :param {b}: {d2}\n    :param'


def docstring(model, n: int = 64, seed: int = 0, *, prepend_bos: Optional[bool] = None,
              metric="logit-diff") -> Task:
    """``n`` docstring prompts (module docstring): argument names, function name and descriptions seeded."""
    _check_n(n)
    tok = tokenizer_of(model)
    prefix, mode = bos_prefix(model, prepend_bos)
    words = [w for w in ARGUMENTS if _word(tok, w) is not None]
    if len(words) < 11:
        raise QKCircuitsError(f"docstring: this tokenizer has {len(words)} argument words that are one token with a "
                              f"leading space (need >= 11)")
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        pick = [words[j] for j in torch.randperm(len(words), generator=g)[:11].tolist()]
        args, other, fn = pick[:5], pick[5:10], pick[10]
        d1, d2 = (DESCRIPTIONS[int(j)] for j in torch.randint(len(DESCRIPTIONS), (2,), generator=g))
        fill = dict(fn=fn, desc=DESCRIPTIONS[i % len(DESCRIPTIONS)], a=args[0], b=args[1], d1=d1, d2=d2)
        text = DOCSTRING.format(args=", ".join(args), **fill)
        bad = DOCSTRING.format(args=", ".join(other), **fill)
        head = f"def {fn}(self, " + ", ".join(args[:3])
        doc = text.index(":param") + len(":param ")                       # where the first documented name starts
        second = text.index(":param", doc) + len(":param ")
        rows.append((text, bad, _word(tok, args[2]), [_word(tok, w) for w in args if w != args[2]],
                     {"DEF_C": _at_end(model, prefix, text, head, "docstring"),
                      "DOC_A": _at_end(model, prefix, text, text[:doc + len(args[0])], "docstring"),
                      "DOC_B": _at_end(model, prefix, text, text[:second + len(args[1])], "docstring")}))
    return _assemble(model, prefix, mode, rows, "docstring", metric)


def _at_end(model, prefix, text: str, head: str, where: str) -> int:
    """The index in ``text``'s ids of the last token of its prefix ``head`` (checked in place)."""
    full, ids = encode(model, text, prefix), encode(model, head, prefix)
    if not text.startswith(head) or full[:len(ids)] != ids:
        raise QKCircuitsError(f"{where} prompt {text!r}: {head[-20:]!r} does not tokenize in place")
    return len(ids) - 1


__all__ = ["ARGUMENTS", "CAPITALS", "CENTURIES", "NOUNS", "SEQUENCES", "TEMPLATES", "capital_country", "docstring", "gendered_pronoun",
           "greater_than", "successor", "year_form"]
