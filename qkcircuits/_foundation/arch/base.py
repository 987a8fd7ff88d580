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

import weakref
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
from jaxtyping import Float
from torch import Tensor

from ..errors import QKCircuitsError
from ..rope import RotarySpec
from .norms import Norm, block_norm, module_eps, read_norm
from .qkmap import QKMap, ScoreMaps
from .layer_rotary import layer_rotary


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
        # weakly: adapters are remembered per model (model_cache), and one that held its model would keep it alive
        try:
            self._model = weakref.ref(model)
        except TypeError:                        # a model that takes no weak reference is not remembered either
            self._model = lambda: model
        self.layer = int(layer)
        self.block = model.blocks[self.layer]
        self.bridge = self.block.attn
        comp = getattr(self.bridge, "original_component", None)
        self.module = self.bridge if comp is None else comp     # the module that really computes attention

    @property
    def model(self):
        model = self._model()
        if model is None:
            raise QKCircuitsError("this adapter's model is gone; ask adapter(model, layer) of a loaded model")
        return model

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
        """This layer's rotary (``arch/layer_rotary``), None without rotary; NoPE layers give the identity."""
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

    # -- a head's circuits and what it computes at given inputs (what _weights asks) ----------------------
    def qk_factors(self, head: int, R: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
        """Query head ``head``'s QK circuit as factors (A [d_model, k], B [k, d_model], QK = A B: the bias-free
        bilinear form, ``_weights.qk_ov.qk``); ``R`` [d_qk, d_qk]: the rotary's R(Δ) between query and key
        (``rope.rotation(spec, [Δ], relative=True)[0]``), applied on the query side: QK(Δ) = W_Q R(Δ) W_Kᵀ."""
        w = self.weights()
        Q, K = w.W_Q[head], w.W_K[head]
        if R is not None:
            Q = Q @ R.to(device=Q.device, dtype=Q.dtype)
        return Q, K.T

    def ov_factors(self, head: int) -> Tuple[Tensor, Tensor]:
        """Query head ``head``'s OV circuit as factors (A [d_model, k], B [k, d_model], OV = A B: W_V W_O)."""
        w = self.weights()
        return w.W_V[head], w.W_O[head]

    def qk_at(self, x: Float[Tensor, "batch pos d_model"]) -> Tuple[Tensor, Tensor]:
        """Every query head's factored query and key at the attention's inputs ``x`` (the rows W_Q/W_K read; the
        model's dtype), before the rotary, [batch, head, pos, d_qk] in float64: x W + b, then every norm after the
        projection evaluated at these inputs (a QK-norm, MLA's latent norms) — what ``verify_circuits`` compares
        with the model's own scores."""
        w = self.weights()
        q, k = self._factored_qk(x, w)
        for side, mod in zip("qk", self.qk_norm_modules()):
            if mod is not None:     # QK-norm: the model's own norm, evaluated at these q/k ([b, p, h, d]: per-head
                t = q if side == "q" else k          # weights, as Cohere's, broadcast over the head axis)
                t = mod(t.transpose(1, 2).to(w.W_Q.dtype)).transpose(1, 2).double()
                q, k = (t, k) if side == "q" else (q, t)
        return q, k

    @staticmethod
    def _factored_qk(x: Tensor, w: LayerWeights) -> Tuple[Tensor, Tensor]:
        """x W + b of every query head, [batch, head, pos, d_qk] in float64 (``qk_at`` before any norm)."""
        xd = x.to(w.W_Q.dtype).double()
        q = torch.einsum("bpm,hmd->bhpd", xd, w.W_Q.double()) + w.b_Q.double()[None, :, None]
        k = torch.einsum("bpm,hmd->bhpd", xd, w.W_K.double()) + w.b_K.double()[None, :, None]
        return q, k

    def writes_at(self, x: Float[Tensor, "batch pos d_model"], head: int) -> Float[Tensor, "batch pos d_model"]:
        """What query head ``head`` writes per source position from the attention's inputs ``x`` before the pattern
        mixes them, in float64: (x W_V + b_V) W_O, with every norm on the way evaluated at ``x`` (MLA's KV latent)."""
        w = self.weights()
        return (x.double() @ w.W_V[head].double() + w.b_V[head].double()) @ w.W_O[head].double()

    def rows_qk(self, X: Float[Tensor, "n d_model"], head: int) -> Tuple[Tensor, Tensor]:
        """Query head ``head``'s query and key for token rows ``X`` (what the layer reads for each token alone: the
        contextual token views), bias-free and before the rotary, in the weights' dtype: X W_Q, X W_K, with the norms
        after the projection that the bilinear form keeps (MLA's latent norms, evaluated at each row; a QK-norm is
        one of the QK circuit's caveats and is left out)."""
        w = self.weights()
        X = X.to(w.W_Q.dtype)
        return X @ w.W_Q[head], X @ w.W_K[head]

    def rows_write(self, X: Float[Tensor, "n d_model"], head: int) -> Tensor:
        """Query head ``head``'s bias-free write for token rows ``X`` (X W_V W_O, the weights' dtype), every norm on
        the way evaluated at each row (MLA's KV latent)."""
        w = self.weights()
        X = X.to(w.W_V.dtype)
        return (X @ w.W_V[head]) @ w.W_O[head]

    def inputs_from_residuals(self, resid: Float[Tensor, "n b p d_model"], into: str, heads) -> Tensor:
        """hook_q/k/v values of ``heads`` (query heads for q, KV heads for k/v), head i's computed from ITS OWN
        residual ``resid[i]``: [b, p, n, d] (the task graph's general path). Here: the block's own ln1 per copy
        (cheap, elementwise), then one einsum with the heads' ``input_maps`` (the flops of the model's projection);
        q/k-norm and rotary come after hook_q/k, so they need nothing here."""
        heads = list(heads)
        maps = self.input_maps(into, heads)
        if maps is None:
            raise NotImplementedError(f"{type(self).__name__} has no input_maps: it computes its own "
                                      f"inputs_from_residuals")
        W, bias = maps                                                                 # [n, d, e], [n, e] or None
        n, b, p, d = resid.shape
        normed = self.block.ln1(resid.reshape(n * b, p, d)).view(n, b, p, d)
        out = torch.einsum("nbpd,nde->bpne", normed, W.to(normed.dtype))
        if bias is not None:
            out = out + bias.to(out.dtype)
        return out

    def input_maps(self, into: str, heads) -> Optional[Tuple[Tensor, Optional[Tensor]]]:
        """(W [n, d_model, d], b [n, d] or None) with hook_<into> = ln1(x) W + b for ``heads``, or None where no such
        linear map of the normed input exists (latent attention reads it through its latents and their norms)."""
        return None

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

    def kv_kind(self) -> str:
        """What this layer's KV cache holds, in words: "MHA", "MQA", "GQA 2 of 8" (latent: its latent and rotary key)."""
        if self.n_kv_heads == self.n_heads:
            return "MHA"
        if self.n_kv_heads == 1:
            return "MQA"
        return f"GQA {self.n_kv_heads} of {self.n_heads}"

    # -- what a capture of this layer may name -------------------------------------------------------
    LATENT_ACTIVATIONS = ("q_latent", "kv_latent", "k_rope")

    def activation_refusal(self, names, architecture: str) -> Optional[str]:
        """Why this layer has no ``names`` to capture or edit (one line naming ``architecture``, the model's), or
        None where it has them all: the latents and the decoupled rotary key exist only on latent attention."""
        latent = [n for n in names if n in self.LATENT_ACTIVATIONS]
        if latent:
            return (f"{latent[0]!r} exists only on multi-head latent attention (DeepSeek-V2/V3); this {architecture} "
                    f"has standard attention: capture q, k, v, rot_q, rot_k, scores, pattern or z")
        return None

    def shared_by_heads(self, name: str) -> bool:
        """Whether activation ``name`` is one tensor for every head of the layer (an edit of it acts on all of
        them): the latents and, on latent attention, the shared rotary key."""
        return name in ("q_latent", "kv_latent")

    def head_inputs(self, resid: Float[Tensor, "batch pos d_model"], into: str) -> Tensor:
        """The hook value ``into`` (q, k, v) this layer would compute from residual ``resid``, [batch, pos, head, d]."""
        raise NotImplementedError
