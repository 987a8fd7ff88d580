"""Models whose heads are known by construction: the ground truth every detector is tested on.

>>> from qkcircuits.fixtures import hand_built_induction_model
>>> model = hand_built_induction_model()         # 2 layers x 2 heads, attention only, no LayerNorm
>>> model.cfg.n_layers, model.cfg.n_heads
(2, 2)

Head 0.0 attends from position i to i-1 and writes the token it read into a "previous token"
block of the residual stream; head 1.0 matches the current token against that block, so it
attends to j where tok[j-1] == tok[i] (the token *after* an earlier copy) and copies it to the
"output" block that the unembedding reads; with no match it falls back to position 0 (BOS).
Heads 0.1 and 1.1 attend to themselves and read the token (non-zero z) but write nothing (W_O = 0).

Residual stream (d_model = 3·V + n_ctx), one-hot blocks::

    [ token (V) | position (n_ctx) | previous token (V) | output (V) ]
"""

from __future__ import annotations

import math

import torch
from transformer_lens.config import TransformerBridgeConfig
from transformer_lens.model_bridge import TransformerBridge

PREV_TOKEN_HEAD = (0, 0)
INDUCTION_HEAD = (1, 0)
UNUSED_HEADS = ((0, 1), (1, 1))


def hand_built_induction_model(d_vocab: int = 32, n_ctx: int = 128, margin: float = 30.0, bos_token_id: int = 0,
                               device: str = "cpu") -> TransformerBridge:
    """An exact previous-token head (0.0) feeding an exact induction head (1.0); see the module docstring.

    ``margin`` is the pre-softmax score gap (after the model's 1/√d_head scale) between the
    intended key and every other key, so off-target attention is ≤ n_ctx·e^(-margin/2).
    Unembedding: the output block maps token t to logit ``+margin`` on t, except BOS, which maps
    to ``-margin`` on BOS, so "no match" predicts uniformly over the V-1 other tokens (loss ln(V-1)).
    """
    V, P = d_vocab, n_ctx
    tok, pos, prev, out = 0, V, V + P, 2 * V + P          # block offsets in the residual stream
    d_model, d_head = 3 * V + P, max(V, P) + 1             # +1: a spare coordinate for the BOS fallback
    cfg = TransformerBridgeConfig(
        d_model=d_model, d_head=d_head, n_layers=2, n_ctx=P, n_heads=2, d_vocab=V, attn_only=True,
        normalization_type=None, positional_embedding_type="standard", act_fn="relu", seed=0,
        default_prepend_bos=False, model_name="hand-built-induction",
    )
    model = TransformerBridge.boot_native(cfg, device=device, model_name="hand-built-induction")
    c = margin * math.sqrt(d_head)                          # raw q·k that becomes `margin` after scaling
    native = model.original_model
    with torch.no_grad():
        for p in native.parameters():
            p.zero_()
        native.tok_embed.weight[:, tok:tok + V] = torch.eye(V)
        native.pos.weight[:, pos:pos + P] = torch.eye(P)

        def head_slice(h: int) -> slice:
            return slice(h * d_head, (h + 1) * d_head)

        a0, a1 = native.layers[0].attn, native.layers[1].attn
        # Layer weights are nn.Linear: y = x W^T + b, weight shape [out, in].
        # Head 0.0 (previous token): query at position p points at key coordinate p-1.
        s = head_slice(0)
        for p in range(1, P):
            a0.q.weight[s.start + p - 1, pos + p] = c
        for p in range(P):
            a0.k.weight[s.start + p, pos + p] = 1.0
            # value copies the token, output writes it into the "previous token" block
        for t in range(V):
            a0.v.weight[s.start + t, tok + t] = 1.0
            a0.o.weight[prev + t, s.start + t] = 1.0
        # Head 1.0 (induction): current token vs previous-token block; BOS fallback at half the margin.
        s = head_slice(0)
        spare = s.start + d_head - 1
        for t in range(V):
            a1.q.weight[s.start + t, tok + t] = c
            a1.k.weight[s.start + t, prev + t] = 1.0
            a1.v.weight[s.start + t, tok + t] = 1.0
            a1.o.weight[out + t, s.start + t] = 1.0
        a1.q.bias[spare] = c / 2
        a1.k.weight[spare, pos + 0] = 1.0
        # Heads 0.1 and 1.1: attend to themselves and read the token (W_V copies it into z, so z is
        # non-zero and an ablation of z really replaces something), but write nothing (W_O = 0).
        for attn in (a0, a1):
            s = head_slice(1)
            for p in range(P):
                attn.q.weight[s.start + p, pos + p] = c
                attn.k.weight[s.start + p, pos + p] = 1.0
            for t in range(V):
                attn.v.weight[s.start + t, tok + t] = 1.0
        for t in range(V):
            native.head.weight[t, out + t] = margin
        native.head.weight[bos_token_id, out + bos_token_id] = -margin
    model.cfg.default_prepend_bos = False
    model.eval()
    return model
