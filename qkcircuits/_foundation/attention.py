"""The attention module's own settings, read from the model: scale, soft-cap, rotary module, layer type.

>>> attention_scale(model, 3)          # doctest: +SKIP   (0.125, 'LlamaAttention.scaling', None)
>>> native_rotary(model, 0)            # doctest: +SKIP   TL-native rotary module, or None for HF bridges
>>> layer_type(model, 0)               # doctest: +SKIP   'sliding_attention' on Gemma 3, None on Llama

The lowest layer of the circuit modules: it imports nothing from the package but ``_errors``, so
``_capture`` (which needs the scale and the native rotary to rebuild scores), ``_circuits`` and
``_rotary`` can all read these without an import circle.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from jaxtyping import Float
from torch import Tensor


def attention_component(model, layer: int):
    """The module that really computes ``layer``'s attention (the HF or TL-native module behind the bridge)."""
    attn = model.blocks[int(layer)].attn
    comp = getattr(attn, "original_component", None)
    return attn if comp is None else comp


def attention_scale(model, layer: int) -> Tuple[float, str, Optional[float]]:
    """(factor applied to raw q·k, where it was read, soft-cap or None) for ``layer``'s attention.

    Reads the attention module itself: Hugging Face modules keep ``scaling`` (1/√d_head for Llama;
    GPT-2 folds in 1/(layer+1) when configured; Gemma-3 1/√query_pre_attn_scalar; Gemma-2 style
    ``attn_logit_softcapping``), TransformerLens native modules keep the divisor ``scale`` and
    ``attn_scores_soft_cap``. Falls back to ``model.cfg`` (``attn_scale``, ``use_attn_scale``) and says
    so. The model's score is ``cap · tanh(factor · q·k / cap)`` with a cap, ``factor · q·k`` without.
    """
    comp = attention_component(model, layer)
    cap = None
    for owner, name in ((comp, "attn_logit_softcapping"), (comp, "attn_scores_soft_cap"),
                        (model.cfg, "attn_scores_soft_cap")):
        v = getattr(owner, name, None)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0:
            cap = float(v)
            break
    scaling = getattr(comp, "scaling", None)
    if isinstance(scaling, (int, float)) and scaling > 0:
        return float(scaling), f"{type(comp).__name__}.scaling", cap
    divisor = getattr(comp, "scale", None)
    if isinstance(divisor, (int, float)) and divisor > 0:
        return 1.0 / float(divisor), f"1 / {type(comp).__name__}.scale", cap
    cfg = model.cfg
    if getattr(cfg, "use_attn_scale", True):
        a = float(getattr(cfg, "attn_scale", -1.0))
        d = int(cfg.d_head)
        return (1.0 / a if a > 0 else d ** -0.5), "model.cfg.attn_scale (assumed; module has no scale)", cap
    return 1.0, "model.cfg.use_attn_scale=False", cap


def layer_type(model, layer: int) -> Optional[str]:
    """The layer's attention type where the model mixes types (Gemma 3: ``"sliding_attention"`` /
    ``"full_attention"``), read from the attention module or the HF config's ``layer_types``; else None."""
    t = getattr(attention_component(model, layer), "layer_type", None)
    if isinstance(t, str):
        return t
    hf_cfg = getattr(getattr(model, "original_model", None), "config", None)
    types = getattr(hf_cfg, "layer_types", None)
    if isinstance(types, (list, tuple)) and int(layer) < len(types) and isinstance(types[int(layer)], str):
        return types[int(layer)]
    return None


def sliding_window(model, layer: int) -> Optional[int]:
    """Keys further back than this many positions are masked at ``layer`` (None: no window there).

    Per layer where the module says so (Gemma 3 sets ``sliding_window`` only on its sliding layers);
    else TL's ``use_local_attn``/``window_size`` or the HF config's ``sliding_window`` (unless
    ``use_sliding_window`` is False, as on Qwen2).
    """
    comp = attention_component(model, layer)
    if hasattr(comp, "sliding_window") or hasattr(comp, "is_sliding"):
        w = getattr(comp, "sliding_window", None)
        return int(w) if isinstance(w, int) and w > 0 else None
    cfg = model.cfg
    if getattr(cfg, "use_local_attn", False) and getattr(cfg, "window_size", None):
        return int(cfg.window_size)
    hf_cfg = getattr(getattr(model, "original_model", None), "config", None)
    w = getattr(hf_cfg, "sliding_window", None)
    if isinstance(w, int) and w > 0 and getattr(hf_cfg, "use_sliding_window", True) is not False:
        types = getattr(hf_cfg, "layer_types", None)
        if isinstance(types, (list, tuple)) and int(layer) < len(types) and "sliding" not in str(types[int(layer)]):
            return None
        return w
    return None


def native_rotary(model, layer: int = 0) -> Optional[torch.nn.Module]:
    """The rotary module of a TransformerLens-native attention layer, or None.

    Native attention rotates q and k inside its forward and declares ``hook_rot_q``/``hook_rot_k``
    without ever firing them; there the pre-rotary ``hook_q``/``hook_k`` must be rotated with this
    module (``rotate_native``). Hugging Face bridges fire the rot hooks themselves: None.
    """
    comp = getattr(model.blocks[int(layer)].attn, "original_component", None)
    if getattr(comp, "accepts_pattern_fn", False) and getattr(comp, "rotary", None) is not None:
        return comp.rotary
    return None


def rotate_native(rotary: torch.nn.Module, q: Float[Tensor, "batch pos head d"], k: Float[Tensor, "batch pos kv d"]
                  ) -> "tuple[Tensor, Tensor]":
    """q and k rotated exactly as the native module does (its own ``apply_rope``), in hook layout.

    ``q``/``k`` are [batch, pos, head, d_head] as ``hook_q``/``hook_k`` hold them (k may have fewer,
    KV, heads); the result is on their device, in their layout. Memory: one copy of each.
    """
    dev = rotary.cos_cached.device
    with torch.no_grad():
        rq, rk = rotary.apply_rope(q.transpose(1, 2).to(dev), k.transpose(1, 2).to(dev))
    return rq.transpose(1, 2).to(q.device), rk.transpose(1, 2).to(k.device)
