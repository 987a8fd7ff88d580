"""Short ``__repr__`` and a small ``_repr_html_`` for every result type: the top heads per label and a compact grid.

>>> scores = qk.scan(model, scores="induction,previous_token", progress=False)
>>> scores                           # the repr: per label, how many heads reach it and the top heads
HeadScores(hand-built-induction: 2 layers x 2 heads; scores induction, previous_token; induction: 1 head >= 0.4, top 1.0 (1), ...; previous-token: 1 head >= 0.4, top 0.0 (1), ...)
>>> scores._repr_html_().startswith("<style>")      # what display(scores) shows in a notebook: tables and grids
True

Each result class inherits ``Displayed`` (``__repr__`` = ``self._text()``, ``_repr_html_`` = ``self._html()``)
and renders itself with the shared helpers here (``grid``, ``top_heads``, ``table``, ``box``, ``number``); this
module knows no result class and imports nothing heavier than torch (no plotly: a repr must not load the
plotting stack).

Size bound: a grid draws one 9-px cell per head (``<i>`` with a colour and a hover title, ~53 bytes) for at
most ``MAX_CELLS`` heads; bigger models show the per-layer maximum instead (one cell per layer, said so);
at most ``MAX_GRIDS`` grids per result and ``TOP`` heads per table. So one result's HTML stays under
``MAX_GRIDS`` × ``MAX_CELLS`` × 53 B + tables ≈ 125 kB whatever the model (tests/test_display.py checks
130 kB at 768 heads and on an 80 × 64-head result); a 30 × 9-head scan is ~45 kB. No script, no external
resource: plain HTML and CSS.
"""

from __future__ import annotations

import html as _html
import math
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

MAX_CELLS = 768      # heads drawn per grid; above it, one cell per layer (the layer's maximum)
MAX_GRIDS = 3        # grids per result
TOP = 5              # heads per table row / list

CSS = ("<style>.qk-r{font:12px/1.35 system-ui,sans-serif;color:#222}.qk-r table{border-collapse:collapse;margin:4px 0}"
       ".qk-r td,.qk-r th{padding:1px 8px;border-bottom:1px solid #eee;text-align:left}"
       ".qk-r .g{display:inline-grid;gap:1px;margin:2px 12px 6px 0;vertical-align:top}"
       ".qk-r .g i{width:9px;height:9px;display:block}.qk-r .m{color:#666}</style>")


def number(x, digits: int = 4) -> str:
    """A short number: 4 decimals, trailing zeros dropped; 3 significant digits when tiny or huge; "nan"."""
    x = float(x)
    if math.isnan(x):
        return "nan"
    if x != 0 and (abs(x) >= 1e4 or abs(x) < 1e-3):
        return f"{x:.3g}"
    return f"{x:.{digits}f}".rstrip("0").rstrip(".")


def escape(s) -> str:
    return _html.escape(str(s), quote=True)


def _colour(v: float, lo: float, hi: float, signed: bool) -> str:
    """White → blue (unsigned, lo..hi) or blue ← white → red (signed, centred at 0); NaN light grey."""
    if math.isnan(v):
        return "#eeeeee"
    if signed:
        m = max(abs(lo), abs(hi)) or 1.0
        a = max(-1.0, min(1.0, v / m))
        r, g, b = (255, int(255 * (1 - a)), int(255 * (1 - a))) if a >= 0 else \
            (int(255 * (1 + a)), int(255 * (1 + a)), 255)
        return f"#{r:02x}{g:02x}{b:02x}"
    a = 0.0 if hi <= lo else max(0.0, min(1.0, (v - lo) / (hi - lo)))
    return f"#{int(255 - 215 * a):02x}{int(255 - 155 * a):02x}{int(255 - 75 * a):02x}"


def grid(t: Tensor, title: str, signed: Optional[bool] = None) -> str:
    """A compact layer × head heatmap of ``t`` [L, H] (layers top to bottom), or per-layer maxima past ``MAX_CELLS``."""
    t = t.detach().float().cpu()
    L, H = t.shape
    note = ""
    if L * H > MAX_CELLS:
        t = torch.nan_to_num(t, nan=-math.inf).amax(1, keepdim=True)
        t[t == -math.inf] = math.nan
        note = f" (per-layer max: {L} × {H} heads is over {MAX_CELLS} cells)"
    finite = t[~t.isnan()]
    lo, hi = (float(finite.min()), float(finite.max())) if finite.numel() else (0.0, 1.0)
    signed = lo < 0 if signed is None else signed
    cols = t.shape[1]
    cells = []
    for layer, row in enumerate(t.tolist()):
        for head, v in enumerate(row):
            name = f"{layer}.{head}" if cols == H else f"L{layer}"      # L7: layer 7, its maximum
            cells.append(f'<i style=background:{_colour(v, lo, hi, signed)} title="{name} {number(v)}"></i>')
    return (f'<div style="display:inline-block;vertical-align:top"><div class="m">{escape(title)}{escape(note)} '
            f'[{number(lo)} … {number(hi)}]</div><div class="g" style="grid-template-columns:repeat({cols},9px)">'
            f'{"".join(cells)}</div></div>')


def top_heads(t: Tensor, k: int = TOP, by_abs: bool = False) -> List[Tuple[str, float]]:
    """The ``k`` heads with the largest value (or magnitude) of ``t`` [L, H], NaN last, as ("L.H", value)."""
    key = t.detach().float().abs() if by_abs else t.detach().float()
    key = torch.nan_to_num(key, nan=-math.inf).flatten()
    H = t.shape[1]
    out = []
    for i in key.topk(min(k, key.numel())).indices.tolist():
        v = float(t.flatten()[i])
        if not math.isnan(v):
            out.append((f"{i // H}.{i % H}", v))
    return out


def heads_text(pairs: Sequence[Tuple[str, float]]) -> str:
    return ", ".join(f"{h} ({number(v, 3)})" for h, v in pairs)


def table(rows: Sequence[Sequence[str]], header: Optional[Sequence[str]] = None) -> str:
    head = "<tr>" + "".join(f"<th>{escape(c)}</th>" for c in header) + "</tr>" if header else ""
    body = "".join("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table>{head}{body}</table>"


def box(title: str, *parts: str) -> str:
    return f'{CSS}<div class="qk-r"><b>{escape(title)}</b>{"".join(parts)}</div>'


_f, _e = number, escape        # the old private names (tests/test_display.py reads _f)


class Displayed:
    """Mixin for result classes: ``__repr__`` is the class's ``_text()``, ``_repr_html_`` its ``_html()``.

    A class renders itself with the helpers above; without its own ``_html`` it shows its text in a box.
    """

    def _text(self) -> str:
        return f"{type(self).__name__}()"

    def _html(self) -> str:
        return box(type(self).__name__, f"<div>{escape(self._text())}</div>")

    def __repr__(self) -> str:
        return self._text()

    def _repr_html_(self) -> str:
        return self._html()
