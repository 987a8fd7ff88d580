"""Short ``__repr__`` and a small ``_repr_html_`` for every result type: the top heads per label and a compact grid.

>>> scores = qk.scan(model)          # doctest: +SKIP
>>> scores                           # doctest: +SKIP   HeadScores(toy-induction: 2 layers x 2 heads; ...)
>>> display(scores)                  # doctest: +SKIP   in a notebook: tables of top heads, layer x head grids

Each result class inherits ``Displayed`` (``__repr__`` = ``text(self)``, ``_repr_html_`` = ``html(self)``);
the functions here dispatch on the class name, so this module imports none of the result modules (no import circles) and
nothing heavier than torch (no plotly: a repr must not load the plotting stack).

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
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

MAX_CELLS = 768      # heads drawn per grid; above it, one cell per layer (the layer's maximum)
MAX_GRIDS = 3        # grids per result
TOP = 5              # heads per table row / list

CSS = ("<style>.qk-r{font:12px/1.35 system-ui,sans-serif;color:#222}.qk-r table{border-collapse:collapse;margin:4px 0}"
       ".qk-r td,.qk-r th{padding:1px 8px;border-bottom:1px solid #eee;text-align:left}"
       ".qk-r .g{display:inline-grid;gap:1px;margin:2px 12px 6px 0;vertical-align:top}"
       ".qk-r .g i{width:9px;height:9px;display:block}.qk-r .m{color:#666}</style>")


def _f(x, digits: int = 4) -> str:
    x = float(x)
    if math.isnan(x):
        return "nan"
    if x != 0 and (abs(x) >= 1e4 or abs(x) < 1e-3):
        return f"{x:.3g}"
    return f"{x:.{digits}f}".rstrip("0").rstrip(".")


def _e(s) -> str:
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
            cells.append(f'<i style=background:{_colour(v, lo, hi, signed)} title="{name} {_f(v)}"></i>')
    return (f'<div style="display:inline-block;vertical-align:top"><div class="m">{_e(title)}{_e(note)} '
            f'[{_f(lo)} … {_f(hi)}]</div><div class="g" style="grid-template-columns:repeat({cols},9px)">'
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


def _heads_text(pairs: Sequence[Tuple[str, float]]) -> str:
    return ", ".join(f"{h} ({_f(v, 3)})" for h, v in pairs)


def _table(rows: Sequence[Sequence[str]], header: Optional[Sequence[str]] = None) -> str:
    head = "<tr>" + "".join(f"<th>{_e(c)}</th>" for c in header) + "</tr>" if header else ""
    body = "".join("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table>{head}{body}</table>"


def _box(title: str, *parts: str) -> str:
    return f'{CSS}<div class="qk-r"><b>{_e(title)}</b>{"".join(parts)}</div>'


# ------------------------------------------------------------------------------------------------ per type

# (the one-line text, a thunk that builds the HTML only when a notebook asks for it)
Rendered = Tuple[str, Callable[[], str]]

def _scores(r) -> Rendered:
    labels = r.labels()
    counts: Dict[str, int] = {}
    for names in labels.values():
        for n in names:
            counts[n] = counts.get(n, 0) + 1
    lines = []
    for label, (score, minimum) in r.thresholds.items():
        if score in r.scores:
            lines.append((label, score, minimum, counts.get(label, 0), top_heads(r.scores[score])))
    text = (f"HeadScores({r.model}: {r.n_layers} layers x {r.n_heads} heads; scores {', '.join(r.scores)}"
            + "".join(f"; {lab}: {n} head{'s' * (n != 1)} >= {_f(m)}, top {_heads_text(top[:3])}"
                      for lab, _, m, n, top in lines) + ")")
    rows = [(lab, f"{s} ≥ {_f(m)}", str(n), _heads_text(top)) for lab, s, m, n, top in lines]
    rows += [("", name, "", _heads_text(top_heads(t))) for name, t in r.scores.items()
             if name not in {s for _, s, _, _, _ in lines}]
    shown = [s for _, s, _, _, _ in lines] + [n for n in r.scores if n not in {s for _, s, _, _, _ in lines}]
    grids = "".join(grid(r.scores[n], n) for n in shown[:MAX_GRIDS])
    return text, lambda: _box(f"HeadScores: {r.model}, {r.n_layers} layers × {r.n_heads} heads",
                      _table(rows, ("label", "threshold", "heads", f"top {TOP} (score)")), grids)


def _effects(r) -> Rendered:
    L, H = r.effects.shape
    top = top_heads(r.effects, by_abs=True)
    text = (f"HeadEffects({r.model}: {L} layers x {H} heads; {r.kind}, {r.method} ablation, {r.metric} "
            f"baseline {_f(r.baseline)}; largest |effect|: {_heads_text(top[:3])})")
    rows = [("metric", f"{r.metric} (clean {_f(r.baseline)})"), ("ablation", f"{r.method} ({r.kind})"),
            ("prompts", f"{r.n_prompts} × {r.n_positions} tokens"), (f"top {TOP} by |effect|", _heads_text(top))]
    return text, lambda: _box(f"HeadEffects: {r.model}", _table(rows), grid(r.effects, "metric(ablated) − metric(clean)", True))


def _group(r) -> Rendered:
    heads = ", ".join(map(str, r.heads))
    text = (f"GroupEffect(heads {heads}; {r.metric} {_f(r.baseline)} -> {_f(r.ablated)} "
            f"(effect {r.effect:+.4g}); {r.method} ablation)")
    rows = [("heads", heads), ("metric", r.metric), ("clean", _f(r.baseline)), ("ablated", _f(r.ablated)),
            ("effect", f"{r.effect:+.4g}"), ("ablation", r.method)]
    return text, lambda: _box("GroupEffect", _table(rows))


def _random(r) -> Rendered:
    heads = ", ".join(map(str, r.heads))
    re = r.random_effects.float()
    text = (f"RandomComparison(heads {heads}: effect {r.effect:+.4g} on {r.metric}; {re.numel()} random sets of "
            f"{len(r.heads)}: mean {float(re.mean()):+.4g}, max {float(re.max()):+.4g}; "
            f"{r.fraction_at_least:.0%} of draws >= the group)")
    rows = [("heads", heads), ("effect", f"{r.effect:+.4g} ({r.metric}, {r.method} ablation, clean {_f(r.baseline)})"),
            (f"{re.numel()} random sets", f"mean {float(re.mean()):+.4g}, median {float(re.median()):+.4g}, "
                                          f"max {float(re.max()):+.4g}"),
            ("draws ≥ the group", f"{r.fraction_at_least:.0%}"), ("seed", str(r.seed))]
    return text, lambda: _box("RandomComparison", _table(rows))


def _diagnostics(r) -> Rendered:
    flagged = r.flagged()
    by_flag: Dict[str, List[str]] = {}
    for h, names in flagged:
        for n in names:
            by_flag.setdefault(n, []).append(str(h))
    text = (f"HeadDiagnostics({r.model}: {r.n_layers} layers x {r.n_heads} heads; {len(flagged)} flagged"
            + "".join(f"; {f} {len(hs)}: {', '.join(hs[:3])}{', ...' if len(hs) > 3 else ''}"
                      for f, hs in by_flag.items()) + ")")
    th = r.thresholds
    rows = [(f, str(len(by_flag.get(f, []))), ", ".join(by_flag.get(f, [])[:TOP]) + (" …" if len(by_flag.get(f, [])) > TOP
                                                                                    else "")) for f in r.flags()]
    count = sum(v.float() for v in r.flags().values())
    grids = grid(count, "flags per head") + "".join(grid(r.measures[m], m) for m in ("sink", "entropy_frac_mean",
                                                                                      "qk_var_ratio")
                                                     if m in r.measures)
    return text, lambda: _box(f"HeadDiagnostics: {r.model} (thresholds {', '.join(f'{k} {_f(v)}' for k, v in th.items())})",
                      _table(rows, ("flag", "heads", f"first {TOP}")), grids)


def _composition(r) -> Rendered:
    s = r.scores
    L, H = s.shape[0], s.shape[1]
    flat = torch.nan_to_num(s.flatten(), nan=-math.inf)
    pairs = []
    for i in flat.topk(min(TOP, flat.numel())).indices.tolist():
        a, b = divmod(i, L * H)
        if math.isfinite(float(flat[i])):
            pairs.append((f"{a // H}.{a % H} → {b // H}.{b % H}", float(flat[i])))
    text = (f"CompositionScores({r.mode}: {L} layers x {H} heads; baseline {_f(r.baseline)} subtracted; strongest: "
            + ", ".join(f"{p} {_f(v, 3)}" for p, v in pairs[:3]) + ")")
    best = torch.nan_to_num(s, nan=-math.inf).flatten(0, 1).amax(0)          # [L, H]: each later head's best partner
    best[best == -math.inf] = math.nan
    return text, lambda: _box(f"CompositionScores: {r.mode}-composition (random baseline {_f(r.baseline)} subtracted)",
                      _table([(p, _f(v)) for p, v in pairs], ("earlier → later", "score")),
                      grid(best, "each head's strongest earlier partner"))


def _offsets(r) -> Rendered:
    sm = r.summary()
    text = (f"OffsetProfile(head {r.head}; offsets {sm['offsets'][0]}..{sm['offsets'][1]}; preferred offset "
            f"{sm['preferred_offset']} (score {_f(sm['score_at_preferred'])}); score at 0 {_f(sm['score_at_0'])})")
    y = r.mean_score.float()[:: max(1, r.mean_score.numel() // 256)].tolist()     # at most ~256 points drawn
    lo, hi = min(y), max(y)
    pts = " ".join(f"{i * 300 / max(1, len(y) - 1):.1f},{55 - 50 * (v - lo) / ((hi - lo) or 1):.1f}"
                   for i, v in enumerate(y))
    svg = (f'<div class="m">mean score against offset Δ ({sm["offsets"][0]} … {sm["offsets"][1]})</div>'
           f'<svg width="310" height="60"><polyline fill="none" stroke="#2a6fb0" points="{pts}"/></svg>')
    rows = [(k, str(v)) for k, v in sm.items()]
    return text, lambda: _box(f"OffsetProfile: head {r.head}", _table(rows), svg)


def _activations(r) -> Rendered:
    items = sorted(r.tensors.items())
    text = ("Activations(" + ", ".join(f"{n}@{l} {list(t.shape)}" for (n, l), t in items[:8])
            + (f", ... {len(items)} in all" if len(items) > 8 else "") + ")")
    return text, lambda: _box("Activations", _table([(n, str(l), str(list(t.shape)), str(t.dtype)) for (n, l), t in items[:64]],
                                            ("name", "layer", "shape (as stored)", "dtype")))


def _circuit(r) -> Rendered:
    m = r.matrix
    shape = f"[{m.ldim}, {m.rdim}] = [{m.ldim}, {m.mdim}] @ [{m.mdim}, {m.rdim}]"
    text = f"Circuit({r.kind}, head {r.head}; {shape}; {'exact' if r.exact else 'caveats: ' + '; '.join(r.caveats)})"
    rows = [("kind", r.kind), ("head", str(r.head)), ("factored", shape)] + [(k, str(v)) for k, v in r.settings.items()]
    rows += [("caveat", c) for c in r.caveats]
    return text, lambda: _box(f"Circuit: {r.kind} of head {r.head}", _table(rows))


def _path_effects(r) -> Rendered:
    """A trace: per receiver and input the top senders (effect, baseline); grids of the first receivers' effects."""
    first = [(x, y) for x, y in ((rc, i) for rc in r.receivers[:3] for i in r.into) if r.top(x, y, 1)]
    tops = "; ".join(f"{rc}<-{r.top(rc, x, 1)[0][0]} {x} {_f(r.top(rc, x, 1)[0][1], 3)}" for rc, x in first[:6])
    more = f"; ... {len(r.receivers) - 3} more receivers" if len(r.receivers) > 3 else ""
    text = (f"PathEffects({r.kind}, {r.model}: {len(r.receivers)} receiver{'s' * (len(r.receivers) != 1)}, "
            f"into {','.join(r.into)}, {r.method}; top senders: {tops}{more})")
    shown = r.receivers[:3 * TOP]                       # at most 15 receivers × 3 inputs rows
    rows = []
    for rc in shown:
        for x in r.into:
            b = r.baseline(rc, x)
            rows.append((str(rc), x, _f(r.clean_value(rc, x)), _heads_text([(str(h), v) for h, v in r.top(rc, x, 3)]),
                         f"{_f(b['mean'])} / {_f(b['p95'])}",
                         ", ".join(r.labels.get(str(r.top(rc, x, 1)[0][0]), [])) if r.top(rc, x, 1) else ""))
    if len(r.receivers) > len(shown):
        rows.append((f"… {len(r.receivers) - len(shown)} more receivers", "", "", "", "", ""))
    x0 = "k" if "k" in r.effects else r.into[0]
    grids = "".join(grid(r.effects[x0][i], f"{rc} ← senders ({x0})", True)
                    for i, rc in enumerate(r.receivers[:MAX_GRIDS]))
    return text, lambda: _box(f"PathEffects ({r.kind}): {r.model}, method {r.method}, {r.n_layers} layers × {r.n_heads} heads",
                      _table(rows, ("receiver", "input", "clean", "top 3 senders (effect)", "baseline mean / p95",
                                    "top sender's labels")), grids)


RENDER: Dict[str, Callable] = {
    "HeadScores": _scores, "HeadEffects": _effects, "GroupEffect": _group, "RandomComparison": _random,
    "HeadDiagnostics": _diagnostics, "CompositionScores": _composition, "OffsetProfile": _offsets,
    "Activations": _activations, "Circuit": _circuit,
    "PathEffects": _path_effects,
}


def text(obj) -> str:
    """A short one-line repr: the model, the shape, the top heads."""
    return RENDER[type(obj).__name__](obj)[0]


def html(obj) -> str:
    """The notebook view: tables of the top heads and compact grids (size bound in the module docs)."""
    return RENDER[type(obj).__name__](obj)[1]()


class Displayed:
    """Mixin for result classes: a short ``__repr__`` and the bounded notebook ``_repr_html_`` above."""

    def __repr__(self) -> str:
        return text(self)

    def _repr_html_(self) -> str:
        return html(self)
