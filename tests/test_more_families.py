"""Families whose attention differs from the common case in one way each, checked against the model's own
computation (``verify_circuits`` rebuilds every head's scores from the factored circuits and compares them with
the model's hook_attn_scores / pattern; the rotary checks compare with the model's own hook_rot_q):

- Cohere: rotary on INTERLEAVED pairs, and a bridge that declares ``hook_q_normed`` without firing it;
- SmolLM3: a position-free (NoPE) layer between rotary ones (``no_rope_layers``);
- GPT-Neo: no score scaling at all, and a local layer that sees only ``window_size`` keys back.
"""

import pytest
import torch

import qkcircuits as qk
from qkcircuits._foundation.arch import adapter

from _tiny import GPTNEO_WINDOW, _once, hf_model, tiny_cohere, tiny_gptneo, tiny_smollm3

BUILD = {"cohere": tiny_cohere, "smollm3": tiny_smollm3, "gptneo": tiny_gptneo}


@pytest.fixture(scope="module", params=list(BUILD))
def family(request, tmp_path_factory):
    folder = _once(request.param, tmp_path_factory, BUILD[request.param])
    return request.param, qk.load(str(folder), verbose=False), folder


def test_factored_circuits_reproduce_the_models_own_scores(family):
    name, model, _ = family
    check = qk.verify_circuits(model)
    assert check.passed, (name, check)


def test_each_family_reads_its_own_positional_scheme(family):
    name, model, folder = family
    if name == "cohere":
        spec = qk.weights.rotary_spec(model, layer=0)
        assert spec.style == "pairs" and spec.verified_error < 1e-5 and not spec.caveats
    elif name == "smollm3":
        rotated, nope = qk.weights.rotary_spec(model, layer=0), qk.weights.rotary_spec(model, layer=1)
        assert rotated.verified_error < 1e-5 and float(rotated.omega.abs().max()) > 0
        R = qk.weights.rotation(nope, range(5), relative=True)
        assert torch.equal(R, torch.eye(nope.d_head).expand_as(R)) and "NoPE" in nope.source
        # the offset circuits of the NoPE layer do not depend on the offset, those of a rotary layer do
        a, b = (qk.weights.qk_at_offset(model, "1.0", d).AB for d in (0, 7))
        assert torch.allclose(a, b)
        a, b = (qk.weights.qk_at_offset(model, "0.0", d).AB for d in (0, 7))
        assert not torch.allclose(a, b, atol=1e-4)
    else:
        hf = hf_model(folder)
        assert [adapter(model, L).scale()[0] for L in range(2)] == [1.0, 1.0]
        assert [adapter(model, L).window() for L in range(2)] == [None, GPTNEO_WINDOW]
        assert [hf.transformer.h[L].attn.attention_type for L in range(2)] == ["global", "local"]
        # the pre-softmax scores rebuilt from the pattern this bridge passes as scores: softmax gives the model's
        # own attention pattern, window included (transformers' output_attentions, independent of the bridge)
        toks = torch.arange(1, 13)[None] * 7 % model.cfg.d_vocab
        acts = qk.capture(model, toks, ["scores"])
        with torch.no_grad():
            want = hf(toks, output_attentions=True).attentions
        for L in range(2):
            torch.testing.assert_close(acts["scores", L].softmax(-1), want[L], atol=1e-5, rtol=0)
        assert float(want[1][0, :, 10, :10 - GPTNEO_WINDOW + 1].abs().max()) == 0.0


def test_circuit_forwards_skip_quiet_attention_layers_here_too(family, monkeypatch):
    # the attention-layer skip of the circuit forwards (skips.known_attention) on these bridges, SmolLM3's
    # NoPE-aware subclass included: not run, the same logits as running it (tests/test_circuit_scores.py)
    from test_circuit_scores import _skips_attention_layers

    name, model, _ = family
    _skips_attention_layers(name, model, monkeypatch)
