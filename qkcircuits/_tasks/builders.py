"""Task builders: ``qk.tasks.ioi``, ``qk.tasks.induction``, ``qk.tasks.from_jsonl`` (registered by name in
``registry.py``, which also resolves a command's ``--task``).

>>> task = qk.tasks.induction(model, n=8, seg_len=5, seed=1)
>>> task.n, task.clean.shape[1]
(8, 10)
>>> task.clean[0, 1:6].tolist() == task.clean[0, 6:10].tolist() + [task.answer[0].item()]
True

IOI (Wang et al. 2022): "Then, Mary and John went to the store. John gave a drink to" → " Mary".
ABBA (IO first) and BABA (S first) orders over several sentence frames; corruption ABC: the same frame,
place and object with three fresh names, so nothing in the corrupt prompt says which name is the IO.
Names, places and objects are kept only when they are ONE token (with their leading space) for THIS
model's tokenizer. Frames differ in length: rows are right-padded to one length and the metric reads
each row's ``END`` (its last real token); clean and corrupt rows of a prompt always have the same length.

BOS: ``prepend_bos=None`` (the default of ``ioi`` and ``from_jsonl``) does what the model's tokenizer does on
its own, ``tokenizer(text)`` with its default special tokens (read from the checkpoint's tokenizer, not
TransformerLens' copy, which always adds one: ``qkcircuits._foundation.own_tokenizer``): Llama and Gemma
tokenizers prepend ``<bos>``, GPT-2's and SmolLM2's nothing. True / False force one BOS / none. ``induction``
always starts with BOS (its prompts are the scan's [BOS] + R + R). ``Task.bos`` says whether one was prepended,
``Task.bos_mode`` how it was decided.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Union

import torch

from .._foundation.errors import QKCircuitsError
from .._foundation.jsonread import MAX_JSON_BYTES, JSONProblem, parse_json
from .task import Task, bos_prefix, encode, pad_rows, tokenizer_of

NAMES = ("Mary", "John", "Alice", "Bob", "Tom", "James", "Sarah", "David", "Michael", "Emma", "Anna", "Paul",
         "Mark", "Kate", "Lisa", "Peter", "Jack", "Laura", "Daniel", "Rachel", "Chris", "Steve", "Linda", "Susan",
         "George", "Henry", "Grace", "Jane", "Adam", "Ryan", "Kevin", "Brian", "Eric", "Amy", "Helen", "Frank",
         "Joe", "Sam", "Ben", "Max", "Lucy", "Rose", "Paula", "Karen", "Tim", "Dan", "Mike", "Nick")
PLACES = ("store", "park", "school", "hospital", "office", "restaurant", "station", "library", "garden",
          "beach", "market", "house", "church", "hotel", "bank", "museum")
OBJECTS = ("drink", "book", "ring", "key", "ball", "gift", "letter", "bottle", "bag", "flower", "computer",
           "phone", "cake", "pen", "card", "apple")
# {A} and {B} are the two names of the first clause, {S} the repeated subject, {P} a place, {O} an object.
FRAMES = (
    "Then, {A} and {B} went to the {P}. {S} gave a {O} to",
    "When {A} and {B} got a {O} at the {P}, {S} decided to give it to",
    "After {A} and {B} went to the {P}, {S} gave a {O} to",
    "While {A} and {B} were working at the {P}, {S} gave a {O} to",
    "Friends {A} and {B} found a {O} at the {P}. {S} gave it to",
    "Then, {A} and {B} had a long argument, and afterwards {S} said to",
)


def single_tokens(model, words: Sequence[str]) -> List[str]:
    """The words that are ONE token with a leading space for this model's tokenizer."""
    tok = tokenizer_of(model)
    return [w for w in words if len(tok(" " + w, add_special_tokens=False)["input_ids"]) == 1]


def ioi(model, n: int = 64, seed: int = 0, *, prepend_bos: Optional[bool] = None, names: Optional[Sequence[str]] = None,
        places: Optional[Sequence[str]] = None, objects: Optional[Sequence[str]] = None,
        frames: Sequence[str] = FRAMES, metric="logit-diff") -> Task:
    """``n`` IOI prompts (half ABBA, half BABA, frames in turn), ABC-corrupted; seeded.

    Positions per row: ``IO``, ``S1``, ``S1+1``, ``S2``, ``END``. ``answer`` = " IO", ``wrong`` = " S".
    ``prepend_bos``: None = what the tokenizer does on its own (module docstring), True / False = forced.

    >>> task = qk.tasks.ioi(smollm2, n=8)        # needs SmolLM2  # doctest: +SKIP
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise QKCircuitsError(f"n must be an integer >= 1, got {n!r}")
    tok = tokenizer_of(model)
    prefix, mode = bos_prefix(model, prepend_bos)
    pool = {k: single_tokens(model, v) for k, v in (("names", names or NAMES), ("places", places or PLACES),
                                                      ("objects", objects or OBJECTS))}
    need = {"names": 5, "places": 1, "objects": 1}
    short = [f"{len(pool[k])} single-token {k} (need >= {m})" for k, m in need.items() if len(pool[k]) < m]
    if short:
        raise QKCircuitsError(f"this tokenizer has only {', '.join(short)}; pass names=/places=/objects= lists of "
                              f"words that are one token each with a leading space")
    g = torch.Generator().manual_seed(seed)

    def pick(lst: List[str], k: int) -> List[str]:
        return [lst[i] for i in torch.randperm(len(lst), generator=g)[:k].tolist()]

    def ids(word: str) -> int:
        return tok(" " + word, add_special_tokens=False)["input_ids"][0]

    clean_rows, corrupt_rows, answers, wrongs, prompts = [], [], [], [], []
    pos: Dict[str, List[int]] = {k: [] for k in ("IO", "S1", "S1+1", "S2", "END")}
    for i in range(n):
        frame = frames[(i // 2) % len(frames)]
        io, s, c1, c2, c3 = pick(pool["names"], 5)
        place, obj = pick(pool["places"], 1)[0], pick(pool["objects"], 1)[0]
        abba = i % 2 == 0
        a, b = (io, s) if abba else (s, io)
        text = frame.format(A=a, B=b, S=s, P=place, O=obj)
        bad = frame.format(A=c1, B=c2, S=c3, P=place, O=obj)
        row, crow = encode(model, text, prefix), encode(model, bad, prefix)
        if len(row) != len(crow):            # a name that merges with its neighbour: cannot happen for
            raise QKCircuitsError(f"IOI prompt {text!r} and its corruption tokenize to {len(row)} and "
                                  f"{len(crow)} tokens; pass other names=")
        io_id, s_id = ids(io), ids(s)
        where_io = [j for j, t in enumerate(row) if t == io_id]
        where_s = [j for j, t in enumerate(row) if t == s_id]
        if len(where_io) != 1 or len(where_s) != 2:
            raise QKCircuitsError(f"IOI prompt {text!r}: the names are not single separate tokens in context")
        pos["IO"].append(where_io[0])
        pos["S1"].append(where_s[0])
        pos["S1+1"].append(where_s[0] + 1)
        pos["S2"].append(where_s[1])
        pos["END"].append(len(row) - 1)
        clean_rows.append(row)
        corrupt_rows.append(crow)
        answers.append(io_id)
        wrongs.append(s_id)
        prompts.append(text)
    return Task(pad_rows(model, clean_rows), pad_rows(model, corrupt_rows), torch.tensor(answers),
                torch.tensor(wrongs), metric, {k: torch.tensor(v) for k, v in pos.items()}, "ioi", bool(prefix),
                prompts, mode)


def induction(model, n: int = 32, seg_len: int = 10, seed: int = 0, metric="logit-diff") -> Task:
    """The scan's ``[BOS] + R + R`` prompts cut before their last token: clean = [BOS] + R + R[:-1]
    (answer R[-1], the induction target); corrupt = [BOS] + R' + R[:-1] with another segment R' (drawn
    from the tokens NOT in R where the token pool allows), wrong = R'[-1], the token that sits where the
    corrupt run's induction target would be. A BOS is always prepended (``bos=True``, ``bos_mode="yes"``):
    the prompts are the scan's [BOS] + R + R, whatever the tokenizer does."""
    from .._foundation.sequences import repeated_tokens, token_pool

    if isinstance(seg_len, bool) or not isinstance(seg_len, int) or seg_len < 3:
        raise QKCircuitsError(f"seg_len must be an integer >= 3, got {seg_len!r}")
    rep = repeated_tokens(model, n_seqs=n, seg_len=seg_len, seed=seed).cpu()
    pool = token_pool(model).ids.cpu()
    g = torch.Generator().manual_seed(seed + 1)
    other = []
    for row in rep[:, 1:seg_len + 1]:
        rest = pool[~torch.isin(pool, row)]
        if len(rest) < seg_len:
            rest = pool[pool != row[-1]]
        take = torch.randperm(len(rest), generator=g)[:seg_len]
        other.append(rest[take] if len(rest) >= seg_len else rest[torch.randint(0, len(rest), (seg_len,),
                                                                                 generator=g)])
    other = torch.stack(other)
    clean = rep[:, :-1]
    corrupt = torch.cat([rep[:, :1], other, rep[:, seg_len + 1:-1]], 1)
    return Task(clean, corrupt, rep[:, -1], other[:, -1], metric, {}, "induction", True, None, "yes", None, "induction")


KEYS = ("clean", "corrupt", "answer", "wrong")
OPTIONAL = ("positions",)


def named_positions(tok, spec, row: Sequence[int], start: int, where: str) -> Dict[str, int]:
    """A JSONL line's ``"positions"`` {name: word} as {name: index in ``row``}: the word's first occurrence in the
    clean prompt, or {"text": word, "occurrence": n} for the n-th (n ≥ 1). A word is ONE token of this tokenizer,
    leading space included, as it stands in the prompt; it is looked for from ``start`` on (after the BOS).
    ``END`` is the metric's own position (the last token) and cannot be named. One-line errors name the line."""
    if not isinstance(spec, dict) or not spec:
        raise QKCircuitsError(f"{where}: positions must be a non-empty object {{name: word or {{\"text\": word, "
                              f"\"occurrence\": n}}}}, got {type(spec).__name__}")
    out: Dict[str, int] = {}
    for name, want in spec.items():
        label = f"{where}: position {name!r}"
        if not name.strip():
            raise QKCircuitsError(f"{where}: a position name must not be empty")
        if name == "END":
            raise QKCircuitsError(f"{label}: END is where the metric reads (the prompt's last token) and is set by "
                                  f"the task itself; give this position another name")
        occurrence = 1
        if isinstance(want, dict):
            extra = sorted(set(want) - {"text", "occurrence"})
            if extra or "text" not in want:
                raise QKCircuitsError(f"{label}: expected {{\"text\": word, \"occurrence\": n}}, got keys "
                                      f"{', '.join(map(repr, sorted(want)))}")
            occurrence = want.get("occurrence", 1)
            want = want["text"]
            if isinstance(occurrence, bool) or not isinstance(occurrence, int) or occurrence < 1:
                raise QKCircuitsError(f"{label}: occurrence must be an integer >= 1, got {occurrence!r}")
        if not isinstance(want, str) or not want:
            raise QKCircuitsError(f"{label}: the word must be a non-empty string, got {want!r}")
        ids = tok(want, add_special_tokens=False)["input_ids"]
        if len(ids) != 1:
            raise QKCircuitsError(f"{label}: {want!r} is {len(ids)} tokens {ids}; a named position is one token "
                                  f"(leading space included, as the word stands in the prompt)")
        at = [j for j in range(start, len(row)) if row[j] == ids[0]]
        if not at:
            raise QKCircuitsError(f"{label}: {want!r} (token {ids[0]}) does not occur in the clean prompt; give the "
                                  f"word as it is tokenized there (leading space included)")
        if occurrence > len(at):
            raise QKCircuitsError(f"{label}: {want!r} occurs {len(at)} time{'s' if len(at) > 1 else ''} in the clean "
                                  f"prompt, occurrence {occurrence} asked")
        out[name] = at[occurrence - 1]
    return out


def from_jsonl(model, path: Union[str, Path], *, prepend_bos: Optional[bool] = None, metric="logit-diff") -> Task:
    """One JSON object per line: ``{"clean": str, "corrupt": str, "answer": str, "wrong": str}`` (``answer`` and
    ``wrong`` may each be a list of texts, an answer set: ``"answer": ["4", "5"]``, each one token) and optionally
    ``"positions": {"S": " John", "IO": " Mary"}`` (named positions: each word's first occurrence in the clean
    prompt, ``{"text": " John", "occurrence": 2}`` for the n-th; one token each; every line names the same
    positions; ``named_positions``). ``answer``/``wrong`` are the text that would follow the prompt (" Mary",
    leading space included) and must be ONE token each, and text (not a special token such as ``<|im_end|>``).
    ``prepend_bos``: None = what the tokenizer does on its own (module docstring), True / False = forced. Blank
    lines are skipped; lines end at "\n" (a "\r" before it is dropped), a UTF-8 byte-order mark is allowed.
    Every problem is one line naming the line number (invalid UTF-8 or JSON, a key given twice, unknown or
    missing keys, a position word not found ...).

    >>> p = tmp / "t.jsonl"
    >>> _ = p.write_text('{"clean": "a b", "corrupt": "a c", "answer": " d", "wrong": " e"}\\n')
    >>> qk.tasks.from_jsonl(model, p)
    Traceback (most recent call last):
    ...
    qkcircuits._foundation.errors.QKCircuitsError: this model has no tokenizer; ...
    """
    path = Path(path)
    if not path.is_file():
        raise QKCircuitsError(f"task file {str(path)!r} does not exist (expected a .jsonl file, one JSON object a line)")
    tok = tokenizer_of(model)
    prefix, mode = bos_prefix(model, prepend_bos)
    special = set(getattr(tok, "all_special_ids", None) or [])
    # lines end at "\n" only (JSON strings may hold U+2028, U+0085 ... which str.splitlines would break at); a
    # UTF-8 byte-order mark at the start is allowed
    if path.stat().st_size > MAX_JSON_BYTES:
        raise QKCircuitsError(f"task file {str(path)!r} is {path.stat().st_size >> 20} MiB; at most "
                              f"{MAX_JSON_BYTES >> 20} MiB are read")
    raw = path.read_bytes()
    raw = raw[3:] if raw.startswith(b"\xef\xbb\xbf") else raw
    clean_rows, corrupt_rows, answers, wrongs, prompts = [], [], [], [], []
    sets = False                            # a line gave an answer or wrong list: sets per row (answers.py)
    named: Dict[str, List[int]] = {}
    first_named = None                      # (line number, names) of the first line
    for no, data in enumerate(raw.split(b"\n"), 1):
        where = f"{path.name} line {no}"
        try:
            line = data.decode("utf-8").rstrip("\r")
        except UnicodeDecodeError as e:
            raise QKCircuitsError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start + 1}); expected one JSON "
                                  f"object per line")
        if not line.strip():
            continue
        try:                  # the strict reader: repeated keys, NaN, 1e400, huge integers, deep nesting refused
            obj = parse_json(line)
        except JSONProblem as e:
            if e.syntax:
                raise QKCircuitsError(f"{where}: not valid JSON ({e.error.msg.removesuffix(' at')} at column "
                                      f"{e.error.colno})") from None
            raise QKCircuitsError(f"{where}: {e.detail}") from None
        if not isinstance(obj, dict):
            raise QKCircuitsError(f"{where}: expected an object with keys {', '.join(KEYS)}, got "
                                  f"{type(obj).__name__}")
        unknown = sorted(set(obj) - set(KEYS) - set(OPTIONAL))
        if unknown:
            raise QKCircuitsError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; expected exactly "
                                  f"{', '.join(KEYS)} (and optionally positions)")
        missing = [k for k in KEYS if k not in obj]
        if missing:
            raise QKCircuitsError(f"{where}: missing key(s) {', '.join(missing)}")
        bad = [k for k in ("clean", "corrupt") if not isinstance(obj[k], str) or not obj[k]]
        if bad:
            raise QKCircuitsError(f"{where}: {', '.join(bad)} must be non-empty strings")
        ids = {k: _answer_tokens(tok, obj[k], k, special, where) for k in ("answer", "wrong")}
        both = sorted(set(ids["answer"]) & set(ids["wrong"]))
        if both:
            same = tok.decode([both[0]])
            raise QKCircuitsError(f"{where}: answer and wrong are the same token {same!r}" if len(ids["answer"]) ==
                                  len(ids["wrong"]) == 1 else f"{where}: token {same!r} is in both the answer and the "
                                  f"wrong set")
        row, crow = encode(model, obj["clean"], prefix), encode(model, obj["corrupt"], prefix)
        if len(row) != len(crow):
            raise QKCircuitsError(f"{where}: clean has {len(row)} tokens and corrupt {len(crow)}; they must "
                                  f"have the same token count")
        if len(row) > model.cfg.n_ctx:
            raise QKCircuitsError(f"{where}: {len(row)} tokens exceed the model's context of {model.cfg.n_ctx}")
        here = named_positions(tok, obj["positions"], row, len(prefix), where) if "positions" in obj else {}
        if first_named is None:
            first_named = (no, sorted(here))
        elif sorted(here) != first_named[1]:
            said = ", ".join(first_named[1]) or "none"
            raise QKCircuitsError(f"{where}: names positions {', '.join(sorted(here)) or 'none'}, but line "
                                  f"{first_named[0]} named {said}; every line names the same positions")
        for k, v in here.items():
            named.setdefault(k, []).append(v)
        clean_rows.append(row)
        corrupt_rows.append(crow)
        answers.append(ids["answer"])
        wrongs.append(ids["wrong"])
        sets = sets or isinstance(obj["answer"], list) or isinstance(obj["wrong"], list)
        prompts.append(obj["clean"])
    if not clean_rows:
        raise QKCircuitsError(f"task file {path.name} is empty; expected one JSON object per line with keys "
                              f"{', '.join(KEYS)}")
    end = torch.tensor([len(r) - 1 for r in clean_rows])
    positions = {"END": end, **{k: torch.tensor(v) for k, v in named.items()}}
    if not sets:
        answers, wrongs = [a[0] for a in answers], [w[0] for w in wrongs]
    return Task(pad_rows(model, clean_rows), pad_rows(model, corrupt_rows), answers, wrongs, metric, positions,
                path.stem, bool(prefix), prompts, mode)


def _answer_tokens(tok, value, key: str, special, where: str) -> List[int]:
    """A JSONL line's ``answer`` / ``wrong``: one text, or a non-empty list of texts (a set), each ONE token that is
    not a special token, no token twice; their ids."""
    texts = value if isinstance(value, list) else [value]
    if not texts or not all(isinstance(t, str) and t for t in texts):
        raise QKCircuitsError(f"{where}: {key} must be a non-empty string or a non-empty list of non-empty strings "
                              f"(an answer set), got {json.dumps(value)[:80]}")
    out: List[int] = []
    for text in texts:
        t = tok(text, add_special_tokens=False)["input_ids"]
        if len(t) != 1:
            raise QKCircuitsError(f"{where}: {key} {text!r} is {len(t)} tokens {t}; it must be one token "
                                  f"(the text that follows the prompt, leading space included)")
        if t[0] in special:
            raise QKCircuitsError(f"{where}: {key} {text!r} is the tokenizer's special token {t[0]}; it must be "
                                  f"text that follows the prompt")
        if t[0] in out:
            raise QKCircuitsError(f"{where}: {key} {text!r} is in the set twice (token {t[0]})")
        out.append(t[0])
    return out


__all__ = ["ioi", "induction", "from_jsonl", "named_positions", "single_tokens", "FRAMES", "NAMES", "PLACES", "OBJECTS"]
