"""A circuit found over the whole graph (``qkcircuits circuit``): its faithfulness curve, tables and report section.

>>> view = load_circuit({"curve": {"1": 0.5, "100": 1.0},      # or the path of `qkcircuits circuit --json`
...     "circuit": {"edges": [["0.0", "1.0", "k", 0.6], ["1.0", "logits", "in", -0.3]]}})
>>> faithfulness_curve(view)["layout"]["xaxis"]["type"]  # f over % of edges, the 0.8 line dashed
'log'
>>> [b["type"] for b in circuit_section(view)["blocks"]]   # the section: one list of blocks, drawn in order
['note', 'figures', 'table', 'table']

The graph is ``_circuit_graph.circuit_graph`` (the core circuit by default, a layered layout). The report, ``qkcircuits
circuit -o`` and the app draw ``circuit_section``'s blocks with one renderer (``_page.VIEWER_JS``): a banner
(the file's ``warnings``), notes, figures side by side, tables. Adding a panel is appending a block.
"""

from __future__ import annotations

import math
import os
from typing import Any, Dict, List, Optional

import plotly.graph_objects as go

from ._circuit_data import CircuitView, evidence_cell, evidence_text, load_circuit, parse_node
from ._circuit_graph import (MAX_EDGES, MAX_WIDTH, MIN_WIDTH, NEGATIVE, POSITIVE, circuit_graph, drawn_edges,
                             edge_width)
from ._figures import figure_dict, base_layout, round_float

__all__ = ["circuit_graph", "circuit_section", "drawn_edges", "edge_width", "faithfulness_curve", "load_circuit",
           "MAX_EDGES", "MAX_WIDTH", "MIN_WIDTH", "NEGATIVE", "POSITIVE"]


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
        title += "<br>" + ", ".join(p for p in parts if p)
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


def roles_rows(view: CircuitView) -> List[List[Any]]:
    """[head, role, evidence] per head with a role, in forward order (the report's roles table; the evidence a
    small table of its own, ``evidence_cell``), and a fourth column, why it attends (``qk_text``), when any role
    carries its QK evidence."""
    with_qk = any(isinstance(r.get("qk"), dict) for r in view.roles.values())
    rows = []
    for name, r in sorted(view.roles.items(), key=lambda kv: _order(kv[0])):
        row = [name, str(r.get("role") or ""), evidence_cell(r.get("evidence"))]
        qk = r.get("qk")
        qk = {**qk, "head": name} if isinstance(qk, dict) else qk
        rows.append(row + [qk_text(qk, view.roles)] if with_qk else row)
    return rows


def qk_text(qk: Any, roles: Dict[str, Dict[str, Any]]) -> str:
    """A role's QK evidence (``roles.roles(qk=True)``) as one line, the roles' own words
    (``_explain.evidence.evidence_sentence``): "why 23.0 attends from END → IO (attention 0.57): query side 20.0
    (S-inhibition head) 31 %, emb 20 % (these 3 sources: ...); key side emb 60 %, ...", or that the head does not
    prefer that key (values, not shares of a negative total). Malformed entries in a file are skipped."""
    from .._explain.evidence import evidence_sentence

    if not isinstance(qk, dict):
        return ""
    role_of = {str(h): str(r["role"]) for h, r in roles.items() if isinstance(r, dict) and r.get("role")}
    clean = dict(qk)
    for side in ("query", "key", "query_values", "key_values"):
        clean[side] = [list(x[:2]) for x in qk.get(side) or [] if isinstance(x, (list, tuple)) and len(x) >= 2
                       and isinstance(x[1], (int, float))]
    for side in ("query_rest", "key_rest"):
        if not isinstance(qk.get(side), dict):
            clean.pop(side, None)
    clean["from"], clean["to"] = str(qk.get("from", "?")), str(qk.get("to", "?"))
    head = str(qk.get("head", "this head"))
    return _strip_head(evidence_sentence(head, clean, role_of), head)


def _strip_head(sentence: str, head: str) -> str:
    """The roles table's row already names the head: "why 23.0 attends from END to IO ..." → "attends from END to
    IO ..."."""
    for prefix in (f"why {head} ", f"{head} "):
        if sentence.startswith(prefix):
            return sentence[len(prefix):]
    return sentence


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
    c = view.core
    if c is not None:
        bits.append(f"core circuit: {len(c.heads)} heads + {len(c.mlps)} MLPs"
                    + (f", node faithfulness {evidence_text(c.node_faithfulness)}" if c.node_faithfulness is not None
                       else "") + (f" on the selection prompts, {evidence_text(c.holdout_f)} held out"
                                   if c.holdout_f is not None else ""))
    return "; ".join(bits)


def core_rows(view: CircuitView) -> List[List]:
    """[number of heads, f] of the core's curve (the core table); the count as text ("12", not the page's
    four-decimal number format "12.0000")."""
    return [[str(int(n)) if float(n).is_integer() else str(n), round_float(f)] for n, f in view.core.curve.items()] \
        if view.core else []


def circuit_section(view: CircuitView, n_layers: Optional[int] = None, n_heads: Optional[int] = None,
                    k: int = 20, n_kv: Optional[int] = None, which: str = "auto") -> Dict:
    """The circuit section as data: ``source`` (the file's name) and ``blocks``, drawn in order: a ``banner`` with
    the file's warnings, a ``note`` (the summary line; the core's "how"), ``figures`` (the faithfulness curve
    and the graph: the core circuit by default, ``which``), and ``table``s (roles; the core's f by heads; the top
    ``k`` edges). Every string reaches the page through ``textContent``."""
    blocks: List[Dict] = []
    if view.warnings:
        blocks.append({"type": "banner", "lines": list(view.warnings)})
    blocks.append({"type": "note", "text": summary(view)})
    if view.core is not None and view.core.how:
        blocks.append({"type": "note", "text": f"core circuit: {view.core.how}"})
    figs = []
    if view.info.get("has_curve"):
        figs.append({"id": "circuit-curve", "figure": faithfulness_curve(view)})
    figs.append({"id": "circuit-graph", "figure": circuit_graph(view, n_layers, n_heads, n_kv=n_kv, which=which),
                 "click": "head"})
    blocks.append({"type": "figures", "figures": figs})
    rows = roles_rows(view)
    header = ["head", "role", "evidence"] + (["why it attends (QK)"] if rows and len(rows[0]) == 4 else [])
    blocks.append({"type": "table", "id": "circuit-roles", "title": "Roles", "header": header,
                   "rows": rows, "empty": "no roles in this file"})
    if view.core is not None and view.core.curve:
        blocks.append({"type": "table", "id": "circuit-core", "title": "Core circuit: node faithfulness f by "
                       "number of heads", "header": ["heads", "f"], "rows": core_rows(view)})
    st = view.get("stability")
    if isinstance(st, dict) and st.get("draws"):
        from ._stability_view import stability_blocks

        L, H = view.shape()
        blocks += stability_blocks(st, n_layers or L, n_heads or H)
    edges = edge_rows(view, k)
    blocks.append({"type": "table", "id": "circuit-edges", "title": f"Top edges by |score| ({len(edges)} of "
                   f"{len(view.edges)})", "header": ["sender", "receiver", "input", "score", "sender role",
                                                     "receiver role"], "rows": edges})
    # the file's name, not its folder: a report is meant to be shared
    return {"source": os.path.basename(view.source), "blocks": blocks}
