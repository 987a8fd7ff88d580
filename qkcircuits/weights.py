"""The weight-level building blocks of circuits, for going below ``qk.circuit``, ``qk.qk`` and ``qk.ov``: per-layer
weights, the factors of the embedding and unembedding, affine and full-vocabulary circuits, rotary, composition
and copying pieces, token views.

>>> import qkcircuits as qk
>>> model = qk.load("toy-induction")
>>> w = qk.weights.layer_weights(model, 1)
>>> tuple(w.W_Q.shape)                      # [heads, d_model, d_head]
(2, 224, 129)
>>> round(float(qk.weights.attn_scale(model, 1)) ** -2)      # the score scale 1/√d_head
129

These were root names (``qk.attn_scale``, ...) before 0.2.0 (CHANGELOG.md). The explicit imports below are the
module's one list of names (``__all__`` is read from them).
"""

# ruff: noqa: F401
from ._weights.qk_ov import (LayerWeights, all_ov, all_qk, attn_input_hook, attn_scale, circuit_caveats, embed_factor,
                                embed_rows, full_ov, full_qk, layer_weights, ov_affine, qk_affine, top_tokens,
                                unembed_cols, unembed_embed, unembed_factor)
from ._weights.composition import composition_baseline, composition_column
from ._weights.contextual import TokenInputs, copying_rank, head_logits, token_inputs, token_qk
from ._weights.copying import copying_accuracy, eigen_copying
from ._weights.rotary import RotarySpec, offset_scores, positional_qk, qk_at_offset, rotary_spec, rotation

__all__ = sorted(n for n in dir() if not n.startswith("_"))      # the imports above: the one list
