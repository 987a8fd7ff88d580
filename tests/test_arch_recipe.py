"""docs/architecture.md, "How to add an architecture", executed (issue 36, ask 9).

The recipe's four steps on a tiny GPT-2 checkpoint: (1) subclass the adapter, (2) answer the questions — here the
per-head weights are read from the Hugging Face module's own fused ``c_attn`` / ``c_proj`` (Conv1D: x @ W + b) and
the score scale from its config, not through TransformerLens' ``W_Q`` properties — (3) register it with a rule,
(4) prove it: ``qk.verify_circuits`` (every head's factored QK and OV against the model's own scores and outputs),
the weights equal the built-in adapter's, and ``qk.attend`` stays exact through the new family.
"""

from __future__ import annotations

import pytest
import torch

import _tiny
import qkcircuits as qk
from qkcircuits._foundation import arch
from qkcircuits._foundation.arch import LayerWeights, StandardAttention


class GPT2FusedAttention(StandardAttention):
    """GPT-2's attention read off ``GPT2Attention.c_attn`` ([d_model, 3·d_model], columns q | k | v, head-major)
    and ``c_proj`` ([d_model, d_model]); unfolded norms (``fold_ln=False``), so ln1 stays the input norm."""

    family = "gpt2-fused"

    def weights(self) -> LayerWeights:
        hf, H, d = self.module, self.n_heads, self.d_qk
        with torch.no_grad():
            W = hf.c_attn.weight.detach()                                  # [d_model, 3·H·d]
            b = hf.c_attn.bias.detach()
            W_Q, W_K, W_V = (W[:, i * H * d:(i + 1) * H * d].reshape(-1, H, d).transpose(0, 1) for i in range(3))
            b_Q, b_K, b_V = (b[i * H * d:(i + 1) * H * d].reshape(H, d) for i in range(3))
            W_O = hf.c_proj.weight.detach().reshape(H, d, -1)              # [H, d, d_model]
        return LayerWeights(W_Q, W_K, W_V, W_O, b_Q, b_K, b_V, has_bias=True)

    def W_O(self):
        return self.weights().W_O

    def scale(self):
        cfg = self.module.config
        factor = self.d_qk ** -0.5 if cfg.scale_attn_weights else 1.0
        if cfg.scale_attn_by_inverse_layer_idx:
            factor /= self.layer + 1
        return factor, "GPT2Config.scale_attn_weights (the recipe test's own reading)", None


@pytest.fixture
def gpt2(tmp_path):
    folder = _tiny.tiny_gpt2(tmp_path / "gpt2")
    built_in = qk.load(str(folder), device="cpu", fold_ln=False, verbose=False)
    arch.register_family("gpt2-fused", GPT2FusedAttention, lambda m: arch.architecture(m) == "GPT2LMHeadModel")
    try:
        yield built_in, qk.load(str(folder), device="cpu", fold_ln=False, verbose=False), folder
    finally:
        arch.FAMILIES.pop("gpt2-fused")
        arch._RULES[:] = [r for r in arch._RULES if r[0] != "gpt2-fused"]


def test_a_registered_family_answers_for_the_model_and_proves_itself(gpt2):
    built_in, model, _ = gpt2
    assert arch.family(built_in) == "standard" and arch.family(model) == "gpt2-fused"
    assert isinstance(arch.adapter(model, 1), GPT2FusedAttention)
    for layer in range(model.cfg.n_layers):         # the same weights as the built-in adapter reads through TL
        mine, theirs = arch.adapter(model, layer).weights(), arch.adapter(built_in, layer).weights()
        for name in ("W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V"):
            torch.testing.assert_close(getattr(mine, name), getattr(theirs, name), rtol=0, atol=1e-6)
    check = qk.verify_circuits(model)
    assert check.passed and check.settings["family"] == "gpt2-fused", check
    res = qk.attend(model, "1.2", "a b c d a b c d", query=-1, key=3)
    assert res.exact_error <= 1e-5 and res.settings["family"] == "gpt2-fused"


def test_a_wrong_answer_is_caught_by_the_proof(gpt2):
    # step 4 is a proof, not a formality: a family that reads q and k swapped fails verify_circuits
    _, _, folder = gpt2

    class Swapped(GPT2FusedAttention):
        family = "gpt2-swapped"

        def weights(self):
            w = super().weights()
            return LayerWeights(w.W_K, w.W_Q, w.W_V, w.W_O, w.b_K, w.b_Q, w.b_V, has_bias=True)

    arch.register_family("gpt2-fused", Swapped, lambda m: True)        # replaces the rule and the class
    fresh = qk.load(str(folder), device="cpu", fold_ln=False, verbose=False)
    assert arch.family(fresh) == "gpt2-fused" and not qk.verify_circuits(fresh).passed
    with pytest.raises(qk.QKCircuitsError, match="register_family takes an AttentionAdapter subclass"):
        arch.register_family("x", dict, lambda m: True)
    with pytest.raises(qk.QKCircuitsError, match="family 'standard' is built in"):
        arch.register_family("standard", Swapped, lambda m: False)

