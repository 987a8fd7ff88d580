"""The attention module's own settings, read through the architecture adapters (``_foundation.arch``).

>>> attention_scale(model, 1)[0] > 0
True
>>> native_rotary(model, 0) is None, layer_type(model, 0), sliding_window(model, 0)
(True, None, None)

Kept as the stable functional names that ``capture``, ``_weights`` and ``_analysis`` import; each asks
``adapter(model, layer)``, which is the one place that probes modules. ``rotate_native`` rotates hook-layout
q/k with a TL-native rotary module.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .arch import adapter
from .arch.layer_rotary import rotate_native  # noqa: F401  (re-exported: rotate hook-layout q/k with a TL-native rotary)


def attention_component(model, layer: int):
    """The module that really computes ``layer``'s attention (the HF or TL-native module behind the bridge)."""
    return adapter(model, layer).module


def attention_scale(model, layer: int) -> Tuple[float, str, Optional[float]]:
    """(factor applied to raw q·k, where it was read, soft-cap or None) for ``layer``'s attention.

    The model's score is ``cap · tanh(factor · q·k / cap)`` with a cap, ``factor · q·k`` without; the
    factor is the module's own (e.g. ``DeepseekV3Attention.scaling``, which holds YaRN's mscale²).
    """
    return adapter(model, layer).scale()


def layer_type(model, layer: int) -> Optional[str]:
    """The layer's attention type where the model mixes types (Gemma 3: ``"sliding_attention"`` /
    ``"full_attention"``); else None."""
    return adapter(model, layer).layer_type()


def sliding_window(model, layer: int) -> Optional[int]:
    """Keys further back than this many positions are masked at ``layer`` (None: no window there)."""
    return adapter(model, layer).window()


def native_rotary(model, layer: int = 0) -> Optional[torch.nn.Module]:
    """The rotary module of a TransformerLens-native attention layer, or None (HF bridges fire the rot hooks)."""
    return adapter(model, layer).native_rotary()
