"""What a model's tokenizer adds around a text on its own (``tokenizer(text)``, default special tokens).

>>> special_affixes(bos_tokenizer)      # doctest: +SKIP (a tokenizer that puts BOS id 0 first: tests/test_task_bos.py)
{'prefix': [0], 'suffix': []}
>>> own_affixes(smollm2)                # doctest: +SKIP (needs SmolLM2: tests/test_doc_claims.py checks it)
{'prefix': [], 'suffix': [], 'source': "the checkpoint's tokenizer"}

TransformerLens is no guide: it reloads the tokenizer with ``add_bos_token=True`` where it can
(``get_tokenizer_with_bos``; a Hugging Face folder's: then a bridge's ``model.tokenizer(text)`` starts with BOS
whatever the checkpoint's tokenizer does), and its ``cfg.default_prepend_bos`` is True for SmolLM2, whose
tokenizer adds none (its ``<|im_start|>`` is a chat marker
that lowers the IOI logit difference from 4.35 to 3.23). So ``qk.load`` reads the tokenizer the checkpoint
ships (before TransformerLens touches it) and records what it adds (``model_cache.recall(model, "own tokenizer")``); the task
builders' ``prepend_bos=None`` follows that.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional

from . import model_cache

PROBE = "attention heads move information"
ATTR = "own tokenizer"          # its name in the model's store (model_cache)


def special_affixes(tokenizer, text: str = PROBE) -> Dict[str, List[int]]:
    """The ids ``tokenizer(text)`` puts before (``prefix``: a BOS, a [CLS]) and after (``suffix``: an EOS) the
    ids of ``text`` itself (``add_special_tokens=False``)."""
    own = list(tokenizer(text)["input_ids"])
    plain = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    for k in range(len(own) - len(plain) + 1):
        if own[k:k + len(plain)] == plain:
            return {"prefix": own[:k], "suffix": own[k + len(plain):]}
    # the special tokens changed how the text itself tokenizes (not seen in practice): keep its leading specials
    specials = set(getattr(tokenizer, "all_special_ids", None) or [])
    lead = []
    for t in own:
        if t not in specials:
            break
        lead.append(t)
    return {"prefix": lead, "suffix": []}


def read(load: Callable[[], object], source: str) -> Optional[Dict[str, object]]:
    """``special_affixes`` of the tokenizer ``load()`` returns, with where it came from; None when it cannot be
    loaded (no tokenizer files, offline without a cache ...)."""
    try:
        tok = load()
    except Exception:  # any loader failure means "unknown here": the caller falls back
        return None
    if tok is None:
        return None
    return {**special_affixes(tok), "source": source}


def own_affixes(model) -> Dict[str, object]:
    """What ``model``'s tokenizer adds on its own: what ``qk.load`` recorded from the checkpoint's tokenizer;
    for a bridge built elsewhere, its tokenizer reloaded from ``name_or_path`` without TransformerLens'
    ``add_bos_token=True`` (offline), else its tokenizer as it is (which may carry TransformerLens' BOS: said in
    ``source``). A model without a tokenizer adds nothing."""
    known = model_cache.recall(model, ATTR)
    if isinstance(known, dict):
        return known
    tok = getattr(model, "tokenizer", None)
    if tok is None:
        return {"prefix": [], "suffix": [], "source": "no tokenizer"}
    name = getattr(tok, "name_or_path", None)
    got = None
    if name:
        def reload():
            from transformers import AutoTokenizer

            from .offline import hub_offline

            with hub_offline():
                return AutoTokenizer.from_pretrained(name)
        got = read(reload, f"the tokenizer of {name!r} as saved")
    if got is None:
        got = {**special_affixes(tok), "source": "the bridge's tokenizer (TransformerLens may have set add_bos_token)"}
    model_cache.remember(model, ATTR, got)     # a model that takes no weak reference: computed again next time
    return got
