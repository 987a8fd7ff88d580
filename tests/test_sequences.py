"""Prompt sets: repeated random tokens and natural text, reproducible by seed, free of special tokens."""

from __future__ import annotations

import pytest
import torch

import _tiny
from _typecheck import unchecked
import qkcircuits as qk
from qkcircuits import QKCircuitsError, repeated_tokens, text_tokens, token_pool
from qkcircuits._foundation.sequences import bos_id, check_seed
from qkcircuits.fixtures import hand_built_induction_model


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    return qk.load(_tiny.gpt2_dir(tmp_path_factory), device="cpu", verbose=False)


def _check_structure(tokens, n_seqs, seg_len, n_repeats, bos, banned):
    assert tokens.shape == (n_seqs, 1 + seg_len * n_repeats) and tokens.dtype == torch.long
    assert (tokens[:, 0] == bos).all()
    body = tokens[:, 1:]
    segs = body.view(n_seqs, n_repeats, seg_len)
    for r in range(1, n_repeats):
        assert torch.equal(segs[:, r], segs[:, 0])                     # R repeated exactly
    assert not torch.isin(body, torch.tensor(sorted(banned))).any()    # no BOS / special token inside
    return segs[:, 0]


def test_repeated_tokens_on_the_hand_built_model(hand_built):
    tokens = repeated_tokens(hand_built, n_seqs=6, seg_len=20, seed=3)
    seg = _check_structure(tokens, 6, 20, 2, bos=0, banned={0})
    for row in seg:
        assert len(set(row.tolist())) == 20                              # drawn without replacement
    assert int(seg.max()) < hand_built.cfg.d_vocab
    # the whole pool can be used: 31 non-BOS ids, a segment of 31 is a permutation of them
    full = repeated_tokens(hand_built, n_seqs=2, seg_len=31, seed=0)[:, 1:32]
    assert sorted(full[0].tolist()) == list(range(1, 32))


def test_reproducible_by_seed(hand_built, gpt2):
    for model in (hand_built, gpt2):
        a = repeated_tokens(model, n_seqs=4, seg_len=10, seed=7)
        assert torch.equal(a, repeated_tokens(model, n_seqs=4, seg_len=10, seed=7))
        assert not torch.equal(a, repeated_tokens(model, n_seqs=4, seg_len=10, seed=8))
        assert len({tuple(r) for r in a[:, 1:11].tolist()}) == 4       # rows differ from each other
    # the global torch RNG neither affects nor is affected by the draw
    torch.manual_seed(0)
    x = repeated_tokens(hand_built, n_seqs=2, seg_len=5, seed=1)
    after = torch.rand(1)
    torch.manual_seed(123)
    assert torch.equal(x, repeated_tokens(hand_built, n_seqs=2, seg_len=5, seed=1))
    torch.manual_seed(0)
    assert torch.equal(torch.rand(1), after)


def test_no_special_tokens_with_a_real_tokenizer(gpt2):
    tok = gpt2.tokenizer
    special = set(tok.all_special_ids)
    assert special == {0} and bos_id(gpt2) == tok.bos_token_id == 0
    tokens = repeated_tokens(gpt2, n_seqs=8, seg_len=25, n_repeats=2, seed=0)
    seg = _check_structure(tokens, 8, 25, 2, bos=0, banned=special)
    for row in seg:
        assert len(set(row.tolist())) == 25
    pool = token_pool(gpt2)
    assert pool.bos_id == 0 and 0 not in pool.ids.tolist() and len(pool.ids) == len(tok) - 1   # 400 < 1000: untrimmed


@pytest.mark.parametrize("n_repeats", [2, 3])
def test_repeats_and_explicit_bos(hand_built, n_repeats):
    tokens = repeated_tokens(hand_built, n_seqs=3, seg_len=8, n_repeats=n_repeats, seed=0, bos=5)
    _check_structure(tokens, 3, 8, n_repeats, bos=5, banned={5})
    no_bos = repeated_tokens(hand_built, n_seqs=3, seg_len=8, n_repeats=n_repeats, seed=0, prepend_bos=False)
    assert no_bos.shape == (3, 8 * n_repeats)


def test_small_vocab_falls_back_to_drawing_with_replacement():
    tiny = hand_built_induction_model(d_vocab=6, n_ctx=32)
    tokens = repeated_tokens(tiny, n_seqs=4, seg_len=12, seed=0)
    seg = _check_structure(tokens, 4, 12, 2, bos=0, banned={0})
    assert set(seg.flatten().tolist()) <= {1, 2, 3, 4, 5}


def test_exclude_and_pool_override(hand_built):
    pool = token_pool(hand_built, exclude=range(10, 32))
    assert pool.ids.tolist() == list(range(1, 10))
    tokens = repeated_tokens(hand_built, n_seqs=5, seg_len=9, seed=0, pool=pool)
    assert set(tokens[:, 1:].flatten().tolist()) == set(range(1, 10))


@pytest.mark.parametrize("seed", [-1, 1.5, True, "0", None, 2**63])
def test_bad_seed(seed, hand_built):
    with pytest.raises(QKCircuitsError, match=r"seed must be a non-negative integer, got"):
        unchecked(repeated_tokens)(hand_built, n_seqs=2, seg_len=4, seed=seed)     # beneath the type-check hook
    with pytest.raises(QKCircuitsError, match=repr(seed).replace("(", r"\(").replace(".", r"\.")):
        check_seed(seed)


def test_too_long_and_bad_sizes(hand_built):
    n_ctx = hand_built.cfg.n_ctx
    seg = n_ctx // 2
    with pytest.raises(QKCircuitsError, match=rf"2 x {seg} tokens \+ BOS = {2 * seg + 1} exceeds the model's "
                                              rf"context of {n_ctx}"):
        repeated_tokens(hand_built, n_seqs=2, seg_len=seg, seed=0)
    fits = repeated_tokens(hand_built, n_seqs=1, seg_len=(n_ctx - 1) // 2, seed=0, n_repeats=2)
    assert fits.shape[1] <= n_ctx
    with pytest.raises(QKCircuitsError, match=rf"2 x {n_ctx // 2 + 1} tokens = {2 * (n_ctx // 2) + 2} exceeds"):
        repeated_tokens(hand_built, n_seqs=1, seg_len=n_ctx // 2 + 1, seed=0, prepend_bos=False)
    for kw, match in [({"n_seqs": 0}, "n_seqs must be an integer >= 1"), ({"seg_len": 1}, "seg_len must be"),
                      ({"n_repeats": 1}, "n_repeats must be an integer >= 2"), ({"seg_len": 4.0}, "got 4.0")]:
        with pytest.raises(QKCircuitsError, match=match):
            unchecked(repeated_tokens)(hand_built, **{"n_seqs": 2, "seg_len": 4, "seed": 0, **kw})


def test_text_tokens(gpt2, hand_built):
    tok = gpt2.tokenizer
    ids = tok(qk.natural_text(), add_special_tokens=False)["input_ids"]
    rows = text_tokens(gpt2, seq_len=40, n_seqs=3)
    assert rows.shape == (3, 41) and (rows[:, 0] == 0).all()
    assert rows[:, 1:].flatten().tolist() == ids[:120]                 # consecutive text, no BOS inside
    assert 0 not in rows[:, 1:].tolist()
    all_rows = text_tokens(gpt2, seq_len=40)
    assert all_rows.shape[0] == len(ids) // 40
    with pytest.raises(QKCircuitsError, match=r"seq_len 64 must be between 2 and 63"):
        text_tokens(gpt2, seq_len=64)
    with pytest.raises(QKCircuitsError, match="fewer than one row"):
        text_tokens(gpt2, "a short text", seq_len=40)
    with pytest.raises(QKCircuitsError, match="need a tokenizer"):
        text_tokens(hand_built)


@pytest.mark.smollm2
def test_smollm2_pool_avoids_specials_and_extremes(smollm2):
    tok = smollm2.tokenizer
    pool = token_pool(smollm2)
    V = len(tok)
    assert pool.bos_id == tok.bos_token_id == 1
    ids = pool.ids
    assert not torch.isin(ids, torch.tensor(tok.all_special_ids)).any()
    assert int(ids.min()) >= int(0.02 * V) and int(ids.max()) < int(0.9 * V)
    tokens = repeated_tokens(smollm2, n_seqs=4, seg_len=50, seed=0)
    seg = _check_structure(tokens, 4, 50, 2, bos=1, banned=set(tok.all_special_ids))
    for row in seg:
        assert len(set(row.tolist())) == 50
        assert all(t.strip() for t in tok.convert_ids_to_tokens(row.tolist()))


def test_default_segment_length_fits_the_context_and_the_token_pool(hand_built):
    # 32 ids minus BOS: a longer R would repeat tokens and split a perfect head's attention
    assert qk.segment_length(hand_built) == 31
    assert qk.segment_length(hand_built, n_repeats=4, preferred=25) == 25
    assert qk.segment_length(hand_built, n_repeats=4, preferred=40) == 31       # (128-1)//4 = 31 too
    from qkcircuits._analysis.metrics import default_tokens, induction_loss

    toks = default_tokens(hand_built, "induction-loss")
    assert toks.shape[1] == 1 + 2 * 31
    assert all(len(set(row[1:32].tolist())) == 31 for row in toks)
    with torch.no_grad():
        assert float(induction_loss()(hand_built(toks), toks)) < 1e-3   # the exact induction circuit predicts R
