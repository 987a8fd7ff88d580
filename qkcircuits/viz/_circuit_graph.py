"""The circuit graph a person reads: the core circuit by default, laid out in layers by grandalf, no label overlaps.

>>> view = load_circuit({"circuit": {"edges": [["emb", "0.0", "v", 0.2], ["0.0", "1.0", "k", 0.6],
...                                            ["1.0", "logits", "in", -0.3]]},
...                      "core": {"heads": ["1.0", "0.0"], "mlps": [], "node_faithfulness": 0.97,
...                               "curve": {"1": 0.6, "2": 0.97}, "how": "greedy by node score"}})
>>> fig = circuit_graph(view)                                   # the core: its nodes, the edges between them
>>> fig["meta"]["which"], sorted(fig["meta"]["nodes"])
('core', ['0.0', '1.0', 'emb', 'logits'])
>>> circuit_graph(view, which="edges")["meta"]["which"]         # the edge circuit on request
'edges'

What is drawn (``which``):

- ``"core"`` (the default when the file has ``core``): the embedding, the core's heads and MLPs, the logits;
  edges = the edge circuit's edges whose two ends are drawn nodes (``core.edges`` when the file gives them), the
  ``CORE_IN_EDGES`` of largest |score| into each node (the title says how many are drawn); an
  edge into a KV head ``L.kvG`` (grouped-query attention: k and v belong to the KV head) is drawn into each core
  query head that shares it, its hover naming the KV head.
- ``"edges"`` (the default without ``core``): the edge circuit, its ``max_edges`` edges of largest |score| and
  only the nodes they touch.

How: rows are the model's order (the embedding, each layer's KV heads, heads and MLP, ..., the logits; one row
per rank that holds a node, its name on the y axis); within rows grandalf's Sugiyama layout orders the nodes to
reduce crossings and places them as wide as their labels (``_circuit_layout``), and a long edge bends through the
rows it crosses. Position-aware circuits (node names ``"20.0@END"``) get one column per position, its name on top.
Node colour = role (legend on the right), edge width ∝ |score| (``MAX_WIDTH`` px for the largest drawn, at least
``MIN_WIDTH``), red positive, blue negative, dash = the receiver's input (q solid, k dashed, v dotted). Hover: an
edge's marker gives sender → receiver, input, score and both roles; a node its role and evidence (and its place
in the core). The file's ``warnings`` are written in red above the graph.

One data unit is one pixel on both axes (the figure is sized to the layout), so the layout's gaps are the drawn
gaps; tests/test_circuit_graph.py measures in Chromium that no label overlaps another label or a node.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import plotly.graph_objects as go

from ._circuit_data import CircuitView, Edge, Node, evidence_text, load_circuit
from ._circuit_layout import ROW_PX, layout
from ._figures import TITLE_SIZE, base_layout, figure_dict, round_float, text_px, wrap

__all__ = ["circuit_graph", "edge_width", "load_circuit", "MAX_EDGES", "MAX_WIDTH", "MIN_WIDTH"]

MAX_EDGES = 300        # edges drawn (the largest |score|); one plotly trace each, so a browser stays quick
MAX_WIDTH = 8.0        # px, the drawn edge of largest |score|
MIN_WIDTH = 1.0        # px: an edge of the circuit stays visible however small its score (toy induction: the
                       # key edge 0.0 -> 1.0 scores 8e-5 under EAP-IG beside 36 for emb -> 1.0 v)
POSITIVE, NEGATIVE = "#d62728", "#1f77b4"
INPUT_DASH = {"q": "solid", "k": "dash", "v": "dot"}
INPUT_AT = {"q": 0.4, "k": 0.5, "v": 0.6}          # hover marker along the edge, so q/k/v edges of a pair differ
# the role names of qk.roles() (qkcircuits/_tasks/roles.py), lower-cased; short forms for other files
ROLE_COLOURS = {"name mover": "#2ca02c", "negative name mover": "#9467bd", "s-inhibition head": "#ff7f0e",
                "induction head": "#d62728", "previous-token head": "#1f77b4", "duplicate-token head": "#8c564b",
                "direct-logit head": "#e377c2", "feeds the circuit": "#17becf", "unclassified": "#7f7f7f",
                "minor": "#c7c7c7"}
SYMBOLS = {"head": "circle", "kv": "diamond"}        # embed, MLPs, logits: squares
KIND_COLOURS = {"embed": "#444444", "logits": "#444444", "mlp": "#bcbd22", "head": "#ffffff", "kv": "#ffffff"}
FALLBACK = ["#aec7e8", "#ffbb78", "#98df8a", "#c5b0d5", "#c49c94", "#dbdb8d"]
CORE_IN_EDGES = 3      # the core graph draws the 3 strongest edges (by |score|) into each node
MARKER = 12            # px, node marker size
FONT = 11              # px, node labels and axis labels
PAD = 14               # px between the layout and the plot area's edge
WARN_SIZE = 12
WARN_COLOUR = "#b00000"


def _esc(text: str) -> str:
    """File text for plotly's pseudo-HTML (titles, legend, hover, annotations): < > & as entities, shown as typed."""
    return str(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def edge_width(score: float, top: float) -> float:
    """Line width in px: ``MAX_WIDTH`` × |score| / ``top`` (the largest drawn |score|), at least ``MIN_WIDTH``."""
    return max(MIN_WIDTH, MAX_WIDTH * abs(score) / top)


def drawn_edges(view: CircuitView, max_edges: int = MAX_EDGES) -> List[Edge]:
    """The edges of the edge circuit drawn: all of them up to ``max_edges``, else the ``max_edges`` of largest
    |score|."""
    return view.edges if len(view.edges) <= max_edges else view.top_edges(max_edges)


def _role_colour(role: str, seen: Dict[str, str]) -> str:
    key = role.lower().strip()
    for name, c in ROLE_COLOURS.items():
        if key in (name, name + "s", name.replace(" head", "")):
            return c
    if key not in seen:
        seen[key] = FALLBACK[len(seen) % len(FALLBACK)]
    return seen[key]


def _group_size(view: CircuitView, n_heads: Optional[int], n_kv: Optional[int]) -> Optional[int]:
    H = n_heads or view.shape()[1]
    kv = n_kv or view.n_kv()
    return H // kv if kv and H and H % kv == 0 else None


def core_graph(view: CircuitView, group: Optional[int], max_edges: int = MAX_EDGES
               ) -> Tuple[List[Node], List[Tuple[Edge, str]]]:
    """(nodes, [(edge, note)]) of the core drawing (module docs); ``note`` names the KV head an edge went into."""
    core = view.core
    inside = set(core.nodes())
    source = core.edges if core.edges is not None else view.edges
    out: List[Tuple[Edge, str]] = []
    for e in source:
        if not (e.sender in inside or e.sender.kind == "embed"):
            continue
        if e.receiver.kind == "kv":
            if not group:
                continue
            heads = range(e.receiver.index * group, (e.receiver.index + 1) * group)
            for n in core.heads:
                if n.layer == e.receiver.layer and n.index in heads and n.pos == e.receiver.pos:
                    out.append((Edge(e.sender, n, e.input, e.score), f"into KV head {e.receiver} (shared by its "
                                                                     f"query heads)"))
        elif e.receiver in inside or e.receiver.kind == "logits":
            out.append((e, ""))
    out = sorted(out, key=lambda p: -abs(p[0].score))
    per: Dict[Node, int] = {}
    kept = []
    for pair in out:                  # the strongest few into each node: a graph a person can follow
        r = pair[0].receiver
        if per.get(r, 0) < CORE_IN_EDGES:
            per[r] = per.get(r, 0) + 1
            kept.append(pair)
    out = kept[:max_edges]
    ends = {n for e, _ in out for n in (e.sender, e.receiver)}
    nodes = list(core.nodes()) + sorted((n for n in ends if n.kind in ("embed", "logits")), key=str)
    if not any(n.kind == "logits" for n in nodes):
        nodes.append(Node("logits"))
    if not any(n.kind == "embed" for n in nodes):
        nodes.insert(0, Node("embed"))
    return nodes, out


def _rank(n: Node, n_layers: int) -> int:
    """The row of a node: the embedding, then per layer its KV heads, heads and MLP, then the logits."""
    if n.kind == "embed":
        return 0
    if n.kind == "logits":
        return 4 * n_layers + 4
    return 4 * n.layer + {"kv": 1, "head": 2, "mlp": 3}[n.kind]


def _row_name(n: Node) -> str:
    return {"embed": "emb", "logits": "logits", "kv": f"layer {n.layer} KV", "head": f"layer {n.layer}",
            "mlp": f"mlp {n.layer}"}[n.kind]


def _node_hover(view: CircuitView, n: Node, group: Optional[int], core_rank: Dict[Node, int]) -> str:
    r = view.roles.get(str(n)) or (view.roles.get(n.base) if n.pos else None)
    role = _esc(view.role(n) or ("none" if n.kind == "head" else n.kind))
    text = f"<b>{n}</b><br>role: {role}"
    if n.kind == "kv":
        shared = (f"query heads {n.layer}.{n.index * group}-{n.layer}.{(n.index + 1) * group - 1}" if group
                  else "its group of query heads")
        text = (f"<b>{n}</b>: key-value head {n.index} of layer {n.layer}<br>its k and v inputs are shared by "
                f"{shared} (grouped-query attention)")
    if n in core_rank:
        text += f"<br>core: chosen {core_rank[n] + 1} of {len(core_rank)}"
    ev = r.get("evidence") if isinstance(r, dict) else None
    if isinstance(ev, dict):                  # one line per item: the hover stays narrow
        text += "".join(f"<br>{_esc(k)}: {_esc(evidence_text(v))}" for k, v in ev.items())
    elif ev is not None:
        text += "<br>" + _esc(evidence_text(ev))
    qk = r.get("qk") if isinstance(r, dict) else None      # QK evidence (query/key sources), when the file has it
    if isinstance(qk, dict):
        text += "".join(f"<br>{_esc(side)}: {_esc(evidence_text(v))}" for side, v in qk.items())
    return text


def _along(points: List[Tuple[float, float]], t: float) -> Tuple[float, float]:
    """The point a fraction ``t`` of the way along a polyline, measured from its END (the receiver)."""
    pts = points[::-1]
    seg = [((b[0] - a[0]) ** 2 + (b[1] - a[1]) ** 2) ** 0.5 for a, b in zip(pts, pts[1:])]
    goal = t * sum(seg)
    for (a, b), d in zip(zip(pts, pts[1:]), seg):
        if goal <= d and d > 0:
            f = goal / d
            return (a[0] + f * (b[0] - a[0]), a[1] + f * (b[1] - a[1]))
        goal -= d
    return pts[-1]


def _columns(nodes: List[Node], view: CircuitView) -> Tuple[Optional[Dict[Node, str]], List[str]]:
    """Position columns when node names carry positions: (node → column, left-to-right order), else (None, [])."""
    if not any(n.pos for n in nodes):
        return None, []
    given = view.get("positions")
    order = [str(p) for p in given] if isinstance(given, list) else []
    for n in sorted(nodes, key=lambda n: n.order):
        if n.pos and n.pos not in order:
            order.append(n.pos)
    if "other" in order:                      # pooled positions last
        order = [p for p in order if p != "other"] + ["other"]
    last = order[-1] if "END" not in order else "END"
    return {n: n.pos or last for n in nodes}, order


def circuit_graph(view: CircuitView, n_layers: Optional[int] = None, n_heads: Optional[int] = None,
                  max_edges: int = MAX_EDGES, n_kv: Optional[int] = None, which: str = "auto") -> Dict:
    """The circuit as a graph (module docs). ``which``: ``"core"``, ``"edges"`` or ``"auto"`` (the core when the
    file has one). ``n_layers``/``n_heads``/``n_kv``: the model's (default: the file's ``graph`` counts). Each edge
    line carries its data in ``meta`` (sender, receiver, input, score); ``meta`` of the figure lists the nodes."""
    from .._foundation.errors import QKCircuitsError

    if which not in ("auto", "core", "edges"):
        raise QKCircuitsError(f"which must be 'core', 'edges' or 'auto', got {which!r}")
    if which == "core" and view.core is None:
        raise QKCircuitsError(f"{view.source}: no core circuit in this file ('core'); draw the edge circuit with "
                              f"which='edges'")
    which = "core" if which == "core" or (which == "auto" and view.core is not None) else "edges"
    L = max(n_layers or 0, view.shape()[0], 1)
    group = _group_size(view, n_heads, n_kv)
    if which == "core":
        nodes, pairs = core_graph(view, group, max_edges)
        core_rank = {n: i for i, n in enumerate(view.core.heads + view.core.mlps)}
    else:
        edges = drawn_edges(view, max_edges)
        pairs = [(e, "") for e in edges]
        nodes = sorted({n for e in edges for n in (e.sender, e.receiver)}, key=lambda n: n.order)
        core_rank = {}
    cols, order = _columns(nodes, view)
    label = {n: (n.base if cols else str(n)) for n in nodes}
    width = {n: MARKER + 6 + text_px(label[n], FONT) for n in nodes}
    rank = {n: _rank(n, L) for n in nodes}
    spots = layout(rank, [(e.sender, e.receiver) for e, _ in pairs], width, cols, order)
    mark = {n: (x - width[n] / 2 + MARKER / 2, y) for n, (x, y) in spots.nodes.items()}   # marker left in the box

    top = max((abs(e.score) for e, _ in pairs), default=0.0) or 1.0
    traces, hx, hy, htext = [], [], [], []
    for e, note in pairs:
        pts = list(spots.routes.get((e.sender, e.receiver)) or [spots.nodes[e.sender], spots.nodes[e.receiver]])
        pts[0], pts[-1] = mark[e.sender], mark[e.receiver]
        traces.append(go.Scatter(x=[round(p[0], 1) for p in pts], y=[round(p[1], 1) for p in pts], mode="lines",
                                 showlegend=False, hoverinfo="skip",
                                 meta={"sender": str(e.sender), "receiver": str(e.receiver), "input": e.input,
                                       "score": round_float(e.score)},
                                 line=dict(color=POSITIVE if e.score >= 0 else NEGATIVE,
                                           width=edge_width(e.score, top), dash=INPUT_DASH.get(e.input or "", "solid"))))
        x, y = _along(pts, INPUT_AT.get(e.input or "", 0.5))
        hx.append(round(x, 1))
        hy.append(round(y, 1))
        into = f" ({e.input})" if e.input and e.input != "in" else ""
        htext.append(f"{e.sender} → {e.receiver}{into}<br>score {e.score:.4g}"
                     + (f"<br>{note}" if note else "")
                     + f"<br>{e.sender}: {_esc(view.role(e.sender) or 'no role')}; "
                       f"{e.receiver}: {_esc(view.role(e.receiver) or 'no role')}")
    if pairs:
        traces.append(go.Scatter(x=hx, y=hy, mode="markers", name="edges", showlegend=False, text=htext,
                                 marker=dict(size=7, color="rgba(0,0,0,0.15)"),
                                 hovertemplate="%{text}<extra></extra>"))
    by_group: Dict[str, List[Node]] = {}
    plain = {"no role": "head", "MLP": "mlp", "embed / logits": "embed", "KV head": "kv"}
    for n in sorted(nodes, key=lambda n: n.order):
        name = view.role(n) or {"head": "no role", "mlp": "MLP", "kv": "KV head"}.get(n.kind, "embed / logits")
        by_group.setdefault(name, []).append(n)
    seen: Dict[str, str] = {}
    for name, ns in by_group.items():
        colour = KIND_COLOURS[plain[name]] if name in plain else _role_colour(name, seen)
        traces.append(go.Scatter(x=[round(mark[n][0], 1) for n in ns], y=[mark[n][1] for n in ns],
                                 mode="markers+text", name=_esc(name), text=[label[n] for n in ns],
                                 textposition="middle right", textfont=dict(size=FONT),
                                 customdata=[[n.base, _node_hover(view, n, group, core_rank), str(n)] for n in ns],
                                 marker=dict(size=MARKER, color=colour, line=dict(color="#000", width=1),
                                             symbol=[SYMBOLS.get(n.kind, "square") for n in ns]),
                                 hovertemplate="%{customdata[1]}<extra></extra>"))
    return _figure(view, which, traces, spots, nodes, rank, width, order, pairs, list(by_group))


def _title(view: CircuitView, which: str, pairs, nodes) -> str:
    method = view.get("method")
    how = f" ({method})" if method else ""
    if which == "core":
        c = view.core
        nf = f", node f {c.node_faithfulness:.3f}" if c.node_faithfulness is not None else ""
        head = (f"core circuit{how}: {len(c.heads)} heads + {len(c.mlps)} MLPs{nf}; the {len(pairs)} strongest "
                f"edges between them (at most {CORE_IN_EDGES} into each node)")
    else:
        n = len(view.edges)
        cut = f"top {len(pairs)} of {n} edges by |score|" if len(pairs) < n else f"{len(pairs)} edges"
        head = f"edge circuit{how}: {cut}, {len(nodes)} nodes"
    kv = "<br>◇ = KV head (its k/v inputs are shared by its query heads)" if any(n.kind == "kv" for n in nodes) else ""
    return (f"{head}<br>width ∝ |score| (≥ {MIN_WIDTH:g} px), red +, blue −; q solid, k dashed, v dotted{kv}")


def _figure(view, which, traces, spots, nodes, rank, width, order, pairs, legend) -> Dict:
    xs0 = [spots.nodes[n][0] - width[n] / 2 for n in nodes] + [x for r in spots.routes.values() for x, _ in r]
    xs1 = [spots.nodes[n][0] + width[n] / 2 for n in nodes] + [x for r in spots.routes.values() for x, _ in r]
    x0, x1 = min(xs0, default=0.0) - PAD, max(xs1, default=0.0) + PAD
    rows = sorted(spots.rows.items())
    header = ROW_PX * 0.55 if order else 0.0
    y0, y1 = -PAD - header, (rows[-1][1] if rows else 0.0) + PAD
    row_names = {}
    for n in nodes:
        row_names.setdefault(rank[n], _row_name(n))
    ticks = [(y, row_names[r]) for r, y in rows]
    left = int(max((text_px(t, FONT) for _, t in ticks), default=20) + 18)
    right = int(max((text_px(t, FONT) for t in legend), default=20) + 56)
    plot_w = max(x1 - x0, 420.0)
    if plot_w > x1 - x0:                                   # a narrow graph: centred in a readable figure
        extra = (plot_w - (x1 - x0)) / 2
        x0, x1 = x0 - extra, x1 + extra
    W = int(round(left + plot_w + right))
    title = _title(view, which, pairs, nodes)
    warn_lines = [_esc(line) for w in view.warnings for line in wrap("⚠ " + w, W - 24, WARN_SIZE)]
    warn_px = int(round(len(warn_lines) * WARN_SIZE * 1.35)) + (8 if warn_lines else 0)
    top = 64 + warn_px
    H = int(round(top + (y1 - y0) + 16))
    annotations = [dict(text=f"@{c}", x=(a + b) / 2, y=-PAD - header / 2, xref="x", yref="y", showarrow=False,
                        font=dict(size=12, color="#333"), xanchor="center", yanchor="middle")
                   for c, (a, b) in spots.columns.items() if order]
    if warn_lines:
        annotations.append(dict(text="<br>".join(warn_lines), x=0, xref="paper", xanchor="left", xshift=-left + 8,
                                y=1, yref="paper", yanchor="bottom", yshift=4, align="left", showarrow=False,
                                font=dict(size=WARN_SIZE, color=WARN_COLOUR)))
    lay = base_layout(title, width=W, height=H, margin=dict(l=left, r=right, t=top, b=16),
                      xaxis=dict(visible=False, range=[x0, x1], fixedrange=True),
                      yaxis=dict(range=[y1, y0], tickvals=[y for y, _ in ticks], ticktext=[t for _, t in ticks],
                                 showgrid=True, gridcolor="#f0f0f0", zeroline=False, fixedrange=True,
                                 tickfont=dict(size=FONT)),
                      legend=dict(x=1, xanchor="left", y=1, yanchor="top", font=dict(size=FONT),
                                  title=dict(text="role")),
                      annotations=annotations, hovermode="closest")
    fig = go.Figure(traces, layout=lay)
    out = figure_dict(fig)
    out["meta"] = {"name": "circuit", "which": which, "description": "edges sender → receiver input, width = |score|, "
                   "colour = sign", "n_edges": len(view.edges), "n_drawn": len(pairs),
                   "nodes": [str(n) for n in nodes], "title_size": TITLE_SIZE}
    return out
