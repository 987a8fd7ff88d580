"""The stability panel of a circuit (``qkcircuits circuit --resamples N``): how often each head and MLP is in the
draws' core circuits, and each head's roles with their frequencies.

>>> st = {"draws": [{"draw": 0, "heads": ["0.0"], "mlps": [], "f": 1.0, "holdout_f": 0.9, "template": None}],
...       "inclusion": {"0.0": 1.0}, "jaccard": {"nodes": {"mean": None, "min": None},
...       "edges": {"mean": None, "min": None}}, "roles": {"0.0": {"name mover": 1.0}},
...       "stable_core": {"heads": ["0.0"], "mlps": [], "share": 0.8, "holdout_f": 0.9, "interval": [0.8, 1.0]}}
>>> [b["type"] for b in stability_blocks(st, 2, 2)]
['note', 'figures', 'table', 'table']
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import plotly.graph_objects as go

from ._figures import base_layout, figure_dict


def _num(v: Any) -> Optional[float]:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v else None


def _pct(v: Any) -> str:
    x = _num(v)
    return "n/a" if x is None else f"{100 * x:.0f} %"


def _f(v: Any) -> str:
    x = _num(v)
    return "n/a" if x is None else f"{x:.3f}"


def inclusion_figure(st: Dict[str, Any], n_layers: int, n_heads: int) -> Dict:
    """Heatmap: layers (rows) × heads (columns) of the fraction of draws whose core holds the head, the MLPs as
    one more column (``mlp``)."""
    inc = st.get("inclusion") or {}
    z = [[_num(inc.get(f"{L}.{h}")) or 0.0 for h in range(n_heads)] + [_num(inc.get(f"mlp{L}")) or 0.0]
         for L in range(n_layers)]
    x = [str(h) for h in range(n_heads)] + ["mlp"]
    n = len(st.get("draws") or [])
    heat = go.Heatmap(z=z, x=x, y=list(range(n_layers)), zmin=0, zmax=1, colorscale="Blues",
                      colorbar=dict(title="in core"),
                      hovertemplate="layer %{y}, head %{x}<br>in %{z:.0%} of the draws' cores<extra></extra>")
    fig = go.Figure(heat, layout=base_layout(
        f"How often each node is in the core ({n} draws of the prompts)", height=max(300, 14 * n_layers + 120),
        width=max(420, 22 * (n_heads + 1) + 200), xaxis=dict(title="head (mlp: the layer's MLP)", type="category"),
        yaxis=dict(title="layer", autorange="reversed", tickmode="linear", dtick=1 if n_layers <= 16 else 2)))
    out = figure_dict(fig)
    out["meta"] = {"name": "inclusion", "description": "inclusion frequency of each node in the draws' cores"}
    return out


def stability_blocks(st: Dict[str, Any], n_layers: int, n_heads: int) -> List[Dict]:
    """The panel's blocks: a note (stable core, held-out f, Jaccard), the inclusion heatmap, the roles with their
    frequencies, and the draws."""
    sc = st.get("stable_core") or {}
    j = st.get("jaccard") or {}
    lo, hi = (list(sc.get("interval") or []) + [None, None])[:2]
    draws = st.get("draws") or []
    note = (f"stability over {len(draws)} draws of the prompts: stable core (nodes in >= {_pct(sc.get('share'))} of "
            f"the draws' cores) {len(sc.get('heads') or [])} heads + {len(sc.get('mlps') or [])} MLPs, held-out f "
            f"{_f(sc.get('holdout_f'))} [{_f(lo)}-{_f(hi)}]; Jaccard between draws: nodes mean "
            f"{_f((j.get('nodes') or {}).get('mean'))} (min {_f((j.get('nodes') or {}).get('min'))}), edges mean "
            f"{_f((j.get('edges') or {}).get('mean'))} (min {_f((j.get('edges') or {}).get('min'))})")
    roles = []
    for head, freq in (st.get("roles") or {}).items():
        items = sorted(((r, _num(v) or 0.0) for r, v in (freq or {}).items()), key=lambda t: -t[1])
        named = [(r, v) for r, v in items if r not in ("-", "minor")]
        if named:
            roles.append([head, named[0][0], _pct(named[0][1]),
                          ", ".join(f"{r} {_pct(v)}" for r, v in items if (r, v) != named[0])])
    roles.sort(key=lambda r: (-float(r[2].rstrip(" %") or 0), r[0]))
    rows = [[str(d.get("draw")), "-" if d.get("template") is None else str(d.get("template")),
             f"{len(d.get('heads') or [])} + {len(d.get('mlps') or [])}", _f(d.get("f")), _f(d.get("holdout_f")),
             _f(d.get("template_f")) if d.get("template") is not None else ""] for d in draws]
    return [{"type": "note", "text": note},
            {"type": "figures", "figures": [{"id": "stability-inclusion",
                                             "figure": inclusion_figure(st, n_layers, n_heads), "click": "head"}]},
            {"type": "table", "id": "stability-roles", "title": "Roles over the draws (the most frequent, then the "
             "others)", "header": ["head", "role", "frequency", "other roles"], "rows": roles,
             "empty": "no head had a role in any draw"},
            {"type": "table", "id": "stability-draws", "title": "The draws' cores", "header": [
                "draw", "template left out", "heads + MLPs", "f (own prompts)", "f (held-out)",
                "f (unseen template)"], "rows": rows}]
