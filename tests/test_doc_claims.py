"""The values that docstring examples show but cannot compare themselves (they need SmolLM2 or a model the doctest
namespace lacks, so they are ``# doctest: +SKIP``), checked here: a skipped example claims nothing unchecked."""

from __future__ import annotations

import pytest
import torch

import _tiny
import qkcircuits as qk


def test_latent_adapter_example(tmp_path):
    """qkcircuits/_foundation/arch/latent.py: ``a.family, a.kv_lora_rank, a.d_rope, a.d_qk, a.d_v``."""
    from qkcircuits._foundation.arch import adapter

    deepseek = qk.load(str(_tiny.tiny_deepseek(tmp_path / "ds")), device="cpu", verbose=False)
    a = adapter(deepseek, 1)
    assert (a.family, a.kv_lora_rank, a.d_rope, a.d_qk, a.d_v) == ("latent", 16, 8, 24, 16)


@pytest.mark.smollm2
def test_smollm2_examples(smollm2):
    """fetch.py's file name, own_tokenizer.py's ``own_affixes(smollm2)``, rotary.py's ``rotary_spec`` and the
    shape and formula its prose gives for ``qk_at_offset`` / ``offset_scores``."""
    from qkcircuits._foundation.fetch import smollm2_gguf
    from qkcircuits._foundation.own_tokenizer import own_affixes
    from qkcircuits._weights.qk_ov import layer_weights
    from qkcircuits._weights.rotary import offset_scores, qk_at_offset, rotary_spec, rotation

    assert smollm2_gguf(quiet=True).name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert own_affixes(smollm2) == {"prefix": [], "suffix": [], "source": "the checkpoint's tokenizer"}
    spec = rotary_spec(smollm2)
    assert {k: spec.describe()[k] for k in ("style", "base")} == {"style": "halves", "base": 100000.0}
    w = layer_weights(smollm2, 3)
    Ri, Rj = rotation(rotary_spec(smollm2, layer=3), [7, 6]).double()     # absolute: query at 7, key at 6
    want = w.W_Q[1].double() @ Ri @ Rj.T @ w.W_K[1].double().T          # x W_Q R(7) · (y W_K R(6))ᵀ over x, y
    got = qk_at_offset(smollm2, "3.1", 1).AB.double()
    assert torch.allclose(got, want, atol=1e-4 * float(want.abs().max()))
    x = torch.randn(5, smollm2.cfg.d_model, generator=torch.Generator().manual_seed(0))
    assert tuple(offset_scores(smollm2, 3, x).shape) == (smollm2.cfg.n_heads, 5, 5)
