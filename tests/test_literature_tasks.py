"""Tasks from the literature (issue 42, ask 3): each a registered generator with its named positions.

Structure on a word-level tokenizer (every word one token, no model needed); whether SmolLM2 does each task (clean
better than corrupt on every prompt) under the ``smollm2`` marker. greater-than's digit form on the tiny GPT-2's
tokenizer: tests/test_task_registry.py.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

import qkcircuits as qk


class Words:
    """Every word (with its leading space) and every punctuation mark is one token; ids given on first sight."""

    pad_token_id = 0

    def __init__(self):
        self.ids = {"<pad>": 0}
        self.words = ["<pad>"]

    def __call__(self, text, add_special_tokens=False):
        out = []
        for piece in re.findall(r" ?\w+|[^\w\s]| ", text):
            if piece not in self.ids:
                self.ids[piece] = len(self.words)
                self.words.append(piece)
            out.append(self.ids[piece])
        return {"input_ids": out}

    def decode(self, ids):
        return "".join(self.words[int(i)] for i in ids)


@pytest.fixture()
def words():
    return SimpleNamespace(tokenizer=Words())


def _at(task, tok, i, name):
    return tok.decode([int(task.clean[i, task.positions[name][i]])])


def test_gendered_pronoun(words):
    from qkcircuits._tasks.literature import FEMALE, MALE

    tok = words.tokenizer
    task = qk.tasks.build_task(words, "gendered-pronoun", n=6, seed=1, prepend_bos=False)
    she, he = tok(" she")["input_ids"][0], tok(" he")["input_ids"][0]
    assert task.answer.tolist() == [she, he] * 3 and task.wrong.tolist() == [he, she] * 3
    for i, text in enumerate(task.prompts):
        name = _at(task, tok, i, "NAME").strip()
        bad = tok.decode(task.corrupt[i, :task.positions["END"][i] + 1])
        other = bad.split(" is ")[0].split()[-1]
        assert name in (FEMALE if i % 2 == 0 else MALE) and other in (MALE if i % 2 == 0 else FEMALE)
        assert bad == text.replace(f" {name} ", f" {other} ") and text.endswith("isn't")
        assert tok.decode(task.clean[i, :task.positions["END"][i] + 1]) == text


def test_capital_country(words):
    from qkcircuits._tasks.literature import CAPITALS

    tok = words.tokenizer
    country = dict(CAPITALS)
    task = qk.tasks.build_task(words, "capital-country", n=6, seed=2, prepend_bos=False)
    for i, text in enumerate(task.prompts):
        city = _at(task, tok, i, "CITY").strip()
        bad = tok.decode(task.corrupt[i, :task.positions["END"][i] + 1])
        other = [c for c in country if f" {c}" in bad][0]
        assert other != city and bad == text.replace(city, other)
        assert tok.decode([int(task.answer[i])]) == " " + country[city]
        assert tok.decode([int(task.wrong[i])]) == " " + country[other]


def test_successor(words):
    from qkcircuits._tasks.literature import SEQUENCES

    tok = words.tokenizer
    task = qk.tasks.build_task(words, "successor", n=6, seed=0, prepend_bos=False)
    assert task.metric.name == "prob-diff" and task.answer.dim() == 1 and task.wrong.dim() == 2
    for i, text in enumerate(task.prompts):
        items = [w.strip() for w in text.rstrip(",").split(",")]
        seq = next(s for s in SEQUENCES.values() if items[0] in s)
        k = seq.index(items[0])
        assert items == list(seq[k:k + 3]) and _at(task, tok, i, "LAST").strip() == items[2]
        assert _at(task, tok, i, "FIRST").strip() == items[0]
        assert tok.decode([int(task.answer[i])]) == " " + seq[k + 3]
        wrong = sorted(tok.decode([int(x)]).strip() for x in task.wrong[i] if x >= 0)
        assert wrong == sorted(w for w in seq if w != seq[k + 3])
        bad = [w.strip() for w in tok.decode(task.corrupt[i, :task.positions["END"][i] + 1]).rstrip(",").split(",")]
        assert bad != items and bad == list(seq[seq.index(bad[0]):seq.index(bad[0]) + 3])


def test_docstring(words):
    tok = words.tokenizer
    task = qk.tasks.build_task(words, "docstring", n=4, seed=0, prepend_bos=False)
    for i, text in enumerate(task.prompts):
        args = text.split("(self, ")[1].split(")")[0].split(", ")
        assert len(args) == 5 and text.endswith(":param")
        assert [_at(task, tok, i, k).strip() for k in ("DEF_C", "DOC_A", "DOC_B")] == [args[2], args[0], args[1]]
        assert tok.decode([int(task.answer[i])]) == " " + args[2]
        assert sorted(tok.decode([int(x)]).strip() for x in task.wrong[i]) == sorted(args[:2] + args[3:])
        bad = tok.decode(task.corrupt[i, :task.positions["END"][i] + 1])
        assert not set(args) & set(bad.split("(self, ")[1].split(")")[0].replace(",", "").split())


def test_a_tokenizer_without_the_words_is_refused_in_one_line():
    class Chars(Words):
        def __call__(self, text, add_special_tokens=False):
            return super().__call__(" ".join(text))          # every character its own token
    model = SimpleNamespace(tokenizer=Chars())
    for name, message in (("successor", "no sequence"), ("gendered-pronoun", "too few single-token names"),
                          ("capital-country", "capital/country pairs"), ("docstring", "argument words")):
        with pytest.raises(qk.QKCircuitsError, match=message) as e:
            qk.tasks.build_task(model, name, n=2, prepend_bos=False)
        assert "\n" not in str(e.value)


@pytest.mark.smollm2
@pytest.mark.parametrize("name", ["greater-than", "successor", "gendered-pronoun", "capital-country", "docstring"])
def test_smollm2_does_each_task_on_every_prompt(smollm2, name):
    task = qk.tasks.build_task(smollm2, name, n=8, seed=0)
    with torch.no_grad():
        clean, corrupt = (task.row_values(smollm2(getattr(task, w))) for w in ("clean", "corrupt"))
    assert bool((clean > corrupt).all()), (name, clean, corrupt)


def test_greater_than_two_digit_form():
    """A tokenizer that writes " 1732" as " 17", "32" (GPT-2's way): the sets are the two-digit years above the
    start year's YY and those up to it (Hanna et al.'s), YY the start year's second token."""
    class Pairs(Words):
        def __call__(self, text, add_special_tokens=False):
            out = []
            for piece in re.findall(r" ?\d\d|\d\d| ?\w+|[^\w\s]| ", text):
                if piece not in self.ids:
                    self.ids[piece] = len(self.words)
                    self.words.append(piece)
                out.append(self.ids[piece])
            return {"input_ids": out}

    model = SimpleNamespace(tokenizer=Pairs())
    tok = model.tokenizer
    task = qk.tasks.build_task(model, "greater-than", n=4, seed=0, prepend_bos=False)
    for i, text in enumerate(task.prompts):
        start = text.split("year ")[1][:4]
        yy = int(start[2:])
        assert _at(task, tok, i, "YY") == start[2:] and _at(task, tok, i, "XX").strip() == start[:2]
        assert sorted(int(tok.decode([int(x)])) for x in task.answer[i] if x >= 0) == list(range(yy + 1, 100))
        assert sorted(int(tok.decode([int(x)])) for x in task.wrong[i] if x >= 0) == list(range(yy + 1))
        assert tok.decode(task.corrupt[i, :task.positions["END"][i] + 1]).split("year ")[1][:4] == start[:2] + "01"
