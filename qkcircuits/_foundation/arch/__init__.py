"""One adapter per attention family: ``adapter(model, layer)`` answers what qkcircuits needs of a layer.

>>> from qkcircuits._foundation.arch import adapter, family
>>> family(model)
'standard'
>>> adapter(model, 1).n_heads
2

Families: ``standard`` (multi-head, grouped-query and multi-query attention, with or without rotary or
learned positions, QK-norm, soft-cap, sliding windows, per-layer-type rotary, Gemma's post-norms:
``StandardAttention``) and ``latent`` (multi-head latent attention, DeepSeek-V2/V3: ``LatentAttention``).
A model neither knows fails with one ``QKCircuitsError`` line naming its architecture.
How to add a family: docs/architecture.md, "How to add an architecture".
"""

from __future__ import annotations

from typing import Callable, Dict, List, Tuple, Type

import torch

from ..errors import QKCircuitsError
from ..model_cache import recall, remember, remembered
from .base import AttentionAdapter, LayerWeights
from .latent import LatentAttention
from .standard import StandardAttention

FAMILIES: Dict[str, Type[AttentionAdapter]] = {"standard": StandardAttention, "latent": LatentAttention}
BUILT_IN = tuple(FAMILIES)
# (family, rule): families added by register_family, asked before the built-in rules, newest first
_RULES: List[Tuple[str, Callable[[object], bool]]] = []
WORKS_ON = "multi-head/GQA/MQA attention (GPT-2, GPT-J, GPT-NeoX/Pythia, Llama, Qwen, Gemma, ...) and multi-head latent attention (DeepSeek-V2/V3)"

__all__ = ["AttentionAdapter", "FAMILIES", "LatentAttention", "LayerWeights", "StandardAttention", "adapter",
           "architecture", "family", "prepare", "register_family", "unregister_family"]


def architecture(model) -> str:
    """The model's architecture name (HF ``config.architectures[0]``, else TL's ``cfg.architecture``)."""
    hf_cfg = getattr(getattr(model, "original_model", None), "config", None)
    names = getattr(hf_cfg, "architectures", None)
    if isinstance(names, (list, tuple)) and names:
        return str(names[0])
    return str(getattr(model.cfg, "architecture", None) or type(model).__name__)


def register_family(name: str, adapter_class: type, matches: Callable[[object], bool]) -> None:
    """Add an attention family: ``adapter_class`` (a subclass of ``AttentionAdapter``) answers for every layer of
    a model for which ``matches(model)`` is True (asked before the built-in rules; the latest registration first).
    Registering a name again replaces it; the built-in names are refused. Register before ``qk.load``: a model
    remembers its family once detected. docs/architecture.md, "How to add an architecture"; executed by
    tests/test_recipes.py."""
    if not (isinstance(adapter_class, type) and issubclass(adapter_class, AttentionAdapter)):
        raise QKCircuitsError(f"register_family takes an AttentionAdapter subclass, got {adapter_class!r}")
    if not callable(matches):
        raise QKCircuitsError(f"register_family's matches must be a function of the model, got {matches!r}")
    if name in BUILT_IN:
        raise QKCircuitsError(f"family {name!r} is built in; register yours under another name (a rule decides "
                              f"which models it answers for)")
    FAMILIES[str(name)] = adapter_class
    _RULES[:] = [(n, r) for n, r in _RULES if n != name]
    _RULES.insert(0, (str(name), matches))


def unregister_family(name: str) -> None:
    """Take a registered family out again (its class and its rule; models loaded after it no longer match it).
    The built-in families stay; an unknown name is one line naming the registered ones."""
    if name in BUILT_IN:
        raise QKCircuitsError(f"family {name!r} is built in and stays")
    if name not in FAMILIES:
        added = ", ".join(n for n in FAMILIES if n not in BUILT_IN) or "none"
        raise QKCircuitsError(f"no registered family {name!r}; registered: {added}")
    del FAMILIES[name]
    _RULES[:] = [(n, r) for n, r in _RULES if n != name]


def _detect(model) -> str:
    for name, matches in _RULES:
        if matches(model):
            return name
    attn = model.blocks[0].attn
    try:
        comp = getattr(attn, "original_component", None)
        if hasattr(attn, "hook_kv_latent") or hasattr(comp, "kv_a_proj_with_mqa"):
            return "latent"
        attn.W_Q
        attn.W_O
        _check_head_separable(model)
    except QKCircuitsError:
        raise
    except Exception as e:       # noqa: BLE001  (TL raises NotImplementedError/AttributeError/RuntimeError)
        raise QKCircuitsError(f"qkcircuits has no attention adapter for architecture {architecture(model)} "
                              f"({type(attn).__name__}: {str(e).splitlines()[0][:80] if str(e) else type(e).__name__}); "
                              f"it works on {WORKS_ON}") from None
    return "standard"


def _check_head_separable(model) -> None:
    """Refuse (one line) blocks whose per-head views would be wrong: no norm before the attention (OLMo-2 norms
    the attention's OUTPUT instead; every view here reads W_Q etc. through ln1), or a QK-norm over the whole
    query/key width (OLMo-2's q_norm is [n_heads·d_head]: each head's normed query depends on every head's)."""
    blk, attn = model.blocks[0], model.blocks[0].attn
    if isinstance(blk, torch.nn.Module) and getattr(blk, "ln1", None) is None:      # (duck-typed stand-ins pass)
        raise QKCircuitsError(f"qkcircuits has no adapter for architecture {architecture(model)}: its blocks have no "
                              f"norm before the attention (post-norms only, as OLMo-2); it works on {WORKS_ON}")
    norm = getattr(attn, "q_norm", None)
    weight = getattr(getattr(norm, "original_component", norm), "weight", None)
    d_head = int(getattr(model.cfg, "d_head", 0) or 0)
    # a [heads, d_head] weight (Cohere) normalises each head on its own; a flat [heads·d_head] one (OLMo-2) does not
    if weight is not None and d_head and weight.dim() == 1 and weight.numel() > d_head:
        raise QKCircuitsError(f"qkcircuits has no adapter for architecture {architecture(model)}: its QK-norm spans "
                              f"all heads ({weight.numel()} = heads x d_head, not d_head {d_head}), so a head's query "
                              f"depends on every head's; it works on {WORKS_ON}")


def family(model) -> str:
    """``"standard"``, ``"latent"`` or a registered family's name; cached on the model (its attention modules do
    not change: a record in the model's store, ``model_cache``)."""
    fam = recall(model, "attention family")
    if fam is None:
        fam = _detect(model)
        for layer in range(int(model.cfg.n_layers)):
            FAMILIES[fam](model, layer).prepare()
        remember(model, "attention family", fam)     # a model that takes no weak reference: detected again next time
    return fam


def prepare(model) -> str:
    """Detect the family and fit the hooks to qkcircuits' layout (``qk.load`` calls it); returns the family."""
    return family(model)


def adapters(model) -> Dict[Tuple[str, int], AttentionAdapter]:
    """The adapters made so far for ``model``, by (family, layer): remembered in the model's store
    (``model_cache``; each adapter holds its model weakly, so the store does not keep the model alive)."""
    return remembered(model, "adapters", None, dict)


def adapter(model, layer: int = 0) -> AttentionAdapter:
    """The adapter of ``layer``'s attention (``layer`` checked against the model's layers)."""
    n = int(model.cfg.n_layers)
    if isinstance(layer, bool) or not 0 <= int(layer) < n:
        raise QKCircuitsError(f"layer {layer!r} is out of range: the model has layers 0-{n - 1}")
    cache = adapters(model)
    key: Tuple[str, int] = (family(model), int(layer))
    if key not in cache:
        cache[key] = FAMILIES[key[0]](model, int(layer))
    return cache[key]
