"""Figures of a circuit found over the whole graph (``qkcircuits circuit``): the graph and the faithfulness curve.

>>> view = load_circuit({"curve": {"1": 0.5, "100": 1.0},      # or the path of `qkcircuits circuit --json`
...     "circuit": {"edges": [["0.0", "1.0", "k", 0.6], ["1.0", "logits", "in", -0.3]]}})
>>> fig = circuit_graph(view)                           # nodes by layer, width ∝ |score|, red +, blue −
>>> [(t["meta"]["sender"], t["line"]["width"], t["line"]["color"]) for t in fig["data"] if t["mode"] == "lines"]
[('0.0', 8.0, '#d62728'), ('1.0', 4.0, '#1f77b4')]
>>> faithfulness_curve(view)["layout"]["xaxis"]["type"]  # f over % of edges, the 0.8 line dashed
'log'

Both are JSON-ready plotly dicts like every builder in ``viz/_figures.py``; the report, ``qk.plot.circuit``
and ``qk.plot.faithfulness`` draw the same dicts. Layout of the graph: y = layer (layer 0 at the top,
the embedding above it, the logits below the last layer; an MLP half a layer below its attention), x = the
head index, a layer's MLP in a column right of the heads. Edge line width is proportional to |score|
(``MAX_WIDTH`` px for the largest drawn edge), red for a positive score, blue for a negative one (the
colours of the signed score grids); the dash says the receiver's input (q solid, k dashed, v dotted; an
MLP or the logits have one input: solid). Hover on an edge's midpoint marker: sender → receiver, input,
score and both nodes' roles; on a node: its role and evidence.
"""

from __future__ import annotations

import math
import os
from typing import Dict, List, Optional

import plotly.graph_objects as go

from ._circuit_data import CircuitView, Edge, Node, evidence_text, load_circuit, parse_node
from ._figures import figure_dict, base_layout, round_float

__all__ = ["circuit_graph", "edge_width", "faithfulness_curve", "load_circuit", "MAX_EDGES", "MAX_WIDTH", "MIN_WIDTH"]

MAX_EDGES = 300        # edges drawn (the largest |score|); one plotly trace each, so a browser stays quick
MAX_WIDTH = 8.0        # px, the drawn edge of largest |score|
MIN_WIDTH = 1.0        # px: an edge of the circuit stays visible however small its score (toy induction: the
                       # key edge 0.0 -> 1.0 scores 8e-5 under EAP-IG beside 36 for emb -> 1.0 v)
POSITIVE, NEGATIVE = "#d62728", "#1f77b4"
INPUT_DASH = {"q": "solid", "k": "dash", "v": "dot"}
INPUT_AT = {"q": 0.4, "k": 0.5, "v": 0.6}          # hover marker along the edge, so q/k/v edges of a pair differ
# the role names of circuit.roles() (qkcircuits/_tasks/roles.py), lower-cased; short forms for other files
ROLE_COLOURS = {"name mover": "#2ca02c", "negative name mover": "#9467bd", "s-inhibition head": "#ff7f0e",
                "induction head": "#d62728", "previous-token head": "#1f77b4", "duplicate-token head": "#8c564b",
                "direct-logit head": "#e377c2", "feeds the circuit": "#17becf", "unclassified": "#7f7f7f",
                "minor": "#c7c7c7"}
SYMBOLS = {"head": "circle", "kv": "diamond"}        # embed, MLPs, logits: squares
KIND_COLOURS = {"embed": "#444444", "logits": "#444444", "mlp": "#bcbd22", "head": "#c7c7c7", "kv": "#ffffff"}
FALLBACK = ["#aec7e8", "#ffbb78", "#98df8a", "#c5b0d5", "#c49c94", "#dbdb8d"]


def node_xy(n: Node, n_layers: int, n_heads: int, group: Optional[int] = None) -> tuple:
    """(x, y) of a node: heads at (head, layer); KV head G of layer L (grouped-query attention) a quarter layer
    above its group of ``group`` query heads, at their centre (at x = G when the group size is unknown);
    MLP L at (n_heads, L + 0.5); embed above layer 0 and the logits below the last layer, centred."""
    mid = (n_heads - 1) / 2
    if n.kind == "kv":
        x = n.index * group + (group - 1) / 2 if group else float(n.index)
        return (float(x), n.layer - 0.25)
    if n.kind == "embed":
        return (mid, -1.0)
    if n.kind == "logits":
        return (mid, float(n_layers))
    if n.kind == "mlp":
        return (float(n_heads), n.layer + 0.5)
    return (float(n.index), float(n.layer))


def _role_colour(role: str, seen: Dict[str, str]) -> str:
    key = role.lower().strip()
    for name, c in ROLE_COLOURS.items():
        if key in (name, name + "s", name.replace(" head", "")):
            return c
    if key not in seen:
        seen[key] = FALLBACK[len(seen) % len(FALLBACK)]
    return seen[key]


def _node_hover(view: CircuitView, n: Node, group: Optional[int] = None) -> str:
    r = view.roles.get(str(n))
    role = view.role(n) or ("none" if n.kind == "head" else n.kind)
    text = f"<b>{n}</b><br>role: {role}"
    if n.kind == "kv":
        shared = (f"query heads {n.layer}.{n.index * group}-{n.layer}.{(n.index + 1) * group - 1}" if group
                  else "its group of query heads")
        text = (f"<b>{n}</b>: key-value head {n.index} of layer {n.layer}<br>its k and v inputs are shared by "
                f"{shared} (grouped-query attention)")
    ev = r.get("evidence") if isinstance(r, dict) else None
    if isinstance(ev, dict):                  # one line per item: the hover stays narrow
        text += "".join(f"<br>{k}: {evidence_text(v)}" for k, v in ev.items())
    elif ev is not None:
        text += "<br>" + evidence_text(ev)
    return text


def edge_width(score: float, top: float) -> float:
    """Line width in px: ``MAX_WIDTH`` × |score| / ``top`` (the largest drawn |score|), at least ``MIN_WIDTH``."""
    return max(MIN_WIDTH, MAX_WIDTH * abs(score) / top)


def drawn_edges(view: CircuitView, max_edges: int = MAX_EDGES) -> List[Edge]:
    """The edges the graph draws: all of them up to ``max_edges``, else the ``max_edges`` of largest |score|."""
    return view.edges if len(view.edges) <= max_edges else view.top_edges(max_edges)


def circuit_graph(view: CircuitView, n_layers: Optional[int] = None, n_heads: Optional[int] = None,
                  max_edges: int = MAX_EDGES, n_kv: Optional[int] = None) -> Dict:
    """The circuit as a graph (module docs). ``n_layers``/``n_heads``/``n_kv``: the model's (default: the
    file's ``graph`` counts, else the smallest grid that holds every node). Each edge line carries its data in
    ``meta`` (sender, receiver, input, score)."""
    need_l, need_h = view.shape()
    L, H = max(n_layers or 0, need_l, 1), max(n_heads or 0, need_h, 1)
    kv = n_kv or view.n_kv()
    group = H // kv if kv and H % kv == 0 else None
    edges = drawn_edges(view, max_edges)
    top = max((abs(e.score) for e in edges), default=0.0) or 1.0
    traces = []
    hx, hy, htext = [], [], []
    for e in edges:
        (x0, y0), (x1, y1) = node_xy(e.sender, L, H, group), node_xy(e.receiver, L, H, group)
        colour = POSITIVE if e.score >= 0 else NEGATIVE
        traces.append(go.Scatter(x=[x0, x1], y=[y0, y1], mode="lines", showlegend=False, hoverinfo="skip",
                                 meta={"sender": str(e.sender), "receiver": str(e.receiver), "input": e.input,
                                       "score": round_float(e.score)},
                                 line=dict(color=colour, width=edge_width(e.score, top),
                                           dash=INPUT_DASH.get(e.input or "", "solid"))))
        t = INPUT_AT.get(e.input or "", 0.5)
        hx.append(x1 + t * (x0 - x1))
        hy.append(y1 + t * (y0 - y1))
        into = f" ({e.input})" if e.input and e.input != "in" else ""
        htext.append(f"{e.sender} → {e.receiver}{into}<br>score {e.score:.4g}<br>"
                     f"{e.sender}: {view.role(e.sender) or 'no role'}; "
                     f"{e.receiver}: {view.role(e.receiver) or 'no role'}")
    if edges:
        traces.append(go.Scatter(x=hx, y=hy, mode="markers", name="edges", showlegend=False, text=htext,
                                 marker=dict(size=7, color="rgba(0,0,0,0.15)"),
                                 hovertemplate="%{text}<extra></extra>"))
    shown = {e.sender for e in edges} | {e.receiver for e in edges} | {n for n in view.nodes() if n.kind == "head"}
    nodes = sorted(shown, key=lambda n: n.order)
    by_group: Dict[str, List[Node]] = {}
    for n in nodes:
        name = view.role(n) or {"head": "no role", "mlp": "MLP", "kv": "KV head (k/v of its query heads)"}.get(
            n.kind, "embed / logits")
        by_group.setdefault(name, []).append(n)
    seen: Dict[str, str] = {}
    for name, ns in by_group.items():
        plain = {"no role": "head", "MLP": "mlp", "embed / logits": "embed", "KV head (k/v of its query heads)": "kv"}
        colour = KIND_COLOURS[plain[name]] if name in plain else _role_colour(name, seen)
        xy = [node_xy(n, L, H, group) for n in ns]
        traces.append(go.Scatter(x=[p[0] for p in xy], y=[p[1] for p in xy], mode="markers+text", name=name,
                                 text=[str(n) for n in ns], textposition="middle right",
                                 customdata=[[str(n), _node_hover(view, n, group)] for n in ns],
                                 marker=dict(size=14, color=colour, line=dict(color="#000", width=1),
                                             symbol=[SYMBOLS.get(n.kind, "square") for n in ns]),
                                 hovertemplate="%{customdata[1]}<extra></extra>"))
    cut = f"top {len(edges)} of {len(view.edges)} edges by |score|" if len(edges) < len(view.edges) \
        else f"{len(edges)} edges"
    method = view.get("method")
    title = (f"circuit{f' ({method})' if method else ''}: {cut}; width ∝ |score| (≥ {MIN_WIDTH:g} px), "
             f"red +, blue −; "
             f"q solid, k dashed, v dotted"
             + ("; ◇ = KV head (its k/v inputs are shared by its query heads)" if any(
                 n.kind == "kv" for n in nodes) else ""))
    ticks = list(range(0, L, 1 if L <= 16 else 2))
    fig = go.Figure(traces, layout=base_layout(
        title, height=max(420, min(1100, 230 + 36 * (L + 2))), width=max(660, 200 + 60 * (H + 1)),
        xaxis=dict(title="head (MLP: right column)", range=[-0.7, H + 0.9], dtick=1, zeroline=False),
        yaxis=dict(title="layer", range=[L + 0.6, -1.6], zeroline=False, tickvals=[-1, *ticks, L],
                   ticktext=["emb", *map(str, ticks), "logits"]),
        margin=dict(l=60, r=20, t=64, b=130), legend=dict(orientation="h", y=-0.26, yanchor="top"),
        hovermode="closest"))
    out = figure_dict(fig)
    out["meta"] = {"name": "circuit", "description": "edges sender → receiver input, width = |score|, colour = sign",
                   "n_edges": len(view.edges), "n_drawn": len(edges)}
    return out


def faithfulness_curve(view: CircuitView) -> Dict:
    """f against the percent of edges kept (log x axis), the 0.8 line dashed, CPR and CMD in the title.
    A point at 0 % cannot sit on a log axis: it is left off and its f given in a note."""
    on_axis = [(p, f) for p, f in view.curve if p > 0 and f == f]
    zero = [f for p, f in view.curve if p == 0 and f == f]
    undefined = [p for p, f in view.curve if f != f]
    line = go.Scatter(x=[p for p, _ in on_axis], y=[round_float(f) for _, f in on_axis], mode="lines+markers",
                      name="f", marker=dict(size=7), line=dict(color="#2c3e50"),
                      hovertemplate="%{x}% of edges<br>f = %{y:.4f}<extra></extra>")
    cpr, cmd = view.get("cpr"), view.get("cmd")
    parts = [f"CPR {cpr:.3f}" if cpr is not None else "", f"CMD {cmd:.3f}" if cmd is not None else ""]
    metric = view.get("metric")
    title = "faithfulness f = (m(C) − m(∅)) / (m(full) − m(∅))" + (f" ({metric})" if metric else "")
    if any(parts):
        title += ": " + ", ".join(p for p in parts if p)
    notes = [dict(text="f = 0.8", x=1, xref="paper", y=0.8, yref="y", xanchor="right", yanchor="bottom",
                  showarrow=False, font=dict(size=9, color="#888"))]
    if zero:
        notes.append(dict(text=f"f(0 %) = {zero[0]:.3f} (not on a log axis)", x=0, xref="paper", y=1.02,
                          yref="paper", xanchor="left", yanchor="bottom", showarrow=False, font=dict(size=9)))
    if undefined:
        notes.append(dict(text=f"f undefined at {len(undefined)} size(s): m(full) = m(∅), the model does not do "
                               f"the task",
                          x=1, xref="paper", y=1.02, yref="paper", xanchor="right", yanchor="bottom",
                          showarrow=False, font=dict(size=9, color="#b00")))
    ys = [f for _, f in view.curve if f == f] + [0.0, 1.0]
    shapes = [dict(type="line", x0=0, x1=1, xref="paper", y0=0.8, y1=0.8, yref="y",
                   line=dict(color="#888", dash="dash", width=1))]
    chosen = chosen_percent(view)
    if chosen:                                # the circuit's own size, where the file says it
        shapes.append(dict(type="line", x0=chosen, x1=chosen, xref="x", y0=0, y1=1, yref="paper",
                           line=dict(color="#2ca02c", dash="dot", width=1)))
        notes.append(dict(text=f"circuit: {chosen:g} %", x=math.log10(chosen), xref="x", y=0, yref="paper",
                          xanchor="left", yanchor="bottom", showarrow=False, font=dict(size=9, color="#2ca02c")))
    fig = go.Figure(line, layout=base_layout(
        title, height=380, width=620, showlegend=False, annotations=notes, shapes=shapes,
        xaxis=dict(title="edges in the circuit (% of all edges, log scale)", type="log"),
        yaxis=dict(title="f", range=[min(ys) - 0.05, max(ys) + 0.05], zeroline=True)))
    out = figure_dict(fig)
    out["meta"] = {"name": "faithfulness", "description": "f over the grid of circuit sizes",
                   "cpr": cpr, "cmd": cmd}
    return out


def chosen_percent(view: CircuitView) -> Optional[float]:
    """The circuit's size in percent of the graph's edges when the file says (``circuit.percent`` or
    ``chosen_percent``), else None."""
    for key in ("circuit.percent", "chosen_percent"):
        v = view.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= 100:
            return float(v)
    return None


def roles_rows(view: CircuitView) -> List[List[str]]:
    """[head, role, evidence] per head with a role, in forward order (the report's roles table)."""
    rows = []
    for name, r in sorted(view.roles.items(), key=lambda kv: _order(kv[0])):
        rows.append([name, str(r.get("role") or ""), evidence_text(r.get("evidence"))])
    return rows


def _order(name: str):
    n = parse_node(name)
    return n.order if n is not None else (float("inf"), 0)


def edge_rows(view: CircuitView, k: int = 20) -> List[List]:
    """[sender, receiver, input, score, sender role, receiver role] of the ``k`` edges of largest |score|."""
    return [[str(e.sender), str(e.receiver), e.input or "", round_float(e.score), view.role(e.sender), view.role(e.receiver)]
            for e in view.top_edges(k)]


def summary(view: CircuitView) -> str:
    """One sentence: model, task, prompts, metric clean/corrupt, method, circuit size, node faithfulness."""
    g = view.get
    bits = []
    if g("model"):
        bits.append(f"model {g('model')}")
    if g("task"):
        bits.append(f"task {g('task')}" + (f" ({g('n_prompts')} prompts)" if g("n_prompts") is not None else ""))
    if g("metric"):
        m = f"metric {g('metric')}"
        if g("clean") is not None and g("corrupt") is not None:
            m += f": clean {g('clean'):.4g}, corrupt {g('corrupt'):.4g}"
        bits.append(m)
    if g("method"):
        bits.append(f"method {g('method')}" + (f" ({g('steps')} steps)" if g("steps") else ""))
    heads = len(view.heads) or len({n for n in view.nodes() if n.kind == "head"})
    pct = chosen_percent(view)
    bits.append(f"circuit: {len(view.edges)} edges" + (f" (chosen at {pct:g} % of the graph's edges, then pruned)"
                                                       if pct else "") + f", {heads} heads")
    nf = g("node_faithfulness")
    if nf is not None:
        bits.append(f"node faithfulness {evidence_text(nf)}")
    return "; ".join(bits)


def circuit_section(view: CircuitView, n_layers: Optional[int] = None, n_heads: Optional[int] = None,
                    k: int = 20, n_kv: Optional[int] = None) -> Dict:
    """The report's circuit section as data: a summary line, both figures, the roles table and the top ``k``
    edges (every string reaches the page through ``textContent``)."""
    # the file's name, not its folder: a report is meant to be shared
    return {"summary": summary(view), "source": os.path.basename(view.source),
            "curve": faithfulness_curve(view) if view.info.get("has_curve") else None,
            "graph": circuit_graph(view, n_layers, n_heads, n_kv=n_kv),
            "roles": roles_rows(view), "edges": edge_rows(view, k), "n_edges": len(view.edges)}
