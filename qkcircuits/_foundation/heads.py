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

MAX_DIGITS = 6        # a layer or head index has at most this many digits (no model comes near 10**6)
MAX_RANGE = 4096      # heads one range may name when the model's shape is not known


def _short(text: str, n: int = 40) -> str:
    return text if len(text) <= n else text[:n] + "..."


def _spec_parts(item: str):
    """``(layer, first, last)`` of one text item, with ``first`` ``"*"`` or an int and ``last`` an int or None;
    nothing is expanded, and no number longer than ``MAX_DIGITS`` is converted."""
    m = _DOT.match(item) or _LH.match(item)
    if not m:
        raise QKCircuitsError(f"cannot read a head from {_short(item)!r}; use {_ACCEPTED}")
    for g in m.groups():
        if g is not None and len(g) > MAX_DIGITS:
            raise QKCircuitsError(f"head spec {_short(item.strip())!r} has a {len(g)}-digit number; a layer or head "
                                  f"index has at most {MAX_DIGITS} digits")
    layer, first, last = int(m.group(1)), m.group(2), m.group(3)
    first = first if first == "*" else int(first)
    last = None if last is None else int(last)
    if first == "*" and last is not None:
        raise QKCircuitsError(f"cannot read a head from {_short(item)!r}; use {_ACCEPTED}")
    if last is not None and last < first:
        raise QKCircuitsError(f"head range {item.strip()!r} runs backwards; write it as {layer}.{last}-{first}")
    return layer, first, last


def check_head_spec(text: str) -> str:
    """``text`` if it reads as heads (syntax only: nothing expanded, no model needed), else a one-line error.
    The CLI's ``--head``/``--heads``/``--receivers`` use it as their argparse ``type`` (exit 2 before the model
    loads).

    >>> check_head_spec("5.1,L6H*")
    '5.1,L6H*'
    """
    items = _items(text)
    if not items:
        raise QKCircuitsError(f"no heads given in {_short(str(text))!r}; name at least one, e.g. '0.0' or 'L0H0'")
    for item in items:
        layer, first, last = _spec_parts(item)
        if last is not None and last - first + 1 > MAX_RANGE:
            raise QKCircuitsError(f"head range {item.strip()!r} names {last - first + 1} heads; at most {MAX_RANGE}")
    return text


def parse_heads(spec: HeadsLike, *, n_heads: Optional[int] = None, n_layers: Optional[int] = None) -> List[Head]:
    """Heads from text (``"5.1,L6H9,7.0-2,8.*"``), a ``Head``, a ``(layer, head)`` pair or a list of those.

    ``"L.*"`` needs ``n_heads``. Order is kept, duplicates dropped. With ``n_layers``/``n_heads`` a range is
    checked by its ends against the shape BEFORE it is expanded; without them a range is limited to ``MAX_RANGE``
    heads, and every index to ``MAX_DIGITS`` digits (``"1.0-99999999"`` is one line, at once).
    """
    out: List[Head] = []
    for item in _items(spec):
        if isinstance(item, Head):
            out.append(item)
            continue
        if isinstance(item, (tuple, list)) and len(item) == 2 and all(isinstance(x, int) and not isinstance(x, bool)
                                                                        for x in item):
            out.append(Head(int(item[0]), int(item[1])))
            continue
        if not isinstance(item, str):
            raise QKCircuitsError(f"cannot read a head from {_short(repr(item))}; use {_ACCEPTED}")
        layer, first, last = _spec_parts(item)
        if first == "*":
            if n_heads is None:
                raise QKCircuitsError(f"head spec {item!r} needs the model's head count to expand '*'")
            first, last = 0, n_heads - 1
        last = first if last is None else last
        if n_layers is not None and n_heads is not None:
            for h in (first, last):            # the ends, checked before anything is built
                check_heads([Head(layer, h)], n_layers, n_heads)
        elif last - first + 1 > MAX_RANGE:
            raise QKCircuitsError(f"head range {item.strip()!r} names {last - first + 1} heads; at most {MAX_RANGE}")
        out.extend(Head(layer, h) for h in range(first, last + 1))
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
    from .args import require_model

    require_model(model)                  # None, a spec string, a task ...: one line (arch.model_facts.is_model decides)
    L, H = int(model.cfg.n_layers), int(model.cfg.n_heads)
    heads = check_heads(parse_heads(spec, n_heads=H, n_layers=L), L, H)
    if not heads:
        raise QKCircuitsError(f"no heads given in {_short(repr(spec))}; name at least one, e.g. '0.0' or 'L0H0'")
    return heads


def n_kv_heads(model) -> int:
    """Number of key/value heads per layer (== ``n_heads`` without grouped-query attention)."""
    from .arch.model_facts import n_kv_heads as kv_heads_of       # here: parsing heads (the CLI's argparse) needs no torch

    return kv_heads_of(model)


def kv_head(head: int, n_heads: int, n_kv_heads: int) -> int:
    """The KV head that query head ``head`` reads: ``head // (n_heads // n_kv_heads)`` (HF ``repeat_kv`` order)."""
    if n_heads % n_kv_heads:
        raise QKCircuitsError(f"n_heads={n_heads} is not a multiple of n_kv_heads={n_kv_heads}")
    return head // (n_heads // n_kv_heads)


def all_heads(n_layers: int, n_heads: int) -> List[Head]:
    return [Head(layer, h) for layer in range(n_layers) for h in range(n_heads)]
