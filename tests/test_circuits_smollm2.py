"""Circuits on SmolLM2-135M (rotary theta 100000, 9 query heads on 3 KV heads): against the model's own scores."""

from __future__ import annotations

import pytest
import torch

import qkcircuits as qk

pytestmark = pytest.mark.smollm2

LAYERS = (0, 7, 18, 29)


@pytest.fixture(scope="module")
def acts(smollm2):
    """ln1 inputs and attention scores of LAYERS for 24 tokens of natural text (one partial forward)."""
    tokens = qk.text_tokens(smollm2, seq_len=23, n_seqs=1)                       # BOS + 23 text tokens
    assert tokens.shape == (1, 24)
    names = {qk.weights.attn_input_hook(smollm2, layer) for layer in LAYERS} | \
            {f"blocks.{layer}.attn.hook_attn_scores" for layer in LAYERS}
    with torch.no_grad():
        _, cache = smollm2.run_with_cache(tokens, names_filter=lambda n: n in names)
    return {k: v[0] for k, v in cache.items()}


def test_rotary_spec_reads_the_model_not_tl_cfg(smollm2):
    spec = qk.weights.rotary_spec(smollm2)
    assert spec.base == 100000.0 and smollm2.cfg.rotary_base == 10000      # TL's cfg is wrong; we are not
    assert spec.style == "halves" and spec.rotary_dim == 64 and spec.verified_error < 1e-5
    assert qk.weights.circuit_caveats(smollm2) == [] and not spec.caveats


def test_offset_identity_reproduces_attention_scores(smollm2, acts):
    spec = qk.weights.rotary_spec(smollm2)
    mask = torch.tril(torch.ones(24, 24, dtype=torch.bool))
    for layer in LAYERS:
        x = acts[qk.weights.attn_input_hook(smollm2, layer)]
        assert x.shape == (24, 576)
        ref = acts[f"blocks.{layer}.attn.hook_attn_scores"]
        ours = qk.weights.offset_scores(smollm2, layer, x, spec=spec)
        err = (ours - ref)[:, mask].abs().max()
        assert err < 1e-4 * max(1.0, float(ref[:, mask].abs().max())), (layer, float(err))
        for h, i, j in [(0, 5, 5), (4, 20, 13), (8, 23, 0)]:            # the public circuit, entry by entry
            M = qk.weights.qk_at_offset(smollm2, (layer, h), i - j, spec=spec)
            s = x[i] @ M.A @ M.B @ x[j] * qk.weights.attn_scale(smollm2, layer)
            assert float(s) == pytest.approx(float(ref[h, i, j]), abs=1e-4 * max(1.0, abs(float(ref[h, i, j]))))


def test_wrong_rotary_base_breaks_the_identity(smollm2, acts):
    """TL's cfg.rotary_base (10000) instead of the model's 100000: the same comparison must fail."""
    wrong = qk.weights.rotary_spec(smollm2, base=float(smollm2.cfg.rotary_base))
    mask = torch.tril(torch.ones(24, 24, dtype=torch.bool))
    for layer in LAYERS[1:3]:
        x, ref = acts[qk.weights.attn_input_hook(smollm2, layer)], acts[f"blocks.{layer}.attn.hook_attn_scores"]
        err = (qk.weights.offset_scores(smollm2, layer, x, spec=wrong) - ref)[:, mask].abs().max()
        assert err > 0.5, (layer, float(err))


def test_gqa_heads_use_their_kv_head(smollm2_raw):
    attn = smollm2_raw.original_model.model.layers[5].self_attn
    Wq, Wk, Wv, Wo = (getattr(attn, n).weight.detach() for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
    for h in range(9):
        kv = slice((h // 3) * 64, (h // 3 + 1) * 64)
        q = Wq[h * 64:(h + 1) * 64].T
        torch.testing.assert_close(qk.qk(smollm2_raw, (5, h)).AB, q @ Wk[kv], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(qk.ov(smollm2_raw, (5, h)).AB, Wv[kv].T @ Wo[:, h * 64:(h + 1) * 64].T,
                                   atol=1e-5, rtol=1e-5)


def test_all_qk_matches_transformer_lens(smollm2):
    ours, tl = qk.weights.all_qk(smollm2), smollm2.QK
    for layer, h in [(0, 0), (11, 4), (29, 8)]:
        torch.testing.assert_close(ours[layer, h].AB, tl[layer, h].AB, atol=1e-5, rtol=1e-5)


def test_full_ov_copying_score_equals_d_model_side(smollm2):
    scores = qk.copying_scores(smollm2)
    assert scores.shape == (30, 9)        # (its values are checked against the eigenvalues below, not a bound)
    G = (qk.weights.unembed_cols(smollm2) @ qk.weights.embed_rows(smollm2, 0)).double()  # [576, 576]
    for layer, h in [(2, 1), (20, 6)]:
        M = qk.ov(smollm2, (layer, h)).AB.double() @ G                              # nonzero eig = those of E·OV·U
        assert float(scores[layer, h]) == pytest.approx(float(qk.weights.eigen_copying(torch.linalg.eigvals(M))), abs=1e-4)
