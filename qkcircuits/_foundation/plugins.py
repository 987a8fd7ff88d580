"""Plugins from installed packages' entry points, loaded whole or not at all (``load_entry_points``): the one rule
the detector registry (``qkcircuits.detectors``) and the task registry (``qkcircuits.tasks``) share.

>>> from types import SimpleNamespace as NS
>>> reg, by_entry = {}, {}
>>> class Item:
...     def __init__(self, name): self.name = name
>>> ep = NS(name="mine", value="pkg:items", load=lambda: [Item("a"), Item("b")])
>>> load_entry_points([ep], Item, "Item", "item", reg, by_entry, lambda x: reg.__setitem__(x.name, x))
['a', 'b']
>>> sorted(reg), by_entry
(['a', 'b'], {'mine = pkg:items': ['a', 'b']})

An entry point's object is an item, a list of items, or a function returning either. A plugin that fails to load,
gives anything but items of ``kind``, or names an item another plugin or the built-ins hold, is skipped whole with
one warning naming it (its other items are not added either); loading the same entry point again replaces its own
items. The caller holds its registry's lock around the call.
"""

from __future__ import annotations

import warnings
from typing import Callable, Dict, Iterable, List

from .errors import QKCircuitsError


def load_entry_points(entry_points: Iterable, kind: type, kind_name: str, what: str, registry: Dict[str, object],
                      by_entry: Dict[str, List[str]], add: Callable[[object], None]) -> List[str]:
    """Add each entry point's items of ``kind`` with ``add`` (module docstring); returns the names added.
    ``registry``: name → item (to see what is taken); ``by_entry``: "name = value" → the names that entry point
    added (updated)."""
    names: List[str] = []
    for ep in entry_points:
        key = f"{ep.name} = {ep.value}"
        own = set(by_entry.get(key, ()))
        try:
            obj = ep.load()
            found = obj() if callable(obj) and not isinstance(obj, kind) else obj
            items = [found] if isinstance(found, kind) else list(found)
            bad = [x for x in items if not isinstance(x, kind)]
            if bad:
                raise QKCircuitsError(f"it gave {type(bad[0]).__name__}, not a {kind_name}")
            taken = [x.name for x in items if x.name in registry and x.name not in own]
            if taken:
                raise QKCircuitsError(f"{what} {taken[0]!r} is already registered")
            for x in items:
                add(x)
        except Exception as e:  # noqa: BLE001  a third party's bug: say which plugin, keep the rest
            warnings.warn(f"qkcircuits: the {what} plugin {ep.name!r} ({ep.value}) was not loaded: "
                          f"{type(e).__name__}: {e}", stacklevel=3)
            continue
        by_entry[key] = [x.name for x in items]
        names += [x.name for x in items]
    return names
