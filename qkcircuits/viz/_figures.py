"""Plotly figures of the views, returned as JSON-ready dicts (``{"data": [...], "layout": {...}}``).

>>> import plotly
>>> scores = qk.scan(model, progress=False)
>>> fig = score_grid(scores["induction"], "induction")        # a dict: {"data", "layout", "meta"}
>>> fig["data"][0]["type"], fig["data"][0]["z"][1][0]         # layer 1, head 0: the induction head
('heatmap', 1.0)
>>> plotly.io.from_json(json.dumps(fig)).data[0].type        # a plotly figure again: .show() draws it
'heatmap'

The report embeds these dicts and draws them with ``Plotly.newPlot``; the app returns the same dicts
from its JSON endpoints, so both views show identical figures. Figures use the empty ``"none"``
template (plotly's default template adds ~6 kB to every figure). Hover text gives exact values and
token strings; token axes use indices with tick labels, because plotly merges equal category names.
"""

from __future__ import annotations

import json
import math
from typing import Dict, List, Optional, Sequence, Union

import plotly.graph_objects as go
from torch import Tensor

DIGITS = 5   # significant digits kept in the figures (hover shows 4 decimals)
LABEL_CHARS = 14   # token labels on axes and in cells are cut to this many characters (the hover has the full text)


def round_float(x) -> Optional[float]:
    x = float(x)
    if math.isnan(x) or math.isinf(x):
        return None
    return float(f"{x:.{DIGITS}g}")


def _grid(t: Tensor) -> List[List[Optional[float]]]:
    return [[round_float(v) for v in row] for row in t.tolist()]


def show_token(s: str) -> str:
    """A token as an axis label: leading/trailing spaces as '␣', newlines as '⏎'."""
    return s.replace("\n", "⏎").replace(" ", "␣") if s.strip() != s or "\n" in s else s


def figure_dict(fig: go.Figure) -> Dict:
    return json.loads(fig.to_json())


# plotly's toolbar (modebar) sits in the top ~28 px of a figure, right-aligned, and covers whatever is there
# on hover; a centred title in the default 40 px top margin sat under it (measured in tests/test_notebook.py:
# the title's and the toolbar's boxes intersect). The title now starts below the toolbar, left-aligned.
TOOLBAR_PX = 30
TOP_MARGIN = 64
MULTILINE_PX = 12


# Text widths are estimated, not measured (the figure is built in Python): CHAR_EM × font size per character is
# above the mean width of the labels and titles drawn here (measured in Chromium's default sans-serif: ~0.45 em
# for a title, ~0.55 em for labels of digits like "23.7"); the browser tests (tests/test_report_layout.py,
# tests/test_circuit_graph.py) measure that no text is cut by its figure's edge and no label overlaps another.
CHAR_EM = 0.56
TITLE_SIZE = 14
LINE_PX = 1.3           # line height in font sizes


def text_px(text: str, size: Union[int, float]) -> float:
    """Estimated drawn width of ``text`` (no HTML) at font ``size`` px."""
    return CHAR_EM * size * len(text)


def wrap(text: str, width_px: Union[int, float], size: Union[int, float]) -> List[str]:
    """``text`` broken at spaces into lines whose estimated width fits ``width_px`` (a word longer than a line
    stays whole on its own line).

    >>> wrap("circuit: 12 edges; width ∝ |score|", 130, 10)
    ['circuit: 12 edges;', 'width ∝ |score|']
    """
    per_line = max(8, int(width_px / (CHAR_EM * size)))
    lines: List[str] = []
    for part in text.split("<br>"):
        line = ""
        for word in part.split(" "):
            if line and len(line) + 1 + len(word) > per_line:
                lines.append(line)
                line = word
            else:
                line = f"{line} {word}" if line else word
        lines.append(line)
    return lines


def shorten(text: str, n: int) -> str:
    """``text`` cut to ``n`` characters with an ellipsis (the full text goes in the hover).

    >>> shorten("␣Paris␣and␣France", 10)
    '␣Paris␣an…'
    """
    return text if len(text) <= n else text[: n - 1] + "…"


def base_layout(title: str, **kw) -> Dict:
    """The layout every figure starts from: the empty template, the title left-aligned under the toolbar. With a
    ``width``, a title longer than the figure is wrapped onto more lines and the figure grows by those lines
    (its plot area stays the size asked for), so no title runs past the right edge."""
    width = kw.get("width")
    lines = wrap(title, width - 16, TITLE_SIZE) if width else [title]
    # plotly draws a title of several lines ~10 px higher than one of a single line (measured in Chromium: the
    # box's top at 17 px instead of 27 px below the figure's top), into the toolbar: pushed down by MULTILINE_PX
    shift = MULTILINE_PX if len(lines) > 1 else 0
    extra = int(round(LINE_PX * TITLE_SIZE * (len(lines) - 1))) + shift
    base = dict(template="none", title=dict(text="<br>".join(lines), font=dict(size=TITLE_SIZE), x=0,
                                            xref="container", xanchor="left", y=1, yref="container", yanchor="top",
                                            pad=dict(t=TOOLBAR_PX + shift, l=8)),
                margin=dict(l=60, r=20, t=TOP_MARGIN, b=50), font=dict(size=11))
    base.update(kw)
    if extra:
        base["margin"] = {**base["margin"], "t": base["margin"].get("t", TOP_MARGIN) + extra}
        if "height" in base:
            base["height"] = base["height"] + extra
    return base


def is_signed(values: Tensor, name: str = "") -> bool:
    """A score that can be negative (by definition, or because some value is): drawn on a diverging
    scale centred at 0, so white means 0 and the two colours mean the two signs."""
    return name in SIGNED_SCORES or float(values.nan_to_num(0).min()) < 0


# Scores that are signed by definition even when a model happens to have no negative head.
SIGNED_SCORES = ("eigen_copying",)


def score_grid(values: Tensor, name: str, description: str = "", colorscale: Optional[str] = None,
               zmid: Optional[float] = None, *, others: Optional[Dict[str, Tensor]] = None,
               labels: Optional[Dict[object, List[str]]] = None) -> Dict:
    """Layer × head heatmap of one per-head score; a click reports (layer, head) as (y, x).

    Hover shows the head, ``name``'s value, every score in ``others`` ({name: [L, H]}) and the head's
    ``labels`` ({Head or "L.H": [label, ...]}). Signed values (``is_signed``) get the diverging RdBu
    scale (red positive) centred at 0 unless ``colorscale`` is given.
    """
    L, H = values.shape
    text = [[f"{layer}.{head}" for head in range(H)] for layer in range(L)]
    signed = is_signed(values, name)
    if colorscale is None:
        colorscale = "RdBu" if signed else "Blues"
    if signed and zmid is None:
        zmid = 0.0
    rows = {k: v for k, v in (others or {}).items() if k != name and tuple(v.shape) == (L, H)}
    lab = {str(k): v for k, v in (labels or {}).items()}
    hover = f"head %{{text}}<br><b>{name} = %{{z:.4f}}</b>"
    custom = None
    if rows or labels is not None:
        grids = [t.tolist() for t in rows.values()]
        custom = [[[round_float(g[layer][head]) for g in grids] + [", ".join(lab.get(f"{layer}.{head}", [])) or "none"]
                   for head in range(H)] for layer in range(L)]
        hover += "".join(f"<br>{k} = %{{customdata[{i}]:.4f}}" for i, k in enumerate(rows))
        if labels is not None:
            hover += f"<br>labels: %{{customdata[{len(rows)}]}}"
    hm = go.Heatmap(z=_grid(values), x=list(range(H)), y=list(range(L)), text=text, customdata=custom,
                    colorscale=colorscale, reversescale=colorscale == "RdBu", zmid=zmid, xgap=1, ygap=1,
                    colorbar=dict(thickness=10), hovertemplate=hover + "<extra></extra>")
    height = max(220, min(900, 60 + TOP_MARGIN + 18 * L))
    fig = go.Figure(hm, layout=base_layout(name, height=height, width=max(240, 110 + 26 * H),
                                       # no zero lines: seen through the 1-px cell gaps they drew dots along head 0 and layer 0
                                       xaxis=dict(title="head", dtick=1, zeroline=False, showgrid=False),
                                       yaxis=dict(title="layer", autorange="reversed", dtick=1 if L <= 16 else 5,
                                                  zeroline=False, showgrid=False)))
    out = figure_dict(fig)
    out["meta"] = {"name": name, "description": description}
    return out


def qk_heatmap(matrix: Tensor, labels: Sequence[str], head: str, view: str = "direct") -> Dict:
    """Query token (rows) × key token (columns) pre-softmax score of the head's QK circuit (no biases) on
    ``view`` rows (direct, effective or contextual: the title says which)."""
    n = len(labels)
    shown = [shorten(show_token(s), LABEL_CHARS) for s in labels]
    custom = [[[json.dumps(labels[i]), json.dumps(labels[j])] for j in range(n)] for i in range(n)]
    hm = go.Heatmap(z=_grid(matrix), x=list(range(n)), y=list(range(n)), customdata=custom, colorscale="RdBu",
                    reversescale=True, zmid=0, colorbar=dict(thickness=10),
                    hovertemplate="query %{customdata[0]}<br>key %{customdata[1]}<br>score %{z:.4f}<extra></extra>")
    side = max(340, min(740, 114 + 16 * n))
    # margins hold the tick labels and the axis titles: the left one the longest label, the bottom one the longest
    # label turned by 60° (sin 60° of its length plus half a line); the plot area keeps its size
    longest = text_px(max(shown, key=len, default=""), 11)
    left, bottom = int(longest) + 44, int(0.87 * longest + 6) + 42
    fig = go.Figure(hm, layout=base_layout(
        f"{head} QK over tokens ({view} inputs, pre-softmax, no biases)", height=side - 50 + bottom,
        width=side + 20 + left, margin=dict(l=left, r=20, t=TOP_MARGIN, b=bottom),
        xaxis=dict(title=dict(text="key token", standoff=4), tickvals=list(range(n)), ticktext=shown, tickangle=-60,
                   automargin=False),
        yaxis=dict(title=dict(text="query token", standoff=4), tickvals=list(range(n)), ticktext=shown,
                   autorange="reversed", automargin=False)))
    return figure_dict(fig)


def ov_table(values: Tensor, out_ids: Tensor, src_labels: Sequence[str], out_labels: Sequence[Sequence[str]],
             src_ids: Sequence[int], head: str, view: str = "direct", ranks: Optional[Sequence[float]] = None) -> Dict:
    """Source token (rows) → its top-k output tokens (columns by rank), cell colour = logit raised, text = token;
    ``view`` (direct, effective, contextual) goes in the title; ``ranks`` (the source token's own rank among
    all output logits) in the row labels as ``token ⟨r⟩``."""
    n, k = values.shape
    rows = [shorten(show_token(s), LABEL_CHARS) for s in src_labels]
    if ranks is not None:
        rows = [f"{t} ⟨{_rank(r)}⟩" for t, r in zip(rows, ranks)]
    text = [[shorten(show_token(s), LABEL_CHARS) for s in row] for row in out_labels]
    custom = [[[json.dumps(src_labels[i]), json.dumps(out_labels[i][r]), "yes" if int(out_ids[i, r]) == int(src_ids[i])
                else "no"] for r in range(k)] for i in range(n)]
    hm = go.Heatmap(z=_grid(values), x=[f"#{r + 1}" for r in range(k)], y=list(range(n)), text=text,
                    texttemplate="%{text}", customdata=custom, colorscale="Greens", colorbar=dict(thickness=10),
                    hovertemplate="source %{customdata[0]} → output %{customdata[1]}<br>logit %{z:.4f}"
                                  "<br>copies itself: %{customdata[2]}<extra></extra>")
    # the left margin holds the tick labels AND the axis title beside them: sized from the longest label
    left = int(text_px(max(rows, key=len, default=""), 11)) + 34
    fig = go.Figure(hm, layout=base_layout(
        f"{head} OV: source token → top output tokens ({view} inputs, logits)",
        height=max(340, min(940, 130 + 18 * n)), width=left + 110 + 95 * k, xaxis=dict(title="rank", side="top"),
        margin=dict(l=left, r=20, t=TOP_MARGIN + 40, b=20),
        yaxis=dict(title=dict(text="source token ⟨its own rank⟩" if ranks is not None else "source token",
                              standoff=6),
                   tickvals=list(range(n)), ticktext=rows, autorange="reversed", automargin=False)))
    return figure_dict(fig)


def _rank(r: float) -> str:
    return f"{r:.0f}" if float(r) == int(r) else f"{r:.1f}"


def profile_line(offsets: Sequence[int], score: Sequence[float], label: str, head: str,
                 preferred: Optional[int] = None) -> Dict:
    """Score against query−key offset Δ (positional or rotary QK profile); ``preferred``: the offset the profile
    peaks at, marked and named (``meta["preferred_offset"]``), so a text about the figure can be checked against it."""
    width = 520
    note = wrap(label, width - 80, 9)
    traces = [go.Scatter(x=list(offsets), y=[round_float(v) for v in score], mode="lines+markers", name="score",
                         marker=dict(size=4), showlegend=False,
                         hovertemplate="offset Δ = %{x}<br>score %{y:.4f}<extra></extra>")]
    title = f"{head} QK by offset"
    if preferred is not None:
        y = score[list(offsets).index(preferred)]
        traces.append(go.Scatter(x=[preferred], y=[round_float(y)], mode="markers", name="peak", showlegend=False,
                                 marker=dict(size=10, color="#d62728", symbol="circle-open", line=dict(width=2)),
                                 hovertemplate="peak: Δ = %{x}<br>score %{y:.4f}<extra></extra>"))
        title += f": peaks at Δ = {preferred}"
    fig = go.Figure(traces, layout=base_layout(
        title, height=320 + 12 * (len(note) - 1), width=width,
        margin=dict(l=60, r=20, t=TOP_MARGIN + 12 * len(note), b=50),
        xaxis=dict(title="offset Δ = query pos − key pos"), yaxis=dict(title="score"),
        annotations=[dict(text="<br>".join(note), showarrow=False, xref="paper", yref="paper", x=0, y=1.0,
                          xanchor="left", yanchor="bottom", align="left", font=dict(size=9))]))
    out = figure_dict(fig)
    out["meta"] = {"name": "offsets", "preferred_offset": preferred, "label": label}
    return out


def partners_bar(partners: Sequence[Sequence], head: str) -> Dict:
    """Earlier heads ranked by K-composition with this head (baseline-subtracted)."""
    names = [str(p[0]) for p in partners][::-1]
    vals = [round_float(p[1]) for p in partners][::-1]
    bar = go.Bar(x=vals, y=names, orientation="h",
                 hovertemplate="earlier head %{y}<br>K-composition %{x:.4f}<extra></extra>")
    fig = go.Figure(bar, layout=base_layout(f"{head} K-composition partners (weights only)",
                                        height=max(220, 104 + 26 * len(names)),
                                        width=420, xaxis=dict(title="score − random baseline"),
                                        yaxis=dict(type="category")))
    return figure_dict(fig)


# ------------------------------------------------------------------------------ path patching (trace)

INPUT_COLOURS = {"q": "#1f77b4", "k": "#d62728", "v": "#2ca02c"}
LABEL_COLOURS = {"induction": "#d62728", "previous-token": "#1f77b4", "duplicate-token": "#9467bd"}


def reads_from_bars(rows: Sequence[Dict], head: str, kind: str = "exact", threshold: float = 0.10) -> Dict:
    """Top senders of one receiver per input (q, k, v): horizontal effect bars, one colour per input, with
    the baseline (mean and p95 over all senders) as a dotted and a dashed line per input. A bar is solid where the
    receiver "reads from" that sender (``reads``: the effect is at least ``threshold`` of the receiver's clean value
    and above p95), faded where it is not: the panel claims no source the sentences do not.

    ``rows``: [{"input", "sender", "effect", "metric", "mean", "p95", "clean", "reads"}], best first within an
    input."""
    traces, shapes = [], []
    order = []
    for x in ("q", "k", "v"):
        rs = [r for r in rows if r["input"] == x]
        if not rs:
            continue
        names = [f"{x}: {r['sender']}" for r in rs]
        order += names
        verdict = [("reads from it" if r.get("reads") else f"under the 'reads from' threshold ({threshold:.0%} of the "
                    f"clean {r['clean']:.3g} and above p95)") if r.get("clean") is not None else "" for r in rs]
        traces.append(go.Bar(x=[round_float(r["effect"]) for r in rs], y=names, orientation="h", name=f"{x} ({rs[0]['metric']})",
                             marker=dict(color=INPUT_COLOURS[x], opacity=[1.0 if r.get("reads") else 0.3 for r in rs]),
                             customdata=[[r["sender"], r["metric"], round_float(r["mean"]), round_float(r["p95"]), v]
                                         for r, v in zip(rs, verdict)],
                             hovertemplate="sender %{customdata[0]} → " + x + "<br>effect %{x:.4f} (%{customdata[1]})"
                                           "<br>baseline mean %{customdata[2]}, p95 %{customdata[3]}"
                                           "<br>%{customdata[4]}<extra></extra>"))
        for key, dash in (("mean", "dot"), ("p95", "dash")):
            v = round_float(rs[0][key])
            if v is not None:
                shapes.append(dict(type="line", x0=v, x1=v, y0=names[0], y1=names[-1], yref="y",
                                   line=dict(color=INPUT_COLOURS[x], dash=dash, width=1)))
    fig = go.Figure(traces, layout=base_layout(
        f"senders into {head} ({kind} path patching); solid: reads from (≥ {threshold:.0%} of clean, > p95)",
        height=max(240, 110 + 22 * len(order)), width=600, barmode="overlay", shapes=shapes,
        xaxis=dict(title="effect = harm to the metric (dotted: mean, dashed: p95 over all senders)"),
        yaxis=dict(type="category", categoryorder="array", categoryarray=order[::-1]),
        legend=dict(x=1, xanchor="right", y=0, yanchor="bottom")))
    return figure_dict(fig)


NEAR = 0.3          # a node this close (heads / layers) to an edge's straight line would read as on it


def _distance(p, a, b) -> float:
    """Distance from point ``p`` to the segment ``a``-``b`` (data units)."""
    (px, py), (ax, ay), (bx, by) = p, a, b
    dx, dy = bx - ax, by - ay
    t = max(0.0, min(1.0, ((px - ax) * dx + (py - ay) * dy) / ((dx * dx + dy * dy) or 1.0)))
    return ((px - ax - t * dx) ** 2 + (py - ay - t * dy) ** 2) ** 0.5


def edge_path(a, b, points, n: int = 17):
    """The x and y of the edge ``a`` → ``b`` (points (head, layer)): the straight line, or, when another of the
    graph's ``points`` lies within ``NEAR`` of it (16.0 → 18.6 through 17.3: read as a chain), a curve bowed
    sideways just enough that every point is at least ``NEAR`` away (``n`` points of a quadratic Bézier)."""
    others = [p for p in points if p != tuple(a) and p != tuple(b)]
    if not any(_distance(p, a, b) < NEAR for p in others):
        return [a[0], b[0]], [a[1], b[1]]
    (ax, ay), (bx, by) = a, b
    dx, dy = bx - ax, by - ay
    norm = (dx * dx + dy * dy) ** 0.5 or 1.0
    nx, ny = -dy / norm, dx / norm                       # unit normal
    for bow in (0.6, -0.6, 1.0, -1.0, 1.5, -1.5, 2.2, -2.2):
        cx, cy = (ax + bx) / 2 + bow * nx * norm / 2, (ay + by) / 2 + bow * ny * norm / 2
        ts = [i / (n - 1) for i in range(n)]
        xs = [(1 - t) ** 2 * ax + 2 * (1 - t) * t * cx + t * t * bx for t in ts]
        ys = [(1 - t) ** 2 * ay + 2 * (1 - t) * t * cy + t * t * by for t in ts]
        segs = list(zip(zip(xs, ys), zip(xs[1:], ys[1:])))
        if all(min(_distance(p, u, v) for u, v in segs) >= NEAR for p in others):
            break
    return [round_float(x) for x in xs], [round_float(y) for y in ys]


def circuit_graph(nodes: Sequence[Dict], edges: Sequence[Dict], n_layers: int, n_heads: int, title: str) -> Dict:
    """Traced heads as a graph at (x = head, y = layer), so a click selects the head like a grid cell.

    ``nodes``: [{"head": "L.H", "layer", "index", "label"}]; ``edges``: [{"src", "dst", "input", "effect"}] with
    src/dst as (layer, head). Nodes are coloured by their first scan label; edges by input, labelled q/k/v."""
    traces = []
    hx, hy, htext = [], [], []
    points = [(n["index"], n["layer"]) for n in nodes]
    for e in edges:
        (l0, h0), (l1, h1) = e["src"], e["dst"]
        xs, ys = edge_path((h0, l0), (h1, l1), points)
        # meta: the edge as data (sender, receiver, input, effect), so a figure can be checked against its result
        traces.append(go.Scatter(x=xs, y=ys, mode="lines", showlegend=False, hoverinfo="skip",
                                 meta={"src": f"{l0}.{h0}", "dst": f"{l1}.{h1}", "input": e["input"],
                                       "effect": round_float(e["effect"])},
                                 line=dict(color=INPUT_COLOURS[e["input"]], width=1 + 5 * min(1.0, abs(e["effect"])))))
        # the effect in the hover of a marker at 40% of the way from the receiver (no text on the edges: labels of
        # edges into one receiver overlapped)
        at = round(0.6 * (len(xs) - 1)) if len(xs) > 2 else None
        hx.append(xs[at] if at is not None else h1 + 0.4 * (h0 - h1))
        hy.append(ys[at] if at is not None else l1 + 0.4 * (l0 - l1))
        share = f" ({e['effect'] / abs(e['clean']):.0%} of the clean {e['clean']:.3g})" if e.get("clean") else ""
        htext.append(f"{l0}.{h0} → {l1}.{h1} ({e['input']})<br>effect {e['effect']:.3f}{share}")
    if edges:
        traces.append(go.Scatter(x=hx, y=hy, mode="markers", name="edges", showlegend=False, text=htext,
                                 marker=dict(size=8, color=[INPUT_COLOURS[e["input"]] for e in edges], opacity=0.5),
                                 hovertemplate="%{text}<extra></extra>"))
    for x in INPUT_COLOURS:                   # the legend of the edge colours (no data: one entry per input)
        if any(e["input"] == x for e in edges):
            traces.append(go.Scatter(x=[None], y=[None], mode="markers", name=f"into {x}",
                                     marker=dict(color=INPUT_COLOURS[x], symbol="line-ew-open", size=14,
                                                 line=dict(width=3, color=INPUT_COLOURS[x]))))
    by_label: Dict[str, List[Dict]] = {}
    for n in nodes:
        by_label.setdefault(n["label"] or "no label", []).append(n)
    for label, ns in by_label.items():
        traces.append(go.Scatter(x=[n["index"] for n in ns], y=[n["layer"] for n in ns], mode="markers+text",
                                 name=label, text=[n["head"] for n in ns], textposition="middle right",
                                 marker=dict(size=14, color=LABEL_COLOURS.get(label, "#7f7f7f"),
                                             line=dict(color="#000", width=1)),
                                 hovertemplate="head %{text}<br>" + label + "<extra></extra>"))
    # only the layers that hold traced heads (coordinates stay (head, layer), so clicks still name heads)
    lo = min([n["layer"] for n in nodes], default=0)
    hi = max([n["layer"] for n in nodes], default=n_layers - 1)
    fig = go.Figure(traces, layout=base_layout(
        title, height=max(320, min(900, 140 + 40 * (hi - lo + 1))), width=max(520, 160 + 70 * n_heads),
        xaxis=dict(title="head", range=[-0.5, n_heads - 0.5], dtick=1),
        yaxis=dict(title="layer", range=[hi + 0.5, lo - 0.5], dtick=1 if hi - lo <= 16 else 2),
        legend=dict(orientation="h", y=-0.2)))
    return figure_dict(fig)


def random_baseline(effect: float, random_effects: Sequence[float], heads: Sequence[str], metric: str,
                    method: str) -> Dict:
    """The effect of ablating ``heads`` together (a vertical line) against ablating as many random other
    heads (one dot per draw, jittered vertically so equal effects stay visible)."""
    n = len(random_effects)
    jitter = [((i * 0.618) % 1.0) - 0.5 for i in range(n)]       # deterministic, evenly spread
    dots = go.Scatter(x=[round_float(v) for v in random_effects], y=jitter, mode="markers", name="random heads",
                      marker=dict(size=7, color="#888"),
                      hovertemplate="random draw<br>effect %{x:.4f}<extra></extra>")
    group = go.Scatter(x=[round_float(effect), round_float(effect)], y=[-0.7, 0.7], mode="lines", name="these heads",
                       line=dict(color="#c0392b", width=3),
                       hovertemplate=f"{', '.join(heads)}<br>effect %{{x:.4f}}<extra></extra>")
    fig = go.Figure([dots, group], layout=base_layout(
        f"ablating {', '.join(heads)} vs {n} random sets of {len(heads)} head{'s' * (len(heads) != 1)} ({method})",
        height=260, width=560,
        xaxis=dict(title=f"effect on {metric} (ablated − clean)", zeroline=True),
        yaxis=dict(visible=False, range=[-0.8, 0.95]), showlegend=False,
        annotations=[dict(x=round_float(effect), y=0.7, text="these heads", showarrow=False, yanchor="bottom",
                          font=dict(color="#c0392b")),
                     dict(x=0, xref="paper", y=0.95, text="grey: random sets", showarrow=False, xanchor="left",
                          yanchor="top", font=dict(color="#666"))]))
    return figure_dict(fig)
