"""Multi-head, grouped-query and multi-query attention (GPT-2, GPT-J, GPT-NeoX, Llama, Qwen, Gemma, TL-native models).

>>> from qkcircuits._foundation.arch import adapter
>>> a = adapter(model, 0)
>>> a.family, a.scale()[1]
('standard', '1 / NativeAttention.scale')

Everything that probes a standard attention module lives here: where the score scale and soft-cap are
kept (HF ``scaling``/``attn_logit_softcapping``, TL ``scale``/``attn_scores_soft_cap``, then ``model.cfg``),
the layer type and sliding window (Gemma 3 per layer), QK-norm modules, and TL's W_Q/W_K/W_V/W_O
(K/V expanded to query heads in HF ``repeat_kv`` order: query head h reads KV head h // group).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from jaxtyping import Float
from torch import Tensor

from ..errors import QKCircuitsError
from ..model_cache import recall, remember
from .base import AttentionAdapter, LayerWeights
from .norms import Norm, module_eps, read_norm
from .qkmap import QKMap
from .layer_rotary import layer_frequencies

QK_NORM_NAMES = ("q_norm", "k_norm", "q_layernorm", "k_layernorm", "query_layernorm", "key_layernorm")
# transformers' attention modules that keep no ``scaling`` and apply none (GPT-Neo's softmax(q·k), unscaled),
# where TransformerLens' config says 1/√d_head
UNSCALED = ("GPTNeoSelfAttention", "GPTNeoFlashAttention2")


class StandardAttention(AttentionAdapter):
    """q = x W_Q + b_Q, k = x W_K + b_K, v = x W_V + b_V per (KV) head, z_h = softmax(s) v, out = Σ_h z_h W_O^h."""

    family = "standard"

    def __init__(self, model, layer: int):
        super().__init__(model, layer)
        cfg = model.cfg
        self.n_heads = int(cfg.n_heads)
        self.n_kv_heads = int(getattr(cfg, "n_key_value_heads", None) or cfg.n_heads)
        self.d_qk = self.d_v = int(cfg.d_head)

    # -- weights ----------------------------------------------------------------------------------
    def weights(self) -> LayerWeights:
        """Detached weights of this layer. Memory: 4 · n_heads · d_model · d_head floats."""
        attn, n_heads, n_kv = self.bridge, self.n_heads, self.n_kv_heads
        with torch.no_grad():
            W_Q, W_K, W_V, W_O = (getattr(attn, n).detach() for n in ("W_Q", "W_K", "W_V", "W_O"))
            # Expand only what is per KV head: a bridge that already hands out per-query-head K/V must not
            # be expanded twice.
            W_K, W_V = (self._per_query_head(W, n) for W, n in ((W_K, "W_K"), (W_V, "W_V")))
            biases, has_bias = [], False
            for name, kv in (("b_Q", False), ("b_K", True), ("b_V", True)):
                b = _bias(attn, name)
                if b is None:
                    b = torch.zeros(n_heads, W_Q.shape[-1], dtype=W_Q.dtype, device=W_Q.device)
                else:
                    has_bias = True
                    b = b.detach().reshape(-1, W_Q.shape[-1])
                    if kv:
                        b = self._per_query_head(b, name)
                biases.append(b)
        return LayerWeights(W_Q, W_K, W_V, W_O, *biases, has_bias=has_bias)

    def W_O(self) -> Float[Tensor, "head d_v d_model"]:
        return self.bridge.W_O.detach()

    def _per_query_head(self, t: Tensor, name: str) -> Tensor:
        if t.shape[0] == self.n_heads:
            return t
        if t.shape[0] == self.n_kv_heads:
            return t.repeat_interleave(self.n_heads // self.n_kv_heads, 0)
        raise QKCircuitsError(f"layer {self.layer}: {name} has {t.shape[0]} heads; expected {self.n_kv_heads} "
                              f"(KV heads) or {self.n_heads} (query heads)")

    # -- scores -----------------------------------------------------------------------------------
    def scale(self) -> Tuple[float, str, Optional[float]]:
        """Reads the attention module itself: HF modules keep ``scaling`` (1/√d_head for Llama; GPT-2 folds
        in 1/(layer+1) when configured; Gemma-3 1/√query_pre_attn_scalar; Gemma-2 ``attn_logit_softcapping``),
        TL native modules the divisor ``scale`` and ``attn_scores_soft_cap``; else ``model.cfg`` (and says so)."""
        comp, cfg = self.module, self.model.cfg
        cap = None
        for owner, name in ((comp, "attn_logit_softcapping"), (comp, "attn_scores_soft_cap"),
                            (cfg, "attn_scores_soft_cap")):
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
        if type(comp).__name__ in UNSCALED:
            return 1.0, f"{type(comp).__name__} does not scale its scores", cap
        if getattr(cfg, "use_attn_scale", True):
            a = float(getattr(cfg, "attn_scale", -1.0))
            return (1.0 / a if a > 0 else self.d_qk ** -0.5), "model.cfg.attn_scale (assumed; module has no scale)", cap
        return 1.0, "model.cfg.use_attn_scale=False", cap

    def layer_type(self) -> Optional[str]:
        t = getattr(self.module, "layer_type", None)
        if isinstance(t, str):
            return t
        types = getattr(_hf_config(self.model), "layer_types", None)
        if isinstance(types, (list, tuple)) and self.layer < len(types) and isinstance(types[self.layer], str):
            return types[self.layer]
        return None

    def window(self) -> Optional[int]:
        """Per layer where the module says so (Gemma 3 sets ``sliding_window`` only on its sliding layers); else
        TL's ``use_local_attn``/``window_size`` or the HF config's ``sliding_window`` (unless
        ``use_sliding_window`` is False, as on Qwen2)."""
        comp, cfg = self.module, self.model.cfg
        if getattr(comp, "attention_type", None) in ("local", "global"):     # GPT-Neo: local layers see window_size
            w = getattr(_hf_config(self.model), "window_size", None)
            return int(w) if comp.attention_type == "local" and isinstance(w, int) and w > 0 else None
        if hasattr(comp, "sliding_window") or hasattr(comp, "is_sliding"):
            w = getattr(comp, "sliding_window", None)
            return int(w) if isinstance(w, int) and w > 0 else None
        if getattr(cfg, "use_local_attn", False) and getattr(cfg, "window_size", None):
            return int(cfg.window_size)
        hf_cfg = _hf_config(self.model)
        w = getattr(hf_cfg, "sliding_window", None)
        if isinstance(w, int) and w > 0 and getattr(hf_cfg, "use_sliding_window", True) is not False:
            types = getattr(hf_cfg, "layer_types", None)
            if isinstance(types, (list, tuple)) and self.layer < len(types) and "sliding" not in str(types[self.layer]):
                return None
            return w
        return None

    def native_rotary(self) -> Optional[torch.nn.Module]:
        """TL-native attention rotates q/k inside its forward without firing ``hook_rot_q/k``: its rotary module."""
        comp = getattr(self.bridge, "original_component", None)
        if getattr(comp, "accepts_pattern_fn", False) and getattr(comp, "rotary", None) is not None:
            return comp.rotary
        return None

    def score_inputs(self) -> Tuple[str, str, str]:
        """Most rotary bridges of HF models fire hook_rot_q/k (the rotated q/k); TL-native ones never do
        (``"native"``: rotate with the module), nor do GPT-J's and GPT-NeoX's (``"rebuilt"``: rotate with the
        model's own frequencies, ``rotary.rotary_spec``, whose pairing is verified against the pattern)."""
        rotary = hasattr(self.bridge, "hook_rot_q") and getattr(self.model.cfg, "positional_embedding_type",
                                                                   "standard") == "rotary"
        if not rotary or not self.uses_rotary():
            return "q", "k", ""
        if self.native_rotary() is not None:
            return "q", "k", "native"
        return ("rot_q", "rot_k", "") if self.rot_hooks_fire() else ("q", "k", "rebuilt")

    def uses_rotary(self) -> bool:
        """False on a rotary model's position-free (NoPE) layers: SmolLM3 and Llama-4 rotate only where
        ``config.no_rope_layers[layer]`` is 1 (the HF module's ``use_rope``); True everywhere else."""
        flag = getattr(self.module, "use_rope", None)
        if isinstance(flag, (bool, int)):
            return bool(flag)
        nope = getattr(_hf_config(self.model), "no_rope_layers", None)
        if isinstance(nope, (list, tuple)) and self.layer < len(nope) and isinstance(nope[self.layer], (bool, int)):
            return bool(nope[self.layer])
        return True

    def rot_hooks_fire(self) -> bool:
        """Whether this bridge really fires ``hook_rot_q`` (declared on every rotary bridge, never fired by
        GPT-J's or GPT-NeoX's): one 2-token forward through layer 0, cached on the model (``qk.load`` asks
        once, in ``prepare``, so no analysis pays a forward for it; a record in the model's store)."""
        fires = recall(self.model, "rotary hooks fire")
        if fires is None:
            seen = []
            toks = torch.zeros(1, 2, dtype=torch.long, device=self.model.W_E.device)
            with torch.no_grad():
                self.model.run_with_hooks(toks, fwd_hooks=[("blocks.0.attn.hook_rot_q",
                                                             lambda t, hook: seen.append(1))], stop_at_layer=1)
            fires = bool(seen)
            remember(self.model, "rotary hooks fire", fires)
        return fires

    def prepare(self) -> None:
        if self.layer == 0 and getattr(self.model.cfg, "positional_embedding_type", "") == "rotary" \
                and hasattr(self.bridge, "hook_rot_q") and self.native_rotary() is None:
            try:
                self.rot_hooks_fire()
            except Exception:  # noqa: BLE001  (a model that cannot run yet: asked again when an analysis needs it)
                pass

    def rotary_frequencies(self):
        """(inv_freq, attention_scaling, theta, where) of this layer's own HF rotary (per layer type where the
        model keeps one set per type, e.g. Gemma 3's ``sliding_attention_inv_freq``)."""
        return layer_frequencies(self.model, self.layer, self.layer_type())

    @property
    def qk_norm(self) -> bool:
        return bool(getattr(self.model.cfg, "use_qk_norm", False)) or any(
            getattr(self.module, n, None) is not None for n in QK_NORM_NAMES)

    def input_maps(self, into: str, heads) -> Tuple[Tensor, Optional[Tensor]]:
        """(W [n, d_model, d_head], b [n, d_head] or None) of ``into`` (q, k, v) for ``heads`` — query heads for q,
        KV heads for k/v — as the bridge holds them (hook_q/k/v = ln1(x) W + b). Reads only that projection: the
        circuit runs call it per layer and per run."""
        X = into.upper()
        heads = list(heads)
        W = getattr(self.bridge, f"W_{X}").detach()
        b = _bias(self.bridge, f"b_{X}")
        if into != "q" and W.shape[0] == self.n_heads != self.n_kv_heads:   # a bridge with per-query-head K/V
            heads = [g * (self.n_heads // self.n_kv_heads) for g in heads]
        if b is not None:
            b = b.detach().reshape(W.shape[0], -1)[heads]
        return W[heads], b

    def qk_norm_modules(self) -> Tuple[Optional[torch.nn.Module], Optional[torch.nn.Module]]:
        out = []
        for side in ("q", "k"):
            names = [x for x in QK_NORM_NAMES if x.startswith(side) or x.startswith("query" if side == "q" else "key")]
            out.append(next((getattr(self.module, x) for x in names if getattr(self.module, x, None) is not None), None))
        return out[0], out[1]

    def qk_norms(self) -> Tuple[Optional[Norm], Optional[Norm]]:
        """The HF module's own q/k norms (``q_norm``/``k_norm``, Cohere's ``q_layernorm``, ...), read off their
        outputs (``norms.read_norm``): per head, shared ([d_head] weight) or per head ([heads, d_head])."""
        out = []
        for mod, n, side in zip(self.qk_norm_modules(), (self.n_heads, self.n_kv_heads), "qk"):
            if mod is None:
                out.append(None)
                continue
            w = getattr(getattr(mod, "original_component", mod), "weight", None)
            shape = (n, self.d_qk) if isinstance(w, Tensor) and w.dim() == 2 else (self.d_qk,)
            out.append(read_norm(mod, shape, eps=module_eps(mod, getattr(self.model.cfg, "eps", 1e-6)),
                                 kind="RMS", what=f"layer {self.layer}'s {side}-norm"))
        return out[0], out[1]

    def _maps(self, side: str, heads: List[int]) -> List[QKMap]:
        """W = P·diag(w)·W_x[h], c = β W_x[h] + b_x[h] (``arch/qkmap``); the key side per KV head. The weights, norms
        and rotary are read once for all ``heads``."""
        w = self.weights()
        norm = self.input_norm()
        qn, kn = self.qk_norms()
        rotary = self.rotary(verify=False)                # the callers check the result against the model's pattern
        out = []
        for head in heads:
            idx = head if side == "q" else head * (self.n_heads // self.n_kv_heads)
            Wx = (w.W_Q if side == "q" else w.W_K)[idx].double()
            bx = (w.b_Q if side == "q" else w.b_K)[idx].double()
            M = Wx if norm.weight is None else norm.weight.double()[:, None] * Wx
            if norm.kind == "LN":
                M = M - M.mean(0, keepdim=True)                  # x P M = (x − mean x) M
            c = bx if norm.bias is None else bx + norm.bias.double() @ Wx
            out.append(QKMap(side, head, M, c, norm, qn if side == "q" else kn, rotary))
        return out

    # -- hooks ------------------------------------------------------------------------------------
    def head_inputs(self, resid: Float[Tensor, "batch pos d_model"], into: str) -> Tensor:
        """hook_q (per query head) or hook_k/hook_v (per KV head) from the residual entering the block:
        ln1, then x W + b (pre-rotary, pre-QK-norm, as the hooks hold them)."""
        if into not in ("q", "k", "v"):
            raise QKCircuitsError(f"head_inputs recomputes 'q', 'k' or 'v', got {into!r}")
        w = self.weights()
        W, b = {"q": (w.W_Q, w.b_Q), "k": (w.W_K, w.b_K), "v": (w.W_V, w.b_V)}[into]
        with torch.no_grad():
            x = self.block.ln1(resid)
            out = torch.einsum("bpm,hmd->bphd", x.to(W.dtype), W) + b
        if into != "q" and self.n_kv_heads != self.n_heads:
            out = out[:, :, :: self.n_heads // self.n_kv_heads]
        return out

    # -- cache ------------------------------------------------------------------------------------
    def kv_floats(self) -> Tuple[int, int]:
        """(floats this layer caches per token: K and V of each KV head, its multi-head equivalent)."""
        return 2 * self.n_kv_heads * self.d_qk, 2 * self.n_heads * self.d_qk


def _bias(attn, name: str) -> Optional[Tensor]:
    try:
        return getattr(attn, name)
    except Exception:  # bias-free bridges raise (AttributeError/RuntimeError/...) instead of returning None
        return None


def _hf_config(model):
    return getattr(getattr(model, "original_model", None), "config", None)
