"""Rotary on bridges that never fire ``hook_rot_q/k`` (GPT-J, GPT-NeoX / Pythia), against transformers' own
attention probabilities (``output_attentions``, eager): the frequencies are read off the model (GPT-J keeps only
a sin|cos table), the pairing is known by construction (NeoX ``rotate_half``: halves; GPT-J
``rotate_every_two``: pairs) and must be *detected* from the pattern, and every tool that multiplies q and k
(offset circuits, captured scores, diagnose) must reproduce the model."""

from __future__ import annotations

import _tiny
import pytest
import torch

import qkcircuits as qk

FAMILIES = {"neox": ("halves", _tiny.neox_dir), "gptj": ("pairs", _tiny.gptj_dir)}
N = 12


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def fam(request, tmp_path_factory):
    style, build = FAMILIES[request.param]
    folder = build(tmp_path_factory)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    toks = (torch.arange(N) * 7 + 5)[None] % 300
    with torch.no_grad():
        probs = hf(toks, output_attentions=True).attentions                  # [1, head, q, k] per layer
    return request.param, style, qk.load(str(folder), device="cpu"), toks, probs


def _causal_softmax(scores):
    mask = torch.ones(scores.shape[-2:], dtype=torch.bool).tril()
    return scores.masked_fill(~mask, float("-inf")).softmax(-1)


def test_frequencies_and_pairing_are_read_and_verified_from_the_pattern(fam):
    name, style, m, _, _ = fam
    for layer in range(2):
        spec = qk.weights.rotary_spec(m, layer=layer)
        # HF: inv_freq = 1 / 10000^(2k / rotary_dim), rotary_dim 4 of d_head 8 on both tiny models
        want = 1.0 / 10000 ** (torch.arange(0, 4, 2, dtype=torch.float64) / 4)
        assert spec.style == style and spec.rotary_dim == 4 and spec.d_head == 8
        torch.testing.assert_close(spec.omega.double(), want, rtol=1e-6, atol=1e-7)
        assert spec.verified_error < 1e-5 and not spec.caveats, (name, spec.caveats)
        assert spec.base == pytest.approx(10000.0, rel=1e-4)


def test_offset_scores_reproduce_transformers_attention_and_the_wrong_pairing_does_not(fam):
    name, style, m, toks, probs = fam
    names = {qk.weights.attn_input_hook(m, L) for L in range(2)}
    with torch.no_grad():
        _, cache = m.run_with_cache(toks, names_filter=lambda n: n in names)
    for layer in range(2):
        x = cache[qk.weights.attn_input_hook(m, layer)][0]
        spec = qk.weights.rotary_spec(m, layer=layer)
        ours = qk.weights.offset_scores(m, layer, x, spec=spec)
        torch.testing.assert_close(_causal_softmax(ours), probs[layer][0], atol=1e-5, rtol=1e-4)
        other = qk.weights.RotarySpec(spec.omega, "pairs" if style == "halves" else "halves", spec.rotary_dim, spec.d_head)
        wrong = _causal_softmax(qk.weights.offset_scores(m, layer, x, spec=other))
        assert (wrong - probs[layer][0]).abs().max() > 1e-3, name


def test_captured_scores_are_pre_softmax_scores_not_the_pattern(fam):
    """GPT-J's bridge fires hook_attn_scores with the pattern and no rotated q/k: the scores are rebuilt."""
    name, _, m, toks, probs = fam
    acts = qk.capture(m, toks, names=["scores", "pattern"])
    future = ~torch.ones(N, N, dtype=torch.bool).tril()
    for layer in range(2):
        sc = acts.tensors[("scores", layer)][0]
        assert (sc[:, future] < -1e30).all() and sc[:, ~future].abs().max() > 1.5, name   # not probabilities
        torch.testing.assert_close(sc.softmax(-1), probs[layer][0], atol=1e-5, rtol=1e-4)


def test_diagnose_rotates_q_and_k_and_checks_them_against_the_model(fam):
    name, _, m, _, _ = fam
    d = qk.diagnose(m, progress=False, n_seqs=2)
    assert any("rebuilt" in s for s in d.settings["qk_hooks"]), d.settings["qk_hooks"]
    df = d.to_frame()
    assert df["pattern_err"].max() < 1e-4 and df["scores_err"].max() < 1e-4, (name, df[["pattern_err", "scores_err"]].max())


def test_capturing_rot_q_says_how_to_rotate_and_that_recipe_is_the_models_rotation(fam):
    name, _, m, toks, probs = fam
    with pytest.raises(qk.QKCircuitsError, match="never fired the hooks for rot_q@0") as e:
        qk.capture(m, toks, names=["rot_q"], layers=[0])
    assert "\n" not in str(e.value) and "qk.weights.rotation(qk.weights.rotary_spec(model, layer=L), range(pos))" in str(e.value)
    acts = qk.capture(m, toks, names=["q", "k"], layers=[0])
    R = qk.weights.rotation(qk.weights.rotary_spec(m, layer=0), range(N))          # [pos, d, d]
    q, k = (torch.einsum("bphd,pde->bphe", acts.tensors[(x, 0)], R) for x in ("q", "k"))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k)[0] * qk.weights.attn_scale(m, 0)
    torch.testing.assert_close(_causal_softmax(scores), probs[0][0], atol=1e-5, rtol=1e-4)
