"""Views of a trace (``PathEffects``): a per-head "reads from" panel and the circuit graph.

>>> res = qk.trace_induction(model, k=1, progress=False)
>>> fig = reads_from(res, Head(1, 0))           # top senders per input, with the baseline
>>> fig["data"][0]["type"]
'bar'
>>> fig = circuit(res)                          # traced heads as a graph, edges above p95
>>> sorted(fig)
['data', 'layout', 'meta']

The report (``report_html(..., trace=res)``) and the app (``create_app(..., trace=res)``) embed both.
"""

from __future__ import annotations

from typing import Dict, List, Optional

from .._foundation.heads import Head
from .._paths.path_effects import READS_FROM, PathEffects
from . import _figures as F


def reads_from(res: PathEffects, head: Head, k: int = 3) -> Optional[Dict]:
    """The "reads from" figure of ``head`` when it is one of the trace's receivers, else None: its top ``k`` senders
    per input, solid where the head reads from that sender (``PathEffects.reads``), faded where the effect is under
    the threshold."""
    if head not in res.receivers:
        return None
    rows = []
    for x in res.into:
        b = res.baseline(head, x)
        for s, e in res.top(k, receiver=head, into=x):
            rows.append({"input": x, "sender": str(s), "effect": e, "metric": res.metrics[x], **b,
                         "clean": res.clean_value(head, x), "reads": res.reads(head, x, e)})
    return F.reads_from_bars(rows, str(head), res.kind, READS_FROM) if rows else None


def circuit_edges(res: PathEffects, per_input: int = 2) -> List[Dict]:
    """Edges drawn: for every receiver and input, the senders it "reads from" (``PathEffects.reads``: effect ≥
    ``READS_FROM`` of the receiver's clean value and above the 95th percentile of its senders; at most
    ``per_input``); each with its share of the clean value."""
    out = []
    for r in res.receivers:
        for x in res.into:
            clean = res.clean_value(r, x)
            for s, e in res.top(per_input, receiver=r, into=x):
                if res.reads(r, x, e):
                    out.append({"src": (s.layer, s.head), "dst": (r.layer, r.head), "input": x, "effect": e,
                                "clean": clean})
    return out


def circuit(res: PathEffects, per_input: int = 2) -> Dict:
    """The traced heads (receivers and the senders of the drawn edges) as a graph coloured by scan label."""
    edges = circuit_edges(res, per_input)
    heads = list(dict.fromkeys([Head(*e["src"]) for e in edges] + list(res.receivers)))
    nodes = [{"head": str(h), "layer": h.layer, "index": h.head,
              "label": (res.labels.get(str(h)) or [""])[0]} for h in heads]
    title = (f"circuit ({res.kind}, {res.method}): edges with effect ≥ {READS_FROM:.0%} of the receiver's clean value "
             f"and above p95, width = effect")
    fig = F.circuit_graph(nodes, edges, res.n_layers, res.n_heads, title)
    fig["meta"] = {"name": "circuit", "description": "path-patching edges sender → receiver input (q/k/v)"}
    return fig
