"""The "why it attends" figure of an ``Attribution`` (``qk.attend``): the pair heatmap of the top query sources ×
the top key sources, with each side's marginal as bars, sources labelled with their roles; and a standalone page.

>>> r = qk.attend(model, "1.0", torch.tensor([[0, 5, 6, 7, 5, 6, 7]]), key="induction")
>>> fig = attend_figure(r, k=3)
>>> [t["type"] for t in fig["data"]]
['heatmap', 'bar', 'bar']
>>> fig["data"][0]["y"][-1], fig["data"][0]["x"][-1]      # the rest of each side, so the cells add up to the total
('rest', 'rest')
"""

from __future__ import annotations

import html
from typing import Dict, List, Tuple

import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from .._explain.attribution import Attribution
from .._explain.words import shares_shown
from ._figures import TOP_MARGIN, base_layout, figure_dict, round_float

LABEL_CHARS = 28        # longer source labels are shortened on the axes (the hover has them whole)


def _short(text: str) -> str:
    return text if len(text) <= LABEL_CHARS else text[: LABEL_CHARS - 1] + "…"


def _table(res: Attribution, k: int) -> Tuple[List[str], List[str], torch.Tensor]:
    """The ``k`` largest sources of each side (by |marginal|), plus the top pair's two sources when they are not
    among them (the sentences name that pair: the figure draws it), and the pair values between them, every other
    kept source and the pair table's own "other" merged into one "rest" row and column (so the cells still add
    up)."""
    P = res.pair_values.double()
    top = res.pairs(1)

    def pick(names: List[str], sources, must: List[str]) -> List[int]:
        order = [n for n, _, _ in sources if n in names and n != "other"][:k]
        order += [n for n in must if n in names and n not in order]
        return [names.index(n) for n in order]

    qi = pick(res.pair_query, res.query_sources(), [top[0][0]] if top else [])
    ki = pick(res.pair_key, res.key_sources(), [top[0][1]] if top else [])
    q_rest = [i for i in range(P.shape[0]) if i not in qi]
    k_rest = [j for j in range(P.shape[1]) if j not in ki]
    rows = torch.cat([P[qi], P[q_rest].sum(0, keepdim=True)], 0)
    M = torch.cat([rows[:, ki], rows[:, k_rest].sum(1, keepdim=True)], 1)
    return [res.pair_query[i] for i in qi] + ["rest"], [res.pair_key[j] for j in ki] + ["rest"], M


def attend_figure(res: Attribution, k: int = 12) -> Dict:
    """Heatmap (rows: query sources, columns: key sources, value = that pair's mean contribution, red > 0 > blue)
    with the key-side marginals as bars above and the query-side marginals as bars on the left."""
    qn, kn, M = _table(res, k)
    qm = dict((n, v) for n, v, _ in res.query_sources())
    km = dict((n, v) for n, v, _ in res.key_sources())
    q_bar = [qm.get(n, 0.0) if n != "rest" else float(M[-1].sum()) for n in qn]
    k_bar = [km.get(n, 0.0) if n != "rest" else float(M[:, -1].sum()) for n in kn]
    total = res.total
    # "rest" says what it holds: how many sources, and (of a positive total) their share
    rest_q, rest_k = len(res.query_names) - (len(qn) - 1), len(res.key_names) - (len(kn) - 1)
    names = {("q", "rest"): _rest(rest_q, q_bar[-1], total), ("k", "rest"): _rest(rest_k, k_bar[-1], total)}
    ql = [names.get(("q", n)) or _short(res.label(n)) for n in qn]
    kl = [names.get(("k", n)) or _short(res.label(n)) for n in kn]
    lab_q = dict(zip(qn, ql))
    lab_k = dict(zip(kn, kl))
    lim = float(M.abs().max()) or 1.0
    fig = make_subplots(rows=2, cols=2, column_widths=[0.22, 0.78], row_heights=[0.22, 0.78], shared_xaxes="columns",
                        shared_yaxes="rows", horizontal_spacing=0.04, vertical_spacing=0.02)
    hover = [[f"query {lab_q[a] if a == 'rest' else res.label(a)}<br>key {lab_k[b] if b == 'rest' else res.label(b)}"
              f"<br>value {round_float(v)}<br>share {_pct(v, total)}" for b, v in zip(kn, row)]
             for a, row in zip(qn, M.tolist())]
    fig.add_trace(go.Heatmap(z=[[round_float(v) for v in row] for row in M.tolist()], x=kn, y=qn, text=hover,
                             hoverinfo="text", colorscale="RdBu", reversescale=True, zmin=-lim, zmax=lim,
                             colorbar=dict(title=dict(text="pair value"), len=0.7, y=0.36, x=1.01)), row=2, col=2)
    fig.add_trace(go.Bar(x=kn, y=[round_float(v) for v in k_bar], marker_color="#8a5a9e", name="key side",
                         hovertext=[f"key {lab_k[n]}: {round_float(v)} ({_pct(v, total)})" for n, v in zip(kn, k_bar)],
                         hoverinfo="text", showlegend=False), row=1, col=2)
    fig.add_trace(go.Bar(y=qn, x=[round_float(v) for v in q_bar], orientation="h", marker_color="#3f7f5f",
                         name="query side", showlegend=False, hoverinfo="text",
                         hovertext=[f"query {lab_q[n]}: {round_float(v)} ({_pct(v, total)})" for n, v in zip(qn, q_bar)]),
                  row=2, col=1)
    height = max(420, 150 + 24 * len(qn) + 110)
    what = f"why {res.head} attends" if res.attends() else f"{res.head} does not prefer this key"
    title = (f"{what}: {res.reading} {round_float(total)} over {len(res.rows)} rows{res.prompts_text()}, attention "
             f"{res.attention:.2f} (exact to {res.exact_error:.0e})")
    fig.update_layout(**base_layout(title, height=height, width=max(640, 260 + 46 * len(kn) + 180),
                                    margin=dict(l=8, r=20, t=TOP_MARGIN + 10, b=8)))
    # source names such as "16.0" would make plotly draw a numeric axis: every axis of names is categorical
    for r, c in ((2, 2), (1, 2)):
        fig.update_xaxes(type="category", categoryorder="array", categoryarray=kn, row=r, col=c)
    for r, c in ((2, 2), (2, 1)):
        fig.update_yaxes(type="category", categoryorder="array", categoryarray=qn, row=r, col=c)
    fig.update_xaxes(tickmode="array", tickvals=kn, ticktext=kl, tickangle=-40, row=2, col=2, side="bottom",
                     automargin=True)
    fig.update_yaxes(autorange="reversed", showticklabels=False, row=2, col=2)
    fig.update_yaxes(tickmode="array", tickvals=qn, ticktext=ql, autorange="reversed", automargin=True, row=2, col=1)
    fig.update_xaxes(title_text="query side (value)", row=2, col=1)               # positive to the right
    fig.update_yaxes(title_text="key side", row=1, col=2, showticklabels=True)   # its own tick values
    fig.update_xaxes(showticklabels=False, row=1, col=2)
    out = figure_dict(fig)
    out["meta"] = {"kind": "attend", "head": res.head, "reading": res.reading, "total": total}
    return out


def _pct(v: float, total: float) -> str:
    return f"{100 * v / total:.0f} %" if shares_shown(total) else "n/a"


def _rest(count: int, value: float, total: float) -> str:
    """The label of a side's "rest": "rest: 290 others, 71 %" (a value when the total is not positive)."""
    amount = _pct(value, total) if shares_shown(total) else f"{round_float(value)}"
    return f"rest: {count} other{'s' if count != 1 else ''}, {amount}"


def attend_section(res: Attribution, figure_html: str) -> str:
    """The "why it attends" block the report and ``attend -o`` show: the sentences, then the figure."""
    items = "".join(f"<li>{html.escape(s)}</li>" for s in res.sentences())
    title = f"Why {res.head} attends" if res.attends() else f"{res.head} does not prefer this key"
    return (f'<section class="qk-attend"><h2>{html.escape(title)}</h2><ul>{items}</ul>'
            f"{figure_html}</section>")


def attend_sections(results) -> List[Dict]:
    """The report's and the app's "why it attends" sections: one per ``Attribution`` (its sentences, then its
    figure); a (head, score, reason) entry says why that head could not be explained."""
    out = []
    for n, res in enumerate(results):
        if not isinstance(res, Attribution):
            head, score, reason = res
            out.append({"id": f"attend-{n}", "title": f"Why {head} attends ({str(score).replace('_', '-')})",
                        "blocks": [{"type": "note", "text": reason}]})
            continue
        what, role = res.settings.get("explains"), res.settings.get("explains_role")
        title = (f"Why {res.head} attends" if res.attends() else f"{res.head} does not prefer this key") + \
            (f" (top {what.replace('_', '-')} head)" if what else f" ({role} in the circuit)" if role else "")
        blocks = [{"type": "note", "text": s} for s in res.sentences()]
        blocks.append({"type": "figures", "figures": [{"id": f"attend-figure-{n}", "figure": attend_figure(res)}]})
        out.append({"id": f"attend-{n}", "title": title, "blocks": blocks})
    return out


def attend_page(res: Attribution) -> str:
    """A standalone offline page (plotly inlined) for ``qkcircuits attend -o``, in the report's style (its CSS,
    a title and a line naming the model, the rows and the prompts)."""
    from ._notebook import as_figure, figure_html
    from ._page import CSS

    title = f"qkcircuits attend: {res.head} on {res.model}"
    sub = (f"{len(res.rows)} rows: {res.settings.get('rows', '')}{res.prompts_text()}; reading {res.reading}; "
           f"exact to {res.exact_error:.0e}")
    body = (f"<h1>{html.escape(title)}</h1><p class=muted>{html.escape(sub)}</p>"
            + attend_section(res, figure_html(as_figure(attend_figure(res)), libraries=True)))
    css = CSS + ".qk-attend ul { padding-left: 18px; font-size: 13px; } .qk-attend li { margin: 2px 0; }"
    return ('<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f"<title>{html.escape(title)}</title><style>{css}</style></head>\n<body>\n{body}\n</body></html>\n")
