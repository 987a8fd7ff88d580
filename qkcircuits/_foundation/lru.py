"""A size-bounded mapping that forgets the least recently used entry: what long-running views cache in.

>>> c = LRU(2)
>>> c["a"], c["b"] = 1, 2
>>> _ = c["a"]           # "a" is now the most recent
>>> c["c"] = 3           # "b" goes
>>> sorted(c)
['a', 'c']
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Hashable, Iterator


class LRU:
    """At most ``maxsize`` entries; reading or writing an entry makes it the most recent. Thread-safe."""

    def __init__(self, maxsize: int = 32):
        if isinstance(maxsize, bool) or not isinstance(maxsize, int) or maxsize < 1:
            raise ValueError(f"maxsize must be a positive integer, got {maxsize!r}")
        self.maxsize = maxsize
        self._data: "OrderedDict[Hashable, Any]" = OrderedDict()
        self._lock = threading.Lock()

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._data

    def __getitem__(self, key: Hashable) -> Any:
        with self._lock:
            self._data.move_to_end(key)
            return self._data[key]

    def __setitem__(self, key: Hashable, value: Any) -> None:
        with self._lock:
            self._data[key] = value
            self._data.move_to_end(key)
            while len(self._data) > self.maxsize:
                self._data.popitem(last=False)

    def __len__(self) -> int:
        return len(self._data)

    def __iter__(self) -> Iterator[Hashable]:
        return iter(list(self._data))
