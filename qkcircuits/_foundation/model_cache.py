"""What qkcircuits remembers about a model, in ONE place, with one rule for when it is stale.

>>> calls = []
>>> def pool():
...     calls.append(1)
...     return "the token pool"
>>> remembered(model, "doc: pool", ("bos", 0), pool), remembered(model, "doc: pool", ("bos", 0), pool)
('the token pool', 'the token pool')
>>> len(calls)                                    # computed once per model, name and key
1
>>> stats = remembered(model, "doc: stats", None, lambda: object(), depends="weights")
>>> stats is remembered(model, "doc: stats", None, lambda: object(), depends="weights")
True
>>> with torch.no_grad():
...     _ = model.W_E.mul_(1.0)                   # an in-place edit, even one that changes no value
>>> stats is remembered(model, "doc: stats", None, lambda: object(), depends="weights")   # stale: made again
False

**The store.** One ``WeakKeyDictionary`` from a model to its entries: everything remembered goes with the model
(no model is kept alive by a cache, and nothing is written onto the model object). A model that takes no weak
reference gets nothing remembered: each call computes.

**The invalidation rule.** An entry names what it was computed from (``depends``):

- ``None`` (records and caches of things that do not change for a loaded model: its tokenizer's decodings and
  token pool, how it was loaded, which cached GGUF conversion it came from): kept while the model lives.
- ``"weights"``: kept while every parameter of the model is the same tensor, unchanged in place. Its stamp is
  (``data_ptr``, ``_version``, shape, dtype) per parameter: torch bumps ``_version`` on every in-place write
  (``W.mul_``, ``W[...] = ``, ``copy_``, an optimiser step), and a replaced parameter has new storage. An entry
  whose stamp differs is computed again, and the stale one is dropped.
- ``"embed"``: the same rule on the embedding ``W_E`` alone (caches of embedding rows only).

Hooks are not weights: a value computed while hooks were active (inside ``qk.edit``) includes their effect, so
functions that run the model for a cache (``corpus_stats``) say so and run outside edits where they can.
``forget(model)`` drops everything remembered of a model (``forget(model, name)``: one name).

Who keeps what here (each entry's name): ``token pool`` (sequences.token_pool), ``load spec`` and
``gguf conversion`` (model.load, gguf_cache), ``own tokenizer`` (own_tokenizer.affixes), ``decoded tokens``
(_explain.attribution), ``corpus stats`` (_weights.contextual), ``mean embed row`` (_weights.rotary),
``view context`` (qk.plot), ``scan: ov_copying`` and ``scan: eigen_copying`` (_analysis.detect).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Dict, Hashable, Optional, Tuple

from .errors import QKCircuitsError

DEPENDS = (None, "weights", "embed")

# model -> {(name, key): (stamp, value)}
_STORE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_LOCK = threading.RLock()


def _tensor_stamp(t) -> Tuple:
    return (t.data_ptr(), t._version, tuple(t.shape), str(t.dtype))


def stamp(model, depends: Optional[str]) -> Optional[Tuple]:
    """What an entry made now would be valid for (module docstring: the rule)."""
    if depends is None:
        return None
    if depends == "embed":
        return _tensor_stamp(model.W_E.detach())
    if depends == "weights":
        import torch                             # not at import: the CLI's parser imports this module's users

        if not isinstance(model, torch.nn.Module):    # not a torch module: its embedding is what the views read
            return _tensor_stamp(model.W_E.detach())
        return tuple(_tensor_stamp(p) for p in model.parameters())
    raise QKCircuitsError(f"depends must be one of None, 'weights', 'embed', got {depends!r}")


def _entries(model) -> Optional[Dict]:
    try:
        return _STORE.setdefault(model, {})
    except TypeError:                            # a model that takes no weak reference: nothing is remembered
        return None


def remembered(model, name: str, key: Hashable, compute: Callable[[], Any], *, depends: Optional[str] = None) -> Any:
    """``compute()`` for ``model`` under ``(name, key)``, computed once and kept while it is valid (``depends``).

    Memory: whatever ``compute`` returns, per model, name and key, until the model goes or the entry is stale.
    """
    if depends not in DEPENDS:
        raise QKCircuitsError(f"depends must be one of None, 'weights', 'embed', got {depends!r}")
    entries = _entries(model)
    if entries is None:
        return compute()
    now = stamp(model, depends)
    with _LOCK:
        got = entries.get((name, key))
        if got is not None and got[0] == now:
            return got[1]
    value = compute()                            # outside the lock: a long computation blocks no other model
    with _LOCK:
        for old in [k for k, (s, _) in entries.items() if k[0] == name and s != now]:
            del entries[old]                     # entries of this name made from older weights
        entries[(name, key)] = (now, value)
    return value


def remember(model, name: str, value: Any) -> None:
    """Record ``value`` for ``model`` under ``name`` for as long as the model lives (``depends=None``)."""
    entries = _entries(model)
    if entries is not None:
        with _LOCK:
            entries[(name, None)] = (None, value)


def recall(model, name: str, default: Any = None) -> Any:
    """What ``remember`` recorded for ``model`` under ``name``, else ``default``."""
    try:
        entries = _STORE.get(model)
    except TypeError:
        return default
    got = None if entries is None else entries.get((name, None))
    return default if got is None else got[1]


def forget(model, name: Optional[str] = None) -> None:
    """Drop what is remembered of ``model`` (every entry, or those under ``name``)."""
    try:
        entries = _STORE.get(model)
    except TypeError:
        return
    if entries is None:
        return
    with _LOCK:
        for k in [k for k in entries if name is None or k[0] == name]:
            del entries[k]


def names(model) -> Dict[str, int]:
    """{name: entries} remembered of ``model`` (what a memory question about a session looks at first)."""
    try:
        entries = _STORE.get(model) or {}
    except TypeError:
        return {}
    out: Dict[str, int] = {}
    for name, _ in list(entries):
        out[name] = out.get(name, 0) + 1
    return out
