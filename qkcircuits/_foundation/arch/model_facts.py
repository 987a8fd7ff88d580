"""Model-wide architecture facts, asked of the model in one place (the per-layer ones are the adapters').

>>> from qkcircuits._foundation.arch import model_facts as M
>>> M.positional(model), M.learned_positions(model), M.n_kv_heads(model), M.parallel_blocks(model)
('standard', True, 2, False)
>>> M.is_model(model), M.is_model("toy-induction")
(True, False)

Every other module asks these functions (or ``adapter(model, layer)``) instead of probing modules and configs
itself; tests/test_arch_probes.py counts the probes left outside ``_foundation/arch``.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from ..errors import QKCircuitsError


def is_model(obj) -> bool:
    """A loaded model (a TransformerLens bridge or native model): it has ``cfg`` and ``blocks``."""
    return hasattr(obj, "cfg") and hasattr(obj, "blocks")


def has_config(obj) -> bool:
    """Whether ``obj`` carries a model config (``cfg``): enough for views that only need the model's shape."""
    return hasattr(obj, "cfg")


def positional(model) -> str:
    """TransformerLens' positional embedding type: "standard" (learned absolute), "rotary", "shortformer",
    "alibi", ..."""
    return str(getattr(model.cfg, "positional_embedding_type", "standard"))


def learned_positions(model) -> bool:
    """Whether the model adds a learned absolute position embedding (``W_pos``; GPT-2, GPT-Neo)."""
    return positional(model) in ("standard", "shortformer") and hasattr(model, "W_pos")


def folded(model) -> bool:
    """Whether ``qk.load(fold_ln=True)`` folded the norms into the next weights (TransformerLens' compatibility
    mode; never into multi-head latent attention, which TransformerLens cannot fold)."""
    return bool(getattr(model, "compatibility_mode", False)) and not hasattr(model.blocks[0].attn, "hook_kv_latent")


def n_kv_heads(model) -> int:
    """Key/value heads per layer (== ``n_heads`` without grouped-query attention)."""
    return int(getattr(model.cfg, "n_key_value_heads", None) or model.cfg.n_heads)


def model_name(model) -> str:
    return str(getattr(model.cfg, "model_name", None) or "model")


def has_mlps(model) -> bool:
    """Whether every block has an MLP (attention-only models have none)."""
    return all(getattr(b, "mlp", None) is not None for b in model.blocks)


def parallel_blocks(model) -> bool:
    """Whether every block's MLP reads the block's input residual, as its attention does (GPT-J, GPT-NeoX with
    ``use_parallel_residual``, Phi-1/2, Falcon): TransformerLens says so in ``cfg.parallel_attn_mlp`` and
    wraps such blocks in ``ParallelBlockBridge`` (which has no ``hook_resid_mid``)."""
    kinds = {type(b).__name__ == "ParallelBlockBridge" for b in model.blocks}
    if len(kinds) > 1:
        raise QKCircuitsError("this model mixes parallel and sequential blocks; the circuit graph needs one kind")
    return bool(getattr(model.cfg, "parallel_attn_mlp", False)) or kinds == {True}


def mlp_input(model, layer: int, resid: Tensor) -> Tensor:
    """What MLP ``layer`` reads (``mlp.hook_in``) from a residual: its ln2 recomputed (GPT-J's parallel block has
    one norm, ln1, for its attention and its MLP)."""
    blk = model.blocks[layer]
    ln2 = getattr(blk, "ln2", None)
    return (ln2 if ln2 is not None else blk.ln1)(resid)


def mlp_module(model, layer: int) -> Optional[torch.nn.Module]:
    """Block ``layer``'s MLP where TransformerLens wraps it as one bridge with ``hook_in``/``hook_out``
    (``MLPBridge``, ``GatedMLPBridge``: a run that knows its output may skip it), else None."""
    mlp = getattr(model.blocks[layer], "mlp", None)
    return mlp if type(mlp).__name__ in ("MLPBridge", "GatedMLPBridge") else None


# attention bridges that return (attn_output, attn_weights) and whose callers (transformers' decoder layers
# through TransformerLens' block bridges) read only attn_output: checked for GPT-2, Llama, Gemma-3, GPT-NeoX,
# GPT-J and DeepSeek's latent attention in tests/test_circuit_scores.py, SmolLM3 (its NoPE-aware subclass),
# Cohere and GPT-Neo in tests/test_more_families.py. Exact class names: a subclass may change what it returns.
KNOWN_ATTENTION = ("AttentionBridge", "JointQKVAttentionBridge", "PositionEmbeddingsAttentionBridge",
                   "JointQKVPositionEmbeddingsAttentionBridge", "MLAAttentionBridge", "_SmolLM3AttentionBridge")




def replaceable_attention(model, layer: int) -> Optional[torch.nn.Module]:
    """Block ``layer``'s attention bridge when it is one of ``KNOWN_ATTENTION`` (a run that knows its output may
    return ``(output, None)`` in its place), else None."""
    attn = model.blocks[layer].attn
    return attn if type(attn).__name__ in KNOWN_ATTENTION else None


def default_bos_id(model) -> Optional[int]:
    """The BOS id TransformerLens prepends when the tokenizer names none (``cfg.default_prepend_bos_token_id``)."""
    v = getattr(model.cfg, "default_prepend_bos_token_id", None)
    return v if isinstance(v, int) else None


def final_norm_module(model) -> Optional[torch.nn.Module]:
    """The norm in front of the unembedding (``ln_final``), or None."""
    return getattr(model, "ln_final", None)


def post_norm_module(model, layer: int) -> Optional[torch.nn.Module]:
    """The norm block ``layer`` applies to its attention output before adding it (Gemma's ``ln1_post``), or None:
    the module itself, for replaying it exactly (``adapter(model, layer).post_norm()`` describes it)."""
    return getattr(model.blocks[layer], "ln1_post", None)


def logits_transform(model) -> Optional[Callable[[Tensor], Tensor]]:
    """The transform the model's forward applies after the unembedding (Gemma-2's final soft-cap
    ``cap · tanh(logits / cap)``; TransformerLens' ``adapter.apply_output_logits_transform``), or None."""
    transform = getattr(getattr(model, "adapter", None), "apply_output_logits_transform", None)
    return transform if callable(transform) else None


def hf_config(model):
    """The wrapped Hugging Face model's config, or None (TL-native models)."""
    return getattr(getattr(model, "original_model", None), "config", None)


def rope_type(model) -> str:
    """The rotary scaling type ("default", "yarn", "dynamic", "longrope", ...)."""
    rope = getattr(model.cfg, "rope_parameters", None) or getattr(hf_config(model), "rope_parameters", None) or {}
    return str(rope.get("rope_type", "default")) if isinstance(rope, dict) else "default"


# the config fields a fingerprint records (``_foundation/fingerprint.py``); None where the config has none
SHAPE_CONFIG = ("n_layers", "n_heads", "d_model", "d_head", "d_mlp", "d_vocab", "n_ctx", "normalization_type",
                "rotary_dim")


def shape_config(model) -> dict:
    """``{name: value}`` of ``SHAPE_CONFIG`` as the model's config holds them (None where absent), plus
    ``n_kv_heads`` and ``positional``; and the shapes of the embedding, unembedding and (learned) position
    matrices as the model holds them now (``W_E``, ``W_U``, ``W_pos``: views, nothing copied)."""
    cfg = model.cfg
    out = {}
    for name in SHAPE_CONFIG:
        v = getattr(cfg, name, None)
        out[name] = v if v is None or isinstance(v, (bool, str)) else int(v) if float(v).is_integer() else float(v)
    out["n_kv_heads"] = n_kv_heads(model)
    out["positional"] = positional(model)
    out["W_E"] = [int(n) for n in model.W_E.shape]
    out["W_U"] = [int(n) for n in model.W_U.shape]
    out["W_pos"] = [int(n) for n in model.W_pos.shape] if learned_positions(model) else None
    return out
