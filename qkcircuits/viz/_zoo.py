"""The zoo comparison as one self-contained offline HTML page (plotly inlined, no network).

>>> from qkcircuits._foundation.io import write_atomic
>>> write_atomic(str(tmp / "zoo.html"), zoo_html(qk.zoo(["toy-induction"], progress=False)))
>>> "toy-induction" in (tmp / "zoo.html").read_text()
True
>>> zoo_html(qk.zoo(["smollm2-135m", "toy-induction"]))   # doctest: +SKIP (needs SmolLM2)

One panel per model, side by side, sharing the y axis: every head's induction score (blue) and
previous-token score (orange) against its relative depth ``layer / n_layers`` (heads of a layer
spread a little along x so they do not overlap); heads at or above the 0.4 threshold are drawn
larger. Below: a table with each model's labelled heads, the causal check and ``k_sources``.
"""

from __future__ import annotations

import html
from typing import Any, Dict, List

from ._page import CSS, script_text

COLOURS = {"induction": "#1f77b4", "previous_token": "#ff7f0e"}


def zoo_figure(models: List[Dict[str, Any]]):
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    n = len(models)
    fig = make_subplots(rows=1, cols=n, shared_yaxes=True, horizontal_spacing=0.03 if n > 1 else 0.1,
                        subplot_titles=[f"{m['model']} ({m['n_layers']}x{m['n_heads']})" for m in models])
    for col, m in enumerate(models, start=1):
        L, H = m["n_layers"], m["n_heads"]
        for kind, colour in COLOURS.items():
            grid = m.get("scores", {}).get(kind)
            if not grid:
                continue
            xs, ys, sizes, text = [], [], [], []
            for layer, row in enumerate(grid):
                for head, v in enumerate(row):
                    if v is None:
                        continue
                    xs.append(round((layer + 0.8 * head / max(H, 1)) / L, 4))
                    ys.append(v)
                    sizes.append(10 if v >= 0.4 else 5)
                    text.append(f"{layer}.{head}")
            fig.add_trace(go.Scatter(x=xs, y=ys, mode="markers", text=text, name=kind.replace("_", "-"),
                                     legendgroup=kind, showlegend=col == 1,
                                     marker=dict(color=colour, size=sizes, opacity=0.75),
                                     hovertemplate="head %{text}<br>depth %{x:.2f}<br>score %{y:.3f}<extra>"
                                                   + kind + "</extra>"), row=1, col=col)
        fig.update_xaxes(range=[-0.02, 1.02], title_text="depth (layer / n_layers)", row=1, col=col)
    fig.update_yaxes(range=[-0.02, 1.05], title_text="score", row=1, col=1)
    fig.add_hline(y=0.4, line=dict(color="#999", dash="dot", width=1))
    fig.update_layout(template="none", height=420, width=max(520, 360 * n), margin=dict(l=60, r=20, t=50, b=50),
                      legend=dict(orientation="h", y=-0.2), font=dict(size=11))
    return fig


def _heads(items: List[Dict[str, Any]]) -> str:
    if not items:
        return "<span class=muted>none at or above 0.4</span>"
    return ", ".join(f"{html.escape(h['head'])} ({h['score']:.2f} @ {h['depth']:.2f})" for h in items)


def _task_table(models: List[Dict[str, Any]], task) -> str:
    """The ``zoo --task NAME`` section: per model the task's metric, CPR/CMD, circuit and name movers."""
    rows = []
    for m in models:
        t = m.get(task) if task else None
        if t is None:
            continue
        if "skipped" in t:
            rows.append(f"<tr><td><b>{html.escape(m['model'])}</b></td><td colspan=4 class=muted>skipped: "
                        f"{html.escape(t['skipped'])}</td></tr>")
            continue
        movers = ", ".join(f"{html.escape(h['head'])} ({h['direct_share']:.2f} of the logit difference, END → IO "
                           f"{h['END->IO']:.2f})" for h in t["name_movers"]) or "<span class=muted>none</span>"
        values = t.get("values") or t["logit_diff"]          # older files: logit_diff only
        rows.append(f"<tr><td><b>{html.escape(m['model'])}</b></td><td>{values['clean']:+.3f} / "
                    f"{values['corrupt']:+.3f}</td><td>{t['cpr']:.3f} / {t['cmd']:.3f}</td><td>"
                    + (f"{t['chosen_percent']:g}% of the edges: {t['circuit_edges']} edges, {t['circuit_heads']} heads "
                       f"(node view f {t['node_faithfulness']:.3f})" if t.get("circuit_named", True) else
                       "<span class=muted>none named (" + ("the model does not do the task" if not
                       t.get("does_task", True) else "no size below 100% reaches f ≥ 0.8") + ")</span>")
                    + f"</td><td>{movers}</td></tr>")
    if not rows:
        return ""
    ran = [m[task] for m in models if isinstance(m.get(task), dict) and "skipped" not in m[task]]
    metric = ran[0].get("metric", "logit-diff") if ran else "logit-diff"
    return (f"<h2>{html.escape(str(task))} circuits</h2><table class=zoo><tr><th>model</th><th>"
            f"{html.escape(metric)} clean / corrupt</th>"
            "<th>CPR / CMD</th><th>circuit (smallest size with f ≥ 0.8)</th><th>name movers</th></tr>"
            + "".join(rows) + "</table>")


def zoo_html(zoo) -> str:
    """The page for a ``Zoo`` (or its ``to_dict()``)."""
    from .._scale.zoo import confirmation_verdict

    d = zoo if isinstance(zoo, dict) else zoo.to_dict()
    models = d["models"]
    fig = zoo_figure(models).to_html(full_html=False, include_plotlyjs=False, div_id="zoo-figure",
                                     config={"displaylogo": False, "responsive": False})
    rows = []
    for m in models:
        c = m.get("confirmation")
        conf = ("—" if not c else f"{c['effect']:+.3f} nats (random sets: max {c['random_max']:+.3f}, mean "
                                  f"{c['random_mean']:+.3f}; heads {', '.join(map(html.escape, c['heads']))}); "
                                  f"{html.escape(confirmation_verdict(c))}")
        ks = m.get("k_sources")
        ks_text = "not traced" if ks is None else (
            ", ".join(f"{html.escape(k)} ← {html.escape(str(v) if v else 'no clear source')}" for k, v in ks.items())
            or "no induction heads")
        rows.append(f"<tr><td><b>{html.escape(m['model'])}</b><br><span class=muted>{m['n_layers']} layers x "
                    f"{m['n_heads']} heads</span></td><td>{_heads(m['induction'])}</td>"
                    f"<td>{_heads(m['previous_token'])}</td><td>{conf}</td><td>{ks_text}</td></tr>")
    table = ("<table class=zoo><tr><th>model</th><th>induction heads (score @ depth)</th><th>previous-token heads"
             "</th><th>causal check: top induction heads ablated</th><th>K sources</th></tr>"
             + "".join(rows) + "</table>")
    table += _task_table(models, d.get("settings", {}).get("task"))
    note = html.escape(d.get("notes", {}).get("k_sources", ""))
    css = CSS + (".zoo { border-collapse: collapse; font-size: 13px; } .zoo td, .zoo th { border-bottom: 1px solid "
                 "#ddd; padding: 4px 8px; text-align: left; vertical-align: top; }")
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>qkcircuits zoo</title>"
            f"<style>{css}</style>\n<script>{script_text('plotly')}</script>\n</head><body>"
            f"<h1>Induction and previous-token heads across models</h1><p class=muted>Scores from qkcircuits scan "
            f"([BOS]+R+R, threshold 0.4); depth = layer / n_layers. {note}.</p>{fig}<h2>Heads</h2>{table}"
            "</body></html>\n")
