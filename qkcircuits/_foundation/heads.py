"""Heads as values: ``Head(layer, head)``, parsed from text, checked against a model.

>>> Head.parse("5.1")
Head(layer=5, head=1)
>>> Head.parse("L5H1") == Head(5, 1)
True
>>> parse_heads("5.1, 5.5, 7.0-2")
[Head(layer=5, head=1), Head(layer=5, head=5), Head(layer=7, head=0), Head(layer=7, head=1), Head(layer=7, head=2)]
>>> parse_heads("L1H*", n_heads=3)
[Head(layer=1, head=0), Head(layer=1, head=1), Head(layer=1, head=2)]
>>> kv_head(7, n_heads=9, n_kv_heads=3)   # grouped-query attention: 3 query heads per KV head
2
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence, Union

from .errors import QKCircuitsError
from .arch.model import n_kv_heads as kv_heads_of

_DOT = re.compile(r"^\s*(\d+)\s*\.\s*(\d+|\*)(?:\s*-\s*(\d+))?\s*$")
_LH = re.compile(r"^\s*[Ll]\s*(\d+)\s*[Hh]\s*(\d+|\*)(?:\s*-\s*(\d+))?\s*$")
_ACCEPTED = "'5.1', 'L5H1', '5.*', '5.0-3' or a comma-separated list of these"


@dataclass(frozen=True, order=True)
class Head:
    """One attention head: ``layer`` and query-head index ``head`` (both 0-based)."""

    layer: int
    head: int

    def __str__(self) -> str:
        return f"{self.layer}.{self.head}"

    @classmethod
    def parse(cls, text: Union[str, "Head", Sequence[int]]) -> "Head":
        """One head from ``"5.1"``, ``"L5H1"``, ``(5, 1)`` or a ``Head``."""
        heads = parse_heads(text)
        if len(heads) != 1:
            raise QKCircuitsError(f"expected one head, got {len(heads)} from {text!r}")
        return heads[0]


HeadsLike = Union[str, Head, Sequence[int], Iterable[Union[str, Head, Sequence[int]]]]


def parse_heads(spec: HeadsLike, *, n_heads: Optional[int] = None) -> List[Head]:
    """Heads from text (``"5.1,L6H9,7.0-2,8.*"``), a ``Head``, a ``(layer, head)`` pair or a list of those.

    ``"L.*"`` needs ``n_heads``. Order is kept, duplicates dropped.
    """
    out: List[Head] = []
    for item in _items(spec):
        if isinstance(item, Head):
            out.append(item)
            continue
        if isinstance(item, (tuple, list)) and len(item) == 2 and all(isinstance(x, int) for x in item):
            out.append(Head(int(item[0]), int(item[1])))
            continue
        if not isinstance(item, str):
            raise QKCircuitsError(f"cannot read a head from {item!r}; use {_ACCEPTED}")
        m = _DOT.match(item) or _LH.match(item)
        if not m:
            raise QKCircuitsError(f"cannot read a head from {item!r}; use {_ACCEPTED}")
        layer, first, last = int(m.group(1)), m.group(2), m.group(3)
        if first == "*":
            if n_heads is None:
                raise QKCircuitsError(f"head spec {item!r} needs the model's head count to expand '*'")
            out.extend(Head(layer, h) for h in range(n_heads))
        else:
            stop = int(last) if last is not None else int(first)
            if stop < int(first):
                raise QKCircuitsError(f"head range {item!r} runs backwards; write it as {layer}.{stop}-{first}")
            out.extend(Head(layer, h) for h in range(int(first), stop + 1))
    seen, unique = set(), []
    for h in out:
        if h not in seen:
            seen.add(h)
            unique.append(h)
    return unique


def _items(spec: object) -> list:   # anything: parse_heads names what it cannot read
    if isinstance(spec, str):
        return [s for s in spec.split(",") if s.strip()]
    if isinstance(spec, Head):
        return [spec]
    if isinstance(spec, (tuple, list)) and len(spec) == 2 and all(isinstance(x, int) for x in spec):
        return [tuple(spec)]
    if not isinstance(spec, Iterable):
        return [spec]  # parse_heads reports it as unreadable (a one-line error, not a TypeError)
    items: list = []
    for s in spec:
        items.extend(_items(s) if isinstance(s, str) else [s])
    return items


def check_heads(heads: Iterable[Head], n_layers: int, n_heads: int) -> List[Head]:
    """Raise a one-line error for the first head outside ``n_layers × n_heads``; else return the list."""
    heads = list(heads)
    for h in heads:
        if not (0 <= h.layer < n_layers and 0 <= h.head < n_heads):
            raise QKCircuitsError(f"head {h} is out of range: the model has layers 0-{n_layers - 1} and heads "
                                  f"0-{n_heads - 1} per layer")
    return heads


def model_heads(model, spec: HeadsLike) -> List[Head]:
    """Parse ``spec`` and validate it against ``model.cfg`` (``n_layers``, ``n_heads``)."""
    heads = check_heads(parse_heads(spec, n_heads=model.cfg.n_heads), model.cfg.n_layers, model.cfg.n_heads)
    if not heads:
        raise QKCircuitsError(f"no heads given in {spec!r}; name at least one, e.g. '0.0' or 'L0H0'")
    return heads


def n_kv_heads(model) -> int:
    """Number of key/value heads per layer (== ``n_heads`` without grouped-query attention)."""
    return kv_heads_of(model)


def kv_head(head: int, n_heads: int, n_kv_heads: int) -> int:
    """The KV head that query head ``head`` reads: ``head // (n_heads // n_kv_heads)`` (HF ``repeat_kv`` order)."""
    if n_heads % n_kv_heads:
        raise QKCircuitsError(f"n_heads={n_heads} is not a multiple of n_kv_heads={n_kv_heads}")
    return head // (n_heads // n_kv_heads)


def all_heads(n_layers: int, n_heads: int) -> List[Head]:
    return [Head(layer, h) for layer in range(n_layers) for h in range(n_heads)]
