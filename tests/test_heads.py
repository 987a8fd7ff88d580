"""Heads as values: parsing, validation against a model, and the GQA query-head -> KV-head map."""

from __future__ import annotations

import pytest
import torch

import _tiny
from _typecheck import unchecked
import qkcircuits as qk
from qkcircuits import Head, QKCircuitsError, kv_head, model_heads, n_kv_heads, parse_heads
from qkcircuits._foundation.capture import expand_kv


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    return qk.load(_tiny.gpt2_dir(tmp_path_factory), device="cpu", verbose=False)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return qk.load(_tiny.llama_dir(tmp_path_factory), device="cpu", verbose=False)


@pytest.mark.parametrize("text", ["5.1", "L5H1", "l5h1", " 5 . 1 ", "L5 H1", "5.1-1"])
def test_parse_one_head(text):
    assert Head.parse(text) == Head(5, 1)
    assert parse_heads(text) == [Head(5, 1)]


def test_parse_value_forms_and_str_round_trip():
    assert Head.parse((3, 2)) == Head(3, 2) == Head.parse(Head(3, 2))
    assert str(Head(12, 7)) == "12.7" and Head.parse(str(Head(12, 7))) == Head(12, 7)
    assert sorted([Head(1, 0), Head(0, 3), Head(0, 1)]) == [Head(0, 1), Head(0, 3), Head(1, 0)]


def test_parse_lists_ranges_and_stars():
    assert parse_heads("5.1, L6H9,7.0-2") == [Head(5, 1), Head(6, 9), Head(7, 0), Head(7, 1), Head(7, 2)]
    assert parse_heads("L7H1-3") == [Head(7, 1), Head(7, 2), Head(7, 3)]
    assert parse_heads("2.*", n_heads=3) == [Head(2, 0), Head(2, 1), Head(2, 2)]
    assert parse_heads("L0H*", n_heads=2) == [Head(0, 0), Head(0, 1)]
    # mixed list of strings, pairs and heads; order kept, duplicates dropped
    assert parse_heads(["1.1", (0, 2), Head(1, 1), "0.2,3.0"]) == [Head(1, 1), Head(0, 2), Head(3, 0)]
    assert parse_heads([(0, 1), (2, 3)]) == [Head(0, 1), Head(2, 3)]


@pytest.mark.parametrize("bad", ["5", "L5", "H1", "5.1.2", "a.b", "5.-1", "-1.0", "5:1", "L5H", "5.1-", "5..1"])
def test_parse_errors_name_the_bad_value(bad):
    with pytest.raises(QKCircuitsError, match="cannot read a head") as e:
        parse_heads(bad)
    assert repr(bad.split(",")[0]) in str(e.value) and "'L5H1'" in str(e.value)
    assert "\n" not in str(e.value)


def test_parse_errors_for_backwards_range_star_and_many():
    with pytest.raises(QKCircuitsError, match=r"runs backwards; write it as 7.1-3"):
        parse_heads("7.3-1")
    with pytest.raises(QKCircuitsError, match="head count"):
        parse_heads("2.*")
    with pytest.raises(QKCircuitsError, match="expected one head, got 3"):
        Head.parse("7.0-2")


@pytest.mark.parametrize("bad", [5, 2.5, None, object()])
def test_parse_non_text_is_a_clear_error(bad):
    with pytest.raises(QKCircuitsError, match="cannot read a head"):
        unchecked(parse_heads)(bad)          # what a user without the type-check hook sees


def test_validation_against_model(gpt2):
    assert model_heads(gpt2, "L1H3, 0.*") == [Head(1, 3), Head(0, 0), Head(0, 1), Head(0, 2), Head(0, 3)]
    with pytest.raises(QKCircuitsError, match=r"head 2\.0 is out of range: the model has layers 0-1 and heads 0-3"):
        model_heads(gpt2, "2.0")
    with pytest.raises(QKCircuitsError, match=r"head 1\.4 is out of range"):
        model_heads(gpt2, ["0.0", "1.4"])
    with pytest.raises(QKCircuitsError, match="no heads given"):
        model_heads(gpt2, "")


def test_n_kv_heads(gpt2, llama, hand_built):
    assert n_kv_heads(gpt2) == gpt2.cfg.n_heads == 4
    assert n_kv_heads(llama) == 2 and llama.cfg.n_heads == 4
    assert n_kv_heads(hand_built) == 2


def test_kv_head_matches_transformers_repeat_kv():
    """Query head h reads the KV head that HF's repeat_kv puts at position h."""
    from transformers.models.llama.modeling_llama import repeat_kv

    for n_heads, n_kv in [(4, 2), (9, 3), (8, 1), (6, 6), (32, 8)]:
        kv = torch.randn(1, n_kv, 3, 2)                    # HF layout [batch, kv_head, pos, d]
        expanded = repeat_kv(kv, n_heads // n_kv)
        for h in range(n_heads):
            assert torch.equal(expanded[0, h], kv[0, kv_head(h, n_heads, n_kv)]), (n_heads, n_kv, h)
        # our expand_kv (TL layout [batch, pos, head, d]) is the same map
        ours = expand_kv(kv.transpose(1, 2), n_heads).transpose(1, 2)
        assert torch.equal(ours, expanded)
    with pytest.raises(QKCircuitsError, match="not a multiple"):
        kv_head(0, 9, 2)


def test_kv_index_on_a_gqa_model(llama):
    from qkcircuits._foundation.capture import kv_index

    assert [kv_index(llama, h) for h in range(4)] == [0, 0, 1, 1]
