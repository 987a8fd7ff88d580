"""What every attention adapter answers for one layer, and the per-head weights it hands out.

>>> from qkcircuits._foundation.arch import adapter
>>> a = adapter(model, 1)
>>> a.family, a.n_heads, a.d_qk, a.d_v
('standard', 2, 129, 129)
>>> tuple(a.weights().W_Q.shape)                 # [head, d_model, d_qk], K/V expanded to query heads
(2, 224, 129)

The adapters are the only place that knows how a family lays out its attention (which module holds
the projections, where the score scale lives, how hooks are shaped); everything above asks them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
from jaxtyping import Float
from torch import Tensor

from ..rope import RotarySpec
from .norms import Norm, block_norm, module_eps, read_norm
from .qkmap import QKMap, ScoreMaps
from .rotary import layer_rotary


@dataclass
class LayerWeights:
    """One layer's attention weights per query head (K/V expanded for GQA), biases zero where absent.

    For multi-head latent attention these are the *effective* maps through the latents with the latent
    norms' weights γ applied and their per-position RMS scales left out (see docs/circuits.md):
    W_Q^h = W_DQ·γ_q·W_UQ^h (or W_Q^h), W_K^h = [W_DKV·γ_kv·W_UK^h | W_KR], W_V^h = W_DKV·γ_kv·W_UV^h.
    """

    W_Q: Float[Tensor, "head d_model d_qk"]
    W_K: Float[Tensor, "head d_model d_qk"]
    W_V: Float[Tensor, "head d_model d_v"]
    W_O: Float[Tensor, "head d_v d_model"]
    b_Q: Float[Tensor, "head d_qk"]
    b_K: Float[Tensor, "head d_qk"]
    b_V: Float[Tensor, "head d_v"]
    has_bias: bool


class AttentionAdapter:
    """One layer's attention as qkcircuits needs it. Subclasses: ``StandardAttention``, ``LatentAttention``.

    Attributes: ``family`` ("standard" | "latent"), ``n_heads``, ``n_kv_heads``, ``d_qk`` (query/key width
    per head), ``d_v`` (value/z width per head), ``layer``.
    """

    family = "abstract"

    def __init__(self, model, layer: int):
        self.model, self.layer = model, int(layer)
        self.block = model.blocks[self.layer]
        self.bridge = self.block.attn
        comp = getattr(self.bridge, "original_component", None)
        self.module = self.bridge if comp is None else comp     # the module that really computes attention

    # -- shape ------------------------------------------------------------------------------------
    n_heads: int
    n_kv_heads: int
    d_qk: int
    d_v: int

    # -- weights ----------------------------------------------------------------------------------
    def weights(self) -> LayerWeights:
        raise NotImplementedError

    def W_O(self) -> Float[Tensor, "head d_v d_model"]:
        """Each head's output map, [head, d_v, d_model] (detached)."""
        return self.weights().W_O

    @property
    def folded(self) -> bool:
        """Whether the input norm's weight is folded into W_Q/W_K/W_V (``qk.load(fold_ln=True)``)."""
        return bool(getattr(self.model, "compatibility_mode", False))

    # -- scores -----------------------------------------------------------------------------------
    def scale(self) -> Tuple[float, str, Optional[float]]:
        """(factor applied to raw q·k, where it was read, soft-cap or None)."""
        raise NotImplementedError

    def window(self) -> Optional[int]:
        return None

    def layer_type(self) -> Optional[str]:
        return None

    def native_rotary(self) -> Optional[torch.nn.Module]:
        return None

    def caveats(self) -> List[str]:
        """Ways this layer's score leaves (bilinear form) × scale, beyond the model-wide ones."""
        return []

    @property
    def qk_norm(self) -> bool:
        return False

    def alibi_slopes(self) -> Optional[Tensor]:
        """ALiBi's per-head slopes [n_heads] (Bloom, Falcon with ALiBi: the score gains slope_h · j for key position
        j; any other family is caught by attend's exactness checks), or None."""
        if getattr(self.model.cfg, "positional_embedding_type", "standard") != "alibi":
            return None
        from transformer_lens.model_bridge.generalized_components.alibi_utils import build_alibi_slopes

        return build_alibi_slopes(self.n_heads, torch.device("cpu")).double()

    def softcap(self) -> Optional[float]:
        """The soft-cap the module applies to its scores (cap · tanh(score / cap)), or None."""
        return self.scale()[2]

    # -- norms and positions ----------------------------------------------------------------------
    def input_norm(self) -> Norm:
        """The norm in front of this attention (``ln1``): kind, eps, effective weight and bias, read off the module."""
        return block_norm(self.model, self.layer)

    def post_norm(self) -> Optional[Norm]:
        """The norm the block applies to this attention's output before adding it (Gemma's ``ln1_post``), or None."""
        mod = getattr(self.block, "ln1_post", None)
        if mod is None:
            return None
        d = int(self.model.cfg.d_model)
        return read_norm(mod, (d,), eps=module_eps(mod, getattr(self.model.cfg, "eps", 1e-6)), kind="RMS",
                         what=f"layer {self.layer}'s post-attention norm")

    def qk_norms(self) -> Tuple[Optional[Norm], Optional[Norm]]:
        """(query norm, key norm) applied per head before the rotary (QK-norm), each None where absent."""
        return None, None

    def qk_norm_modules(self) -> Tuple[Optional[torch.nn.Module], Optional[torch.nn.Module]]:
        """The QK-norm modules themselves (query, key), for replaying them exactly; None where absent."""
        return None, None

    def output_module(self) -> Optional[torch.nn.Module]:
        """The module that maps the heads' concatenated z to the attention output (``o_proj``), or None (TL-native
        attention applies W_O itself)."""
        o = getattr(self.bridge, "o", None)
        return getattr(o, "original_component", None) if o is not None else None

    def rotary(self, verify: bool = True) -> Optional[RotarySpec]:
        """This layer's rotary (``arch/rotary``), None without rotary; NoPE layers give the identity."""
        return layer_rotary(self, verify)

    # -- the attribution maps (arch/qkmap): ``_maps`` is each family's ---------------------------------
    def query_map(self, head: int) -> QKMap:
        """Query head ``head``'s query as a function of the residual entering the block (``arch/qkmap``)."""
        return self.query_maps([int(head)])[0]

    def key_map(self, kv_head: int) -> QKMap:
        """KV head ``kv_head``'s key as a function of the residual entering the block (``arch/qkmap``)."""
        return self.key_maps([int(kv_head)])[0]

    def query_maps(self, heads) -> List[QKMap]:
        """``query_map`` of each of ``heads``, the layer's weights and norms read once."""
        return self._maps("q", [int(h) for h in heads])

    def key_maps(self, kv_heads) -> List[QKMap]:
        """``key_map`` of each of ``kv_heads``, the layer's weights and norms read once."""
        return self._maps("k", [int(g) for g in kv_heads])

    def _maps(self, side: str, heads: List[int]) -> List[QKMap]:
        """The maps of ``side`` ("q": query heads, "k": KV heads) for ``heads``: each family's own."""
        raise NotImplementedError

    def score_maps(self, heads) -> ScoreMaps:
        """Everything the score of query heads ``heads`` is made of, in one object (``qkmap.ScoreMaps``): their
        query maps, their KV heads' key maps, the scale, soft-cap, window, ALiBi slopes and rotary, and what the maps
        freeze (what ``qk.attend`` asks of a layer)."""
        heads = [int(h) for h in heads]
        group = self.n_heads // self.n_kv_heads
        kv = sorted({h // group for h in heads})
        factor, source, cap = self.scale()
        query = self.query_maps(heads)
        key = dict(zip(kv, self.key_maps(kv)))
        rotary = (query + list(key.values()))[0].rotary if heads else self.rotary(verify=False)
        return ScoreMaps(heads, query, key, group, factor, source, cap, self.window(), self.alibi_slopes(), rotary,
                         self.frozen_factors(), self.family)

    def frozen_factors(self) -> List[str]:
        """What this layer's attribution maps hold at their value in one run: each per-position scale of a norm
        between the residual and the score (the input norm's; a QK-norm's)."""
        out = ["the input norm's 1/σ at each position"] if self.input_norm().kind else []
        if any(n is not None for n in self.qk_norms()):
            out.append("the QK-norm's 1/σ of each head's query and key")
        return out

    def uses_rotary(self) -> bool:
        return True

    @property
    def scores_hook_holds_pattern(self) -> bool:
        """TL's generic (native) attention fires hook_attn_scores with the softmaxed pattern."""
        return bool(getattr(getattr(self.bridge, "original_component", None), "accepts_pattern_fn", False))

    # -- modules a run may replace or adjust ---------------------------------------------------------
    def projection(self, into: str) -> Optional[Tuple[torch.nn.Linear, object]]:
        """(the plain ``nn.Linear`` whose output is ``hook_<into>`` (q, k, v), the bridge's hook point on that
        output), or None where no single Linear computes it (joint QKV, latent attention): what a run that knows
        the value may skip (``_tasks/skips.py``)."""
        lin = getattr(self.bridge, into, None)
        orig = getattr(lin, "original_component", None)
        if type(orig) is not torch.nn.Linear:
            return None
        return orig, getattr(lin, "hook_out", None)

    def kv_groups(self) -> Optional[int]:
        """transformers' ``num_key_value_groups``: how many query heads share a KV head, as the wrapped module's
        attention reads it to repeat K/V per query head; None where the module has no such number."""
        n = getattr(self.module, "num_key_value_groups", None) if self.module is not self.bridge else None
        return n if isinstance(n, int) else None

    def set_kv_groups(self, n: int) -> None:
        """Set the number ``kv_groups`` reads (1: the module takes K/V already given per query head)."""
        self.module.num_key_value_groups = int(n)

    # -- hooks ------------------------------------------------------------------------------------
    def score_inputs(self) -> Tuple[str, str, str]:
        """(q name, k name, rotation still to apply): the capture names whose dot product × scale is the score;
        ``"native"``: rotate them with the TL-native rotary (``attention.rotate_native``), ``"rebuilt"``: with
        the model's own frequencies (``rotary.rotate``), ``""``: nothing to apply."""
        return "q", "k", ""

    def prepare(self) -> None:
        """Adjust the bridge's hooks once so they fire in qkcircuits' layout (nothing to do for most families)."""

    def kv_floats(self) -> Tuple[int, int]:
        """(floats cached per token by this layer, the same for multi-head attention with these query heads)."""
        raise NotImplementedError

    def head_inputs(self, resid: Float[Tensor, "batch pos d_model"], into: str) -> Tensor:
        """The hook value ``into`` (q, k, v) this layer would compute from residual ``resid``, [batch, pos, head, d]."""
        raise NotImplementedError
